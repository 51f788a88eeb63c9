"""Grouped GEMM for MoE experts: one public op, the backend chosen by name.

`fused_experts(...)` takes the same arguments whatever the backend; `moe_serve.platform` decides which
backend a model uses ("torch" on CPU, "triton" on CUDA unless overridden) and models never name one.
"""
from __future__ import annotations

import torch

from kernels.grouped_gemm.reference import fused_experts_reference

BACKENDS = ("torch", "triton")


def fused_experts(
    x_TD: torch.Tensor,
    w13_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    backend: str = "torch",
) -> torch.Tensor:
    """Weighted sum over each token's top-k experts of SwiGLU(x @ w13^T) @ w2^T.

    See `kernels.grouped_gemm.reference.fused_experts_reference` for shapes; ids of -1 are skipped.
    """
    if backend == "torch":
        return fused_experts_reference(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK)
    if backend == "triton":
        from kernels.grouped_gemm.triton_kernel import fused_experts_triton  # lazy: triton is heavy

        return fused_experts_triton(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK)
    raise ValueError(f"moe_backend={backend!r} is not one of {BACKENDS}")
