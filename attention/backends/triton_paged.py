"""Triton paged attention: KV writes and attention over block tables, same API as `reference.py`.

Shape legend: T packed query tokens, B sequences, N query heads, G kv heads, QH = N // G query heads
per kv head, H head dim, Hv value head dim, L kv_lora_rank, R rope dim, S split-K partitions.
Cache layouts are those of `reference.py`: k/v (num_blocks, block_size, G, H), latent
(num_blocks, block_size, L + R).

One attention kernel serves every case. A program owns a tile of BLOCK_Q query tokens of one
sequence times BLOCK_QH query heads of one kv head, so a K/V tile loaded once feeds every query head
that reads it (GQA; MLA is one shared kv head). Decode is the tile with BLOCK_Q = 1; prefill and
chunked prefill use taller tiles with the causal mask applied against absolute positions. Keys are
gathered token by token through the block table, so any block size and any table order (holes,
shared prefix blocks) work. For decode with few sequences the key range is split over S programs
whose partial results are merged by log-sum-exp in a second kernel (split-K / flash-decoding).
MLA uses the same kernel with a rope part added to the scores and the latent tile reused as V.

FP8 caches (--kv-cache-dtype fp8_e4m3 / fp8_e5m2: float8_e4m3fn / float8_e5m2 cache tensors): the
kernels learn it from the cache pointer's element type, a compiled variant of its own. Writes store
each float value saturated to the format's finite max and rounded to nearest even (`_fp8_bits`:
torch's `x.float().clamp(-max, max).to(fp8)`, byte for byte); reads widen each loaded value exactly
to float32, then compute as for any cache. No scale is applied here: per-layer k/v scales are the
attention layer's (attention/layer.py).
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from attention.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    # The CPU interpreter multiplies bf16 tiles as raw uint16 bits; upcast there only.
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=PREC)
    return acc


@triton.jit
def _fp8_bits(x, MANT: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr):
    """The FP8 byte (MANT mantissa bits, exponent bias BIAS, finite max MAX) of float32 x saturated to
    +-MAX, rounded to nearest even: torch's `x.clamp(-MAX, MAX).to(float8)`. Integer arithmetic on the
    bits, so the interpreter (whose float8 cast truncates) and every GPU give the same byte.

    The significand with its implicit bit, sig (24 bits), is shifted right by s: 23 - MANT for a
    normal result, more below the smallest normal (the FP8 subnormals: quantum 2^(1 - BIAS - MANT)).
    Rounding carries into the exponent field (and from the largest subnormal into the smallest
    normal) by itself, since the encoding is ((exponent - 1) << MANT) + sig-with-implicit-bit."""
    nan = x != x
    x = tl.minimum(tl.maximum(x, -MAX), MAX)
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    e = (mag >> 23) - 127  # unbiased exponent (zero and fp32 subnormals round to 0 below)
    sig = (mag & 0x7FFFFF) | 0x800000
    s = tl.minimum(tl.maximum(23 - MANT, 24 - BIAS - MANT - e), 25)  # 25: every sig rounds to 0
    half = (1 << (s - 1)) - 1 + ((sig >> s) & 1)  # ties to even
    q = ((sig + half) >> s) + (tl.maximum(e + BIAS - 1, 0) << MANT)
    q = tl.where(nan, 0x7F, q)  # NaN stays NaN (0x7F is NaN in both formats)
    return (q | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def _to_cache(x, DST: tl.constexpr):
    """x as the cache's element type DST: an FP8 cache (float8_e4m3fn / float8_e5m2) takes the
    saturating round-to-nearest-even cast of x in float32, any other a plain cast."""
    if DST == tl.float8e4nv:
        y = _fp8_bits(x.to(tl.float32), 3, 7, 448.0).to(tl.float8e4nv, bitcast=True)
    elif DST == tl.float8e5:
        y = _fp8_bits(x.to(tl.float32), 2, 15, 57344.0).to(tl.float8e5, bitcast=True)
    else:
        y = x.to(DST)
    return y


@triton.jit
def _write_rows_kernel(src_ptr, cache_ptr, slot_ptr, R, C, block_size,
                       stride_st, stride_sr, stride_sc, stride_cb, stride_cs, stride_cr, stride_cc,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """cache[slot // block_size, slot % block_size] = src[t] for one token t; slots < 0 are padding."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    r = tl.arange(0, BLOCK_R)[:, None]
    c = tl.arange(0, BLOCK_C)[None, :]
    mask = (r < R) & (c < C)
    row = tl.load(src_ptr + t * stride_st + r * stride_sr + c * stride_sc, mask=mask)
    dst = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    tl.store(dst + r * stride_cr + c * stride_cc, _to_cache(row, cache_ptr.dtype.element_ty), mask=mask)


# Launch arguments that change from step to step (batch, context and split counts, and the strides
# of buffers sized by them), and the window and chunk lengths (one variant serves every length).
# Triton would otherwise specialise each integer argument on "== 1" and "divisible by 16" and
# compile a new variant mid-serving whenever one of those flips.
_PER_STEP_ATTN_ARGS = ("num_q_tiles", "num_splits", "window", "chunk", "num_sel", "stride_bt", "stride_ot",
                       "stride_on", "stride_os", "stride_lt", "stride_ln", "stride_st")
_PER_STEP_REDUCE_ARGS = ("num_splits", "stride_wt", "stride_wn", "stride_ws", "stride_lt", "stride_ln")


@triton.jit
def _tile_program(num_q_tiles, BLOCK_Q: tl.constexpr):
    """(head program, sequence, query tile of it, key split) of this program; decode (BLOCK_Q == 1)
    puts the head tiles on the fastest grid axis."""
    if BLOCK_Q == 1:  # decode: head tiles fastest
        pid_h = tl.program_id(0)
        pid_q = tl.program_id(1)
    else:
        pid_q = tl.program_id(0)
        pid_h = tl.program_id(1)
    split = tl.program_id(2)
    return pid_h, pid_q // num_q_tiles, pid_q % num_q_tiles, split


@triton.jit
def _key_range(ctx, q_len, q_tile, split, num_splits, window, chunk, num_sel,
               BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, CHUNKED: tl.constexpr,
               SPARSE: tl.constexpr):
    """[kv_start, kv_stop): the keys (SPARSE: the selection's entries) this tile reads in its split.

    The keys the tile can see at all are cut into num_splits BLOCK_N-aligned ranges. With SLIDING
    or CHUNKED they start at the tile's first query's first visible key, so blocks before it (freed
    by the cache manager, their table entries stale) are never read."""
    kv_len = ctx - q_len + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len)
    if SPARSE:  # ranges of the selection instead of positions
        kv_len = num_sel
    if SLIDING or CHUNKED:  # keys before the tile's first query's window (chunk) are never read
        first_q = ctx - q_len + q_tile * BLOCK_Q
        if SLIDING:
            kv_lo = tl.maximum(first_q - window + 1, 0)
        else:
            kv_lo = first_q // chunk * chunk
        split_len = tl.cdiv(tl.cdiv(kv_len - kv_lo, num_splits), BLOCK_N) * BLOCK_N
        kv_start = kv_lo + split * split_len
    else:
        split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
        kv_start = split * split_len
    return kv_start, tl.minimum(kv_start + split_len, kv_len)


