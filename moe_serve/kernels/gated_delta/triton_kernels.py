"""Triton Gated DeltaNet: the short causal convolution and the gated delta rule over a packed
varlen batch, with the API of moe_serve/kernels/gated_delta/reference.py.

Shape legend: T packed rows, B sequences, H heads (q/k heads already repeated to the value
heads), K / V key and value head dims, C convolution channels, KW its width (W = KW - 1 inputs of
state), BT the chunk of rows the prefill solves at once, BV the value columns one program owns.

Kernels:
- `_conv1d_kernel`: a program owns BLOCK_C channels of BLOCK_T rows of one sequence; inputs
  before the sequence's first row come from its conv state (or are zero for a fresh sequence).
  Prefill tiles run in parallel, so the new states (each sequence's last W inputs) are written
  after them by `_conv_state_kernel`; DECODE (one row per sequence, row b) writes its own, after
  a barrier, so no thread overwrites an entry another still reads.
- `_recurrent_kernel` (decode): one token per sequence; a program owns a (K, BV) tile of one
  sequence's head state: read from the slot, decayed, corrected by the delta rule, read out by
  q and written back in place. Nothing is read on the host: a CUDA graph can hold it.
- prefill, in two launches over the sequences after the step's leading decodes:
  `_chunk_inverse_kernel` (one program per (chunk, head), all chunks in parallel) solves each
  chunk's unit lower-triangular system (I + A), A[i, j] = beta_i (k_i · k_j) exp(G_i - G_j) for
  i > j, G the running sum of g, by forward substitution into a (BT, BT) workspace;
  `_chunk_scan_kernel` (one program per (sequence, head, V tile)) then walks the sequence's
  chunks in order carrying the state tile in registers (moe_serve/kernels/gated_delta/__init__.py
  `chunked_delta_rule` gives the algebra): with T = (I + A)^-1, the corrected values
  v' = T (beta v) - T (beta exp(G) k) S = T (beta (v - exp(G) k S)) (one (BT, BV) product with T),
  o = exp(G) q S + (causal exp(G_i - G_j) q kᵀ) v',
  S <- exp(G_last) S + (exp(G_last - G) k)ᵀ v'. It starts from the slot's state (zeros for a
  fresh sequence) and stores the final state back.

Everything a variant is compiled for (tiles, warps, dtypes, DECODE, the l2 norm, the conv bias
and activation) depends on the model's shapes and the kind of step, never on the batch size or
lengths, which are runtime values; per-step integers are left unspecialised.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows the prefill solves at once (the chunk of the chunked form).
CHUNK = 64


@triton.jit
def _conv_write_state(x_ptr, state, c, c_mask, start, L, known, stride_xt, stride_xc, stride_sw,
                      W: tl.constexpr, BLOCK_W: tl.constexpr):
    """The sequence's last W inputs into its conv state (state: the slot's pointer per channel c):
    entry i is the input at row L - W + i, which is before the first row when the sequence is
    shorter than W (then one of the `known` older state entries, or zero)."""
    i = tl.arange(0, BLOCK_W)
    src = L - W + i
    keep = (i < W)[None, :] & c_mask[:, None]
    new = tl.load(x_ptr + (start + src).to(tl.int64)[None, :] * stride_xt + c[:, None] * stride_xc,
                  mask=keep & (src >= 0)[None, :], other=0.0).to(state.dtype.element_ty)
    new += tl.load(state[:, None] + (src + W)[None, :] * stride_sw, mask=keep & ((src < 0) & (src >= -known))[None, :],
                   other=0.0)
    tl.debug_barrier()  # every read of the old state (here and before) ahead of any write
    tl.store(state[:, None] + i[None, :] * stride_sw, new, mask=keep)


@triton.jit(do_not_specialize=("read_cont",))
def _conv1d_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, y_ptr, slots_ptr, tiles_ptr, cont_ptr, C, read_cont,
                   stride_xt, stride_xc, stride_wc, stride_wk, stride_ss, stride_sc, stride_sw, stride_yt, stride_yc,
                   KW: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
                   HAS_BIAS: tl.constexpr, SILU: tl.constexpr, DECODE: tl.constexpr):
    """y = act(bias + sum_j w[:, j] * x[t + j - W]) for BLOCK_C channels of BLOCK_T rows of one
    sequence, inputs before its first row from its state. Prefill: tiles (P, 5) int32 rows
    (sequence, its first row, its rows, continues, the tile's first row in it); the state is
    written by `_conv_state_kernel` after. DECODE: sequence b is row b, one row (continues =
    cont[b] if read_cont else 1), and the program writes its state too."""
    p = tl.program_id(0)  # the long axis: tiles of a long prompt can outnumber a grid's second axis
    pid_c = tl.program_id(1)
    W: tl.constexpr = KW - 1
    if DECODE:
        b = p
        start = p
        L = 1
        t0 = 0
        cont = tl.full([], 1, tl.int32)
        if read_cont != 0:
            cont = tl.load(cont_ptr + p)
    else:
        b = tl.load(tiles_ptr + p * 5)
        start = tl.load(tiles_ptr + p * 5 + 1)
        L = tl.load(tiles_ptr + p * 5 + 2)
        cont = tl.load(tiles_ptr + p * 5 + 3)
        t0 = tl.load(tiles_ptr + p * 5 + 4)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    known = W * cont  # inputs before the first row the state holds: none for a fresh sequence
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < C
    state = state_ptr + slot * stride_ss + c * stride_sc
    t = t0 + tl.arange(0, BLOCK_T)  # rows of the sequence
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(KW):
        src = t + (j - W)  # the input row this tap reads, relative to the sequence's first row
        w_j = tl.load(w_ptr + c * stride_wc + j * stride_wk, mask=c_mask, other=0.0).to(tl.float32)
        in_x = (src >= 0) & (t < L)
        x = tl.load(x_ptr + (start + src).to(tl.int64)[:, None] * stride_xt + c[None, :] * stride_xc,
                    mask=in_x[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
        in_state = (src < 0) & (src >= -known) & (t < L)
        x += tl.load(state[None, :] + (src + W)[:, None] * stride_sw,
                     mask=in_state[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
        acc += x * w_j[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + (start + t).to(tl.int64)[:, None] * stride_yt + c[None, :] * stride_yc,
             acc.to(y_ptr.dtype.element_ty), mask=(t < L)[:, None] & c_mask[None, :])
    if DECODE:
        _conv_write_state(x_ptr, state, c, c_mask, start, L, known, stride_xt, stride_xc, stride_sw, W, BLOCK_W)


@triton.jit
def _conv_state_kernel(x_ptr, state_ptr, slots_ptr, seqs_ptr, C,
                       stride_xt, stride_xc, stride_ss, stride_sc, stride_sw,
                       KW: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    """Prefill, after `_conv1d_kernel` read the old states: each sequence's last W inputs into its
    conv state; seqs: (B, 3) int32 rows (first row, rows, continues), no rows: slot untouched."""
    b = tl.program_id(0)
    pid_c = tl.program_id(1)
    start = tl.load(seqs_ptr + b * 3)
    L = tl.load(seqs_ptr + b * 3 + 1)
    cont = tl.load(seqs_ptr + b * 3 + 2)
    if L == 0:
        return
    slot = tl.load(slots_ptr + b).to(tl.int64)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < C
    _conv_write_state(x_ptr, state_ptr + slot * stride_ss + c * stride_sc, c, c_mask, start, L, (KW - 1) * cont,
                      stride_xt, stride_xc, stride_sw, KW - 1, BLOCK_W)


@triton.jit
def _l2norm_rows(x, USE_L2NORM: tl.constexpr):
    # x / sqrt(sum(x^2) + 1e-6), the reference's l2 norm
    if USE_L2NORM:
        x = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=-1, keep_dims=True) + 1e-6))
    return x


@triton.jit
def _l2norm_cols(x, USE_L2NORM: tl.constexpr):
    if USE_L2NORM:
        x = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0, keep_dims=True) + 1e-6))
    return x


@triton.jit(do_not_specialize=("read_cont",))
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr, slots_ptr, cont_ptr,
                      K, V, scale, read_cont,
                      stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                      stride_vt, stride_vh, stride_vd, stride_gt, stride_gh, stride_bt, stride_bh,
                      stride_ss, stride_sh, stride_sk, stride_sv, stride_ot, stride_oh, stride_od,
                      BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr):
    """One token (row b) of sequence b, head h, value columns pv * BV ...: the state tile read from
    slot slots[b] (zeros where read_cont and cont[b] == 0), stepped, and written back."""
    pv = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    t = b.to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    dk = tl.arange(0, BK)
    dv = pv * BV + tl.arange(0, BV)
    k_mask, v_mask = dk < K, dv < V
    q = tl.load(q_ptr + t * stride_qt + h * stride_qh + dk * stride_qd, mask=k_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + dk * stride_kd, mask=k_mask, other=0.0).to(tl.float32)
    q = _l2norm_rows(q, USE_L2NORM) * scale
    k = _l2norm_rows(k, USE_L2NORM)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + dv * stride_vd, mask=v_mask, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + t * stride_gt + h * stride_gh).to(tl.float32))
    beta = tl.load(beta_ptr + t * stride_bt + h * stride_bh).to(tl.float32)
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + dk[:, None] * stride_sk + dv[None, :] * stride_sv
    cont = tl.full([], 1, tl.int32)
    if read_cont != 0:
        cont = tl.load(cont_ptr + b)
    state_rows = K * cont  # none read for a fresh sequence
    S = tl.load(s_ptrs, mask=(dk < state_rows)[:, None] & v_mask[None, :], other=0.0).to(tl.float32) * decay
    delta = beta * (v - tl.sum(S * k[:, None], axis=0))
    S += k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], axis=0)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + dv * stride_od, o.to(o_ptr.dtype.element_ty), mask=v_mask)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=k_mask[:, None] & v_mask[None, :])


@triton.jit
def _chunk_inverse_kernel(k_ptr, g_ptr, beta_ptr, tinv_ptr, chunks_ptr, K,
                          stride_kt, stride_kh, stride_kd, stride_gt, stride_gh, stride_bt, stride_bh,
                          stride_ac, stride_ah, stride_ai,
                          BT: tl.constexpr, BK: tl.constexpr, USE_L2NORM: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 of chunk c (rows chunks[c] .. + chunks[c + 1]) and head h into tinv[c, h]
    (BT, BT), computed in float32 and stored in the inputs' dtype (the scan's product operand):
    row i is e_i - sum_{j < i} A[i, j] row j, filled top down."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(chunks_ptr + c * 2)
    n = tl.load(chunks_ptr + c * 2 + 1)
    r = tl.arange(0, BT)
    rows = (start + r).to(tl.int64)
    r_mask = r < n
    dk = tl.arange(0, BK)
    k = tl.load(k_ptr + rows[:, None] * stride_kt + h * stride_kh + dk[None, :] * stride_kd,
                mask=r_mask[:, None] & (dk[None, :] < K), other=0.0).to(tl.float32)
    k = _l2norm_rows(k, USE_L2NORM)
    g = tl.load(g_ptr + rows * stride_gt + h * stride_gh, mask=r_mask, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rows * stride_bt + h * stride_bh, mask=r_mask, other=0.0).to(tl.float32)
    G = tl.cumsum(g, axis=0)
    # A transposed: At[j, i] = A[i, j], so that row i of A is a column of At, whose sum over axis 1
    # lands along the rows of the inverse it combines.
    kk = tl.dot(k, tl.trans(k), input_precision=PREC)
    below = r[:, None] < r[None, :]  # j < i
    At = tl.where(below, kk * beta[None, :] * tl.exp(tl.where(below, G[None, :] - G[:, None], 0.0)), 0.0)
    inv = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, BT):
        a = tl.sum(tl.where(r[None, :] == i, At, 0.0), axis=1)  # A[i, j] over j
        row = tl.sum(a[:, None] * inv, axis=0)  # sum_j A[i, j] inv[j, :]
        inv = tl.where(r[:, None] == i, inv - row[None, :], inv)
    tl.store(tinv_ptr + c.to(tl.int64) * stride_ac + h * stride_ah + r[:, None] * stride_ai + r[None, :],
             inv.to(tinv_ptr.dtype.element_ty))


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    # The CPU interpreter multiplies bf16 tiles as raw uint16 bits; upcast there only.
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=PREC)
    return acc


@triton.jit
def _chunk_scan_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tinv_ptr, state_ptr, o_ptr, slots_ptr, seqs_ptr,
                       K, V, scale,
                       stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                       stride_vt, stride_vh, stride_vd, stride_gt, stride_gh, stride_bt, stride_bh,
                       stride_ac, stride_ah, stride_ai,
                       stride_ss, stride_sh, stride_sk, stride_sv, stride_ot, stride_oh, stride_od,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr,
                       PREC: tl.constexpr, UPCAST: tl.constexpr):
    """The chunks of sequence seqs[p] in order for head h and value columns pv * BV ..., carrying
    the (K, BV) float32 state tile; seqs: (P, 5) int32 (sequence index, first row, rows, first
    chunk, continues). Products take their operands in the inputs' dtype (bf16 / fp16 tensor
    cores; fp32 models: PREC) and accumulate in float32."""
    p = tl.program_id(0)
    h = tl.program_id(1)
    pv = tl.program_id(2)
    ty = q_ptr.dtype.element_ty
    b = tl.load(seqs_ptr + p * 5)
    start = tl.load(seqs_ptr + p * 5 + 1)
    L = tl.load(seqs_ptr + p * 5 + 2)
    chunk0 = tl.load(seqs_ptr + p * 5 + 3)
    cont = tl.load(seqs_ptr + p * 5 + 4)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    r = tl.arange(0, BT)
    dk = tl.arange(0, BK)
    dv = pv * BV + tl.arange(0, BV)
    k_mask, v_mask = dk < K, dv < V
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + dk[:, None] * stride_sk + dv[None, :] * stride_sv
    state_rows = K * cont  # none read for a fresh sequence
    S = tl.load(s_ptrs, mask=(dk < state_rows)[:, None] & v_mask[None, :], other=0.0).to(tl.float32)
    causal = r[:, None] >= r[None, :]
    for ci in range(0, tl.cdiv(L, BT)):
        rows = (start + ci * BT + r).to(tl.int64)
        r_mask = r < L - ci * BT
        qk_mask = r_mask[:, None] & k_mask[None, :]
        g = tl.load(g_ptr + rows * stride_gt + h * stride_gh, mask=r_mask, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + rows * stride_bt + h * stride_bh, mask=r_mask, other=0.0).to(tl.float32)
        G = tl.cumsum(g, axis=0)
        G_last = tl.sum(g, axis=0)  # padded rows have g = 0
        S_in = S.to(ty)
        # What the chunk's queries read from the state it enters with, and their causal scores.
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + dk[None, :] * stride_qd, mask=qk_mask,
                    other=0.0).to(tl.float32)
        k = tl.load(k_ptr + rows[:, None] * stride_kt + h * stride_kh + dk[None, :] * stride_kd, mask=qk_mask,
                    other=0.0).to(tl.float32)
        q = _l2norm_rows(q, USE_L2NORM) * scale
        k = _l2norm_rows(k, USE_L2NORM).to(ty)
        o = _dot((q * tl.exp(G)[:, None]).to(ty), S_in, tl.zeros((BT, BV), dtype=tl.float32), PREC, UPCAST)
        scores = _dot(q.to(ty), tl.trans(k), tl.zeros((BT, BT), dtype=tl.float32), PREC, UPCAST)
        scores = tl.where(causal, scores * tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)
        # v' = u - w S = T (beta (v - exp(G) k S)): the (BT, K) w is never formed
        v = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + dv[None, :] * stride_vd,
                    mask=r_mask[:, None] & v_mask[None, :], other=0.0).to(tl.float32)
        kS = _dot(k, S_in, tl.zeros((BT, BV), dtype=tl.float32), PREC, UPCAST)
        v = beta[:, None] * (v - tl.exp(G)[:, None] * kS)
        inv = tl.load(tinv_ptr + (chunk0 + ci).to(tl.int64) * stride_ac + h * stride_ah + r[:, None] * stride_ai
                      + r[None, :])
        v_new = _dot(inv, v.to(ty), tl.zeros((BT, BV), dtype=tl.float32), PREC, UPCAST).to(ty)
        o = _dot(scores.to(ty), v_new, o, PREC, UPCAST)
        tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + dv[None, :] * stride_od,
                 o.to(o_ptr.dtype.element_ty), mask=r_mask[:, None] & v_mask[None, :])
        # The state update reads k transposed: loaded again (from cache) rather than held live.
        kT = tl.load(k_ptr + rows[None, :] * stride_kt + h * stride_kh + dk[:, None] * stride_kd,
                     mask=k_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        kT = _l2norm_cols(kT, USE_L2NORM) * tl.exp(G_last - G)[None, :]
        S = _dot(kT.to(ty), v_new, S * tl.exp(G_last), PREC, UPCAST)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=k_mask[:, None] & v_mask[None, :])


# Kernels were decorated in interpreter mode iff TRITON_INTERPRET=1 was set when this module loaded.
INTERPRETED = type(_recurrent_kernel).__name__ == "InterpretedFunction"


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("Triton kernels need CUDA tensors; to run them on the CPU set "
                           "TRITON_INTERPRET=1 before the kernel modules are imported")


def _leading_decodes(query_lens_cpu) -> int:
    n = 0
    for q in query_lens_cpu:
        if q != 1:
            break
        n += 1
    return n


def _host_table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """Per-sequence (or per-chunk) integers made on the host, one copy to the device."""
    return torch.tensor(rows, dtype=torch.int32).to(device, non_blocking=True)


_PLACEHOLDERS: dict = {}


def _placeholder(device: torch.device) -> torch.Tensor:
    """An int32 tensor passed for a table a launch does not read, so that the argument's type (and
    the compiled variant) is the same whether the table is there or not."""
    if device not in _PLACEHOLDERS:
        _PLACEHOLDERS[device] = torch.zeros(4, dtype=torch.int32, device=device)
    return _PLACEHOLDERS[device]


def _cont_flags(context_lens_cpu, device: torch.device) -> tuple[torch.Tensor, int]:
    """(cont (B,) int32, read_cont): where every sequence continues, a placeholder and read_cont 0
    (a captured decode step is given that case: its host lengths are those of long contexts)."""
    if all(c > 0 for c in context_lens_cpu):
        return _placeholder(device), 0
    return _host_table([int(c > 0) for c in context_lens_cpu], device), 1


def conv_launch(C: int, KW: int, decode: bool, has_bias: bool, silu: bool) -> dict:
    """Constexprs and launch options of `_conv1d_kernel`: from the layer's shape and the kind of
    step only."""
    return dict(KW=KW, BLOCK_C=min(64, max(16, triton.next_power_of_2(C))), BLOCK_T=1 if decode else 16,
                BLOCK_W=max(2, triton.next_power_of_2(KW - 1)), HAS_BIAS=has_bias, SILU=silu, DECODE=decode,
                num_warps=4)


def recurrent_launch(K: int, V: int, l2norm: bool) -> dict:
    """Constexprs of `_recurrent_kernel`: a (K, 32) state tile per program (4 KB of float32 per
    warp pair: registers, no spill), more programs for small batches."""
    return dict(BK=max(16, triton.next_power_of_2(K)), BV=min(32, max(16, triton.next_power_of_2(V))),
                USE_L2NORM=l2norm, num_warps=4)


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def inverse_launch(K: int, dtype: torch.dtype, l2norm: bool) -> dict:
    return dict(BT=CHUNK, BK=max(16, triton.next_power_of_2(K)), USE_L2NORM=l2norm, PREC=_prec(dtype), num_warps=4)


def scan_launch(K: int, V: int, dtype: torch.dtype, l2norm: bool) -> dict:
    """Constexprs and options of `_chunk_scan_kernel`: 16 value columns per program and 8 warps (a
    128 x 16 state tile, the chunk's q and k tiles in half precision: no spill on sm_90 / sm_100
    for K = 128, moe_serve.kernels.aot_check; 32 columns spill on sm_90), so a long prompt alone still
    fills the GPU with H * V / 16 programs."""
    return dict(BT=CHUNK, BK=max(16, triton.next_power_of_2(K)), BV=16,
                USE_L2NORM=l2norm, PREC=_prec(dtype), UPCAST=INTERPRETED, num_warps=8, num_stages=1)


def causal_conv1d(x_TC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None,
                  conv_state_SCW: torch.Tensor, slots_B: torch.Tensor, query_lens_cpu, context_lens_cpu,
                  activation: str | None = "silu") -> torch.Tensor:
    """moe_serve/kernels/gated_delta/reference.py `causal_conv1d`: one launch for a decode step, two for prefill."""
    T, C = x_TC.shape
    KW = weight_CK.shape[1]
    if KW < 2 or conv_state_SCW.shape[1:] != (C, KW - 1):
        raise ValueError(f"conv state {tuple(conv_state_SCW.shape)} is not (slots, C={C}, K-1={KW - 1}), K >= 2")
    if activation not in ("silu", None):
        raise ValueError(f"activation {activation!r} is not 'silu' or None")
    y_TC = torch.empty_like(x_TC)
    B = len(query_lens_cpu)
    if T == 0 or B == 0:
        return y_TC
    _check_device(x_TC)
    launch = conv_launch(C, KW, _leading_decodes(query_lens_cpu) == B, bias_C is not None, activation == "silu")
    c_tiles = triton.cdiv(C, launch["BLOCK_C"])
    args = (x_TC, weight_CK, bias_C if bias_C is not None else weight_CK, conv_state_SCW, y_TC, slots_B)
    strides = (*x_TC.stride(), *weight_CK.stride(), *conv_state_SCW.stride(), *y_TC.stride())
    if launch["DECODE"]:
        cont, read_cont = _cont_flags(context_lens_cpu, x_TC.device)
        _conv1d_kernel[(B, c_tiles)](*args, _placeholder(x_TC.device), cont, C, read_cont, *strides, **launch)
        return y_TC
    # Prefill: one program per tile of BLOCK_T rows (all in parallel), then the states.
    seqs, tiles, start = [], [], 0
    for b, (n, ctx) in enumerate(zip(query_lens_cpu, context_lens_cpu)):
        seqs.append([start, n, int(ctx > 0)])
        tiles += [[b, start, n, int(ctx > 0), t0] for t0 in range(0, n, launch["BLOCK_T"])]
        start += n
    # One copy for both tables; the sequence rows padded to a multiple of 16 (192 bytes), so the tile
    # table's address stays 16-byte aligned (Triton compiles a variant per alignment) whatever the count.
    padded = -(-B // 16) * 16
    table = _host_table([x for r in seqs for x in r] + [0] * 3 * (padded - B) + [x for r in tiles for x in r],
                        x_TC.device)
    if tiles:
        _conv1d_kernel[(len(tiles), c_tiles)](*args, table[3 * padded:], _placeholder(x_TC.device), C, 0, *strides,
                                              **launch)
    _conv_state_kernel[(B, c_tiles)](x_TC, conv_state_SCW, slots_B, table, C, *x_TC.stride(),
                                     *conv_state_SCW.stride(), KW=KW, BLOCK_C=launch["BLOCK_C"],
                                     BLOCK_W=launch["BLOCK_W"])
    return y_TC


def gated_delta_rule(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                     beta_TH: torch.Tensor, state_SHKV: torch.Tensor, slots_B: torch.Tensor, query_lens_cpu,
                     context_lens_cpu, scale: float, use_qk_l2norm: bool = True) -> torch.Tensor:
    """moe_serve/kernels/gated_delta/reference.py `gated_delta_rule`: the step's leading one-row sequences
    by the recurrent kernel, the others by the chunked pair."""
    T, H, K = q_THK.shape
    V = v_THV.shape[-1]
    if state_SHKV.shape[1:] != (H, K, V):
        raise ValueError(f"state {tuple(state_SHKV.shape)} is not (slots, H={H}, K={K}, V={V})")
    o_THV = torch.empty((T, H, V), dtype=v_THV.dtype, device=v_THV.device)
    B = len(query_lens_cpu)
    if T == 0 or B == 0:
        return o_THV
    _check_device(q_THK)
    strides = (*q_THK.stride(), *k_THK.stride(), *v_THV.stride(), *g_TH.stride(), *beta_TH.stride())
    nd = _leading_decodes(query_lens_cpu)
    if nd:
        cont, read_cont = _cont_flags(context_lens_cpu[:nd], q_THK.device)
        launch = recurrent_launch(K, V, use_qk_l2norm)
        _recurrent_kernel[(triton.cdiv(V, launch["BV"]), H, nd)](
            q_THK, k_THK, v_THV, g_TH, beta_TH, state_SHKV, o_THV, slots_B, cont, K, V, scale, read_cont, *strides,
            *state_SHKV.stride(), *o_THV.stride(), **launch)
    if nd == B:
        return o_THV
    # Prefill: the remaining sequences with rows, their chunks numbered in order.
    seqs, chunks, start = [], [], 0
    for b, (n, ctx) in enumerate(zip(query_lens_cpu, context_lens_cpu)):
        if b >= nd and n > 0:
            seqs.append([b, start, n, len(chunks), int(ctx > 0)])
            chunks += [[c, min(CHUNK, start + n - c)] for c in range(start, start + n, CHUNK)]
        start += n
    if not seqs:
        return o_THV
    dtype = q_THK.dtype
    tinv = torch.empty((len(chunks), H, CHUNK, CHUNK), dtype=q_THK.dtype, device=q_THK.device)
    # One copy for both tables; the sequence rows padded to a multiple of 4 (80 bytes), so the chunk
    # table's address stays 16-byte aligned (Triton compiles a variant per alignment) whatever the count.
    padded = -(-len(seqs) // 4) * 4
    table = _host_table([x for s in seqs for x in s] + [0] * 5 * (padded - len(seqs)) +
                        [x for c in chunks for x in c], q_THK.device)
    seq_table, chunk_table = table[:5 * padded], table[5 * padded:]
    _chunk_inverse_kernel[(len(chunks), H)](
        k_THK, g_TH, beta_TH, tinv, chunk_table, K, *k_THK.stride(), *g_TH.stride(), *beta_TH.stride(),
        *tinv.stride()[:3], **inverse_launch(K, dtype, use_qk_l2norm))
    launch = scan_launch(K, V, dtype, use_qk_l2norm)
    _chunk_scan_kernel[(len(seqs), H, triton.cdiv(V, launch["BV"]))](
        q_THK, k_THK, v_THV, g_TH, beta_TH, tinv, state_SHKV, o_THV, slots_B, seq_table, K, V, scale,
        *strides, *tinv.stride()[:3], *state_SHKV.stride(), *o_THV.stride(), **launch)
    return o_THV
