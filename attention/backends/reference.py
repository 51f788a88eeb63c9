"""Pure-torch paged attention: the reference every kernel is tested against, and the CPU path.

Cache layouts (one tensor per layer):
  - standard (MHA/GQA): k_cache, v_cache each (num_blocks, block_size, num_kv_heads, head_dim)
  - MLA (DeepSeek): latent_cache (num_blocks, block_size, kv_lora_rank + rope_dim); each token keeps
    its normalised compressed KV followed by its rotated shared key, nothing expanded.
Shape legend: T packed query tokens, N query heads, G kv heads, H head dim, L kv_lora_rank, R rope dim.
"""
from __future__ import annotations

import torch

from attention.metadata import AttentionMetadata


def write_kv(k_TGH: torch.Tensor, v_TGH: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping_T: torch.Tensor) -> None:
    """Store each new token's K and V at its slot (block_id * block_size + offset)."""
    nb, bs = k_cache.shape[:2]
    k_cache.view(nb * bs, *k_cache.shape[2:]).index_copy_(0, slot_mapping_T, k_TGH.to(k_cache.dtype))
    v_cache.view(nb * bs, *v_cache.shape[2:]).index_copy_(0, slot_mapping_T, v_TGH.to(v_cache.dtype))


def write_latent(latent_TC: torch.Tensor, latent_cache: torch.Tensor, slot_mapping_T: torch.Tensor) -> None:
    """MLA: store each new token's [compressed kv | rotated k_pe] row at its slot."""
    nb, bs, c = latent_cache.shape
    latent_cache.view(nb * bs, c).index_copy_(0, slot_mapping_T, latent_TC.to(latent_cache.dtype))


def _gather(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """The first n token rows of one sequence's context, gathered through its block table."""
    bs = cache.shape[1]
    nblocks = (n + bs - 1) // bs
    return cache[table[:nblocks].long()].flatten(0, 1)[:n]


def _causal_softmax_attend(scores_NQS: torch.Tensor, q_len: int, ctx_len: int) -> torch.Tensor:
    # Query i sits at absolute position ctx_len - q_len + i and sees keys 0..that position.
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=scores_NQS.device)
    k_pos = torch.arange(ctx_len, device=scores_NQS.device)
    mask = k_pos[None, :] > q_pos[:, None]
    scores_NQS = scores_NQS.masked_fill(mask, float("-inf"))
    return torch.softmax(scores_NQS, dim=-1)


