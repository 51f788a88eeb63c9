"""The one place that picks kernels and communication backends for the hardware, and logs it.

At start-up `choose` resolves one backend per kind of op: experts, attention, linear layers,
norms and linear attention (the classes in OPS, by the names that say what runs: "torch" for
torch ops only, "cpu_c" for our C kernels in moe_serve/kernels/cpu_ops with torch ops for the shapes they
do not take, "triton"), the process-group backend (gloo on CPUs, NCCL on GPUs) and the dispatch
backend (DeepEP where it runs). The model runner builds the objects (`resolve_ops`) and binds
them to the layers (`bind_ops`); a layer calls the object it holds and never asks which device it
is on. Explicit choices override "auto" for comparisons and tests; models never name a kernel.

A new backend for one kind of op is one class (with the methods of the kind's torch class) and
one line in OPS. A kind without a flag of its own (compressed attention, DeepSeek-V4's) follows
another's name (FOLLOWS): the attention backend's class of that kind, else its torch ops.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
from dataclasses import dataclass, replace

import torch
from torch import nn

from attention.backends import CpuCAttention, TorchAttention, TritonAttention
from attention.backends.compressed import InvariantTorchCompressedAttention, TorchCompressedAttention
from attention.backends.invariant import InvariantCpuCAttention, InvariantTorchAttention, InvariantTritonAttention
from moe_serve.kernels.batch_invariant import (InvariantCpuCExperts, InvariantCpuCLinear, InvariantTorchExperts,
                                               InvariantTorchLinear, InvariantTritonExperts, InvariantTritonLinear)
from moe_serve.kernels import cpu_ops
from moe_serve.kernels.gated_delta import CpuCLinearAttention, TorchLinearAttention, TritonLinearAttention
from moe_serve.kernels.gated_delta.invariant import InvariantCpuCLinearAttention, InvariantTorchLinearAttention
from moe_serve.kernels.grouped_gemm import CpuCExperts, TorchExperts, TritonExperts
from moe_serve.kernels.linear import CpuCLinear, TorchLinear, TritonLinear
from moe_serve.kernels.norm import CpuCNorm, TorchNorm

log = logging.getLogger("moe_serve.platform")

# kind of op -> backend name -> class. Layers declare their kind (`op_kind`) and get `ops`.
OPS: dict[str, dict[str, type]] = {
    "experts": {"torch": TorchExperts, "cpu_c": CpuCExperts, "triton": TritonExperts},
    "attention": {"torch": TorchAttention, "cpu_c": CpuCAttention, "triton": TritonAttention},
    "linear": {"torch": TorchLinear, "cpu_c": CpuCLinear, "triton": TritonLinear},
    "norm": {"torch": TorchNorm, "cpu_c": CpuCNorm},
    "linear_attention": {"torch": TorchLinearAttention, "cpu_c": CpuCLinearAttention,
                         "triton": TritonLinearAttention},
    "compressed_attention": {"torch": TorchCompressedAttention},
}
# Kinds with no flag of their own: the backend of the kind they follow, by its name (their torch ops
# where that name has no class of theirs yet), shown beside it in the table where the names differ.
FOLLOWS = {"compressed_attention": "attention"}
# Earlier names of the same backends, still accepted by the flags.
ALIASES = {"reference": "torch"}
# --batch-invariant: kind -> backend name -> the class whose ops give a token bitwise the same output
# whatever else shares its step (moe_serve/kernels/batch_invariant.py says which ops were not and
# why). The norms are per-row reductions in torch and in C already. A name missing here is refused
# with the flag; a kind missing here is refused when a model's layer asks for it (bind_ops).
INVARIANT: dict[str, dict[str, type]] = {
    "experts": {"torch": InvariantTorchExperts, "cpu_c": InvariantCpuCExperts, "triton": InvariantTritonExperts},
    "attention": {"torch": InvariantTorchAttention, "cpu_c": InvariantCpuCAttention, "triton": InvariantTritonAttention},
    "linear": {"torch": InvariantTorchLinear, "cpu_c": InvariantCpuCLinear, "triton": InvariantTritonLinear},
    "norm": {"torch": TorchNorm, "cpu_c": CpuCNorm},
    # triton: the torch form on the device (one row per call), so "auto" on a GPU is not refused
    "linear_attention": {"torch": InvariantTorchLinearAttention, "cpu_c": InvariantCpuCLinearAttention,
                         "triton": InvariantTorchLinearAttention},
    # a kind of FOLLOWS: its torch form whatever the attention backend's name (as without the flag)
    "compressed_attention": {"torch": InvariantTorchCompressedAttention},
}


@dataclass(frozen=True)
class PlatformChoice:
    device: torch.device
    moe_backend: str
    attention_backend: str
    dist_backend: str
    all2all_backend: str
    linear_backend: str = "torch"
    norm_backend: str = "torch"
    linear_attention_backend: str = "torch"
    batch_invariant: bool = False


@dataclass(frozen=True)
class Ops:
    """The backend object of each kind of op (the keys of OPS), as bound to the layers."""

    device: torch.device
    experts: object
    attention: object
    linear: object
    norm: object
    linear_attention: object
    compressed_attention: object
    batch_invariant: bool = False  # the INVARIANT classes; layers of other kinds are refused at bind

    @property
    def compiles_kernels(self) -> bool:
        """Whether kernels compile on first launch here (Triton on CUDA; on the CPU it is interpreted),
        so the runner compiles them before serving."""
        return self.device.type == "cuda"

    @property
    def captures_graphs(self) -> bool:
        """Whether a decode step can be held in a CUDA graph: CUDA, and attention and linear-attention
        backends that need no host lengths."""
        return self.device.type == "cuda" and self.attention.captures_graphs and self.linear_attention.captures_graphs

    def capturable(self) -> "Ops":
        """The backends a CUDA graph (or the CPU check of what one would hold) runs: no C call,
        no host read of routing ids."""
        return replace(self, **{kind: getattr(self, kind).capturable() for kind in OPS})

    def table(self) -> str:
        names = {kind: getattr(self, kind).name for kind in OPS}
        return ", ".join(f"{kind}={name}" + "".join(f" ({f}={names[f]})" for f, led in FOLLOWS.items()
                                                    if led == kind and names[f] != name)
                         for kind, name in names.items() if kind not in FOLLOWS)


def resolve_ops(device: torch.device, experts: str, attention: str, linear: str = "torch",
                norm: str = "torch", linear_attention: str = "torch", batch_invariant: bool = False) -> Ops:
    """The backend objects for resolved names (EngineConfig's); batch_invariant: the INVARIANT
    classes of those names (`choose` refused names without one)."""
    names = dict(experts=experts, attention=attention, linear=linear, norm=norm, linear_attention=linear_attention)
    table = {kind: {**OPS[kind], **(INVARIANT.get(kind, {}) if batch_invariant else {})} for kind in OPS}
    objs = {kind: table[kind][name](device) for kind, name in names.items()}
    for kind, led in FOLLOWS.items():
        # under the flag only the invariant forms: a default class under the led name must not win
        forms = INVARIANT[kind] if batch_invariant else OPS[kind]
        objs[kind] = forms.get(names[led], forms["torch"])(device)
    return Ops(device, **objs, batch_invariant=batch_invariant)


def bind_ops(model: nn.Module, ops: Ops) -> None:
    """Give every layer that declares an `op_kind` the backend object of that kind."""
    for m in model.modules():
        kind = getattr(type(m), "op_kind", None)
        if kind is not None:
            if ops.batch_invariant and kind not in INVARIANT:
                raise ValueError(f"--batch-invariant: {type(m).__name__} runs {kind.replace('_', ' ')} "
                                 f"({getattr(ops, kind).name}), which has no batch-invariant form yet")
            m.ops = getattr(ops, kind)


@contextlib.contextmanager
def capturable(model: nn.Module):
    """Within: every layer runs its backend's capturable form (`capturable()`: no C call, no host
    read of routing ids), as a CUDA graph capture needs and as the CPU checks of what a graph would
    hold use; after, the backends they held before."""
    before = [(m, m.ops) for m in model.modules() if getattr(type(m), "op_kind", None) is not None]
    forms: dict[int, object] = {}  # one capturable form per backend object
    for m, o in before:
        m.ops = forms.setdefault(id(o), o.capturable())
    try:
        yield
    finally:
        for m, o in before:
            m.ops = o


def _backend_name(kind: str, requested: str, on_gpu: bool) -> str:
    """One kind's backend for a requested name ("auto" or a name in OPS, or an alias)."""
    requested = ALIASES.get(requested, requested)
    flag = "moe_backend" if kind == "experts" else f"{kind}_backend"
    if requested == "auto":
        if on_gpu:
            return "triton" if "triton" in OPS[kind] else "torch"
        return "cpu_c" if cpu_ops.available() and "cpu_c" in OPS[kind] else "torch"
    if requested not in OPS[kind]:
        raise ValueError(f"{flag}={requested!r} is not one of {('auto', *OPS[kind])}")
    if requested == "cpu_c" and on_gpu:
        raise ValueError(f"{flag}='cpu_c' runs on the CPU only; the device here is CUDA")
    if requested == "cpu_c" and not cpu_ops.available():
        raise ValueError(f"{flag}='cpu_c': our C kernels are not available here (see the cpu_ops log line: "
                         "no compiler, a failed build, or MOE_SERVE_CPU_OPS=0)")
    return requested


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available on this machine")
    return dev


