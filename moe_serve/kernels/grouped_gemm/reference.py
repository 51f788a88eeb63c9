"""Pure-torch grouped GEMM for MoE experts: the reference every other backend is tested against.

Shape legend: T tokens, K top-k, D hidden size, F expert intermediate size, E experts on this rank.

The computation is grouped by expert: (token, k) pairs are sorted by expert id once, and each expert
with at least one pair runs two dense GEMMs on exactly its rows. Experts with no tokens cost nothing
and no expert computes tokens that were not routed to it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_serve.kernels.cpu_gemm import linear as torch_linear


def silu_and_mul(gate_up_NF2: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, where the last dim holds [gate | up] halves."""
    gate, up = gate_up_NF2.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's expert activation over [gate | up] halves: gate clamped above at `limit`, up to
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate_up_NF2: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up_NF2.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def kernel_activation(activation) -> tuple[int, float, float] | None:
    """(ACT, alpha, limit) of the Triton grouped GEMM (triton_kernel.py) for an activation, or None
    when it has no kernel form: "silu" is 0; DeepSeek-V4's LimitedSwiGLU (moe_serve/layers/experts.py:
    known by its class name and `limit`, not imported) 1 with its limit, or 0 when the limit is None;
    ClampedSwiGLU 2."""
    if isinstance(activation, str):
        return (0, 0.0, 0.0) if activation == "silu" else None
    if isinstance(activation, ClampedSwiGLU):
        return 2, float(activation.alpha), float(activation.limit)
    if type(activation).__name__ == "LimitedSwiGLU" and hasattr(activation, "limit"):
        return (0, 0.0, 0.0) if activation.limit is None else (1, 0.0, float(activation.limit))
    return None


def activate(gate_up_NF2: torch.Tensor, activation) -> torch.Tensor:
    """activation: "silu" (SwiGLU, every other architecture) or a callable such as ClampedSwiGLU."""
    return silu_and_mul(gate_up_NF2) if activation == "silu" else activation(gate_up_NF2)


def fused_experts_reference(
    x_TD: torch.Tensor,
    w13_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation="silu",
    linear=torch_linear,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) with a SwiGLU expert MLP.

    Args:
        x_TD: tokens, any float dtype.
        w13_EFD: (E, 2F, D) gate rows then up rows of each expert, same dtype as x.
        w2_EDF: (E, D, F) down projection of each expert.
        topk_weights_TK: (T, K) routing weights (float32 or x's dtype).
        topk_ids_TK: (T, K) int expert ids in [0, E), or -1 for an expert not held here
            (its pair contributes nothing).
        w13_bias, w2_bias: optional (E, 2F) / (E, D) biases of the two projections (GPT-OSS),
            in the weights' dtype.
        activation: "silu" or a callable over the [gate | up] halves (see `activate`).
        linear: the GEMM each expert's rows run through (an experts backend passes its own).
    Returns:
        (T, D) in x's dtype; accumulation of the top-k sum is in float32.
    """
    T, D = x_TD.shape
    out_TD = torch.zeros(T, D, dtype=torch.float32, device=x_TD.device)
    if T == 0:
        return out_TD.to(x_TD.dtype)
    K = topk_ids_TK.shape[1]
    flat_ids = topk_ids_TK.reshape(-1)
    valid = flat_ids >= 0
    pair_idx = torch.nonzero(valid, as_tuple=False).squeeze(1)
    if pair_idx.numel() == 0:
        return out_TD.to(x_TD.dtype)
    ids = flat_ids[pair_idx]
    order = torch.argsort(ids, stable=True)
    pair_idx = pair_idx[order]
    ids = ids[order]
    token_idx = pair_idx // K
    weights = topk_weights_TK.reshape(-1)[pair_idx].to(torch.float32)
    # Run boundaries of each expert in the sorted pair list; one host sync for the whole layer.
    counts = torch.bincount(ids, minlength=w13_EFD.shape[0]).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_idx[start:start + n]
        if w13_bias is None and w2_bias is None and activation == "silu":
            h = silu_and_mul(linear(x_TD[rows], w13_EFD[e]))
            y = linear(h, w2_EDF[e])
        else:
            h = activate(linear(x_TD[rows], w13_EFD[e], None if w13_bias is None else w13_bias[e]), activation)
            y = linear(h, w2_EDF[e], None if w2_bias is None else w2_bias[e])
        y = y.to(torch.float32) * weights[start:start + n, None]
        out_TD.index_add_(0, rows, y)
        start += n
    return out_TD.to(x_TD.dtype)


def fused_experts_float64(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, *, w13_bias=None, w2_bias=None,
                          activation="silu") -> torch.Tensor:
    """The same sum computed token by token in float64: a slow, obvious oracle for tests only."""
    T, D = x_TD.shape
    out = torch.zeros(T, D, dtype=torch.float64)
    x = x_TD.double().cpu()
    w13 = w13_EFD.double().cpu()
    w2 = w2_EDF.double().cpu()
    for t in range(T):
        for k in range(topk_ids_TK.shape[1]):
            e = int(topk_ids_TK[t, k])
            if e < 0:
                continue
            gu = w13[e] @ x[t] + (0 if w13_bias is None else w13_bias[e].double().cpu())
            h = activate(gu, activation)
            out[t] += float(topk_weights_TK[t, k]) * (w2[e] @ h + (0 if w2_bias is None else w2_bias[e].double().cpu()))
    return out
