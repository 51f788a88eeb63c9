"""Triton grouped GEMM for MoE experts: every expert in one launch per GEMM.

Shape legend: T tokens, K top-k, P = T*K (token, k) pairs, D hidden size, F expert intermediate
size, E experts on this rank, S padded pair slots (see align.py).

Three launches, none of which syncs with the host:
  1. gate/up GEMM with SiLU-and-mul fused: h[p] = silu(x[t] @ gate_e^T) * (x[t] @ up_e^T)  -> (P, F)
  2. down GEMM with the router weight folded in: y[p] = w[p] * (h[p] @ w2_e^T)             -> (P, D)
     (the expert variants: per-expert biases on both GEMMs, GPT-OSS's clamped SwiGLU or
     DeepSeek-V4's limited one in place of silu * up; see ACT / HAS_BIAS)
  3. top-k sum: out[t] = sum_k y[t*K + k] over pairs whose expert is held here (fp32)     -> (T, D)
Row blocks of the GEMMs each hold one expert's pairs (align.py pads every expert's run to BLOCK_M),
so a program loads one expert's weight tile and multiplies it against up to BLOCK_M gathered rows.
Blocks past the real padded length belong to no expert and return before loading anything.
The weights are dense (x's dtype), block FP8 or MXFP4 (uint8 blocks and e8m0 scales, mxfp4.py);
quantized tiles are dequantized in registers as they load, never expanded in memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_serve.kernels.grouped_gemm.align import align_block_size
from moe_serve.kernels.grouped_gemm.config import get_config, validate_config
from moe_serve.kernels.grouped_gemm.mxfp4 import Mxfp4Weight
from moe_serve.kernels.grouped_gemm.reference import kernel_activation


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    # The CPU interpreter multiplies bf16 tiles as their raw uint16 bits; upcasting there (and only
    # there) keeps interpreter results meaningful without touching the GPU code path.
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=PREC)
    return acc


@triton.jit
def _dequant(b, s_ptr, s_base, offs_n, k0, offs_k, k_mask, n_mask, stride_sn, stride_sk,
             SB_N: tl.constexpr, SB_K: tl.constexpr, BLOCK_SIZE_K: tl.constexpr):
    """A (BLOCK_K, BLOCK_N) tile of block-FP8 weights times its blocks' scale_inv, in fp32. When
    BLOCK_K divides the scale block along k (128 in real checkpoints) the tile needs one scale per
    column; otherwise one per element."""
    if SB_K % BLOCK_SIZE_K == 0:
        sc = tl.load(s_ptr + s_base + (offs_n // SB_N) * stride_sn + (k0 // SB_K) * stride_sk, mask=n_mask, other=0.0)
        return b.to(tl.float32) * sc[None, :]
    # Rows of the tile past the weight's last column read no scale (it would lie past the scale
    # tensor's end: garbage there times the tile's zeros can be NaN).
    sc = tl.load(s_ptr + s_base + (offs_n // SB_N)[None, :] * stride_sn + ((k0 + offs_k) // SB_K)[:, None] * stride_sk,
                 mask=k_mask[:, None] & n_mask[None, :], other=0.0)
    return b.to(tl.float32) * sc


@triton.jit
def _dot8(a, b, UPCAST: tl.constexpr):
    """FP8 x FP8 -> fp32 tile product (tensor cores on sm_89+; upcast under the interpreter)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _fp4_tile(blk_ptr, sc_ptr, offs_n, n_mask, k0, Kdim, stride_bn, stride_bk, stride_sn, stride_sk,
              BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr):
    """A (BLOCK_K, BLOCK_N) tile of MXFP4 weights in fp32, exactly: the (BLOCK_N, BLOCK_K / 32, 16)
    packed bytes of columns k0.. (two e2m1 values a byte, the low nibble first; stride_bk is the
    byte stride) decoded arithmetically and scaled by 2 ** (s - 127), one e8m0 scale s per 32 k
    (sc_ptr + n * stride_sn + (k // 32) * stride_sk). Kdim is a multiple of 32 and so is BLOCK_K:
    whole groups are in or out."""
    G: tl.constexpr = BLOCK_SIZE_K // 32
    offs_g = k0 // 32 + tl.arange(0, G)
    offs_j = tl.arange(0, 16)
    g_mask = offs_g < Kdim // 32
    n64 = offs_n.to(tl.int64)
    p = tl.load(blk_ptr + n64[:, None, None] * stride_bn + (offs_g[None, :, None] * 16 + offs_j[None, None, :]) * stride_bk,
                mask=n_mask[:, None, None] & g_mask[None, :, None], other=0)
    s = tl.load(sc_ptr + n64[:, None] * stride_sn + offs_g[None, :] * stride_sk,
                mask=n_mask[:, None] & g_mask[None, :], other=127).to(tl.int32)
    v = tl.join(p & 0xF, p >> 4).to(tl.int32)  # (BLOCK_N, G, 16, 2): element 32 g + 2 j + h
    # e2m1: sign bit 3, exponent e bits 1-2, mantissa m bit 0; |value| = (e > 0 ? 2 + m : m) * 2 ** max(e, 1) / 4
    # (0, 0.5, 1, 1.5, 2, 3, 4, 6: e = 0 is the subnormal m * 0.5)
    e = (v >> 1) & 3
    m = v & 1
    mag = (tl.where(e > 0, 2 + m, m) << tl.maximum(e, 1)).to(tl.float32) * 0.25
    val = tl.where((v & 8) != 0, -mag, mag)
    # 2 ** (s - 127) from its bits: the exponent field s (s = 0 is the subnormal 2 ** -127, bits 1 << 22)
    scale = tl.where(s == 0, 1 << 22, s << 23).to(tl.float32, bitcast=True)
    w = tl.reshape(val * scale[:, :, None, None], (BLOCK_SIZE_N, BLOCK_SIZE_K))
    return tl.trans(w)