def _decode_gather(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's context, padded to the longest: (B, S, ...) rows and a (B, S) mask of padding."""
    bs = cache.shape[1]
    nblocks = (max_seq_len + bs - 1) // bs
    rows = cache[block_tables[:, :nblocks].long()].flatten(1, 2)
    pad = torch.arange(rows.shape[1], device=rows.device)[None, :] >= seq_lens[:, None].to(rows.device)
    return rows, pad


def _leading_decodes(meta: AttentionMetadata) -> int:
    """How many sequences at the front of the batch have one query token each. The scheduler puts
    every decode before any prefill chunk, so in a mixed step they are all there."""
    n = 0
    for q in meta.query_lens_cpu:
        if q != 1:
            break
        n += 1
    return n


def paged_attention(q_TNH: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of the packed queries over their paged contexts (prefill, chunked, decode).

    Returns (T, N, Hv) in q's dtype; scores and softmax are computed in float32. The decodes at the
    front of the batch (one query per sequence) run as one padded batched computation, in a mixed
    step too; prefill chunks run sequence by sequence.
    """
    T, N, _ = q_TNH.shape
    G = k_cache.shape[2]
    out = torch.empty(T, N, v_cache.shape[-1], dtype=q_TNH.dtype, device=q_TNH.device)
    nd = _leading_decodes(meta)
    if nd > 1:  # the decodes as one padded batched computation
        bt, sl = meta.block_tables[:nd], meta.seq_lens[:nd]
        longest = max(meta.seq_lens_cpu[:nd])
        k, pad = _decode_gather(k_cache, bt, sl, longest)  # (B, S, G, H)
        v, _ = _decode_gather(v_cache, bt, sl, longest)
        q = q_TNH[:nd].float().view(nd, G, N // G, -1)  # query head n reads kv head n // (N // G)
        scores = torch.einsum("bgrh,bsgh->bgrs", q, k.float()) * scale
        p = torch.softmax(scores.masked_fill(pad[:, None, None, :], float("-inf")), dim=-1)
        out[:nd] = torch.einsum("bgrs,bsgh->bgrh", p, v.float()).reshape(nd, N, -1).to(q_TNH.dtype)
    else:
        nd = 0
    s = nd
    for b in range(nd, meta.num_seqs):
        q_len = meta.query_lens_cpu[b]
        ctx = meta.seq_lens_cpu[b]
        if q_len == 0:
            continue
        k = _gather(k_cache, meta.block_tables[b], ctx).float()  # (S, G, H)
        v = _gather(v_cache, meta.block_tables[b], ctx).float()
        q = q_TNH[s:s + q_len].float()  # (Q, N, H)
        # GQA: query head n reads kv head n // (N // G).
        k = k.repeat_interleave(N // G, dim=1)
        v = v.repeat_interleave(N // G, dim=1)
        scores = torch.einsum("qnh,snh->nqs", q, k) * scale
        p = _causal_softmax_attend(scores, q_len, ctx)
        out[s:s + q_len] = torch.einsum("nqs,snh->qnh", p, v).to(out.dtype)
        s += q_len
    return out


def mla_paged_attention(q_latent_TNL: torch.Tensor, q_pe_TNR: torch.Tensor, latent_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """MLA in its absorbed form over the compressed cache.

    score(t, n, s) = (q_latent[t, n] . c_kv[s] + q_pe[t, n] . k_pe[s]) * scale, and the output is the
    softmax-weighted sum of c_kv rows: (T, N, L). The caller maps it to values with W_UV; mapping the
    query with W_UK beforehand is what makes this equal to attention over expanded K/V.
    """
    T, N, L = q_latent_TNL.shape
    out = torch.empty(T, N, L, dtype=q_latent_TNL.dtype, device=q_latent_TNL.device)
    nd = _leading_decodes(meta)
    if nd > 1:  # the decodes as one padded batched computation
        lat, pad = _decode_gather(latent_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                                  max(meta.seq_lens_cpu[:nd]))  # (B, S, L+R)
        lat = lat.float()
        scores = (torch.einsum("bnl,bsl->bns", q_latent_TNL[:nd].float(), lat[..., :L])
                  + torch.einsum("bnr,bsr->bns", q_pe_TNR[:nd].float(), lat[..., L:])) * scale
        p = torch.softmax(scores.masked_fill(pad[:, None, :], float("-inf")), dim=-1)
        out[:nd] = torch.einsum("bns,bsl->bnl", p, lat[..., :L]).to(q_latent_TNL.dtype)
    else:
        nd = 0
    s = nd
    for b in range(nd, meta.num_seqs):
        q_len = meta.query_lens_cpu[b]
        ctx = meta.seq_lens_cpu[b]
        if q_len == 0:
            continue
        lat = _gather(latent_cache, meta.block_tables[b], ctx).float()  # (S, L+R)
        c_kv, k_pe = lat[:, :L], lat[:, L:]
        scores = (torch.einsum("qnl,sl->nqs", q_latent_TNL[s:s + q_len].float(), c_kv)
                  + torch.einsum("qnr,sr->nqs", q_pe_TNR[s:s + q_len].float(), k_pe)) * scale
        p = _causal_softmax_attend(scores, q_len, ctx)
        out[s:s + q_len] = torch.einsum("nqs,sl->qnl", p, c_kv).to(out.dtype)
        s += q_len
    return out
