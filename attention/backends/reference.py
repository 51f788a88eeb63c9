"""Paged attention in torch ops: the reference every kernel is tested against, and the CPU path
(where the cpu_c backend's C kernels take the decodes and prefill chunks they can: `fast`).

Cache layouts (one tensor per layer):
  - standard (MHA/GQA): k_cache, v_cache each (num_blocks, block_size, num_kv_heads, head_dim)
  - MLA (DeepSeek): latent_cache (num_blocks, block_size, kv_lora_rank + rope_dim); each token keeps
    its normalised compressed KV followed by its rotated shared key, nothing expanded.
FP8 caches (torch.float8_e4m3fn / float8_e5m2): writes saturate (`to_fp8`), every read widens to
float32 before any arithmetic (`_acc`); no scale here (the layer applies k_scale / v_scale).
Shape legend: T packed query tokens, N query heads, G kv heads, H head dim, L kv_lora_rank, R rope dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attention.metadata import AttentionMetadata


# FP8 caches (--kv-cache-dtype fp8*): the largest finite value of each format, which writes saturate to.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def to_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the FP8 `dtype`, saturating at its finite max, rounding to nearest even: exactly
    `x.float().clamp(-max, max).to(dtype)`, the value every backend stores."""
    m = FP8_MAX[dtype]
    return x.float().clamp(-m, m).to(dtype)