@triton.jit
def _bias_row(bias_ptr, offs_n, n_mask):
    """(1, BLOCK_N) fp32 row of a bias, from bias_ptr (the expert's row, unit stride)."""
    return tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _grouped_tile(num_slots, N, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                  GROUP_SIZE_M: tl.constexpr):
    """(row block, column tile) of this program. Grouped ordering: GROUP_SIZE_M consecutive row
    blocks sweep the N tiles together, so the activation rows they gather stay in L2 while each
    weight tile is read by a few programs at once."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_slots, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _fp4_k_step(acc, acc_up, a, b_e_ptr, s_e_ptr, offs_n, n_mask, k0, N, Kdim, s_up_row0,
                stride_bn, stride_bk, stride_sn, stride_sk, GATED: tl.constexpr, PREC: tl.constexpr,
                UPCAST: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr):
    """One K tile against MXFP4 weights (b_e_ptr / s_e_ptr: the expert's blocks and scales): the
    packed e2m1 bytes and their scales decoded in registers, multiplied in a's dtype."""
    b = _fp4_tile(b_e_ptr, s_e_ptr, offs_n, n_mask, k0, Kdim,
                  stride_bn, stride_bk, stride_sn, stride_sk, BLOCK_SIZE_N, BLOCK_SIZE_K).to(a.dtype)
    acc = _dot(a, b, acc, PREC, UPCAST)
    if GATED:
        b_up = _fp4_tile(b_e_ptr + N * stride_bn, s_e_ptr + s_up_row0 * stride_sn,
                         offs_n, n_mask, k0, Kdim, stride_bn, stride_bk, stride_sn,
                         stride_sk, BLOCK_SIZE_N, BLOCK_SIZE_K).to(a.dtype)
        acc_up = _dot(a, b_up, acc_up, PREC, UPCAST)
    return acc, acc_up


@triton.jit
def _k_step(acc, acc_up, a, b_ptrs, up_ptrs, s_ptr, s_base, as_ptr, a_row, row_mask, offs_n, n_mask, offs_k,
            k_mask, k0, s_up_row0, stride_sn, stride_sk, stride_asm, stride_ask,
            GATED: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, B_SCALED: tl.constexpr,
            A_SCALED: tl.constexpr, SB_N: tl.constexpr, SB_K: tl.constexpr, BLOCK_SIZE_K: tl.constexpr):
    """One K tile against dense or block-FP8 weights (b_ptrs / up_ptrs: the gate (or only) and up
    tiles; s_ptr + s_base: the expert's scales): (acc, acc_up) with the tile's products added."""
    b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
    if A_SCALED:  # W8A8: FP8 x FP8 per K tile, rescaled by the row's and the weight block's scales
        kb = k0 // SB_K
        a_sc = tl.load(as_ptr + a_row * stride_asm + kb * stride_ask, mask=row_mask, other=0.0)
        b_sc = tl.load(s_ptr + s_base + (offs_n // SB_N) * stride_sn + kb * stride_sk, mask=n_mask, other=0.0)
        acc += _dot8(a, b, UPCAST) * a_sc[:, None] * b_sc[None, :]
    else:
        if B_SCALED:
            b = _dequant(b, s_ptr, s_base, offs_n, k0, offs_k, k_mask, n_mask, stride_sn,
                         stride_sk, SB_N, SB_K, BLOCK_SIZE_K).to(a.dtype)
        acc = _dot(a, b, acc, PREC, UPCAST)
    if GATED:
        b_up = tl.load(up_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if A_SCALED:
            bu_sc = tl.load(s_ptr + s_base + (s_up_row0 + offs_n // SB_N) * stride_sn + kb * stride_sk,
                            mask=n_mask, other=0.0)
            acc_up += _dot8(a, b_up, UPCAST) * a_sc[:, None] * bu_sc[None, :]
        else:
            if B_SCALED:
                b_up = _dequant(b_up, s_ptr, s_base + s_up_row0 * stride_sn, offs_n, k0,
                                offs_k, k_mask, n_mask, stride_sn, stride_sk, SB_N, SB_K,
                                BLOCK_SIZE_K).to(a.dtype)
            acc_up = _dot(a, b_up, acc_up, PREC, UPCAST)
    return acc, acc_up


@triton.jit
def _activation(acc, acc_up, alpha, limit, ACT: tl.constexpr):
    """The gated activation of the (biased) gate and up products, in fp32 before the one rounding."""
    if ACT == 0:
        acc = acc * tl.sigmoid(acc) * acc_up  # SiLU(gate) * up
    else:
        gate = tl.minimum(acc, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        if ACT == 1:
            acc = gate * tl.sigmoid(gate) * up
        else:
            acc = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    return acc


# num_pairs = T * K changes every step; left unspecialised so its "== 1" / "divisible by 16" flags
# never select a new compiled variant mid-serving (num_slots is always a multiple of BLOCK_SIZE_M).
# The FP8 scale tensors' strides and row offset (whose divisibility follows each model's sizes / 128)
# are read once per tile, never vectorised: unspecialised too, so they add no variant per model.
_SCALE_ARGS = ("stride_se", "stride_sn", "stride_sk", "s_up_row0", "stride_asm", "stride_ask")
# The biases' expert stride (2F or D) is read once per program, as are the activation's constants.
_VARIANT_ARGS = ("stride_bias_e",)


@triton.jit(do_not_specialize=("num_pairs",) + _SCALE_ARGS + _VARIANT_ARGS)
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    N, Kdim, num_slots, num_pairs, a_row_div,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    s_ptr, stride_se, stride_sn, stride_sk, s_up_row0, as_ptr, stride_asm, stride_ask,
    bias_ptr, stride_bias_e, alpha, limit,
    GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    B_SCALED: tl.constexpr = False, SB_N: tl.constexpr = 128, SB_K: tl.constexpr = 128,
    A_SCALED: tl.constexpr = False, B_FP4: tl.constexpr = False, ACT: tl.constexpr = 0,
    HAS_BIAS: tl.constexpr = False,
):
    """c[p, n] = sum_k a[p // a_row_div, k] * b[e, n, k] for the pairs p of each row block.

    GATED: b holds 2N rows [gate | up]; c[p, n] = silu(gate . a) * (up . a).
    MUL_WEIGHT: c[p, :] *= weights[p] before the cast to c's dtype.
    B_SCALED: b is block FP8 (weight-only): each (SB_N, SB_K) block of b[e] is multiplied by its
    scale s[e, n // SB_N, k // SB_K] as it is loaded, and the product is taken in a's dtype; the up
    half's scale rows start at s_up_row0 (gate and up are quantized separately).
    A_SCALED (with B_SCALED, SB_K a multiple of BLOCK_SIZE_K): a is FP8 too, quantized per row per
    SB_K channels with scales as[row, k // SB_K]; each K tile's FP8 x FP8 product is rescaled by both
    operands' scales in fp32 (W8A8, DeepSeek-V3's FP8 GEMM).
    B_FP4: b is MXFP4: b_ptr the uint8 blocks viewed as (E, R, Kdim / 2) (stride_bk the byte
    stride), s_ptr the e8m0 scales (E, R, Kdim / 32); each tile is decoded in registers as it loads
    (`_fp4_tile`, exact) and multiplied in a's dtype. Kdim and BLOCK_SIZE_K are multiples of 32.
    HAS_BIAS: bias[e, n] (rows of stride_bias_e; gate then up for GATED) is added to the fp32
    product: before the activation, and before the router weight (w[p] * (h . w2 + b2)).
    ACT (GATED only), with gate and up the biased products:
      0: silu(gate) * up
      1: silu(min(gate, limit)) * clamp(up, -limit, limit)                     (DeepSeek-V4)
      2: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)  (GPT-OSS)
    """
    pid_m, pid_n = _grouped_tile(num_slots, N, BLOCK_SIZE_M, BLOCK_SIZE_N, GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return

    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)  # S is a multiple of BLOCK_SIZE_M
    row_mask = pair < num_pairs  # padding slots hold the sentinel num_pairs
    a_row = pair // a_row_div
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_SIZE_K)

    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    # int64 expert offset: E * 2F * D passes 2**31 for DeepSeek-sized layers.
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    up_ptrs = b_ptrs + N * stride_bn  # GATED only, as is acc_up
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    s_base = expert * stride_se
    for k_blk in range(0, tl.cdiv(Kdim, BLOCK_SIZE_K)):
        k_mask = offs_k < Kdim - k_blk * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if B_FP4:  # packed e2m1 bytes and their scales, decoded in registers
            acc, acc_up = _fp4_k_step(acc, acc_up, a, b_ptr + expert * stride_be, s_ptr + s_base, offs_n, n_mask,
                                      k_blk * BLOCK_SIZE_K, N, Kdim, s_up_row0, stride_bn, stride_bk, stride_sn,
                                      stride_sk, GATED, PREC, UPCAST, BLOCK_SIZE_N, BLOCK_SIZE_K)
        else:
            acc, acc_up = _k_step(acc, acc_up, a, b_ptrs, up_ptrs, s_ptr, s_base, as_ptr, a_row, row_mask, offs_n,
                                  n_mask, offs_k, k_mask, k_blk * BLOCK_SIZE_K, s_up_row0, stride_sn, stride_sk,
                                  stride_asm, stride_ask, GATED, PREC, UPCAST, B_SCALED, A_SCALED, SB_N, SB_K,
                                  BLOCK_SIZE_K)
            if GATED:
                up_ptrs += BLOCK_SIZE_K * stride_bk
            b_ptrs += BLOCK_SIZE_K * stride_bk
        a_ptrs += BLOCK_SIZE_K * stride_ak

    if HAS_BIAS:
        acc += _bias_row(bias_ptr + expert * stride_bias_e, offs_n, n_mask)
        if GATED:
            acc_up += _bias_row(bias_ptr + expert * stride_bias_e + N, offs_n, n_mask)
    if GATED:  # in fp32 before the one rounding
        acc = _activation(acc, acc_up, alpha, limit, ACT)
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pair, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _topk_sum_kernel(y_ptr, ids_ptr, out_ptr, D, stride_yp, stride_ot, stride_od,
                     TOP_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t, :] = sum_k y[t*K + k, :] (fp32) over the k whose expert id is >= 0."""
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + t * TOP_K + k)
        # Rows of skipped pairs were never written: mask the load instead of multiplying by 0
        # (a row limit of 0 masks the whole row).
        d_limit = tl.where(expert >= 0, D, 0)
        row = tl.load(y_ptr + (t * TOP_K + k) * stride_yp + offs_d, mask=offs_d < d_limit, other=0.0)
        acc += row.to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs_d * stride_od, acc.to(out_ptr.dtype.element_ty), mask=d_mask)


# Kernels were decorated in interpreter mode iff TRITON_INTERPRET=1 was set when this module loaded.
INTERPRETED = type(_grouped_gemm_kernel).__name__ == "InterpretedFunction"


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Workspace allocation; tests replace it to poison every buffer the kernels must overwrite."""
    return torch.empty(shape, dtype=dtype, device=device)


def check_triton_device(t: torch.Tensor) -> None:
    """Raise a clear error when a tensor can reach neither a GPU kernel nor the interpreter."""
    if t.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("Triton kernels need CUDA tensors; to run them on the CPU set "
                           "TRITON_INTERPRET=1 before the kernel modules are imported")


def linear_rows(x: torch.Tensor, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear kernel's operands: x (..., K) as rows (M, K), checked to reach a Triton device when
    there are any, and an empty (M, N) output in x's dtype on x's device."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0]:
        check_triton_device(x2)
    return x2, torch.empty((x2.shape[0], N), dtype=x.dtype, device=x.device)


def gemm_launch(cfg: dict, dtype: torch.dtype) -> dict:
    """Constexprs and launch options of `_grouped_gemm_kernel` (GATED / MUL_WEIGHT and the variant's
    ACT / HAS_BIAS aside) for one config and activation dtype, the same for gate/up and down: what selects a compiled variant
    (moe_serve/kernels/aot_check.py compiles each, as the launch specialises it, and holds it to --max-spill:
    none of the default or tuned tiles spills more than 16 B per thread on sm_90 or sm_100)."""
    return dict(GROUP_SIZE_M=cfg["GROUP_SIZE_M"], BLOCK_SIZE_M=cfg["BLOCK_SIZE_M"], BLOCK_SIZE_N=cfg["BLOCK_SIZE_N"],
                BLOCK_SIZE_K=cfg["BLOCK_SIZE_K"], PREC="ieee" if dtype == torch.float32 else "tf32",
                UPCAST=INTERPRETED, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                B_SCALED=False, SB_N=128, SB_K=128, A_SCALED=False, B_FP4=False)


def fp4_gemm_launch(cfg: dict, dtype: torch.dtype) -> dict:
    """`gemm_launch` for MXFP4 weights: a K tile of at least one scale group (32)."""
    return {**gemm_launch(cfg, dtype), "B_FP4": True, "BLOCK_SIZE_K": max(32, cfg["BLOCK_SIZE_K"])}


def fp8_gemm_launch(cfg: dict, dtype: torch.dtype, scale_block: tuple[int, int]) -> dict:
    """`gemm_launch` for block-FP8 weights with (b0, b1) scale blocks (the Hub's are 128 x 128)."""
    return {**gemm_launch(cfg, dtype), "B_SCALED": True, "SB_N": scale_block[0], "SB_K": scale_block[1],
            "A_SCALED": False}


def w8a8_gemm_launch(cfg: dict, dtype: torch.dtype, scale_block: tuple[int, int]) -> dict:
    """`fp8_gemm_launch` with the activations quantized too (per row per scale_block[1] channels):
    the k tile must divide the scale block along k."""
    launch = {**fp8_gemm_launch(cfg, dtype, scale_block), "A_SCALED": True}
    while scale_block[1] % launch["BLOCK_SIZE_K"]:
        launch["BLOCK_SIZE_K"] //= 2
    if launch["BLOCK_SIZE_K"] < 16:
        raise ValueError(f"W8A8 needs a scale block along k of at least 16 channels, not {scale_block[1]}")
    return launch


def topk_sum_launch(K: int, D: int) -> dict:
    """Constexprs of `_topk_sum_kernel` for top-k K and hidden size D."""
    return dict(TOP_K=K, BLOCK_D=min(1024, triton.next_power_of_2(D)))


def fused_experts_triton(
    x_TD: torch.Tensor,
    w13_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    config: dict | None = None,
    *,
    out_TD: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] | None = None,
    act_quant: bool = False,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation="silu",
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * SwiGLU-expert_{topk_ids[t, k]}(x[t]), experts grouped in one launch.

    Args:
        x_TD: (T, D) tokens, bf16 / fp16 / fp32.
        w13_EFD: (E, 2F, D) gate rows then up rows of each expert, x's dtype.
        w2_EDF: (E, D, F) down projection of each expert, x's dtype.
        topk_weights_TK: (T, K) routing weights, any float dtype (used in fp32).
        topk_ids_TK: (T, K) int expert ids in [0, E), or -1 for a pair whose expert is not here.
        config: launch config (see config.py); None picks the tuned entry or the default.
        out_TD: optional (T, D) output buffer of x's dtype; every element is overwritten.
        w13_scale, w2_scale, scale_block: block FP8 (weight-only): w13 / w2 are float8_e4m3fn and
            these their float32 scale_inv, (E, 2 * ceil(F / b0), ceil(D / b1)) (gate blocks then up
            blocks) and (E, ceil(D / b0), ceil(F / b1)), with scale_block = (b0, b1).
        act_quant: with FP8 weights, quantize the activations too (per token per b1 channels,
            moe_serve/kernels/fp8_quant.py) and multiply FP8 x FP8 (W8A8; the FP8 tensor cores of sm_89+).
        w13_EFD / w2_EDF may instead both be mxfp4.Mxfp4Weight (uint8 blocks (E, R, C / 32, 16) and
            e8m0 scales (E, R, C / 32), D and F multiples of 32): the kernel decodes each tile in
            registers as it loads it; the packed weights are all it reads.
        w13_bias, w2_bias: optional (E, 2F) / (E, D) per-expert biases (any float dtype), added in
            fp32 before the activation and before the router weight, as reference.py does.
        activation: "silu", or an activation with a kernel form (reference.kernel_activation:
            GPT-OSS's ClampedSwiGLU, DeepSeek-V4's LimitedSwiGLU).
    Returns:
        (T, D) in x's dtype; products accumulate in fp32, as does the top-k sum.
    """
    act = _check_experts_args(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, w13_scale, w2_scale,
                              scale_block, w13_bias, w2_bias, activation)
    T, D = x_TD.shape
    E, F2, _ = w13_EFD.shape
    K = topk_ids_TK.shape[1] if topk_ids_TK.dim() == 2 else 0
    out = out_TD if out_TD is not None else torch.empty((T, D), dtype=x_TD.dtype, device=x_TD.device)
    if T == 0:
        return out
    check_triton_device(x_TD)
    cfg = dict(config) if config is not None else get_config(E, F2 // 2, D, x_TD.dtype, T, K, x_TD.device)
    validate_config(cfg)

    routing = align_block_size(topk_ids_TK, E, cfg["BLOCK_SIZE_M"])
    ids_TK = topk_ids_TK.contiguous()
    weights_P = topk_weights_TK.contiguous().view(-1)
    launch = _experts_launch(cfg, x_TD.dtype, w13_EFD, w13_scale, scale_block, act_quant)
    y_PD = _experts_gemms(x_TD, w13_EFD, w2_EDF, weights_P, routing, K, launch, act, w13_scale, w2_scale,
                          scale_block, act_quant, w13_bias, w2_bias)
    topk = topk_sum_launch(K, D)
    _topk_sum_kernel[(T, triton.cdiv(D, topk["BLOCK_D"]))](
        y_PD, ids_TK, out, D, y_PD.stride(0), out.stride(0), out.stride(1), **topk)
    return out


def _check_experts_args(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, w13_scale, w2_scale, scale_block,
                        w13_bias, w2_bias, activation) -> tuple:
    """`fused_experts_triton`'s shapes, dtypes and weight formats, checked before anything runs;
    returns the activation's kernel form (code, alpha, limit)."""
    T, D = x_TD.shape
    E, F2, D13 = w13_EFD.shape
    F = F2 // 2
    K = topk_ids_TK.shape[1] if topk_ids_TK.dim() == 2 else 0
    fp4 = isinstance(w13_EFD, Mxfp4Weight)
    if fp4 != isinstance(w2_EDF, Mxfp4Weight):
        raise ValueError("w13 and w2 must both be MXFP4 (Mxfp4Weight) or neither")
    act = kernel_activation(activation)
    if act is None:
        raise ValueError(f"activation {activation!r} has no form in the Triton grouped GEMM")
    for name, b, shape in (("w13_bias", w13_bias, (E, F2)), ("w2_bias", w2_bias, (E, D))):
        if b is not None and tuple(b.shape) != shape:
            raise ValueError(f"{name}={tuple(b.shape)} must be {shape}")
    if D13 != D or F2 != 2 * F or tuple(w2_EDF.shape) != (E, D, F):
        raise ValueError(f"shapes do not match: x_TD={tuple(x_TD.shape)}, w13_EFD={tuple(w13_EFD.shape)}, "
                         f"w2_EDF={tuple(w2_EDF.shape)}")
    if tuple(topk_ids_TK.shape) != (T, K) or tuple(topk_weights_TK.shape) != (T, K):
        raise ValueError(f"topk_ids_TK={tuple(topk_ids_TK.shape)} and topk_weights_TK="
                         f"{tuple(topk_weights_TK.shape)} must both be (T, K) with T={T}")
    if w13_scale is not None:
        if not (w13_EFD.dtype == w2_EDF.dtype == torch.float8_e4m3fn) or w2_scale is None or scale_block is None:
            raise ValueError("block-FP8 experts need float8_e4m3fn w13 and w2, both scales and scale_block")
        nF = triton.cdiv(F, scale_block[0])
        if (tuple(w13_scale.shape) != (E, 2 * nF, triton.cdiv(D, scale_block[1]))
                or tuple(w2_scale.shape) != (E, triton.cdiv(D, scale_block[0]), triton.cdiv(F, scale_block[1]))):
            raise ValueError(f"scale shapes {tuple(w13_scale.shape)} / {tuple(w2_scale.shape)} do not match the "
                             f"weights for blocks {tuple(scale_block)}")
    elif fp4:
        for w in (w13_EFD, w2_EDF):
            if w.blocks.dtype != torch.uint8 or w.scales.dtype != torch.uint8 or w.blocks.shape[-1] != 16 \
                    or tuple(w.blocks.shape[:-1]) != tuple(w.scales.shape):
                raise ValueError(f"MXFP4 weights need uint8 blocks (E, R, G, 16) and scales (E, R, G), got "
                                 f"{tuple(w.blocks.shape)} {w.blocks.dtype} / {tuple(w.scales.shape)} {w.scales.dtype}")
    elif not (x_TD.dtype == w13_EFD.dtype == w2_EDF.dtype):
        raise ValueError(f"dtypes differ: x {x_TD.dtype}, w13 {w13_EFD.dtype}, w2 {w2_EDF.dtype}")
    return act


def _experts_launch(cfg: dict, dtype: torch.dtype, w13_EFD, w13_scale, scale_block, act_quant: bool) -> dict:
    """The grouped GEMM's constexprs and launch options for this weight format (gate/up and down alike)."""
    scaled = w13_scale is not None
    if act_quant and not scaled:
        raise ValueError("act_quant needs block-FP8 weights")
    if act_quant:
        return w8a8_gemm_launch(cfg, dtype, scale_block)
    if scaled:
        return fp8_gemm_launch(cfg, dtype, scale_block)
    if isinstance(w13_EFD, Mxfp4Weight):
        return fp4_gemm_launch(cfg, dtype)
    return gemm_launch(cfg, dtype)


def _weight_operands(w13_EFD, w2_EDF, w13_scale, w2_scale, scale_block, placeholder: torch.Tensor) -> tuple:
    """(w13, w2, s13, s2): the weights as the kernel reads them and each GEMM's scale arguments
    (s_ptr, stride_se, stride_sn, stride_sk, s_up_row0); placeholder stands in where B_SCALED and
    B_FP4 are off and the scales are never read."""
    F = w2_EDF.shape[2]
    if w13_scale is not None:
        s13 = (w13_scale, w13_scale.stride(0), w13_scale.stride(1), w13_scale.stride(2),
               triton.cdiv(F, scale_block[0]))
        s2 = (w2_scale, w2_scale.stride(0), w2_scale.stride(1), w2_scale.stride(2), 0)
        return w13_EFD, w2_EDF, s13, s2
    if isinstance(w13_EFD, Mxfp4Weight):  # the packed bytes as (E, R, C / 2): k's byte stride is 1; one scale per 32 k
        sc13, sc2 = w13_EFD.scales, w2_EDF.scales
        s13 = (sc13, sc13.stride(0), sc13.stride(1), sc13.stride(2), F)
        s2 = (sc2, sc2.stride(0), sc2.stride(1), sc2.stride(2), 0)
        return w13_EFD.blocks.flatten(2), w2_EDF.blocks.flatten(2), s13, s2
    return w13_EFD, w2_EDF, (placeholder, 0, 0, 0, 0), (placeholder, 0, 0, 0, 0)


def _experts_gemms(x_TD, w13_EFD, w2_EDF, weights_P, routing, K: int, launch: dict, act: tuple, w13_scale,
                   w2_scale, scale_block, act_quant: bool, w13_bias, w2_bias,
                   y_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y (P, D) in y_dtype (default x's): each pair's expert output times its router weight, by the
    gate/up GEMM (activation fused) and the down GEMM; rows of pairs whose expert is not here are
    left unwritten."""
    T, D = x_TD.shape
    F = w2_EDF.shape[2]
    P, S = routing.num_pairs, routing.sorted_pair_ids_S.shape[0]
    BM = launch["BLOCK_SIZE_M"]
    w13, w2, s13, s2 = _weight_operands(w13_EFD, w2_EDF, w13_scale, w2_scale, scale_block, weights_P)
    code, alpha, limit = act
    # The variant's arguments: the bias rows (unit stride along n) and the activation's constants.
    v13, v2 = ((b.contiguous(), b.shape[1]) if b is not None else (weights_P, 0) for b in (w13_bias, w2_bias))
    v13, v2 = (*v13, alpha, limit), (*v2, 0.0, 0.0)
    a_in, a_scales = x_TD, (weights_P, 0, 0)  # the scales are unused unless A_SCALED
    if act_quant:
        from moe_serve.kernels.fp8_quant import quantize_per_token_group

        a_in, xs = quantize_per_token_group(x_TD, scale_block[1])
        a_scales = (xs, xs.stride(0), xs.stride(1))
    y_PD = _empty((P, D), y_dtype or x_TD.dtype, x_TD.device)
    if S == 0:
        return y_PD
    h_PF = _empty((P, F), x_TD.dtype, x_TD.device)
    _grouped_gemm_kernel[(S // BM * triton.cdiv(F, launch["BLOCK_SIZE_N"]),)](
        a_in, w13, h_PF, weights_P,
        routing.sorted_pair_ids_S, routing.expert_ids_B, routing.num_padded,
        F, D, S, P, K,
        a_in.stride(0), a_in.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        h_PF.stride(0), h_PF.stride(1), *s13, *a_scales, *v13,
        GATED=True, MUL_WEIGHT=False, ACT=code, HAS_BIAS=w13_bias is not None, **launch)
    h_in, h_scales = h_PF, (weights_P, 0, 0)
    if act_quant:
        h_in, hs = quantize_per_token_group(h_PF, scale_block[1])
        h_scales = (hs, hs.stride(0), hs.stride(1))
    _grouped_gemm_kernel[(S // BM * triton.cdiv(D, launch["BLOCK_SIZE_N"]),)](
        h_in, w2, y_PD, weights_P,
        routing.sorted_pair_ids_S, routing.expert_ids_B, routing.num_padded,
        D, F, S, P, 1,
        h_in.stride(0), h_in.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        y_PD.stride(0), y_PD.stride(1), *s2, *h_scales, *v2,
        GATED=False, MUL_WEIGHT=True, ACT=0, HAS_BIAS=w2_bias is not None, **launch)
    return y_PD