def use_device(device: torch.device) -> None:
    """Make a CUDA device with an index (--device cuda:N) the process's current device, before
    anything allocates: streams, CUDA graphs and Triton launches go to the current device, not to
    the one tensors were placed on. A rank of a torchrun job has its own already (LOCAL_RANK,
    expert_parallel/runtime/groups.py); naming another one there is refused."""
    if device.type != "cuda" or device.index is None:
        return
    import torch.distributed as dist

    current = torch.cuda.current_device()
    if dist.is_initialized() and dist.get_world_size() > 1 and device.index != current:
        raise ValueError(f"--device {device} on a rank bound to cuda:{current} (its LOCAL_RANK): a rank of an "
                         "expert-parallel job uses its own GPU; pass --device cuda")
    torch.cuda.set_device(device)


def deepep_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("deep_ep") is not None


# What DeepEP's kernels are compiled for (csrc/kernels/launch.cuh of DeepEP V1): intranode ranks
# 2/4/8; across nodes (8 GPUs each) 2/4/8/16 nodes; low-latency kernels only these hidden sizes.
DEEPEP_NVL_PEERS = 8
DEEPEP_INTRANODE_RANKS = (2, 4, 8)
DEEPEP_RDMA_NODES = (2, 4, 8, 16)
DEEPEP_LOW_LATENCY_HIDDEN = (2048, 2560, 4096, 5120, 6144, 7168, 8192)