@triton.jit
def _load_rows(ptr, row, head, offs, width, row_mask, stride_r, stride_h, stride_d):
    """(rows, BLOCK) tile: ptr[row[i], head[i], offs] for the rows of row_mask, columns < width, else 0."""
    return tl.load(ptr + row[:, None] * stride_r + head[:, None] * stride_h + offs[None, :] * stride_d,
                   mask=row_mask[:, None] & (offs[None, :] < width), other=0.0)


@triton.jit
def _block_keys(start, kv_stop, table, sel_row, block_size, BLOCK_N: tl.constexpr, SPARSE: tl.constexpr):
    """(positions, mask, page, offset in page) of the BLOCK_N keys from start: positions start.., or
    (SPARSE) the selection's entries there, -1 (none) masked off."""
    pos = start + tl.arange(0, BLOCK_N)
    k_mask = pos < kv_stop
    if SPARSE:
        pos = tl.load(sel_row + pos, mask=k_mask, other=-1)
        k_mask = pos >= 0
        pos = tl.maximum(pos, 0)
    page = tl.load(table + pos // block_size, mask=k_mask, other=0).to(tl.int64)
    return pos, k_mask, page, (pos % block_size).to(tl.int64)


@triton.jit
def _load_cached(ptr, page, in_page, g, offs, width, k_mask, stride_b, stride_s, stride_g, stride_d):
    """(BLOCK_N, BLOCK) rows of kv head g from the cache at (page, in_page), columns < width, else 0;
    an FP8 cache's rows in float32."""
    x = tl.load(ptr + (page * stride_b + in_page * stride_s + g * stride_g)[:, None] + offs[None, :] * stride_d,
                mask=k_mask[:, None] & (offs[None, :] < width), other=0.0)
    if x.dtype.is_fp8():  # an FP8 cache: widened exactly to float32 (the caller's cast is then exact too)
        x = x.to(tl.float32)
    return x


@triton.jit
def _visible(pos, k_mask, q_pos, row_mask, window, chunk, SLIDING: tl.constexpr, CHUNKED: tl.constexpr,
             SPARSE: tl.constexpr):
    """(rows, BLOCK_N) mask of the keys each query row sees: causal (SPARSE: the selection's own
    cut), within the sliding window, within the query's chunk."""
    if SPARSE:
        visible = k_mask[None, :] & row_mask[:, None]
    else:
        visible = k_mask[None, :] & (pos[None, :] <= q_pos[:, None])
    if SLIDING:
        visible = visible & (pos[None, :] > q_pos[:, None] - window)
    if CHUNKED:
        visible = visible & (pos[None, :] >= (q_pos // chunk * chunk)[:, None])
    return visible


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online softmax over one more block of log2-scaled scores s: (p, alpha, m, l), p the block's
    weights, alpha the factor rescaling what was accumulated, m and l the new max and sum."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps m = -inf; subtract 0 instead so no NaN (-inf - -inf).
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_base[:, None])
    alpha = tl.exp2(m_i - m_base)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _add_sink(m_i, l_i, acc, sinks_ptr, head, row_mask):
    """The sink: one more softmax term per row, with no value; (m, l, acc) rescaled to it."""
    sink = tl.load(sinks_ptr + head, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    m_sink = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_sink)
    l_i = l_i * alpha + tl.exp2(sink - m_sink)
    return m_sink, l_i, acc * alpha[:, None]


@triton.jit
def _store_tile(out_ptr, lse_ptr, acc, m_i, l_i, tok, head, row_mask, offs_hv, HV, split,
                stride_ot, stride_on, stride_os, stride_od, stride_lt, stride_ln, SPLIT_K: tl.constexpr):
    """The normalised tile to out, or (SPLIT_K) to the split's workspace slot with its log2-sum-exp."""
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_mask = row_mask[:, None] & (offs_hv[None, :] < HV)
    o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_on + offs_hv[None, :] * stride_od
    if not SPLIT_K:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        # Every split stores, even an empty one (l = 0 -> o = 0, lse = -inf), so the reduce never
        # reads an unwritten workspace entry.
        tl.store(o_ptrs + split * stride_os, o, mask=o_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + tok * stride_lt + head * stride_ln + split, lse, mask=row_mask)


@triton.jit(do_not_specialize=_PER_STEP_ATTN_ARGS)
def _paged_attn_kernel(
    q_ptr, qr_ptr, k_ptr, kr_ptr, v_ptr, out_ptr, lse_ptr, sinks_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr, sel_ptr,
    scale_log2, num_q_tiles, QH, HD, HR, HV, block_size, num_splits, window, chunk, num_sel,
    stride_qt, stride_qn, stride_qd, stride_qrt, stride_qrn, stride_qrd,
    stride_kb, stride_ks, stride_kg, stride_kd, stride_krb, stride_krs, stride_krg, stride_krd,
    stride_vb, stride_vs, stride_vg, stride_vd, stride_bt,
    stride_ot, stride_on, stride_os, stride_od, stride_lt, stride_ln, stride_st,
    BLOCK_Q: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_HD: tl.constexpr, BLOCK_HR: tl.constexpr, BLOCK_HV: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_ROPE: tl.constexpr, SHARED_KV: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr,
    CHUNKED: tl.constexpr, SPARSE: tl.constexpr,
):
    """Softmax(q . k [+ q_r . k_r]) v for a (BLOCK_Q tokens x BLOCK_QH heads) tile over one key split.

    Grid: (B * num_q_tiles, G * cdiv(QH, BLOCK_QH), num_splits), or for decode (BLOCK_Q == 1)
    (G * cdiv(QH, BLOCK_QH), B, num_splits): the head tiles that read the same keys (MLA: all of
    them, the latent being one kv head) are then consecutive programs, in flight together, so the
    keys come from DRAM once and from L2 for the other tiles. Without SPLIT_K (num_splits == 1)
    the normalised output goes straight to out (T, N, Hv); with it out is the (T, N, S, Hv) fp32
    workspace and lse (T, N, S) receives each split's log2-sum-exp for the reduce kernel. The split
    count is a runtime argument, so any count runs on the same compiled kernel.

    SLIDING: query position p sees keys p - window + 1 .. p only; CHUNKED: keys (p // chunk) * chunk
    .. p only. Either way the key loop starts at the tile's first query's first visible key, so
    blocks before it (freed by the cache manager, their table entries stale) are never read.
    HAS_SINKS: sinks (N,) float32 logits join the softmax denominator, here without SPLIT_K, in the
    reduce kernel with it (once per row).
    SPARSE (DSA; BLOCK_Q == 1): the keys are the token's selection, sel (T, num_sel) positions of
    its sequence, -1 for none; the causal cut is the selection's (the indexer picks only visible
    keys). Splits cut the selection.
    """
    pid_h, seq, q_tile, split = _tile_program(num_q_tiles, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq)
    head_tiles = tl.cdiv(QH, BLOCK_QH)
    g = pid_h // head_tiles

    # Row r of the tile is query token r // BLOCK_QH and head r % BLOCK_QH of kv head g.
    rows = tl.arange(0, BLOCK_Q * BLOCK_QH)
    q_local = q_tile * BLOCK_Q + rows // BLOCK_QH
    h_local = (pid_h % head_tiles) * BLOCK_QH + rows % BLOCK_QH
    row_mask = (q_local < q_len) & (h_local < QH)
    tok = (q_start + q_local).to(tl.int64)
    head = g * QH + h_local
    q_pos = ctx - q_len + q_local  # absolute position: the query sees keys 0..q_pos
    kv_start, kv_stop = _key_range(ctx, q_len, q_tile, split, num_splits, window, chunk, num_sel,
                                   BLOCK_Q, BLOCK_N, SLIDING, CHUNKED, SPARSE)

    offs_hd = tl.arange(0, BLOCK_HD)
    offs_hr = tl.arange(0, BLOCK_HR)
    offs_hv = tl.arange(0, BLOCK_HV)
    q = _load_rows(q_ptr, tok, head, offs_hd, HD, row_mask, stride_qt, stride_qn, stride_qd)
    if HAS_ROPE:
        q_r = _load_rows(qr_ptr, tok, head, offs_hr, HR, row_mask, stride_qrt, stride_qrn, stride_qrd)
    m_i = tl.full((BLOCK_Q * BLOCK_QH,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_Q * BLOCK_QH,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q * BLOCK_QH, BLOCK_HV), dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    sel_row = sel_ptr + (q_start + q_tile).to(tl.int64) * stride_st  # SPARSE: the tile's one token
    for start in range(kv_start, kv_stop, BLOCK_N):
        pos, k_mask, page, in_page = _block_keys(start, kv_stop, table, sel_row, block_size, BLOCK_N, SPARSE)
        k = _load_cached(k_ptr, page, in_page, g, offs_hd, HD, k_mask, stride_kb, stride_ks, stride_kg,
                         stride_kd).to(q.dtype)
        s = _dot(q, tl.trans(k), tl.zeros((BLOCK_Q * BLOCK_QH, BLOCK_N), dtype=tl.float32), PREC, UPCAST)
        if HAS_ROPE:
            k_r = _load_cached(kr_ptr, page, in_page, g, offs_hr, HR, k_mask, stride_krb, stride_krs, stride_krg,
                               stride_krd).to(q_r.dtype)
            s = _dot(q_r, tl.trans(k_r), s, PREC, UPCAST)
        visible = _visible(pos, k_mask, q_pos, row_mask, window, chunk, SLIDING, CHUNKED, SPARSE)
        p, alpha, m_new, l_i = _softmax_step(tl.where(visible, s * scale_log2, float("-inf")), m_i, l_i)
        if SHARED_KV:
            v = k  # MLA: the latent row is both the key (with its rope part) and the value
        else:
            v = _load_cached(v_ptr, page, in_page, g, offs_hv, HV, k_mask, stride_vb, stride_vs, stride_vg,
                             stride_vd).to(q.dtype)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], PREC, UPCAST)
        m_i = m_new

    if HAS_SINKS and not SPLIT_K:  # the sink: one more softmax term, with no value
        m_i, l_i, acc = _add_sink(m_i, l_i, acc, sinks_ptr, head, row_mask)
    _store_tile(out_ptr, lse_ptr, acc, m_i, l_i, tok, head, row_mask, offs_hv, HV, split,
                stride_ot, stride_on, stride_os, stride_od, stride_lt, stride_ln, SPLIT_K)

@triton.jit(do_not_specialize=_PER_STEP_REDUCE_ARGS)
def _reduce_splits_kernel(ws_ptr, lse_ptr, out_ptr, sinks_ptr, HV, num_splits,
                          stride_wt, stride_wn, stride_ws, stride_wd, stride_lt, stride_ln,
                          stride_ot, stride_on, stride_od,
                          BLOCK_HV: tl.constexpr, HAS_SINKS: tl.constexpr):
    """out[t, n] = sum_s 2^(lse_s - max) * o_s / sum_s 2^(lse_s - max), one (token, head) per program.

    Splits are walked one row at a time (the count is a runtime argument): no tile grows with the
    split count, so neither a recompile nor register pressure follows it.
    """
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HV)
    d_mask = offs_d < HV
    lse_row = lse_ptr + t * stride_lt + n * stride_ln
    ws_row = ws_ptr + t * stride_wt + n * stride_wn + offs_d * stride_wd
    # Split 0 always holds key 0, which every query sees, so its lse (and the max) is finite.
    m = tl.load(lse_row)
    for s in range(1, num_splits):
        m = tl.maximum(m, tl.load(lse_row + s))
    acc = tl.zeros((BLOCK_HV,), dtype=tl.float32)
    den = tl.zeros((BLOCK_HV,), dtype=tl.float32)  # the same sum in every lane (a tensor loop carry)
    if HAS_SINKS:  # the head's sink logit joins the denominator once
        sink = tl.load(sinks_ptr + n).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
        den += tl.exp2(sink - m)
    for s in range(0, num_splits):
        w = tl.exp2(tl.load(lse_row + s) - m)  # an empty split has lse = -inf: weight 0
        acc += w * tl.load(ws_row + s * stride_ws, mask=d_mask, other=0.0)
        den += w
    tl.store(out_ptr + t * stride_ot + n * stride_on + offs_d * stride_od, (acc / den).to(out_ptr.dtype.element_ty),
             mask=d_mask)


