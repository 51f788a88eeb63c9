"""Masked grouped GEMM: SwiGLU experts over an expert-major layout with a row count per expert.

Shape legend: E local experts, C rows per expert (capacity), D hidden size, F expert intermediate size.

DeepEP's low-latency dispatch hands each rank x (E, C, D) with count[e] valid rows for local expert
e (the rest of expert e's C rows hold nothing meaningful). Flattening that into E*C routed rows and
running the generic kernel (triton_kernel.py) computes and writes every one of the E*C rows; here

    y[e, :count[e]] = SwiGLU-expert_e(x[e, :count[e]])

and nothing else: two launches (gate/up with SiLU-and-mul fused, then down), no routing weights
(DeepEP's low-latency combine applies them), no top-k sum, and no host read of `count`: every
program loads its expert's count and a row tile starting at or past it returns before loading
anything. Rows of y past count[e] are left as they were; DeepEP's combine sends only the first
count[e] rows of each expert back (the per-rank ranges its dispatch recorded).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_serve.kernels.grouped_gemm.config import DECODE_CONFIG, validate_config
from moe_serve.kernels.grouped_gemm import triton_kernel as tk
from moe_serve.kernels.grouped_gemm.triton_kernel import _dequant, _dot, check_triton_device


# C (the capacity) is fixed per engine, but it is left unspecialised like num_pairs in the generic kernel
# so that its divisibility flags never select another compiled variant; so are the FP8 scales' strides
# (as in the generic kernel).
@triton.jit(do_not_specialize=("C", "stride_se", "stride_sn", "stride_sk", "s_up_row0"))
def _masked_gemm_kernel(
    a_ptr, b_ptr, c_ptr, count_ptr,
    N, Kdim, C,
    stride_ae, stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_ce, stride_cm, stride_cn,
    s_ptr, stride_se, stride_sn, stride_sk, s_up_row0,
    GATED: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
    B_SCALED: tl.constexpr = False, SB_N: tl.constexpr = 128, SB_K: tl.constexpr = 128,
):
    """c[e, m, n] = sum_k a[e, m, k] * b[e, n, k] for m < count[e]; program (tile, e).

    GATED: b holds 2N rows [gate | up]; c[e, m, n] = silu(gate . a) * (up . a).
    B_SCALED: b is block FP8 (weight-only), dequantized tile by tile as in triton_kernel.py; the up
    half's scale rows start at s_up_row0.
    """
    pid = tl.program_id(0)
    expert = tl.program_id(1).to(tl.int64)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    count = tl.load(count_ptr + expert)
    if pid_m * BLOCK_SIZE_M >= count:
        return

    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    row_mask = offs_m < count
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_SIZE_K)

    # int64 expert offsets: E * C * D and E * 2F * D pass 2**31 for DeepSeek-sized layers.
    a_ptrs = a_ptr + expert * stride_ae + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    if GATED:
        up_ptrs = b_ptrs + N * stride_bn
        acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    s_base = expert * stride_se
    for k_blk in range(0, tl.cdiv(Kdim, BLOCK_SIZE_K)):
        k_mask = offs_k < Kdim - k_blk * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if B_SCALED:
            b = _dequant(b, s_ptr, s_base, offs_n, k_blk * BLOCK_SIZE_K, offs_k, k_mask, n_mask, stride_sn, stride_sk,
                         SB_N, SB_K, BLOCK_SIZE_K).to(a.dtype)
        acc = _dot(a, b, acc, PREC, UPCAST)
        if GATED:
            b_up = tl.load(up_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if B_SCALED:
                b_up = _dequant(b_up, s_ptr, s_base + s_up_row0 * stride_sn, offs_n, k_blk * BLOCK_SIZE_K, offs_k,
                                k_mask, n_mask, stride_sn, stride_sk, SB_N, SB_K, BLOCK_SIZE_K).to(a.dtype)
            acc_up = _dot(a, b_up, acc_up, PREC, UPCAST)
            up_ptrs += BLOCK_SIZE_K * stride_bk
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk

    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up  # SiLU(gate) * up, in fp32 before the one rounding
    c_ptrs = c_ptr + expert * stride_ce + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


# Decorated in interpreter mode iff TRITON_INTERPRET=1 was set when this module loaded.
INTERPRETED = type(_masked_gemm_kernel).__name__ == "InterpretedFunction"


def masked_launch(cfg: dict, dtype: torch.dtype, scale_block: tuple[int, int] | None = None,
                  gated: bool = True) -> dict:
    """Constexprs and launch options of `_masked_gemm_kernel` for one grouped-GEMM config
    (config.py's keys; GROUP_SIZE_M has no use here), activation dtype and launch (gated = gate/up,
    else down); with scale_block, for block-FP8 weights. moe_serve/kernels/aot_check.py compiles what this
    returns (as the launch specialises it)."""
    launch = dict(BLOCK_SIZE_M=cfg["BLOCK_SIZE_M"], BLOCK_SIZE_N=cfg["BLOCK_SIZE_N"], BLOCK_SIZE_K=cfg["BLOCK_SIZE_K"],
                  PREC="ieee" if dtype == torch.float32 else "tf32", UPCAST=INTERPRETED, GATED=gated,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], B_SCALED=False, SB_N=128, SB_K=128)
    if scale_block is not None:
        launch.update(B_SCALED=True, SB_N=scale_block[0], SB_K=scale_block[1])
    return launch


def masked_config(rows_per_expert: float) -> dict:
    """The default config for an expected number of valid rows per expert (decode-sized batches
    are what low-latency dispatch carries, so the decode tile unless experts get many rows)."""
    from moe_serve.kernels.grouped_gemm.config import default_config

    return default_config(int(rows_per_expert), 1, 1) if rows_per_expert > 16 else dict(DECODE_CONFIG)


def masked_experts_triton(
    x_ECD: torch.Tensor,
    count_E: torch.Tensor,
    w13_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    config: dict | None = None,
    *,
    out_ECD: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """y[e, :count[e]] = SwiGLU-expert_e(x[e, :count[e]]), unweighted; other rows of y untouched.

    Args:
        x_ECD: (E, C, D) tokens, bf16 / fp16 / fp32; rows past count[e] are never read.
        count_E: (E,) int32 (or int64) valid rows per expert, each in [0, C]; read on the device only.
        w13_EFD: (E, 2F, D) gate rows then up rows of each expert, x's dtype (or float8_e4m3fn).
        w2_EDF: (E, D, F) down projection of each expert.
        config: launch config (config.py's keys); None = the decode config.
        out_ECD: optional (E, C, D) output of x's dtype; only each expert's first count[e] rows are written.
        w13_scale, w2_scale, scale_block: block FP8 weights' scale_inv, as for
            triton_kernel.fused_experts_triton.
    Returns:
        (E, C, D) in x's dtype (out_ECD if given); products accumulate in fp32.
    """
    E, C, D = x_ECD.shape
    E13, F2, D13 = w13_EFD.shape
    F = F2 // 2
    if E13 != E or D13 != D or F2 != 2 * F or tuple(w2_EDF.shape) != (E, D, F) or tuple(count_E.shape) != (E,):
        raise ValueError(f"shapes do not match: x_ECD={tuple(x_ECD.shape)}, count_E={tuple(count_E.shape)}, "
                         f"w13_EFD={tuple(w13_EFD.shape)}, w2_EDF={tuple(w2_EDF.shape)}")
    scaled = w13_scale is not None
    if scaled:
        if not (w13_EFD.dtype == w2_EDF.dtype == torch.float8_e4m3fn) or w2_scale is None or scale_block is None:
            raise ValueError("block-FP8 experts need float8_e4m3fn w13 and w2, both scales and scale_block")
    elif not (x_ECD.dtype == w13_EFD.dtype == w2_EDF.dtype):
        raise ValueError(f"dtypes differ: x {x_ECD.dtype}, w13 {w13_EFD.dtype}, w2 {w2_EDF.dtype}")
    out = out_ECD if out_ECD is not None else torch.empty((E, C, D), dtype=x_ECD.dtype, device=x_ECD.device)
    if E == 0 or C == 0:
        return out
    check_triton_device(x_ECD)
    cfg = dict(config) if config is not None else dict(DECODE_CONFIG)
    validate_config(cfg)
    sb = scale_block if scaled else None
    up_launch, down_launch = (masked_launch(cfg, x_ECD.dtype, sb, gated) for gated in (True, False))
    BM = cfg["BLOCK_SIZE_M"]
    count = count_E.contiguous()
    if scaled:
        nF = triton.cdiv(F, scale_block[0])
        s13 = (w13_scale, w13_scale.stride(0), w13_scale.stride(1), w13_scale.stride(2), nF)
        s2 = (w2_scale, w2_scale.stride(0), w2_scale.stride(1), w2_scale.stride(2), 0)
    else:
        s13 = s2 = (count, 0, 0, 0, 0)  # unused: B_SCALED is off
    h_ECF = tk._empty((E, C, F), x_ECD.dtype, x_ECD.device)  # rows past count are neither written nor read
    m_tiles = triton.cdiv(C, BM)
    _masked_gemm_kernel[(m_tiles * triton.cdiv(F, up_launch["BLOCK_SIZE_N"]), E)](
        x_ECD, w13_EFD, h_ECF, count, F, D, C,
        x_ECD.stride(0), x_ECD.stride(1), x_ECD.stride(2), w13_EFD.stride(0), w13_EFD.stride(1), w13_EFD.stride(2),
        h_ECF.stride(0), h_ECF.stride(1), h_ECF.stride(2), *s13, **up_launch)
    _masked_gemm_kernel[(m_tiles * triton.cdiv(D, down_launch["BLOCK_SIZE_N"]), E)](
        h_ECF, w2_EDF, out, count, D, F, C,
        h_ECF.stride(0), h_ECF.stride(1), h_ECF.stride(2), w2_EDF.stride(0), w2_EDF.stride(1), w2_EDF.stride(2),
        out.stride(0), out.stride(1), out.stride(2), *s2, **down_launch)
    return out
