"""Dense linear layers over packed int4 / int8 weights in Triton: y = x @ W^T (+ b), W a PackedWeight
(moe_serve/quantization/packed.py) read as its codes, scales and offsets and decoded tile by tile in
registers (moe_serve/kernels/packed_tiles.py), never dequantized in memory.

- W4A16 / W8A16: x bf16 / fp16 / fp32, each tile dequantized to x's dtype, fp32 accumulation. A
  decode step reads half a byte (int4) or a byte (int8) per weight plus the group scales, which is
  what a memory-bound step pays for.
- W8A8 (`act_quant`, 8-bit per-channel weights): x quantized to int8 per token
  (moe_serve/kernels/int8_quant.py), int8 x int8 tile products accumulated in int32 over the whole
  of K and rescaled once (a compressed-tensors W8A8 checkpoint's scheme: int8 weights with
  per-channel scales, dynamic per-token activations).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_serve.kernels.grouped_gemm.triton_kernel import linear_rows
from moe_serve.kernels.packed_tiles import _int8_epilogue, _packed_k_step, packed_k_tile, packed_operands


# M (the step's token count) is unspecialised so a new batch size compiles no new variant; so are
# the scales' row stride (K / G) and the group size, read once per tile: no variant per model.
@triton.jit(do_not_specialize=("M", "stride_sn", "group_size"))
def _packed_linear_kernel(x_ptr, q_ptr, s_ptr, o_ptr, b_ptr, y_ptr, xs_ptr, M, N, Kdim,
                          stride_xm, stride_xk, stride_qn, stride_qk, stride_sn, group_size, stride_ym, stride_yn,
                          BITS: tl.constexpr, HAS_OFFSET: tl.constexpr, PER_TILE: tl.constexpr,
                          A_INT8: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_n64 = offs_n.to(tl.int64)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    if A_INT8:  # int32 over the whole of K, rescaled once (packed_tiles.py)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for k_blk in range(0, tl.cdiv(Kdim, BLOCK_K)):
        k0 = k_blk * BLOCK_K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & (offs_k < Kdim - k0)[None, :], other=0.0)
        acc = _packed_k_step(acc, x, q_ptr, s_ptr, o_ptr, offs_n64, n_mask, k0, offs_k, Kdim,
                             stride_qn, stride_qk, stride_sn, group_size, BITS, HAS_OFFSET, PER_TILE, A_INT8,
                             PREC, UPCAST, BLOCK_N, BLOCK_K)
        if A_INT8:
            row_sum += tl.sum(x.to(tl.int32), axis=1)
        x_ptrs += BLOCK_K * stride_xk
    if A_INT8:
        x_scale = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
        acc = _int8_epilogue(acc, row_sum, x_scale, s_ptr, o_ptr, offs_n64, n_mask, stride_sn, HAS_OFFSET)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


INTERPRETED = type(_packed_linear_kernel).__name__ == "InterpretedFunction"


def packed_linear_launch(M: int, dtype: torch.dtype, bits: int, group_size: int, K: int, has_offset: bool,
                         act_quant: bool = False, where: str = "packed linear") -> dict:
    """Constexprs and launch options for M rows: decode-sized M keeps BLOCK_M at 16 (tl.dot's least;
    the row tiles are fp8_linear's, so TritonLinear.ROW_TILES picks each);
    the K tile is 128 (64 for W8A8's wider integer tile; 16 for fp32 activations, as in
    grouped_gemm/triton_packed.py: 128 spilled kilobytes) narrowed to divide the weight's group."""
    bm = 16 if M <= 16 else (32 if M <= 64 else 64)
    block_k = 64 if act_quant else (16 if dtype == torch.float32 else 128)
    bk, per_tile = packed_k_tile(block_k, group_size, K, act_quant, where)
    return dict(BITS=bits, HAS_OFFSET=has_offset, PER_TILE=per_tile, A_INT8=act_quant, BLOCK_M=bm, BLOCK_N=64,
                BLOCK_K=bk, PREC="ieee" if dtype == torch.float32 else "tf32", UPCAST=INTERPRETED,
                num_warps=8 if bm == 64 else 4, num_stages=3)


def packed_linear_triton(x: torch.Tensor, w, bias: torch.Tensor | None = None, act_quant: bool = False,
                         tile_rows: int | None = None) -> torch.Tensor:
    """(..., K) activations (bf16 / fp16 / fp32) and a (N, K) PackedWeight -> (..., N) in x's dtype.
    act_quant: W8A8 (8-bit per-channel weights only): x quantized to int8 per token, integer products.
    tile_rows: pick the row tile as for that many rows whatever M is; None: by M."""
    *lead, K = x.shape
    if len(w.shape) != 2 or w.shape[1] != K:
        raise ValueError(f"packed linear: weight of shape {w.shape} does not fit activations {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"packed linear: activations of dtype {x.dtype}; bf16, fp16 or fp32 are supported")
    if act_quant and w.bits != 8:
        raise ValueError(f"packed linear: W8A8 (act_quant) needs 8-bit weights, this one is {w.bits}-bit")
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise ValueError(f"packed linear: bias {tuple(bias.shape)} must be ({w.shape[0]},)")
    N = w.shape[0]
    x2, y = linear_rows(x, N)
    M = x2.shape[0]
    if M == 0:
        return y.view(*lead, N)
    q, s, o, has_offset = packed_operands(w, "packed linear weight")
    launch = packed_linear_launch(tile_rows or M, x.dtype, w.bits, w.group_size, K, has_offset, act_quant,
                                  "packed linear weight")
    xin, xs = x2, s  # the activation scales are unused unless A_INT8
    if act_quant:
        from moe_serve.kernels.int8_quant import quantize_int8_per_token

        xin, xs = quantize_int8_per_token(x2)
    grid = (triton.cdiv(M, launch["BLOCK_M"]), triton.cdiv(N, launch["BLOCK_N"]))
    _packed_linear_kernel[grid](xin, q, s, o, bias if bias is not None else s, y, xs, M, N, K,
                                xin.stride(0), xin.stride(1), q.stride(0), q.stride(1), s.stride(0), w.group_size,
                                y.stride(0), y.stride(1), HAS_BIAS=bias is not None, **launch)
    return y.view(*lead, N)
