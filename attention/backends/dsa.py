"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5) in torch ops: the lightning indexer's
top-k selection over a paged key cache, and MLA over the selected tokens only.

The indexer keeps one key of I values per token (`index_cache`, (num_blocks, block_size, I), in the
same block table as the layer's MLA latent: the keys live and die with the latent, so prefix hits,
preemption and freeing need nothing of their own). For a query at position p, with its N indexer
heads q_n (rotated like the keys) and per-head weights w_n,

    score(p, s) = sum_n w_n * relu(q_n . k_s * scale),   s = 0 .. p,

and attention reads the `topk` highest-scoring tokens (all of 0 .. p when p + 1 <= topk: then it is
dense MLA exactly). Ties among equal scores are broken by torch.topk, as transformers breaks them;
a score exactly tied at the cut is rare with real weights (relu makes 0 the only likely tie).

Selections are (T, K) int64 token positions of each query row's own sequence, K = min(topk,
longest context of the step), -1 where a row has fewer candidates. The step's leading decodes are
scored and attended as one batch with no host read and fixed shapes for a given longest context
(a CUDA graph holds them); prefill chunks per sequence.
"""
from __future__ import annotations

import torch

from attention.backends.reference import _acc, _decode_gather
from attention.metadata import AttentionMetadata

# Query rows attended at once by `sparse_mla_attention` (bounds the gathered rows' memory:
# rows * K * (L + R) values).
_ROW_VALUES = 1 << 24


def _decode_blocks(meta: AttentionMetadata, block_size: int):
    """The leading decodes' (nd, nblocks) block ids over the longest of their contexts, and the
    (nd, nblocks * block_size) mask of the positions each has; made once a step for every layer."""
    plan = meta.backend_plans.get("dsa_decode")
    if plan is None:
        nd = meta.leading_decodes
        if nd:
            nblocks = -(-max(meta.seq_lens_cpu[:nd]) // block_size)
            blocks = meta.block_tables[:nd, :nblocks].long()
            visible = (torch.arange(nblocks * block_size, device=blocks.device)[None, :]
                       < meta.seq_lens[:nd, None].to(blocks.device))
            plan = (nd, blocks, visible)
        else:
            plan = (0, None, None)
        meta.backend_plans["dsa_decode"] = plan
    return plan


def index_scores(q_QNI: torch.Tensor, w_QN: torch.Tensor, keys_SI: torch.Tensor, scale: float) -> torch.Tensor:
    """(..., Q, S) sum over heads of w * relu(q . k * scale), in float32 (float64 stays float64).
    q (..., Q, N, I), w (..., Q, N), keys (..., S, I)."""
    q, k = _acc(q_QNI), _acc(keys_SI)
    s = torch.relu(torch.matmul(q, k.unsqueeze(-3).transpose(-1, -2)) * scale)  # (..., Q, N, S)
    return torch.matmul(_acc(w_QN).unsqueeze(-2), s).squeeze(-2)


def _select(scores_QS: torch.Tensor, visible_QS: torch.Tensor, k: int) -> torch.Tensor:
    """The k highest visible positions per row, -1 past the visible ones."""
    vals, idx = scores_QS.masked_fill(~visible_QS, float("-inf")).topk(k, dim=-1)
    return idx.masked_fill(vals == float("-inf"), -1)


def dsa_topk(q_TNI: torch.Tensor, w_TN: torch.Tensor, index_cache: torch.Tensor, meta: AttentionMetadata,
             topk: int, scale: float, pool: dict | None = None) -> torch.Tensor:
    """Each query row's selected token positions: (T, min(topk, max_seq_len)) int64, -1 padded.
    The indexer keys of this step's tokens are in the cache already. pool: the backend's gather
    buffers (reference._decode_gather)."""
    T = q_TNI.shape[0]
    K = min(topk, meta.max_seq_len)
    out = torch.full((T, K), -1, dtype=torch.int64, device=q_TNI.device)
    bs = index_cache.shape[1]
    nd, blocks, visible = _decode_blocks(meta, bs)
    if nd:
        keys = _decode_gather(index_cache, blocks, pool, "index_keys")  # (nd, S, I)
        scores = index_scores(q_TNI[:nd, None], w_TN[:nd, None], keys, scale)[:, 0]  # (nd, S)
        k = min(K, keys.shape[1])
        out[:nd, :k] = _select(scores, visible, k)
    s = nd
    for b in range(nd, meta.num_seqs):
        q_len, ctx = meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
        if q_len == 0:
            continue
        nblocks = -(-ctx // bs)
        keys = index_cache.index_select(0, meta.block_tables[b, :nblocks].long()).flatten(0, 1)[:ctx]
        scores = index_scores(q_TNI[s:s + q_len], w_TN[s:s + q_len], keys, scale)  # (Q, S)
        pos = torch.arange(ctx - q_len, ctx, device=keys.device)
        causal = torch.arange(ctx, device=keys.device)[None, :] <= pos[:, None]
        k = min(K, ctx)
        out[s:s + q_len, :k] = _select(scores, causal, k)
        s += q_len
    return out


def _row_seqs(meta: AttentionMetadata, device) -> torch.Tensor:
    """(T,) the sequence of every query row; one per sequence in a decode-only step (no host list)."""
    plan = meta.backend_plans.get("dsa_rows")
    if plan is None:
        if meta.is_decode_only:
            plan = torch.arange(meta.num_seqs, device=device)
        else:
            plan = torch.repeat_interleave(torch.arange(meta.num_seqs),
                                           torch.tensor(meta.query_lens_cpu, dtype=torch.int64)).to(device, non_blocking=True)
        meta.backend_plans["dsa_rows"] = plan
    return plan


def sparse_mla_attention(q_latent_TNL: torch.Tensor, q_pe_TNR: torch.Tensor, latent_cache: torch.Tensor,
                         meta: AttentionMetadata, topk_TK: torch.Tensor, scale: float) -> torch.Tensor:
    """MLA in absorbed form (as reference.mla_paged_attention) over each row's selected tokens only:
    (T, N, L). Rows are gathered through their sequence's block table; -1 entries are masked."""
    T, N, L = q_latent_TNL.shape
    K = topk_TK.shape[1]
    nb, bs, C = latent_cache.shape
    flat = latent_cache.view(nb * bs, C)
    seq_T = _row_seqs(meta, topk_TK.device)
    out = torch.empty(T, N, L, dtype=q_latent_TNL.dtype, device=q_latent_TNL.device)
    step = max(1, _ROW_VALUES // max(1, K * C))
    for r0 in range(0, T, step):
        r1 = min(T, r0 + step)
        idx = topk_TK[r0:r1]
        valid = idx >= 0
        pos = idx.clamp(min=0)
        blk = meta.block_tables[seq_T[r0:r1]].long().gather(1, pos // bs)
        rows = _acc(flat.index_select(0, (blk * bs + pos % bs).reshape(-1)).view(r1 - r0, K, C))  # (R, K, C)
        q = _acc(torch.cat([q_latent_TNL[r0:r1], q_pe_TNR[r0:r1]], dim=-1))  # (R, N, C)
        logits = torch.matmul(q, rows.transpose(1, 2)) * scale  # (R, N, K)
        p = torch.softmax(logits.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
        out[r0:r1] = torch.matmul(p, rows[..., :L]).to(out.dtype)
    return out