def deepep_support(hidden_size: int | None, world_size: int) -> tuple[bool, bool, str]:
    """(usable, low_latency_ok, why): whether DeepEP's kernels take this EP world size at all, and
    whether its low-latency (decode) kernels take this hidden size; `why` says what decided it."""
    if world_size <= DEEPEP_NVL_PEERS:
        if world_size not in DEEPEP_INTRANODE_RANKS:
            return False, False, f"DeepEP's intranode kernels take {DEEPEP_INTRANODE_RANKS} ranks, not {world_size}"
    elif world_size % DEEPEP_NVL_PEERS or world_size // DEEPEP_NVL_PEERS not in DEEPEP_RDMA_NODES:
        return False, False, (f"DeepEP's internode kernels take {DEEPEP_RDMA_NODES} nodes of {DEEPEP_NVL_PEERS} "
                              f"GPUs, not an EP world of {world_size}")
    if hidden_size is not None and hidden_size not in DEEPEP_LOW_LATENCY_HIDDEN:
        return True, False, (f"hidden_size={hidden_size} is not one of DeepEP's low-latency sizes "
                             f"{DEEPEP_LOW_LATENCY_HIDDEN}: normal kernels only")
    return True, True, f"EP world {world_size} and hidden_size={hidden_size} are supported"