# Kernels were decorated in interpreter mode iff TRITON_INTERPRET=1 was set when this module loaded.
INTERPRETED = type(_paged_attn_kernel).__name__ == "InterpretedFunction"


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("Triton kernels need CUDA tensors; to run them on the CPU set "
                           "TRITON_INTERPRET=1 before the kernel modules are imported")


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 0 elsewhere (the interpreter: no split)."""
    return _num_sms(device.index or 0) if device.type == "cuda" else 0


def _write_rows(src_TRC: torch.Tensor, cache_BSRC: torch.Tensor, slot_mapping_T: torch.Tensor) -> None:
    T, R, C = src_TRC.shape
    if T == 0:
        return
    _check_device(src_TRC)
    _write_rows_kernel[(T,)](
        src_TRC, cache_BSRC, slot_mapping_T, R, C, cache_BSRC.shape[1],
        *src_TRC.stride(), *cache_BSRC.stride(), **write_launch(R, C))


def write_kv(k_TGH: torch.Tensor, v_TGH: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping_T: torch.Tensor) -> None:
    """Store each new token's K and V at its slot (block_id * block_size + offset).

    Args:
        k_TGH: (T, G, H) new keys; v_TGH: (T, G, Hv) new values (any strides, cast to the cache dtype).
        k_cache: (num_blocks, block_size, G, H); v_cache: (num_blocks, block_size, G, Hv).
        slot_mapping_T: (T,) int64 slots; a negative slot marks a padding token and is skipped.
    """
    _write_rows(k_TGH, k_cache, slot_mapping_T)
    _write_rows(v_TGH, v_cache, slot_mapping_T)


def write_latent(latent_TC: torch.Tensor, latent_cache: torch.Tensor, slot_mapping_T: torch.Tensor) -> None:
    """MLA: store each new token's [compressed kv | rotated k_pe] row (T, L + R) at its slot.

    latent_cache is (num_blocks, block_size, L + R); negative slots are skipped.
    """
    _write_rows(latent_TC[:, None, :], latent_cache[:, :, None, :], slot_mapping_T)


# Most split-K partitions a decode launch uses (the count is a runtime argument of both kernels).
MAX_SPLITS = 64


def choose_num_splits(decode_only: bool, num_seqs: int, max_seq_len: int, head_programs: int,
                      num_sms: int) -> int:
    """Decode only: split each sequence's keys until about two programs per SM are in flight, keeping
    at least 256 keys per split so the merge stays cheap next to the attention itself. num_sms <= 0
    (no GPU: the interpreter) means no split."""
    if not decode_only or num_sms <= 0:
        return 1
    want = triton.cdiv(2 * num_sms, max(num_seqs * head_programs, 1))
    return max(1, min(want, triton.cdiv(max_seq_len, 256), MAX_SPLITS))


def attention_launch(decode_only: bool, QH: int, HD: int, HR: int, HV: int, dtype: torch.dtype,
                     has_rope: bool, shared_kv: bool, split_k: bool, sliding: bool = False,
                     sinks: bool = False, chunked: bool = False, sparse: bool = False, fp8_cache: bool = False) -> dict:
    """Every constexpr and launch option of `_paged_attn_kernel` for one kind of batch: the things
    that select a compiled variant. They depend on the model's head shape, its dtype, decode versus
    prefill and whether keys are split, never on batch size or context length (moe_serve/kernels/aot_check.py
    compiles each combination ahead of time). sparse (DSA): every query token attends over its own
    selection, so every step takes the decode tile, one token per program. fp8_cache: the K/V (latent)
    cache is FP8 (--kv-cache-dtype), which only MLA's decode tile heeds (below)."""
    big = HD + HR > 256  # MLA-sized rows: smaller tiles
    BLOCK_N, warps = (32, 8) if big else (64, 4)
    if decode_only or sparse:
        # One token per sequence: the tile is the query heads of one kv head (>= 16 rows for tl.dot).
        # MLA: up to 64 heads per program, FlashMLA's tile: 64 x 512 fp32 accumulators are half of
        # 8 warps' registers (at most 32 B spilled per thread on sm_90, none on sm_100, as launched:
        # moe_serve.kernels.aot_check). A 64-head model (Kimi-K2) reads its latent once per program; 128 heads
        # would be the whole register file (8 warps spill 2.2 KB and need 256 KB of shared memory;
        # 16 warps cannot be allocated), so DeepSeek-V3's two head tiles of a sequence run side by
        # side (head tiles are the fastest grid axis) and share its latent rows through L2.
        BLOCK_Q, BLOCK_QH = 1, max(16, min(triton.next_power_of_2(QH), 64))
        if big:
            BLOCK_N = 16
        if big and (sparse or fp8_cache):
            # The selection's positions take registers the 64-head tile does not have to spare
            # (sm_90 spilled 420 B at 64): 32 heads per program, the latent rows shared via L2.
            # So does an FP8 latent's load and widening (sm_90 spilled 264 B at 64, 552 B split).
            BLOCK_QH = min(BLOCK_QH, 32)
    else:
        BLOCK_QH = min(triton.next_power_of_2(QH), 16)
        BLOCK_Q = (32 if big else 64) // BLOCK_QH  # 32-64 rows: BLOCK_QH <= 16 keeps BLOCK_Q >= 2
    return dict(BLOCK_Q=BLOCK_Q, BLOCK_QH=BLOCK_QH, BLOCK_N=BLOCK_N,
                BLOCK_HD=max(16, triton.next_power_of_2(HD)), BLOCK_HR=max(16, triton.next_power_of_2(max(HR, 1))),
                BLOCK_HV=max(16, triton.next_power_of_2(HV)), SPLIT_K=split_k, HAS_ROPE=has_rope,
                SHARED_KV=shared_kv, PREC="ieee" if dtype == torch.float32 else "tf32", UPCAST=INTERPRETED,
                SLIDING=sliding, HAS_SINKS=sinks, CHUNKED=chunked, SPARSE=sparse, num_warps=warps, num_stages=2)


