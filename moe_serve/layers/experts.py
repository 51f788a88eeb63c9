"""Expert blocks the model files share (a model file builds from them; none imports another model's):

- `Mxfp4Experts`: routed experts kept packed in MXFP4 (GPT-OSS as released; DeepSeek-V4's FP4
  experts): the MoE layer's `experts_cls` where the checkpoint ships them so;
- `PackedExperts`: routed experts kept packed in int4 / int8 (moe_serve/quantization/packed.py:
  compressed-tensors, GPTQ and AWQ checkpoints), with per-expert biases where the model has them
  (GPT-OSS), made from a layer's dense experts before loading (`packed_experts`);
- `limited_swiglu`, `LimitedSwiGLU`, `LimitedSwiGLUExpert`: SwiGLU with the gate clamped from above
  and up clamped both ways (DeepSeek-V4's `swiglu_limit`): the function, the routed experts'
  activation (grouped_gemm's `activation` callable) and the dense shared expert (w1 gate, w3 up,
  w2 down, the Hub's names);
- `GatedSharedExpert`: a dense shared expert scaled per token by sigmoid(gate(x)) (Qwen2-MoE,
  Qwen3-Next).

Shape legend: T tokens, D hidden, F intermediate size, E local expert slots.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from expert_parallel.runtime.layer import GroupedExperts
from moe_serve.kernels.grouped_gemm.mxfp4 import Mxfp4Weight
from moe_serve.layers.linear import DenseMLP, Linear
from moe_serve.quantization.packed import PackedWeight, compact_zero, compacted_as, half_scales


class Mxfp4Experts(GroupedExperts):
    """This rank's expert slots kept in MXFP4: w13 as (E, 2F, D / 32, 16) blocks and (E, 2F, D / 32)
    scales ([gate; up] rows), w2 as (E, D, F / 32, 16) and (E, D, F / 32), all uint8; the biases in
    the model's dtype (the GEMM dtype after prepare.py). The expert op reads them packed (the Triton
    grouped GEMM) or dequantizes the routed experts per step (torch ops)."""

    def __init__(self, num_local: int, hidden_size: int, intermediate_size: int, local_logical: list[int], dtype,
                 bias: bool = True, activation="silu"):
        nn.Module.__init__(self)
        D, F = hidden_size, intermediate_size
        if D % 32 or F % 32:
            raise ValueError(f"MXFP4 experts need hidden_size ({D}) and intermediate_size ({F}) divisible by 32")
        self.F = F
        self.w13 = self.w2 = None  # no dense copy

        def u8(*shape):
            return nn.Parameter(torch.zeros(num_local, *shape, dtype=torch.uint8), requires_grad=False)

        self.w13_blocks, self.w13_scales = u8(2 * F, D // 32, 16), u8(2 * F, D // 32)
        self.w2_blocks, self.w2_scales = u8(D, F // 32, 16), u8(D, F // 32)
        self.w13_bias = nn.Parameter(torch.zeros(num_local, 2 * F, dtype=dtype)) if bias else None
        self.w2_bias = nn.Parameter(torch.zeros(num_local, D, dtype=dtype)) if bias else None
        self.activation = activation
        self.set_local_logical(local_logical)

    def op_weights(self):
        return Mxfp4Weight(self.w13_blocks, self.w13_scales), Mxfp4Weight(self.w2_blocks, self.w2_scales)

    def op_kwargs(self) -> dict:
        return dict(w13_bias=self.w13_bias, w2_bias=self.w2_bias, activation=self.activation)


class PackedExperts(GroupedExperts):
    """This rank's expert slots kept packed (PackedWeight's layout, stacked per slot): w13 as
    (E, 2F, D) codes with (E, 2F, D / G13) float32 scales and offsets ([gate; up] rows), w2 as
    (E, D, F) codes with (E, D, F / G2); codes one a byte (8 bits) or two (4 bits), w13 and w2 each
    their own (`bits` one width for both, or (w13's, w2's): GGUF Q4_K_M's 4-bit gate/up beside its
    6-bit down, held a byte a code); with `bias`,
    w13_bias (E, 2F) and w2_bias (E, D) in the model's dtype, unquantized (GPT-OSS's experts as
    llm-compressor writes them: per-expert gate / up / down linear layers with biases). Plain SwiGLU
    experts without biases take our C kernel in decode-sized batches (cpu_ops/quant.c); the torch ops
    dequantize the routed experts per step otherwise (biases, another activation, prefill)."""

    def __init__(self, num_local: int, hidden_size: int, intermediate_size: int, local_logical: list[int], dtype,
                 bits: int | tuple[int, int], group_sizes: tuple[int, int], activation="silu", bias: bool = False):
        nn.Module.__init__(self)
        D, F = hidden_size, intermediate_size
        self.widths = (bits, bits) if isinstance(bits, int) else tuple(bits)  # w13's, w2's
        self.bits = bits if isinstance(bits, int) else max(bits)  # the widest, as errors name it
        self.F, self.D, self.group_sizes = F, D, tuple(group_sizes)
        self.w13 = self.w2 = None  # no dense copy
        self.w13_bias = nn.Parameter(torch.zeros(num_local, 2 * F, dtype=dtype)) if bias else None
        self.w2_bias = nn.Parameter(torch.zeros(num_local, D, dtype=dtype)) if bias else None
        g13, g2 = self.group_sizes
        for K, G, b, what in ((D, g13, self.widths[0], "hidden_size"), (F, g2, self.widths[1], "intermediate_size")):
            if b not in (4, 8):
                raise ValueError(f"packed experts: {b}-bit codes; 4 and 8 are supported")
            if G <= 0 or K % G or (b == 4 and K % 2):
                raise ValueError(f"packed {b}-bit experts: group size {G} must divide {what} {K} (and it must be "
                                 f"even for 4 bits)")

        def param(*shape, dtype=torch.float32):
            return nn.Parameter(torch.zeros(num_local, *shape, dtype=dtype), requires_grad=False)

        per13, per2 = (2 if b == 4 else 1 for b in self.widths)
        self.w13_qweight = param(2 * F, D // per13, dtype=torch.uint8)
        self.w2_qweight = param(D, F // per2, dtype=torch.uint8)
        self.w13_scales, self.w13_offsets = param(2 * F, D // g13), param(2 * F, D // g13)
        self.w2_scales, self.w2_offsets = param(D, F // g2), param(D, F // g2)
        self.activation = activation
        self.set_local_logical(local_logical)

    float8: bool | None = None  # FP8 per-channel experts in the 8-bit codes' storage (set by the first load)
    int8_activations = False  # the checkpoint's scheme quantizes the experts' inputs to int8 per token (W8A8)
    act_quant = False  # ... and the kernel does so (moe_serve/prepare.py: the Triton kernel on CUDA)
    zeros = (0, 0)  # w13's and w2's zero codes where their offsets arrays were dropped (`drop_offsets`)
    cpu_int8_act = False  # our C kernels round the activations to int8 (GGUF files, --cpu-int8-activations)

    def offsets_zero(self, part: str) -> int | None:
        """The code z with which part's ("w13" / "w2") offsets are exactly -z * scales in every slot,
        or None (or already dropped: None)."""
        o = getattr(self, f"{part}_offsets")
        if self.float8 or o is None:
            return None
        return compact_zero(self.widths[part == "w2"], getattr(self, f"{part}_scales").data, o.data)

    def drop_offsets(self, part: str, z: int) -> int:
        """Drop part's offsets, which are -z * scales (`offsets_zero`): the bytes freed. The model
        compacts a part in every layer or in none (moe_serve/prepare.py), so that the layers' slot
        tensors, which a rebalance moves, stay alike."""
        o = getattr(self, f"{part}_offsets")
        setattr(self, f"{part}_offsets", None)
        self.zeros = (z, self.zeros[1]) if part == "w13" else (self.zeros[0], z)
        return o.numel() * o.element_size()

    def half_scales(self, part: str) -> torch.Tensor | None:
        """part's scales as float16 where float16 holds every one exactly, else None."""
        return None if self.float8 else half_scales(getattr(self, f"{part}_scales").data)

    def narrow_scales(self, part: str, h: torch.Tensor) -> int:
        """Keep part's scales as h (`half_scales`): the bytes freed (as `drop_offsets`, in every
        layer or in none)."""
        setattr(self, f"{part}_scales", nn.Parameter(h, requires_grad=False))
        return h.numel() * h.element_size()

    def op_weights(self):
        E = self.w13_qweight.shape[0]
        if self.float8:  # block FP8 with one block a row: the row scales (exact)
            from moe_serve.quantization.fp8 import FP8, BlockFp8Experts

            block = (1, max(self.D, self.F))
            return (BlockFp8Experts(self.w13_qweight.view(FP8), self.w13_scales, block, (self.F, self.F)),
                    BlockFp8Experts(self.w2_qweight.view(FP8), self.w2_scales, block, (self.D,)))
        w13 = PackedWeight(self.widths[0], self.w13_qweight, self.w13_scales, self.w13_offsets, self.group_sizes[0],
                           (E, 2 * self.F, self.D), self.zeros[0])
        w2 = PackedWeight(self.widths[1], self.w2_qweight, self.w2_scales, self.w2_offsets, self.group_sizes[1],
                          (E, self.D, self.F), self.zeros[1])
        if self.act_quant:
            w13.act_quant = w2.act_quant = True  # (the Triton grouped GEMM's W8A8 form reads it)
        if self.cpu_int8_act:
            w13.act8 = w2.act8 = True  # (cpu_ops/quant.py reads it)
        return w13, w2

    def load_bias(self, logical_id: int, kind: str, b: torch.Tensor, raw: str) -> None:
        """One expert's bias of projection `kind` ("gate" / "up" (F,), "down" (D,)), copied to every
        replica; tensor `raw` is named in errors."""
        if self.w13_bias is None:
            raise ValueError(f"tensor {raw!r}: these packed experts have no biases")
        rows = {"gate": slice(0, self.F), "up": slice(self.F, 2 * self.F), "down": slice(None)}[kind]
        want = (self.D,) if kind == "down" else (self.F,)
        if tuple(b.shape) != want:
            raise ValueError(f"tensor {raw!r} has shape {tuple(b.shape)}, expected {want}")
        target = self.w2_bias if kind == "down" else self.w13_bias
        for s in self.slots_of.get(logical_id, ()):
            target.data[s, rows].copy_(b.to(target.dtype))

    def load(self, logical_id: int, kind: str, w, scale_inv=None) -> None:
        """kind "gate" / "up" (F, D) or "down" (D, F), as a PackedWeight of these experts' bits and
        group size, or (8 bits per channel) an FP8 weight with one scale a row
        (compressed_tensors.Fp8ChannelWeight: its bytes in the codes' storage, its scales the row
        scales; the experts are then block FP8, `op_weights`); copied to every replica."""
        fp8 = getattr(w, "group_size", 0) is None
        if not (isinstance(w, PackedWeight) or fp8):
            raise ValueError(f"expert {logical_id} {kind}: the checkpoint gives a dense tensor, but this layer's "
                             f"experts are packed ({self.bits}-bit): every expert projection must be quantized alike")
        if self.float8 is not None and self.float8 != fp8:
            raise ValueError(f"expert {logical_id} {kind}: {'FP8' if fp8 else 'integer'} weights in a layer whose "
                             f"other experts are {'FP8' if self.float8 else 'integer'}: every expert projection must "
                             f"be quantized alike")
        self.float8 = fp8
        if fp8:
            w = PackedWeight(8, w.q.view(torch.uint8), w.scales, None, w.shape[1], w.shape)
        rows = {"gate": slice(0, self.F), "up": slice(self.F, 2 * self.F), "down": slice(None)}.get(kind)
        want = (self.D, self.F) if kind == "down" else (self.F, self.D)
        if rows is None:
            raise ValueError(f"expert weight kind {kind!r} is not supported with packed experts (per-expert gate, up "
                             f"and down tensors are)")
        g, b = (self.group_sizes[1], self.widths[1]) if kind == "down" else (self.group_sizes[0], self.widths[0])
        if (w.bits, w.group_size, w.shape) != (b, g, want):
            raise ValueError(f"expert {logical_id} {kind}: {w.bits}-bit group {w.group_size} {w.shape}, expected "
                             f"{b}-bit group {g} {want}: every expert projection must be quantized alike")
        pre = "w2" if kind == "down" else "w13"
        dropped, half = getattr(self, f"{pre}_offsets") is None, getattr(self, f"{pre}_scales").dtype == torch.float16
        if dropped or half:  # compacted at load: so must w be
            w = compacted_as(w, dropped, self.zeros[pre == "w2"], half, f"expert {logical_id} {kind}")
        parts = [("qweight", w.qweight), ("scales", w.scales)]
        if getattr(self, f"{pre}_offsets") is not None:
            offsets = w.offsets if w.offsets is not None else torch.zeros(w.scales.shape)
            parts.append(("offsets", offsets - float(w.zero) * w.scales.float() if w.zero else offsets))
        for s in self.slots_of.get(logical_id, ()):
            for part, t in parts:
                getattr(self, f"{pre}_{part}").data[s, rows].copy_(t)