def store_rows(flat_cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """flat_cache[slots] = x (rows of the cache's trailing shape), converted to the cache's dtype;
    an FP8 cache saturates (to_fp8), its bytes copied as uint8 (torch has no float8 index_copy_)."""
    if flat_cache.dtype in FP8_MAX:
        flat_cache.view(torch.uint8).index_copy_(0, slots, to_fp8(x, flat_cache.dtype).view(torch.uint8))
    else:
        flat_cache.index_copy_(0, slots, _as(x, flat_cache.dtype))


def write_kv(k_TGH: torch.Tensor, v_TGH: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping_T: torch.Tensor) -> None:
    """Store each new token's K and V at its slot (block_id * block_size + offset)."""
    nb, bs = k_cache.shape[:2]
    store_rows(k_cache.view(nb * bs, *k_cache.shape[2:]), slot_mapping_T, k_TGH)
    store_rows(v_cache.view(nb * bs, *v_cache.shape[2:]), slot_mapping_T, v_TGH)


def write_latent(latent_TC: torch.Tensor, latent_cache: torch.Tensor, slot_mapping_T: torch.Tensor) -> None:
    """MLA: store each new token's [compressed kv | rotated k_pe] row at its slot."""
    nb, bs, c = latent_cache.shape
    store_rows(latent_cache.view(nb * bs, c), slot_mapping_T, latent_TC)


def _gather(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """The first n token rows of one sequence's context, gathered through its block table."""
    bs = cache.shape[1]
    nblocks = (n + bs - 1) // bs
    return cache.index_select(0, table[:nblocks].long()).flatten(0, 1)[:n]


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _acc(t: torch.Tensor) -> torch.Tensor:
    """Attention math in float32 at least (float64 inputs stay float64, for the oracles)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float32)


def _causal_mask(q_len: int, ctx_len: int, device) -> torch.Tensor:
    """(Q, S) True where query i, at absolute position ctx_len - q_len + i, may see key s."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)
    return torch.arange(ctx_len, device=device)[None, :] <= q_pos[:, None]


def _sdpa(q_BNQH: torch.Tensor, k_BGSH: torch.Tensor, v_BGSH: torch.Tensor, mask: torch.Tensor | None,
          scale: float, causal: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v, query head n reading kv head n // (N // G). causal: the
    queries are the whole context (query i sees keys 0..i), SDPA's own causal form: no mask tensor,
    and the kernel skips the key blocks above the diagonal."""
    return F.scaled_dot_product_attention(q_BNQH, k_BGSH, v_BGSH, attn_mask=mask, scale=scale, is_causal=causal,
                                          enable_gqa=q_BNQH.shape[1] != k_BGSH.shape[1])


def _decode_plan(meta: AttentionMetadata, block_size: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """For the decodes at the front of the step: their count nd, the (nd, K) block ids covering the
    longest context and the (nd, 1, 1, K * block_size) mask of the keys each sees (SDPA's shape);
    made once a step (meta.backend_plans) and shared by every layer."""
    plan = meta.backend_plans.get("reference_decode")
    if plan is None:
        nd = meta.leading_decodes
        if nd > 1:
            nblocks = (max(meta.seq_lens_cpu[:nd]) + block_size - 1) // block_size
            blocks = meta.block_tables[:nd, :nblocks].long()
            visible = (torch.arange(nblocks * block_size, device=blocks.device)[None, None, None, :]
                       < meta.seq_lens[:nd, None, None, None].to(blocks.device))
            plan = (nd, _FlatBlocks(blocks), visible)
        else:
            plan = (0, None, None)
        meta.backend_plans["reference_decode"] = plan
    return plan


class _FlatBlocks:
    """A step's (B, K) decode block ids and their flattened (B * K,) form, made once for all layers."""

    def __init__(self, blocks_BK: torch.Tensor):
        self.shape = blocks_BK.shape
        self.flat = blocks_BK.reshape(-1)


def _decode_gather(cache: torch.Tensor, blocks, pool: dict | None = None, name: str = "") -> torch.Tensor:
    """Every decode's context, padded to the longest: (B, K * block_size, ...) rows. index_select of
    whole blocks along dim 0 copies at memcpy speed (3.5x advanced indexing's, measured on CPU).
    blocks: (B, K) block ids, or a step's _FlatBlocks. pool: a backend's buffers (CpuCAttention's):
    the rows go into the one called `name`, kept at the largest size so far and overwritten by the
    next gather of that name (the caller is done with them by then). On a CPU a fresh allocation of
    hundreds of megabytes is page faults on first touch, which cost more than the copy (measured: a
    DeepSeek-V3.2-shaped decode of 8 sequences at 32K, 30% of the dense MLA step)."""
    B, K = blocks.shape
    flat = blocks.flat if isinstance(blocks, _FlatBlocks) else blocks.reshape(-1)
    shape = (B, K * cache.shape[1], *cache.shape[2:])
    if pool is None:
        return cache.index_select(0, flat).view(shape)
    n = flat.shape[0] * cache[0].numel()
    buf = pool.get((name, cache.dtype))
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # a normal tensor: written inside and outside inference mode
            buf = pool[(name, cache.dtype)] = torch.empty(n, dtype=cache.dtype, device=cache.device)
    out = buf[:n].view(flat.shape[0], *cache.shape[1:])
    return torch.index_select(cache, 0, flat, out=out).view(shape)


def paged_attention(q_TNH: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, *, sliding_window: int | None = None,
                    sinks: torch.Tensor | None = None, attention_chunk: int | None = None, fast=None) -> torch.Tensor:
    """Causal attention of the packed queries over their paged contexts (prefill, chunked, decode).

    Returns (T, N, Hv) in q's dtype; scores and softmax are computed in float32. The decodes at the
    front of the batch (one query per sequence) run as one padded batched computation, in a mixed
    step too; prefill chunks run sequence by sequence (on the CPU in float32, all in one C call).

    sliding_window W (GPT-OSS's sliding layers): the query at position p sees keys p - W + 1 .. p
    only (transformers' sliding mask); only the blocks holding those keys are gathered. sinks (N,)
    (GPT-OSS): one learned logit per head joins each softmax's denominator (an attention sink that
    takes weight but adds no value). attention_chunk C (Llama-4's chunked layers): the query at
    position p sees keys (p // C) * C .. p only; blocks before the first query's chunk are never
    gathered (the cache manager frees them as the request advances). These layers take the torch
    path on every backend that has one (the C kernels attend to every key).

    fast: an object whose `decodes` and `prefills` take the step's leading decodes / its prefill
    chunks where they can (the "cpu_c" backend's C kernels: attention/backends/cpu_c.py); None
    (the "torch" backend): torch ops only.
    """
    if sliding_window is not None or sinks is not None or attention_chunk is not None:
        return _paged_attention_windowed(q_TNH, k_cache, v_cache, meta, scale, sliding_window, sinks,
                                         attention_chunk)
    T, N, _ = q_TNH.shape
    o = fast.decodes(q_TNH, k_cache, v_cache, meta, scale) if fast is not None else None
    if o is not None:  # the CPU's decodes, read in place from the cache by our C kernel
        nd = o.shape[0]
        if nd == T:
            return _as(o, q_TNH.dtype)
        o, blocks = o[:, :, None], None  # (nd, N, 1, Hv) as SDPA's below
    else:
        nd, blocks, visible = _decode_plan(meta, k_cache.shape[1])
    if blocks is not None:  # the decodes as one padded batched computation
        k = _decode_gather(k_cache, blocks)  # (B, S, G, H)
        v = _decode_gather(v_cache, blocks)
        q = _acc(q_TNH if nd == T else q_TNH[:nd]).unsqueeze(2)
        o = _sdpa(q, _acc(k).transpose(1, 2), _acc(v).transpose(1, 2), visible, scale)  # (B, N, 1, Hv)
        if nd == T:  # a decode-only step: SDPA's output is the answer
            return _as(o.reshape(T, N, o.shape[-1]), q_TNH.dtype)
    out = torch.empty(T, N, v_cache.shape[-1], dtype=q_TNH.dtype, device=q_TNH.device)
    if nd:
        out[:nd] = o[:, :, 0].to(q_TNH.dtype)
    if fast is not None and fast.prefills(q_TNH, k_cache, v_cache, meta, scale, nd, out):
        return out
    s = nd
    for b in range(nd, meta.num_seqs):
        q_len = meta.query_lens_cpu[b]
        ctx = meta.seq_lens_cpu[b]
        if q_len == 0:
            continue
        k = _acc(_gather(k_cache, meta.block_tables[b], ctx)).transpose(0, 1)[None]  # (1, G, S, H)
        v = _acc(_gather(v_cache, meta.block_tables[b], ctx)).transpose(0, 1)[None]
        q = _acc(q_TNH[s:s + q_len]).transpose(0, 1)[None]  # (1, N, Q, H)
        # One query (a lone decode) sees every key: no mask to build; a whole prompt (no cached
        # prefix) is SDPA's causal case; a chunk after cached tokens gets its offset mask.
        whole = q_len == ctx
        mask = None if q_len == 1 or whole else _causal_mask(q_len, ctx, q.device)
        o = _sdpa(q, k, v, mask, scale, causal=whole and q_len > 1)
        out[s:s + q_len] = o[0].transpose(0, 1).to(out.dtype)
        s += q_len
    return out


def _attend(q_BNQH: torch.Tensor, k_BGSH: torch.Tensor, v_BGSH: torch.Tensor, visible: torch.Tensor, scale: float,
            sinks_N: torch.Tensor | None) -> torch.Tensor:
    """Masked attention (visible broadcasts to (B, N, Q, S)); with sinks, each head's sink logit is
    one more entry of the softmax whose weight is dropped afterwards (transformers' eager form).
    The sink form runs one bmm per kv head on the gathered keys as they lie (rows G * H apart, a
    BLAS-friendly stride): 4x a batched matmul over the strided (B, G) view and 1.7x SDPA without
    sinks, measured for 16 decodes of 2048 keys with GPT-OSS's 64 / 8 heads."""
    if sinks_N is None:
        return _sdpa(q_BNQH, k_BGSH, v_BGSH, visible, scale)
    B, N, Q, H = q_BNQH.shape
    G, S = k_BGSH.shape[1], k_BGSH.shape[2]
    q_g = q_BNQH.reshape(B, G, N // G * Q, H)
    s = torch.stack([torch.bmm(q_g[:, g], k_BGSH[:, g].transpose(-1, -2)) for g in range(G)], 1).view(B, N, Q, S)
    s = (s * scale).masked_fill_(~visible, float("-inf"))
    sink = sinks_N.to(s.dtype).view(1, N, 1, 1).expand(B, N, Q, 1)
    p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :S].reshape(B, G, N // G * Q, S)
    return torch.stack([torch.bmm(p[:, g], v_BGSH[:, g]) for g in range(G)], 1).view(B, N, Q, v_BGSH.shape[-1])


def _first_key(pos: int, window: int | None, chunk: int | None) -> int:
    """The first key position a query at `pos` sees: its window's start, its chunk's, else 0."""
    if window:
        return max(0, pos - window + 1)
    if chunk:
        return pos // chunk * chunk
    return 0


def _decode_plan_windowed(meta: AttentionMetadata, block_size: int, window: int | None, chunk: int | None = None):
    """As `_decode_plan`, for a window or a chunk: each decode gathers only the blocks holding the
    keys it sees (its last `window` keys, or its chunk's so far) ((nd, K) block ids, K the most any
    decode needs) and the (nd, K * block_size) mask of those keys. Made once a step per window and
    chunk (sliding, chunked and full layers differ)."""
    key = ("reference_decode_window", window, chunk)
    plan = meta.backend_plans.get(key)
    if plan is None:
        nd = meta.leading_decodes
        if nd > 1:
            lens = meta.seq_lens_cpu[:nd]
            starts = [_first_key(n - 1, window, chunk) for n in lens]
            first = [k // block_size for k in starts]
            last = [(n + block_size - 1) // block_size for n in lens]
            K = max(b - a for a, b in zip(first, last))
            dev = meta.block_tables.device
            first_t = torch.tensor(first, device=dev)[:, None]
            cols = torch.minimum(first_t + torch.arange(K, device=dev)[None, :],
                                 torch.tensor(last, device=dev)[:, None] - 1)
            blocks = meta.block_tables[:nd].long().gather(1, cols)
            pos = first_t * block_size + torch.arange(K * block_size, device=dev)[None, :]
            visible = pos < torch.tensor(lens, device=dev)[:, None]
            visible &= pos >= torch.tensor(starts, device=dev)[:, None]
            plan = (nd, blocks, visible)
        else:
            plan = (0, None, None)
        meta.backend_plans[key] = plan
    return plan


def _paged_attention_windowed(q_TNH, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                              window: int | None, sinks_N: torch.Tensor | None,
                              chunk: int | None = None) -> torch.Tensor:
    T, N, _ = q_TNH.shape
    bs = k_cache.shape[1]
    out = torch.empty(T, N, v_cache.shape[-1], dtype=q_TNH.dtype, device=q_TNH.device)
    sinks = None if sinks_N is None else sinks_N.to(torch.float32)
    nd, blocks, visible = _decode_plan_windowed(meta, bs, window, chunk)
    if nd:
        k = _decode_gather(k_cache, blocks)  # (B, S, G, H)
        v = _decode_gather(v_cache, blocks)
        o = _attend(_acc(q_TNH[:nd])[:, :, None, :], _acc(k).transpose(1, 2), _acc(v).transpose(1, 2),
                    visible[:, None, None, :], scale, sinks)
        out[:nd] = o[:, :, 0].to(q_TNH.dtype)
    s = nd
    for b in range(nd, meta.num_seqs):
        q_len = meta.query_lens_cpu[b]
        ctx = meta.seq_lens_cpu[b]
        if q_len == 0:
            continue
        # Keys before the first query's window (chunk) are never read: start at the block holding it.
        first = _first_key(ctx - q_len, window, chunk) // bs
        table = meta.block_tables[b, first:]
        k = _acc(_gather(k_cache, table, ctx - first * bs)).transpose(0, 1)[None]  # (1, G, S, H)
        v = _acc(_gather(v_cache, table, ctx - first * bs)).transpose(0, 1)[None]
        q = _acc(q_TNH[s:s + q_len]).transpose(0, 1)[None]  # (1, N, Q, H)
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        k_pos = torch.arange(first * bs, ctx, device=q.device)[None, :]
        vis = k_pos <= q_pos
        if window:
            vis &= k_pos > q_pos - window
        if chunk:
            vis &= k_pos >= q_pos // chunk * chunk
        o = _attend(q, k, v, vis, scale, sinks)
        out[s:s + q_len] = o[0].transpose(0, 1).to(out.dtype)
        s += q_len
    return out


def mla_paged_attention(q_latent_TNL: torch.Tensor, q_pe_TNR: torch.Tensor, latent_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, pool: dict | None = None) -> torch.Tensor:
    """MLA in its absorbed form over the compressed cache.

    score(t, n, s) = (q_latent[t, n] . c_kv[s] + q_pe[t, n] . k_pe[s]) * scale, and the output is the
    softmax-weighted sum of c_kv rows: (T, N, L). The caller maps it to values with W_UV; mapping the
    query with W_UK beforehand is what makes this equal to attention over expanded K/V. pool: the
    backend's gather buffers (see _decode_gather).
    """
    T, N, L = q_latent_TNL.shape
    out = torch.empty(T, N, L, dtype=q_latent_TNL.dtype, device=q_latent_TNL.device)
    nd, blocks, visible = _decode_plan(meta, latent_cache.shape[1])
    if nd:  # the decodes as one padded batched computation
        lat = _acc(_decode_gather(latent_cache, blocks, pool, "latent"))  # (B, S, L+R)
        # [q_latent | q_pe] . [c_kv | k_pe] is the absorbed score: one kv head shared by all heads.
        q = _acc(torch.cat([q_latent_TNL[:nd], q_pe_TNR[:nd]], dim=-1))
        out[:nd] = _mla_rows(q, lat, L, visible[:, 0], scale).to(q_latent_TNL.dtype)
    s = nd
    for b in range(nd, meta.num_seqs):
        q_len = meta.query_lens_cpu[b]
        ctx = meta.seq_lens_cpu[b]
        if q_len == 0:
            continue
        lat = _acc(_gather(latent_cache, meta.block_tables[b], ctx))  # (S, L+R)
        q = _acc(torch.cat([q_latent_TNL[s:s + q_len], q_pe_TNR[s:s + q_len]], dim=-1))  # (Q, N, L+R)
        if q_len == 1:
            o = _mla_rows(q, lat[None], L, None, scale)[0]
        else:
            o = _sdpa(q.transpose(0, 1)[None], lat[None, None], lat[None, None, :, :L], _causal_mask(q_len, ctx, q.device),
                      scale)[0].transpose(0, 1)  # (Q, N, L)
        out[s:s + q_len] = o.to(out.dtype)
        s += q_len
    return out


def _mla_rows(q_BNC: torch.Tensor, lat_BSC: torch.Tensor, L: int, visible_B1S: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """One query per sequence, every head against the sequence's one latent row per key: two batched
    products with the latent read as it is (SDPA's GQA form would copy it once per head)."""
    scores = torch.matmul(q_BNC, lat_BSC.transpose(1, 2)) * scale  # (B, N, S)
    if visible_B1S is not None:
        scores = scores.masked_fill(~visible_B1S, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), lat_BSC[..., :L])  # (B, N, L)