def reduce_launch(HV: int, sinks: bool = False) -> dict:
    """Constexprs of `_reduce_splits_kernel`: the value width (the split count is runtime), sinks."""
    return dict(BLOCK_HV=triton.next_power_of_2(HV), HAS_SINKS=sinks)


def write_launch(R: int, C: int) -> dict:
    """Constexprs of `_write_rows_kernel` for (R, C) rows per token."""
    return dict(BLOCK_R=triton.next_power_of_2(R), BLOCK_C=triton.next_power_of_2(C))


_PLACEHOLDERS: dict = {}


def _fp32_placeholder(device: torch.device) -> torch.Tensor:
    if device not in _PLACEHOLDERS:
        _PLACEHOLDERS[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return _PLACEHOLDERS[device]


def _attend(q, q_r, k, k_r, v, meta: AttentionMetadata, scale: float, HV: int, shared_kv: bool,
            num_splits: int | None, out: torch.Tensor | None, window: int | None = None,
            sinks: torch.Tensor | None = None, chunk: int | None = None,
            sel: torch.Tensor | None = None, one_tile: bool = False) -> torch.Tensor:
    """Launch the attention (and reduce) kernels; k/k_r/v are 4-D (blocks, block_size, G, dim) views;
    sel: each token's selected positions (DSA), (T, K) int32/int64, -1 for none. one_tile
    (--batch-invariant): every step, prefill chunks included, takes the decode tile (one query token
    per program) and no split, so a token reads its keys in the same blocks, in the same order, in
    one program shape, whatever its step (see `invariant_attention`)."""
    T, N, HD = q.shape
    G = k.shape[2]
    if N % G:
        raise ValueError(f"query heads N={N} must be a multiple of kv heads G={G}")
    QH = N // G
    if out is None:
        out = torch.empty((T, N, HV), dtype=q.dtype, device=q.device)
    if T == 0 or meta.num_seqs == 0:
        return out
    _check_device(q)
    has_rope = q_r is not None
    HR = q_r.shape[-1] if has_rope else 0
    # The tile shape does not depend on the split; choose the split count from it, then the variant.
    sparse = sel is not None
    fp8 = k.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    decode_tile = meta.is_decode_only or one_tile
    if one_tile:
        num_splits = 1
    tile = attention_launch(decode_tile, QH, HD, HR, HV, q.dtype, has_rope, shared_kv, False, sparse=sparse,
                            fp8_cache=fp8)
    num_q_tiles = triton.cdiv(meta.max_query_len, tile["BLOCK_Q"])
    head_programs = G * triton.cdiv(QH, tile["BLOCK_QH"])
    keys = sel.shape[1] if sparse else meta.max_seq_len
    S = num_splits or choose_num_splits(meta.is_decode_only, meta.num_seqs, keys, head_programs,
                                        _device_sms(q.device))
    launch = attention_launch(decode_tile, QH, HD, HR, HV, q.dtype, has_rope, shared_kv, S > 1,
                              window is not None, sinks is not None, chunk is not None, sparse, fp8)
    if S > 1:
        ws = torch.empty((T, N, S, HV), dtype=torch.float32, device=q.device)
        lse = torch.empty((T, N, S), dtype=torch.float32, device=q.device)
        dst, dst_strides, lse_strides = ws, ws.stride(), lse.stride()[:2]
    else:
        lse = ws = None
        dst, dst_strides, lse_strides = out, (out.stride(0), out.stride(1), 0, out.stride(2)), (0, 0)
    if not has_rope:
        q_r, k_r = q, k  # unused placeholders; HAS_ROPE=False compiles their loads away
    sinks_arg = sinks if sinks is not None else _fp32_placeholder(q.device)  # HAS_SINKS=False: never read
    # Decode launches head tiles fastest (see the kernel): programs reading the same keys run together.
    q_programs = meta.num_seqs * num_q_tiles
    grid = (head_programs, q_programs, S) if launch["BLOCK_Q"] == 1 else (q_programs, head_programs, S)
    _paged_attn_kernel[grid](
        q, q_r, k, k_r, v, dst, lse if lse is not None else dst, sinks_arg,
        meta.block_tables, meta.seq_lens, meta.query_start_loc, sel if sparse else meta.seq_lens,
        scale * _LOG2E, num_q_tiles, QH, HD, HR, HV, meta.block_size, S, window or 0, chunk or 1, keys,
        *q.stride(), *q_r.stride(), *k.stride(), *k_r.stride(), *v.stride(), meta.block_tables.stride(0),
        *dst_strides, *lse_strides, sel.stride(0) if sparse else 0, **launch)
    if S > 1:
        _reduce_splits_kernel[(T, N)](
            ws, lse, out, sinks_arg, HV, S, *ws.stride(), *lse.stride()[:2], *out.stride(),
            **reduce_launch(HV, sinks is not None))
    return out


def paged_attention(q_TNH: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, *, num_splits: int | None = None,
                    out_TNH: torch.Tensor | None = None, sliding_window: int | None = None,
                    sinks: torch.Tensor | None = None, attention_chunk: int | None = None) -> torch.Tensor:
    """Causal attention of the packed queries over their paged contexts (prefill, chunked, decode).

    Args:
        q_TNH: (T, N, H) queries, bf16 / fp16 / fp32; query head n reads kv head n // (N // G).
        k_cache: (num_blocks, block_size, G, H); v_cache: (num_blocks, block_size, G, Hv); this step's
            keys and values must already be written (write_kv) since queries attend to themselves.
        meta: the batch's AttentionMetadata (query_start_loc, seq_lens, block_tables on q's device).
        scale: softmax scale applied to q . k.
        num_splits: split-K partitions per sequence; None chooses (decode on CUDA only).
        out_TNH: optional (T, N, Hv) output buffer of q's dtype; rows of sequence tokens are overwritten.
        sliding_window: each query sees its last `sliding_window` keys only (GPT-OSS's sliding layers).
        sinks: (N,) float32 per-head logits in every softmax's denominator (GPT-OSS).
        attention_chunk: the query at position p sees keys (p // c) * c .. p only (Llama-4's chunked
            layers); not together with sliding_window.
    Returns:
        (T, N, Hv) in q's dtype; scores, softmax and accumulation are fp32.
    """
    if sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be a contiguous float32 (N,) tensor, got {sinks.dtype}")
    if sliding_window is not None and attention_chunk is not None:
        raise ValueError("sliding_window and attention_chunk exclude each other")
    return _attend(q_TNH, None, k_cache, None, v_cache, meta, scale, v_cache.shape[-1], False,
                   num_splits, out_TNH, sliding_window, sinks, attention_chunk)


def mla_paged_attention(q_latent_TNL: torch.Tensor, q_pe_TNR: torch.Tensor, latent_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, *, num_splits: int | None = None,
                        out_TNL: torch.Tensor | None = None) -> torch.Tensor:
    """MLA in its absorbed form over the compressed cache (decode, prefill and chunked prefill).

    Args:
        q_latent_TNL: (T, N, L) queries already mapped through W_UK; q_pe_TNR: (T, N, R) rotated.
        latent_cache: (num_blocks, block_size, L + R) rows of [c_kv | k_pe], written by write_latent.
        meta, scale, num_splits: as in paged_attention.
        out_TNL: optional (T, N, L) output buffer of q's dtype.
    Returns:
        (T, N, L): softmax((q_latent . c_kv + q_pe . k_pe) * scale) weighted sum of c_kv rows.
    """
    L = q_latent_TNL.shape[-1]
    if latent_cache.shape[-1] != L + q_pe_TNR.shape[-1]:
        raise ValueError(f"latent_cache row {latent_cache.shape[-1]} != L={L} + R={q_pe_TNR.shape[-1]}")
    # The latent is one kv head shared by all N query heads; c_kv doubles as the value.
    lat = latent_cache[:, :, None, :]
    return _attend(q_latent_TNL, q_pe_TNR, lat[..., :L], lat[..., L:], lat[..., :L], meta, scale, L, True,
                   num_splits, out_TNL)


def sparse_mla_attention(q_latent_TNL: torch.Tensor, q_pe_TNR: torch.Tensor, latent_cache: torch.Tensor,
                         meta: AttentionMetadata, topk_TK: torch.Tensor, scale: float, *,
                         num_splits: int | None = None, out_TNL: torch.Tensor | None = None) -> torch.Tensor:
    """DSA: MLA in absorbed form over each token's selected positions only (attention/backends/dsa.py's
    contract): topk_TK (T, K) positions in the token's sequence, -1 for none. Decode and prefill
    alike take one token per program; decode splits the selection (split-K) as it splits keys."""
    L = q_latent_TNL.shape[-1]
    if latent_cache.shape[-1] != L + q_pe_TNR.shape[-1]:
        raise ValueError(f"latent_cache row {latent_cache.shape[-1]} != L={L} + R={q_pe_TNR.shape[-1]}")
    if topk_TK.shape[0] != q_latent_TNL.shape[0] or topk_TK.stride(1) != 1:
        raise ValueError(f"topk {tuple(topk_TK.shape)} must give a unit-stride row per query token")
    lat = latent_cache[:, :, None, :]
    return _attend(q_latent_TNL, q_pe_TNR, lat[..., :L], lat[..., L:], lat[..., :L], meta, scale, L, True,
                   num_splits, out_TNL, sel=topk_TK)


def invariant_attention(q_TNH: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, *, sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                        attention_chunk: int | None = None) -> torch.Tensor:
    """paged_attention's contract, batch-invariant (--batch-invariant): a query token's output is
    bitwise the same whatever else the step holds and whether it is decoded or sits in a prefill
    chunk. Every token is one program of the decode tile (BLOCK_Q = 1, the kv head's query heads as
    rows), never split: it reads exactly its visible keys, from the cache (this step's keys are
    written there first), in BLOCK_N blocks from its first visible key, with an fp32 online softmax
    and accumulator. The decode tile's variants are the ones decode steps already compile."""
    if sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be a contiguous float32 (N,) tensor, got {sinks.dtype}")
    if sliding_window is not None and attention_chunk is not None:
        raise ValueError("sliding_window and attention_chunk exclude each other")
    return _attend(q_TNH, None, k_cache, None, v_cache, meta, scale, v_cache.shape[-1], False, 1, None,
                   sliding_window, sinks, attention_chunk, one_tile=True)


def invariant_mla_attention(q_latent_TNL: torch.Tensor, q_pe_TNR: torch.Tensor, latent_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """mla_paged_attention's contract, batch-invariant as `invariant_attention` is."""
    L = q_latent_TNL.shape[-1]
    if latent_cache.shape[-1] != L + q_pe_TNR.shape[-1]:
        raise ValueError(f"latent_cache row {latent_cache.shape[-1]} != L={L} + R={q_pe_TNR.shape[-1]}")
    lat = latent_cache[:, :, None, :]
    return _attend(q_latent_TNL, q_pe_TNR, lat[..., :L], lat[..., L:], lat[..., :L], meta, scale, L, True, 1, None,
                   one_tile=True)
