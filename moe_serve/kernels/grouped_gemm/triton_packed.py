"""The Triton grouped GEMM for MoE experts kept packed in int4 / int8 (PackedWeight stacked per
expert, moe_serve/quantization/packed.py; moe_serve/layers/experts.py PackedExperts).

Shape legend: T tokens, K top-k, P = T*K (token, k) pairs, D hidden size, F expert intermediate
size, E experts on this rank, S padded pair slots (align.py).

The launches of triton_kernel.py's grouped GEMM (routing aligned per expert, the gate/up GEMM with
the activation fused, the down GEMM with the router weight folded in, the top-k sum), with the
weight tiles read as codes, group scales and offsets and decoded in registers as they load
(moe_serve/kernels/packed_tiles.py): W4A16 / W8A16 in the activations' dtype with fp32 accumulation,
or W8A8 (`act_quant`, 8-bit per-channel experts) with x and h quantized to int8 per row and
int32 accumulation. Each GEMM's K tile is the config's narrowed to divide its weight's group size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_serve.kernels.grouped_gemm import triton_kernel as tk
from moe_serve.kernels.grouped_gemm.align import align_block_size
from moe_serve.kernels.grouped_gemm.config import get_config, validate_config
from moe_serve.kernels.grouped_gemm.reference import kernel_activation
from moe_serve.kernels.grouped_gemm.triton_kernel import _activation, _bias_row, _grouped_tile
from moe_serve.kernels.packed_tiles import _int8_epilogue, _packed_k_step, packed_k_tile, packed_operands


# As in triton_kernel.py: num_pairs changes every step, and the scales' strides (sizes / G) and the
# group size are read once per tile: unspecialised, so they add no variant per step or per model.
@triton.jit(do_not_specialize=("num_pairs", "stride_se", "stride_sn", "group_size", "stride_bias_e"))
def _packed_grouped_gemm_kernel(
    a_ptr, q_ptr, c_ptr, weights_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    N, Kdim, num_slots, num_pairs, a_row_div,
    stride_am, stride_ak, stride_qe, stride_qn, stride_qk, stride_cm, stride_cn,
    s_ptr, o_ptr, stride_se, stride_sn, group_size, as_ptr, bias_ptr, stride_bias_e, alpha, limit,
    GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    BITS: tl.constexpr, HAS_OFFSET: tl.constexpr, PER_TILE: tl.constexpr, A_INT8: tl.constexpr,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """c[p, n] = sum_k a[p // a_row_div, k] * W_e[n, k] for the pairs p of each row block, W_e expert
    e's packed weight: codes q[e] (stride_qk the byte stride along k), scales s[e] and offsets o[e]
    (o_ptr ignored unless HAS_OFFSET) of shape (rows, Kdim / group_size), unit stride along groups.

    GATED: W_e holds 2N rows [gate | up]; c[p, n] = act(gate . a, up . a) (ACT as in triton_kernel).
    MUL_WEIGHT: c[p, :] *= weights[p] before the cast to c's dtype.
    A_INT8: a is int8 with a float32 scale per row of a (as_ptr); 8-bit per-channel codes only.
    HAS_BIAS: bias[e, n] (rows of stride_bias_e; gate then up for GATED) is added to the fp32
    product: before the activation, and before the router weight.
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
    offs_n64 = offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    # int64 expert offsets: E * 2F * D passes 2**31 for DeepSeek-sized layers
    q_e = q_ptr + expert * stride_qe
    s_e = s_ptr + expert * stride_se
    o_e = o_ptr + expert * stride_se
    if A_INT8:  # int32 over the whole of K, rescaled once (packed_tiles.py)
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.int32)
        acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_SIZE_M,), dtype=tl.int32)
    for k_blk in range(0, tl.cdiv(Kdim, BLOCK_SIZE_K)):
        k0 = k_blk * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & (offs_k < Kdim - k0)[None, :], other=0.0)
        acc = _packed_k_step(acc, a, q_e, s_e, o_e, offs_n64, n_mask, k0, offs_k, Kdim,
                             stride_qn, stride_qk, stride_sn, group_size, BITS, HAS_OFFSET, PER_TILE, A_INT8,
                             PREC, UPCAST, BLOCK_SIZE_N, BLOCK_SIZE_K)
        if GATED:  # the up rows start N rows further, in the codes, scales and offsets alike
            acc_up = _packed_k_step(acc_up, a, q_e + N * stride_qn, s_e + N * stride_sn,
                                    o_e + N * stride_sn, offs_n64, n_mask, k0, offs_k, Kdim, stride_qn, stride_qk,
                                    stride_sn, group_size, BITS, HAS_OFFSET, PER_TILE, A_INT8, PREC, UPCAST,
                                    BLOCK_SIZE_N, BLOCK_SIZE_K)
        if A_INT8:
            row_sum += tl.sum(a.to(tl.int32), axis=1)
        a_ptrs += BLOCK_SIZE_K * stride_ak
    if A_INT8:
        a_scale = tl.load(as_ptr + a_row, mask=row_mask, other=0.0)
        acc = _int8_epilogue(acc, row_sum, a_scale, s_e, o_e, offs_n64, n_mask, stride_sn, HAS_OFFSET)
        if GATED:
            acc_up = _int8_epilogue(acc_up, row_sum, a_scale, s_e + N * stride_sn, o_e + N * stride_sn, offs_n64,
                                    n_mask, stride_sn, HAS_OFFSET)

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


