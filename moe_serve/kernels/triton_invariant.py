"""Batch-invariant Triton kernels (`--batch-invariant` on the Triton backends).

Contract: a row's output does not depend on how many rows share the launch, where the row sits or
what the other rows hold. What breaks that on the Triton paths by default: the linear backend's
dense GEMM is cuBLAS (another kernel and k order per M), its block-FP8 kernel picks a row tile by M,
and the grouped GEMM picks its config (tile, BLOCK_K) by the batch's pairs per expert or the tuned
entry nearest T. Here every launch takes one fixed config whatever M is: one tile shape, one
BLOCK_K, the K loop in ascending order, fp32 accumulation, never split over K. A row's products are
then the same instructions over the same operands in every batch: rows of a tile do not mix, and
which tile (or which row of it) holds a row changes nothing.

- `linear_invariant`: y = x W^T (+ b) by `_linear_kernel` (LINEAR_CONFIG), fp32 accumulation;
- `experts_pairs_triton`: each (token, k) pair's weighted expert output, (T, K, D) float32, by the
  grouped GEMM at grouped_gemm.config.INVARIANT_CONFIG (dense, block FP8 / W8A8, MXFP4, biases and
  the kernel's activations alike); batch_invariant.sum_in_id_order adds a token's pairs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_serve.kernels.grouped_gemm.align import align_block_size
from moe_serve.kernels.grouped_gemm.config import INVARIANT_CONFIG
from moe_serve.kernels.grouped_gemm.triton_kernel import (_check_experts_args, _dot, _experts_gemms, _experts_launch,
                                                          check_triton_device, linear_rows)

# The dense linear's one config: 32-row tiles (a decode step wastes at most 31 rows of one tile),
# BLOCK_K 64 (the order of each row's sum over k: 64-wide dots, tiles in ascending k).
LINEAR_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


# M changes every step: unspecialised, so its "== 1" / "divisible by 16" marks never select another
# compiled variant (another variant could be another instruction sequence, so another order).
@triton.jit(do_not_specialize=("M", "stride_xm"))
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, Kdim, stride_xm, stride_xk, stride_wn, stride_wk,
                   stride_ym, stride_yn, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]): fp32 accumulator, K tiles in ascending order."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_blk in range(0, tl.cdiv(Kdim, BLOCK_K)):
        k_mask = offs_k < Kdim - k_blk * BLOCK_K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(x.dtype)
        acc = _dot(x, w, acc, PREC, UPCAST)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# Kernels were decorated in interpreter mode iff TRITON_INTERPRET=1 was set when this module loaded.
INTERPRETED = type(_linear_kernel).__name__ == "InterpretedFunction"


def linear_launch(dtype: torch.dtype, bias: bool) -> dict:
    """Every constexpr and launch option of `_linear_kernel`: one per activation dtype and bias,
    never a function of M (moe_serve/kernels/aot_check.py compiles each)."""
    return dict(HAS_BIAS=bias, BLOCK_M=LINEAR_CONFIG["BLOCK_M"], BLOCK_N=LINEAR_CONFIG["BLOCK_N"],
                BLOCK_K=LINEAR_CONFIG["BLOCK_K"], PREC="ieee" if dtype == torch.float32 else "tf32",
                UPCAST=INTERPRETED, num_warps=LINEAR_CONFIG["num_warps"], num_stages=LINEAR_CONFIG["num_stages"])


def linear_invariant(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """(..., K) activations, dense (N, K) weights (cast to x's dtype tile by tile) -> (..., N) in x's
    dtype: x W^T (+ b) with fp32 accumulation, each row's sums in one order whatever M is."""
    *lead, K = x.shape
    N = w.shape[0]
    if w.dim() != 2 or w.shape[1] != K:
        raise ValueError(f"linear: weight {tuple(w.shape)} does not fit activations {tuple(x.shape)}")
    x2, y = linear_rows(x, N)
    M = x2.shape[0]
    if M == 0:
        return y.view(*lead, N)
    launch = linear_launch(x.dtype, b is not None)
    grid = (triton.cdiv(M, launch["BLOCK_M"]), triton.cdiv(N, launch["BLOCK_N"]))
    _linear_kernel[grid](x2, w, b if b is not None else w, y, M, N, K, x2.stride(0), x2.stride(1), w.stride(0),
                         w.stride(1), y.stride(0), y.stride(1), **launch)
    return y.view(*lead, N)


def experts_pairs_triton(x_TD: torch.Tensor, w13_EFD, w2_EDF, topk_weights_TK: torch.Tensor,
                         topk_ids_TK: torch.Tensor, *, w13_scale=None, w2_scale=None, scale_block=None,
                         act_quant: bool = False, w13_bias=None, w2_bias=None, activation="silu") -> torch.Tensor:
    """(T, K, D) float32: each (token, k) pair's weighted expert output (grouped_gemm.triton_kernel.
    fused_experts_triton's arguments and weight formats), zero for ids outside [0, E); the grouped
    GEMM at INVARIANT_CONFIG for every T, so a pair's output is bitwise the same in any batch."""
    act = _check_experts_args(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, w13_scale, w2_scale,
                              scale_block, w13_bias, w2_bias, activation)
    T, D = x_TD.shape
    E = w13_EFD.shape[0]
    K = topk_ids_TK.shape[1]
    if T == 0:
        return torch.zeros((T, K, D), dtype=torch.float32, device=x_TD.device)
    check_triton_device(x_TD)
    cfg = dict(INVARIANT_CONFIG)
    routing = align_block_size(topk_ids_TK, E, cfg["BLOCK_SIZE_M"])
    launch = _experts_launch(cfg, x_TD.dtype, w13_EFD, w13_scale, scale_block, act_quant)
    y_PD = _experts_gemms(x_TD, w13_EFD, w2_EDF, topk_weights_TK.contiguous().view(-1), routing, K, launch, act,
                          w13_scale, w2_scale, scale_block, act_quant, w13_bias, w2_bias, y_dtype=torch.float32)
    here = (topk_ids_TK >= 0) & (topk_ids_TK < E)  # the rows of other ranks' pairs were never written
    return torch.where(here[..., None], y_PD.view(T, K, D), 0.0)
