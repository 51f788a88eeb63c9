"""Expert blocks the model files share (a model file builds from them; none imports another model's):

- `Mxfp4Experts`: routed experts kept packed in MXFP4 (GPT-OSS as released; DeepSeek-V4's FP4
  experts): the MoE layer's `experts_cls` where the checkpoint ships them so;
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