INTERPRETED = type(_packed_grouped_gemm_kernel).__name__ == "InterpretedFunction"


def packed_gemm_launch(cfg: dict, dtype: torch.dtype, w, act_quant: bool = False, where: str = "packed experts"
                       ) -> dict:
    """Constexprs and launch options of `_packed_grouped_gemm_kernel` (GATED / MUL_WEIGHT / ACT aside)
    for one config, activation dtype and stacked PackedWeight w (its bits, group size and offsets
    select the variant; the K tile is narrowed to divide its group). fp32 activations take K tiles of
    16 and N tiles of at most 64: their exact (FMA) product holds both operand tiles in registers,
    and the dequantized tile's conversion to its operand layout spilled kilobytes per thread at the
    configs' K tiles of 64 and 128, and a 64 x 128 gate/up tile still 472 B on sm_100 (aot_check)."""
    fp32 = dtype == torch.float32
    bk, per_tile = packed_k_tile(16 if fp32 else cfg["BLOCK_SIZE_K"], w.group_size, w.shape[-1], act_quant, where)
    bn = min(64, cfg["BLOCK_SIZE_N"]) if fp32 else cfg["BLOCK_SIZE_N"]
    return dict(GROUP_SIZE_M=cfg["GROUP_SIZE_M"], BLOCK_SIZE_M=cfg["BLOCK_SIZE_M"], BLOCK_SIZE_N=bn,
                BLOCK_SIZE_K=bk, PREC="ieee" if dtype == torch.float32 else "tf32", UPCAST=INTERPRETED,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], BITS=w.bits,
                HAS_OFFSET=w.offsets is not None or bool(getattr(w, "zero", 0)), PER_TILE=per_tile, A_INT8=act_quant)


def _check_packed_experts(x_TD, w13, w2, topk_weights_TK, topk_ids_TK, act_quant: bool) -> None:
    """Shapes, dtypes and formats, checked before anything runs (each error names the tensor)."""
    T, D = x_TD.shape
    if x_TD.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"packed experts: x_TD of dtype {x_TD.dtype}; bf16, fp16 or fp32 are supported")
    for name, w in (("w13", w13), ("w2", w2)):
        if len(w.shape) != 3:
            raise ValueError(f"packed experts: {name} of shape {w.shape} must be stacked per expert (E, rows, K)")
    E, F2, D13 = w13.shape
    F = F2 // 2
    if D13 != D or F2 != 2 * F or tuple(w2.shape) != (E, D, F):
        raise ValueError(f"packed experts: shapes do not match: x_TD={tuple(x_TD.shape)}, w13={w13.shape}, "
                         f"w2={w2.shape}")
    if act_quant and (w13.bits, w2.bits) != (8, 8):
        raise ValueError(f"packed experts: W8A8 (act_quant) needs 8-bit weights, these are w13 {w13.bits}-bit and "
                         f"w2 {w2.bits}-bit")
    K = topk_ids_TK.shape[1] if topk_ids_TK.dim() == 2 else 0
    if tuple(topk_ids_TK.shape) != (T, K) or tuple(topk_weights_TK.shape) != (T, K):
        raise ValueError(f"packed experts: topk_ids_TK={tuple(topk_ids_TK.shape)} and topk_weights_TK="
                         f"{tuple(topk_weights_TK.shape)} must both be (T, K) with T={T}")


