"""Dense linear layers over block-FP8 weights in Triton (weight-only, W8A16): y = x @ dequant(W)^T.

W (N, K) is float8_e4m3fn with a float32 scale_inv per (b0, b1) block (DeepSeek-V3's layout, see
moe_serve/quantization/fp8.py); each weight tile is multiplied by its blocks' scales as it is
loaded, and the product runs in the activations' dtype with fp32 accumulation. HBM traffic for the
weights is one byte per value, half of bf16's, which is what a memory-bound decode step pays for.
With `act_quant` the activations are quantized too, per token per 128 channels
(moe_serve/kernels/fp8_quant.py), and each K tile is an FP8 x FP8 product rescaled by both scales (W8A8, as
DeepSeek-V3 and vLLM run these layers on FP8 tensor cores); the platform turns it on for sm_89+.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_serve.kernels.grouped_gemm.triton_kernel import INTERPRETED, _dequant, _dot, _dot8, linear_rows


# M (the step's token count) is unspecialised: its "== 1" / "divisible by 16" marks would otherwise
# compile a new variant mid-serving as the batch changes; the scales' strides (sizes / 128) are read
# once per tile and left unspecialised so they add no variant per model.
@triton.jit(do_not_specialize=("M", "stride_sn", "stride_sk", "stride_xsm", "stride_xsk"))
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, xs_ptr, M, N, Kdim,
                       stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_ym, stride_yn,
                       stride_xsm, stride_xsk,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SB_N: tl.constexpr, SB_K: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                       A_SCALED: tl.constexpr = False):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_blk in range(0, tl.cdiv(Kdim, BLOCK_K)):
        k_mask = offs_k < Kdim - k_blk * BLOCK_K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if A_SCALED:  # x is FP8 with a scale per (row, SB_K channels); BLOCK_K divides SB_K
            kb = (k_blk * BLOCK_K) // SB_K
            x_sc = tl.load(xs_ptr + offs_m * stride_xsm + kb * stride_xsk, mask=m_mask, other=0.0)
            w_sc = tl.load(s_ptr + (offs_n // SB_N) * stride_sn + kb * stride_sk, mask=n_mask, other=0.0)
            acc += _dot8(x, w, UPCAST) * x_sc[:, None] * w_sc[None, :]
        else:
            w = _dequant(w, s_ptr, 0, offs_n, k_blk * BLOCK_K, offs_k, k_mask, n_mask, stride_sn, stride_sk,
                         SB_N, SB_K, BLOCK_K).to(x.dtype)
            acc = _dot(x, w, acc, PREC, UPCAST)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def fp8_linear_launch(M: int, dtype: torch.dtype, block: tuple[int, int], act_quant: bool = False) -> dict:
    """Tiles for M rows: decode-sized M keeps BLOCK_M at 16 (the tl.dot minimum)."""
    bm = 16 if M <= 16 else (32 if M <= 64 else 64)
    bk = 128  # one scale block deep; no row tile spills with it (moe_serve.kernels.aot_check, as launched)
    if block[1] % bk:
        bk = 32
    if act_quant and bk < 16:
        raise ValueError(f"W8A8 needs a scale block along k of at least 16 channels, not {block[1]}")
    return dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=bk, SB_N=block[0], SB_K=block[1],
                PREC="ieee" if dtype == torch.float32 else "tf32", UPCAST=INTERPRETED,
                num_warps=8 if bm == 64 else 4, num_stages=3, A_SCALED=act_quant)


def fp8_linear_triton(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      bias: torch.Tensor | None = None, act_quant: bool = False,
                      tile_rows: int | None = None) -> torch.Tensor:
    """(..., K) activations, (N, K) FP8 weights with (ceil(N/b0), ceil(K/b1)) scales -> (..., N) in x's dtype.
    tile_rows: pick the row tile as for that many rows whatever M is (--batch-invariant: one tile,
    one reduction order per row); None: by M."""
    *lead, K = x.shape
    N = w.shape[0]
    if w.dtype != torch.float8_e4m3fn or w.shape[1] != K:
        raise ValueError(f"fp8 linear: weight {tuple(w.shape)} {w.dtype} does not fit activations {tuple(x.shape)}")
    if tuple(scale_inv.shape) != (triton.cdiv(N, block[0]), triton.cdiv(K, block[1])):
        raise ValueError(f"fp8 linear: scale_inv {tuple(scale_inv.shape)} does not match weight {tuple(w.shape)} "
                         f"in blocks {tuple(block)}")
    x2, y = linear_rows(x, N)
    M = x2.shape[0]
    if M == 0:
        return y.view(*lead, N)
    launch = fp8_linear_launch(tile_rows or M, x.dtype, block, act_quant)
    xin, xs = x2, scale_inv  # the activation scales are unused unless A_SCALED
    if act_quant:
        from moe_serve.kernels.fp8_quant import quantize_per_token_group

        xin, xs = quantize_per_token_group(x2, block[1])
    grid = (triton.cdiv(M, launch["BLOCK_M"]), triton.cdiv(N, launch["BLOCK_N"]))
    _fp8_linear_kernel[grid](xin, w, scale_inv, bias if bias is not None else scale_inv, y, xs, M, N, K,
                             xin.stride(0), xin.stride(1), w.stride(0), w.stride(1), scale_inv.stride(0),
                             scale_inv.stride(1), y.stride(0), y.stride(1), xs.stride(0), xs.stride(1),
                             HAS_BIAS=bias is not None, **launch)
    return y.view(*lead, N)
