"""The one place that picks kernels and communication backends for the hardware, and logs it.

CPU -> torch reference ops and gloo; CUDA -> Triton kernels and NCCL, DeepEP for dispatch where it
is importable. Explicit choices (`moe_backend`, `attention_backend`, `all2all_backend`) override
"auto" for comparisons and tests; models never name a kernel.
"""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("moe_serve.platform")


@dataclass(frozen=True)
class PlatformChoice:
    device: torch.device
    moe_backend: str
    attention_backend: str
    dist_backend: str
    all2all_backend: str


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available on this machine")
    return dev


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


def fp8_linear_backend(device: torch.device) -> str:
    """Block-FP8 linear layers: the Triton W8A16 kernel on CUDA (kernels/fp8_linear.py), the torch
    dequantize-then-GEMM path on the CPU."""
    return "triton" if device.type == "cuda" else "torch"


def fp8_activation_quant(device: torch.device) -> bool:
    """Block-FP8 GEMMs quantize their activations too (W8A8, FP8 x FP8 on tensor cores) where the
    GPU has FP8 tensor cores (sm_89 and later); elsewhere they stay weight-only."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def choose(device: str = "auto", moe_backend: str = "auto", attention_backend: str = "auto",
           all2all_backend: str = "auto", world_size: int = 1, hidden_size: int | None = None) -> PlatformChoice:
    dev = resolve_device(device)
    on_gpu = dev.type == "cuda"
    for field, value in (("moe_backend", moe_backend), ("attention_backend", attention_backend)):
        if value not in ("auto", "torch", "triton"):
            raise ValueError(f"{field}={value!r} is not one of 'auto', 'torch', 'triton'")
    moe = moe_backend if moe_backend != "auto" else ("triton" if on_gpu else "torch")
    attn = attention_backend if attention_backend != "auto" else ("triton" if on_gpu else "torch")
    a2a, why = choose_all2all(all2all_backend, on_gpu, world_size, hidden_size,
                              on_gpu and world_size > 1 and all2all_backend == "auto" and deepep_available())
    choice = PlatformChoice(dev, moe, attn, "nccl" if on_gpu else "gloo", a2a)
    log.info("platform: device=%s moe_backend=%s attention_backend=%s dist_backend=%s all2all_backend=%s (%s)",
             dev, moe, attn, choice.dist_backend, a2a, why)
    if not on_gpu:
        from kernels import cpu_ops

        # Built here, at start-up, rather than inside the first request's step.
        log.info("platform: CPU kernels: %s", "kernels/cpu_ops (C: experts, paged attention, RMSNorm, q/k norm and "
                 "RoPE, decode-sized linear layers)" if cpu_ops.available() else
                 "torch ops only (see the cpu_ops line above)")
    return choice