def fused_experts_packed_triton(x_TD: torch.Tensor, w13, w2, topk_weights_TK: torch.Tensor,
                                topk_ids_TK: torch.Tensor, config: dict | None = None, *,
                                out_TD: torch.Tensor | None = None, act_quant: bool = False,
                                w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                                activation="silu") -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) over packed experts, in one launch per GEMM.

    Args:
        x_TD: (T, D) tokens, bf16 / fp16 / fp32.
        w13: PackedWeight of shape (E, 2F, D): gate rows then up rows of each expert, 4 or 8 bits,
            any group size dividing D (per channel included), offsets or None.
        w2: PackedWeight of shape (E, D, F), its own bits and group size (GGUF Q4_K_M: 4-bit gate/up
            beside 8-bit down).
        topk_weights_TK, topk_ids_TK: (T, K) routing weights (used in fp32) and expert ids in
            [0, E), or -1 for a pair whose expert is not here.
        config: launch config (config.py); None picks the tuned entry or the default.
        out_TD: optional (T, D) output buffer of x's dtype; every element is overwritten.
        act_quant: W8A8 (8-bit per-channel experts): x and h quantized to int8 per row, int32 products.
        w13_bias, w2_bias: optional (E, 2F) / (E, D) per-expert biases (any float dtype), added in
            fp32 before the activation and before the router weight, as reference.py does.
        activation: "silu" or an activation with a kernel form (reference.kernel_activation).
    Returns:
        (T, D) in x's dtype; products accumulate in fp32 (int32 for W8A8).
    """
    _check_packed_experts(x_TD, w13, w2, topk_weights_TK, topk_ids_TK, act_quant)
    E, F2, D = w13.shape
    for name, b, shape in (("w13_bias", w13_bias, (E, F2)), ("w2_bias", w2_bias, (E, D))):
        if b is not None and tuple(b.shape) != shape:
            raise ValueError(f"packed experts: {name} of shape {tuple(b.shape)} must be {shape}")
    act = kernel_activation(activation)
    if act is None:
        raise ValueError(f"packed experts: activation {activation!r} has no form in the Triton grouped GEMM")
    T = x_TD.shape[0]
    F = F2 // 2
    K = topk_ids_TK.shape[1] if topk_ids_TK.dim() == 2 else 0
    out = out_TD if out_TD is not None else torch.empty((T, D), dtype=x_TD.dtype, device=x_TD.device)
    if T == 0:
        return out
    tk.check_triton_device(x_TD)
    cfg = dict(config) if config is not None else get_config(E, F, D, x_TD.dtype, T, K, x_TD.device)
    validate_config(cfg)
    l13 = packed_gemm_launch(cfg, x_TD.dtype, w13, act_quant, "packed experts w13")
    l2 = packed_gemm_launch(cfg, x_TD.dtype, w2, act_quant, "packed experts w2")
    q13, s13, o13, _ = packed_operands(w13, "packed experts w13")
    q2, s2, o2, _ = packed_operands(w2, "packed experts w2")

    routing = align_block_size(topk_ids_TK, E, cfg["BLOCK_SIZE_M"])
    ids_TK = topk_ids_TK.contiguous()
    weights_P = topk_weights_TK.contiguous().view(-1)
    P, S = routing.num_pairs, routing.sorted_pair_ids_S.shape[0]
    BM = cfg["BLOCK_SIZE_M"]
    code, alpha, limit = act
    # the bias rows (unit stride along n), or a stand-in never read
    b13, b2 = ((b.contiguous(), b.shape[1]) if b is not None else (weights_P, 0) for b in (w13_bias, w2_bias))
    y_PD = tk._empty((P, D), x_TD.dtype, x_TD.device)
    if S:
        a_in, a_sc = x_TD, weights_P  # the activation scales are unused unless A_INT8
        if act_quant:
            from moe_serve.kernels.int8_quant import quantize_int8_per_token

            a_in, a_sc = quantize_int8_per_token(x_TD)
        h_PF = tk._empty((P, F), x_TD.dtype, x_TD.device)
        _packed_grouped_gemm_kernel[(S // BM * triton.cdiv(F, l13["BLOCK_SIZE_N"]),)](
            a_in, q13, h_PF, weights_P, routing.sorted_pair_ids_S, routing.expert_ids_B, routing.num_padded,
            F, D, S, P, K, a_in.stride(0), a_in.stride(1), q13.stride(0), q13.stride(1), q13.stride(2),
            h_PF.stride(0), h_PF.stride(1), s13, o13, s13.stride(0), s13.stride(1), w13.group_size, a_sc,
            *b13, alpha, limit, GATED=True, MUL_WEIGHT=False, ACT=code, HAS_BIAS=w13_bias is not None, **l13)
        h_in, h_sc = h_PF, weights_P
        if act_quant:
            h_in, h_sc = quantize_int8_per_token(h_PF)
        _packed_grouped_gemm_kernel[(S // BM * triton.cdiv(D, l2["BLOCK_SIZE_N"]),)](
            h_in, q2, y_PD, weights_P, routing.sorted_pair_ids_S, routing.expert_ids_B, routing.num_padded,
            D, F, S, P, 1, h_in.stride(0), h_in.stride(1), q2.stride(0), q2.stride(1), q2.stride(2),
            y_PD.stride(0), y_PD.stride(1), s2, o2, s2.stride(0), s2.stride(1), w2.group_size, h_sc,
            *b2, 0.0, 0.0, GATED=False, MUL_WEIGHT=True, ACT=0, HAS_BIAS=w2_bias is not None, **l2)
    topk = tk.topk_sum_launch(K, D)
    tk._topk_sum_kernel[(T, triton.cdiv(D, topk["BLOCK_D"]))](
        y_PD, ids_TK, out, D, y_PD.stride(0), out.stride(0), out.stride(1), **topk)
    return out