def choose_all2all(requested: str, on_gpu: bool, world_size: int, hidden_size: int | None,
                   deepep_installed: bool) -> tuple[str, str]:
    """The dispatch backend and why (the reason names what ruled the others out)."""
    if world_size == 1:
        return "local", "one EP rank: nothing to dispatch"
    if requested == "deepep":
        usable, _, why = deepep_support(hidden_size, world_size)
        if not usable:
            raise ValueError(f"all2all_backend='deepep': {why}")
        return requested, "chosen by --all2all-backend; " + why
    if requested != "auto":
        return requested, "chosen by --all2all-backend"
    if not on_gpu:
        return "all_to_all", "CPU: torch.distributed all_to_all over gloo (DeepEP needs CUDA)"
    if not deepep_installed:
        return "all_to_all", "deep_ep is not installed (see README: DeepEP): NCCL all_to_all"
    usable, _, why = deepep_support(hidden_size, world_size)
    if not usable:
        return "all_to_all", why + ": NCCL all_to_all"
    return "deepep", why


def fp8_activation_quant(device: torch.device) -> bool:
    """Block-FP8 GEMMs quantize their activations too (W8A8, FP8 x FP8 on tensor cores) where the
    GPU has FP8 tensor cores (sm_89 and later); elsewhere they stay weight-only."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def int8_activation_quant(device: torch.device) -> bool:
    """A W8A8 int8 checkpoint's packed GEMMs (8-bit per-channel weights) quantize their activations
    to int8 per token, as its scheme says, where they run in the Triton packed kernels: on CUDA (int8
    tensor cores on every GPU served). The torch ops and our C kernels multiply float activations
    (the package's own decompression)."""
    return device.type == "cuda"


def choose(device: str = "auto", moe_backend: str = "auto", attention_backend: str = "auto",
           all2all_backend: str = "auto", world_size: int = 1, hidden_size: int | None = None,
           linear_backend: str = "auto", norm_backend: str = "auto",
           linear_attention_backend: str = "auto", batch_invariant: bool = False) -> PlatformChoice:
    dev = resolve_device(device)
    on_gpu = dev.type == "cuda"
    names = {kind: _backend_name(kind, req, on_gpu) for kind, req in
             (("experts", moe_backend), ("attention", attention_backend), ("linear", linear_backend),
              ("norm", norm_backend), ("linear_attention", linear_attention_backend))}
    if batch_invariant:
        for kind, table in INVARIANT.items():
            if kind not in FOLLOWS and names[kind] not in table:  # a FOLLOWS kind falls back to its torch form
                flag = "moe_backend" if kind == "experts" else f"{kind}_backend"
                raise ValueError(f"--batch-invariant with {flag}={names[kind]!r}: that backend has no batch-invariant "
                                 f"form (those with one: {', '.join(table)})")
    a2a, why = choose_all2all(all2all_backend, on_gpu, world_size, hidden_size,
                              on_gpu and world_size > 1 and all2all_backend == "auto" and deepep_available())
    choice = PlatformChoice(dev, names["experts"], names["attention"], dist_backend(dev), a2a,
                            names["linear"], names["norm"], names["linear_attention"], batch_invariant)
    log.info("platform: device=%s moe_backend=%s attention_backend=%s linear_backend=%s norm_backend=%s "
             "linear_attention_backend=%s dist_backend=%s all2all_backend=%s (%s) batch_invariant=%s", dev,
             choice.moe_backend, choice.attention_backend, choice.linear_backend, choice.norm_backend,
             choice.linear_attention_backend, choice.dist_backend, a2a, why, batch_invariant)
    return choice


def dist_backend(device: torch.device) -> str:
    """The torch.distributed backend for a rank on this device."""
    return "nccl" if device.type == "cuda" else "gloo"
