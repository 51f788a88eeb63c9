"""Triton DSA indexer: each query token's score of every visible cached token, then torch's top-k.

The contract is attention/backends/dsa.py's `dsa_topk` (its torch ops are the reference): for the
query at position p, score(s) = sum_h w_h * relu(q_h . k_s * scale) for s <= p, -inf past p. One
program scores BLOCK_N keys of one token for all its indexer heads (one tl.dot of heads x keys),
gathering the keys through the block table. The (T, max_seq_len) scores go to torch.topk; fixed
shapes for a given longest context and no host read, so a CUDA graph holds a decode step. The
sparse attention over the selection is the paged attention kernel's SPARSE mode
(triton_paged.sparse_mla_attention).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.backends.triton_paged import INTERPRETED, _check_device, _dot
from attention.metadata import AttentionMetadata

_PER_STEP_ARGS = ("S_pad", "row0", "stride_bt", "stride_ot")
# Query rows scored at once (bounds the (rows, max_seq_len) float32 score buffer of a prefill chunk).
_ROW_VALUES = 1 << 26


@triton.jit(do_not_specialize=_PER_STEP_ARGS)
def _index_scores_kernel(q_ptr, w_ptr, k_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, row_seq_ptr, out_ptr,
                         scale, NI, ID, block_size, S_pad, row0,
                         stride_qt, stride_qn, stride_qd, stride_wt, stride_wn, stride_kb, stride_ks, stride_kd,
                         stride_bt, stride_ot,
                         BLOCK_NI: tl.constexpr, BLOCK_ID: tl.constexpr, BLOCK_N: tl.constexpr,
                         PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (rows, cdiv(S_pad, BLOCK_N)): row r of this launch is query token row0 + r."""
    t = row0 + tl.program_id(0)
    pos = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    seq = tl.load(row_seq_ptr + t)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    q_pos = tl.load(seq_lens_ptr + seq) - q_len + (t - q_start)
    visible = pos <= q_pos
    heads = tl.arange(0, BLOCK_NI)
    dims = tl.arange(0, BLOCK_ID)
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qn + dims[None, :] * stride_qd,
                mask=(heads[:, None] < NI) & (dims[None, :] < ID), other=0.0)
    w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + heads * stride_wn, mask=heads < NI, other=0.0).to(tl.float32)
    page = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_bt + pos // block_size, mask=visible,
                   other=0).to(tl.int64)
    k = tl.load(k_ptr + (page * stride_kb + (pos % block_size).to(tl.int64) * stride_ks)[:, None]
                + dims[None, :] * stride_kd, mask=visible[:, None] & (dims[None, :] < ID), other=0.0)
    if k.dtype.is_fp8():  # FP8 index keys: widened exactly to float32 (the cast to q's dtype is then exact)
        k = k.to(tl.float32)
    k = k.to(q.dtype)
    s = _dot(q, tl.trans(k), tl.zeros((BLOCK_NI, BLOCK_N), dtype=tl.float32), PREC, UPCAST)
    score = tl.sum(tl.maximum(s * scale, 0.0) * w[:, None], 0)
    score = tl.where(visible, score, float("-inf"))
    tl.store(out_ptr + (t - row0).to(tl.int64) * stride_ot + pos, score, mask=pos < S_pad)


def index_launch(NI: int, ID: int, dtype: torch.dtype) -> dict:
    """Constexprs and options of `_index_scores_kernel` for an indexer of NI heads of ID."""
    return dict(BLOCK_NI=max(16, triton.next_power_of_2(NI)), BLOCK_ID=max(16, triton.next_power_of_2(ID)),
                BLOCK_N=32 if NI * ID > 4096 else 64, PREC="ieee" if dtype == torch.float32 else "tf32",
                UPCAST=INTERPRETED, num_warps=8 if NI * ID > 4096 else 4, num_stages=2)


def dsa_topk(q_TNI: torch.Tensor, w_TN: torch.Tensor, index_cache: torch.Tensor, meta: AttentionMetadata,
             topk: int, scale: float) -> torch.Tensor:
    """attention/backends/dsa.py's dsa_topk: (T, min(topk, max_seq_len)) int64 positions, -1 padded."""
    from attention.backends.dsa import _row_seqs

    T, NI, ID = q_TNI.shape
    S_pad = meta.max_seq_len
    K = min(topk, S_pad)
    out = torch.full((T, K), -1, dtype=torch.int64, device=q_TNI.device)
    if T == 0 or K == 0:
        return out
    _check_device(q_TNI)
    rows = _row_seqs(meta, q_TNI.device)
    launch = index_launch(NI, ID, q_TNI.dtype)
    step = max(1, _ROW_VALUES // S_pad)
    for r0 in range(0, T, step):
        n = min(step, T - r0)
        scores = torch.empty((n, S_pad), dtype=torch.float32, device=q_TNI.device)
        grid = (n, triton.cdiv(S_pad, launch["BLOCK_N"]))
        _index_scores_kernel[grid](
            q_TNI, w_TN, index_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, rows, scores,
            scale, NI, ID, meta.block_size, S_pad, r0, *q_TNI.stride(), *w_TN.stride(), *index_cache.stride(),
            meta.block_tables.stride(0), scores.stride(0), **launch)
        vals, idx = scores.topk(K, dim=-1)
        out[r0:r0 + n] = idx.masked_fill(vals == float("-inf"), -1)
    return out
