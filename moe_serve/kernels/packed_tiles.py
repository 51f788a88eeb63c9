"""Tiles of packed int4 / int8 weights (moe_serve/quantization/packed.py) decoded in registers as
they load: the one K step the packed linear (packed_linear.py) and the packed grouped GEMM
(grouped_gemm/triton_packed.py) share.

A weight of N rows and K columns is read as its uint8 codes (8 bits: one a byte; 4 bits: element k
in the low nibble of byte k // 2 when k is even, the high nibble when odd) with float32 scales and
offsets per group of G columns: W[n, k] = scales[n, k // G] * q[n, k] + offsets[n, k // G]. A
(BLOCK_K, BLOCK_N) tile reads BLOCK_K * BLOCK_N * bits / 8 bytes of codes, never a dequantized copy.

Two products:
- W4A16 / W8A16 (`A_INT8` off): the tile is dequantized to float32 and multiplied in the
  activations' dtype, accumulated in float32;
- W8A8 (`A_INT8`, 8-bit codes, one scale and offset per row: per channel): the activations are
  int8 with a scale per row (moe_serve/kernels/int8_quant.py) and the codes become signed
  (q - 128), so every tile's product is int8 x int8 into one int32 accumulator over the whole of K
  (integer tensor cores; |sum| < 127 * 128 * K stays in int32 for K below 130k), rescaled once at
  the end (`_int8_epilogue`): x . W = sx * (s * (xq . (q - 128)) + (o + 128 s) * sum(xq)), exact for
  any offsets.

W*A16 tiles read their scales once per column when the tile lies within one group (`PER_TILE`:
BLOCK_K divides G, or the weight is per channel, G = K), else one per element (a group size the
K tile does not divide: per-channel weights of an odd K, groups not a multiple of 16).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _codes(q_ptr, offs_n64, n_mask, k0, Kdim, stride_qn, stride_qk,
           BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(BLOCK_K, BLOCK_N) int32 codes of columns k0.. of rows offs_n (0 past K or N)."""
    if BITS == 8:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(q_ptr + offs_n64[None, :] * stride_qn + offs_k[:, None] * stride_qk,
                    mask=(offs_k < Kdim)[:, None] & n_mask[None, :], other=0)
        return q.to(tl.int32)
    else:
        # the tile's BLOCK_K / 2 bytes per row, split into (low, high) nibbles: element 2 b + h
        HALF: tl.constexpr = BLOCK_K // 2
        offs_b = k0 // 2 + tl.arange(0, HALF)
        p = tl.load(q_ptr + offs_n64[:, None] * stride_qn + offs_b[None, :] * stride_qk,
                    mask=n_mask[:, None] & (offs_b < Kdim // 2)[None, :], other=0)
        v = tl.reshape(tl.join(p & 0xF, p >> 4), (BLOCK_N, BLOCK_K))
        return tl.trans(v).to(tl.int32)


@triton.jit
def _group_values(p_ptr, offs_n64, n_mask, k0, offs_k, k_mask, stride_pn, group_size, PER_TILE: tl.constexpr):
    """A scale (or offset) per column of the tile, (1, BLOCK_N), when it lies in one group; else
    one per element, (BLOCK_K, BLOCK_N). p_ptr + n * stride_pn + g: the groups of row n, unit stride."""
    if PER_TILE:
        return tl.load(p_ptr + offs_n64 * stride_pn + k0 // group_size, mask=n_mask, other=0.0)[None, :]
    else:
        # rows past K read nothing (past the tensor's end: garbage times the tile's zeros can be NaN)
        return tl.load(p_ptr + offs_n64[None, :] * stride_pn + ((k0 + offs_k) // group_size)[:, None],
                       mask=k_mask[:, None] & n_mask[None, :], other=0.0)


@triton.jit
def _dot_i8(a, b, acc, UPCAST: tl.constexpr):
    """acc (int32) plus the int8 x int8 tile product (the CPU interpreter: the tile in float32, exact
    while its sums stay under 2 ** 24, as they do for K tiles up to 1024)."""
    if UPCAST:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee").to(tl.int32)
    return tl.dot(a, b, acc, out_dtype=tl.int32)


@triton.jit
def _packed_k_step(acc, a, q_ptr, s_ptr, o_ptr, offs_n64, n_mask, k0, offs_k, Kdim,
                   stride_qn, stride_qk, stride_sn, group_size,
                   BITS: tl.constexpr, HAS_OFFSET: tl.constexpr, PER_TILE: tl.constexpr, A_INT8: tl.constexpr,
                   PREC: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc (BLOCK_M, BLOCK_N) plus a (BLOCK_M, BLOCK_K) . W[offs_n, k0:k0 + BLOCK_K]^T: fp32, or with
    A_INT8 int32 over the signed codes (scales and offsets applied by `_int8_epilogue`).
    q_ptr / s_ptr / o_ptr: this weight's codes, scales and offsets (offsets share the scales' strides)."""
    q = _codes(q_ptr, offs_n64, n_mask, k0, Kdim, stride_qn, stride_qk, BITS, BLOCK_N, BLOCK_K)
    if A_INT8:
        acc = _dot_i8(a, (q - 128).to(tl.int8), acc, UPCAST)
    else:
        k_mask = offs_k < Kdim - k0
        s = _group_values(s_ptr, offs_n64, n_mask, k0, offs_k, k_mask, stride_sn, group_size, PER_TILE)
        w = q.to(tl.float32) * s
        if HAS_OFFSET:
            w += _group_values(o_ptr, offs_n64, n_mask, k0, offs_k, k_mask, stride_sn, group_size, PER_TILE)
        w = w.to(a.dtype)
        if UPCAST:  # the interpreter multiplies bf16 tiles as raw bits: in float32 there (see triton_kernel._dot)
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc, input_precision=PREC)
    return acc


@triton.jit
def _int8_epilogue(acc, row_sum, a_scale, s_ptr, o_ptr, offs_n64, n_mask, stride_sn, HAS_OFFSET: tl.constexpr):
    """W8A8's fp32 result from the int32 products over the signed codes (acc), the rows' sums of
    int8 activations (row_sum, int32) and their scales (a_scale):
    a_scale * (s * acc + (o + 128 s) * row_sum), s / o the per-channel scale and offset of each column."""
    s = tl.load(s_ptr + offs_n64 * stride_sn, mask=n_mask, other=0.0)[None, :]
    c = 128.0 * s
    if HAS_OFFSET:
        c += tl.load(o_ptr + offs_n64 * stride_sn, mask=n_mask, other=0.0)[None, :]
    return a_scale[:, None] * (acc.to(tl.float32) * s + row_sum.to(tl.float32)[:, None] * c)


def packed_k_tile(block_k: int, group_size: int, K: int, act_int8: bool, where: str) -> tuple[int, bool]:
    """(BLOCK_K, PER_TILE) for a weight of K columns in groups of group_size from a K tile of
    block_k: the tile is narrowed (not below 16, tl.dot's least) until it divides the group, so
    one scale per column serves it; per channel (G = K) any tile lies in the one group. W8A8
    rescales once, after the whole of K: per-channel weights only (where: the weight, for the error)."""
    if act_int8 and group_size != K:
        raise ValueError(f"{where}: W8A8 needs per-channel weights (group size = K = {K}), not groups of "
                         f"{group_size}")
    if group_size == K:
        return block_k, True
    bk = block_k
    while group_size % bk and bk > 16:
        bk //= 2
    return bk, group_size % bk == 0


def packed_operands(w, where: str) -> tuple:
    """(codes, scales, offsets or scales, has_offset) of a PackedWeight as the kernels read them,
    with its layout checked: codes with unit stride along k's bytes, scales and offsets contiguous. A
    zero code (`PackedWeight.zero`, kept by CPU layers only) becomes offsets -zero * scales here."""
    if w.qweight.stride(-1) != 1:
        raise ValueError(f"{where}: packed codes must have unit stride along K, got strides {w.qweight.stride()}")
    scales = w.scales.float().contiguous()  # (float16 scales, as CPU layers may keep them: widened exactly)
    offsets = w.offsets.contiguous() if w.offsets is not None else None
    if getattr(w, "zero", 0):
        offsets = (-float(w.zero) * scales if offsets is None else offsets - float(w.zero) * scales).contiguous()
    return w.qweight, scales, offsets if offsets is not None else scales, offsets is not None