def packed_experts(dense: GroupedExperts, bits: int | tuple[int, int], group_sizes: tuple[int, int]) -> PackedExperts:
    """Packed experts in place of a layer's dense ones (before loading: the dense tensors were never
    filled), the same slots, sizes, activation and biases."""
    if type(dense) is not GroupedExperts:
        raise ValueError(f"packed experts replace a layer's dense experts, not {type(dense).__name__}")
    E, twoF, D = dense.w13.shape
    with torch.device(dense.w13.device):
        return PackedExperts(E, D, twoF // 2, dense.local_logical, dense.w13.dtype, bits, group_sizes,
                             dense.activation, bias=dense.w13_bias is not None)


def limited_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """SiLU(min(gate, limit)) * clamp(up, -limit, limit); plain SwiGLU when limit is None."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class LimitedSwiGLU:
    """The routed experts' activation on (gate | up) rows: grouped_gemm's `activation` callable (its
    kernels recognise it by this name and read `limit`)."""

    def __init__(self, limit: float | None):
        self.limit = limit

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return limited_swiglu(gate, up, self.limit)


class LimitedSwiGLUExpert(nn.Module):
    """A dense shared expert: w1 (gate), w3 (up), w2 (down), with the SwiGLU limit."""

    def __init__(self, hidden: int, inter: int, limit: float | None, dtype):
        super().__init__()
        self.w1, self.w3 = Linear(hidden, inter, dtype=dtype), Linear(hidden, inter, dtype=dtype)
        self.w2 = Linear(inter, hidden, dtype=dtype)
        self.limit = limit

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        gate, up, ops, limit = self.w1(x_TD), self.w3(x_TD), self.w1.ops, self.limit
        if not getattr(ops, "batch_invariant", False):
            return self.w2(limited_swiglu(gate, up, limit))
        # the clamps are exact; the silu on the linear backend (its invariant form pads the rows so
        # that no element takes torch's scalar tail)
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return self.w2(ops.silu_mul(gate, up))


class GatedSharedExpert(nn.Module):
    """shared_expert(x) * sigmoid(shared_expert_gate(x)): one scalar gate per token."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype):
        super().__init__()
        self.expert = DenseMLP(hidden_size, intermediate_size, dtype)
        self.gate = Linear(hidden_size, 1, dtype=dtype)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.gate.ops.sigmoid(self.gate(x_TD)) * self.expert(x_TD)
