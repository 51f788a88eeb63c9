"""Attention layers over the paged cache. Models build their q/k/v; these store and attend.

The cache tensors are bound once by the model runner (`bind_kv_cache`), the attention backend once
by moe_serve/platform.py (`bind_ops`: `ops`, torch ops until then); the batch's metadata is passed
into every forward call (no hidden per-step global state).

FP8 KV caches (--kv-cache-dtype fp8*): kernels store and read FP8 values as they are; the per-layer
scales (`k_scale`, `v_scale`: plain floats, 1.0 unless the runner sets the checkpoint's, which
weights.py leaves in `checkpoint_kv_scales`) are applied here: K is written as k / k_scale and
the softmax scale multiplied by k_scale, V written as v / v_scale and the output multiplied by
v_scale. MLA's latent is both K and V: written / k_scale, scores and output times k_scale. At 1.0
(every cache but a scaled FP8 one) no op is added.
"""
from __future__ import annotations

import torch
from torch import nn

from attention.backends import TorchAttention
from attention.backends.reference import FP8_MAX, store_rows
from attention.cache_kinds import FULL, CacheKind, chunked, sliding
from attention.metadata import AttentionMetadata


class PagedAttention(nn.Module):
    """Multi-head / grouped-query attention: q (T, N, H), k and v (T, G, H) -> (T, N, Hv)."""

    op_kind = "attention"
    ops = TorchAttention()
    latent = False
    cache_group = 0  # the block table it reads: set by the model runner from `cache_kind`

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 v_head_dim: int | None = None, sliding_window: int | None = None, sinks: bool = False,
                 attention_chunk: int | None = None):
        """sliding_window: each query sees its last `sliding_window` keys only (GPT-OSS's sliding
        layers). sinks: a learned float32 logit per head in every softmax's denominator (GPT-OSS).
        attention_chunk: a query at position p sees keys (p // c) * c .. p only (Llama-4's chunked
        layers). Without any of them, the backend is called exactly as before."""
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} must be at least 1")
        if attention_chunk is not None and (attention_chunk < 1 or sliding_window is not None):
            raise ValueError(f"attention_chunk={attention_chunk} must be at least 1 and not combined with a "
                             f"sliding window (sliding_window={sliding_window})")
        self.sliding_window = sliding_window
        self.attention_chunk = attention_chunk
        self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32)) if sinks else None
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scale = self.v_scale = 1.0  # FP8 cache scales (module docstring); set by the runner

    @property
    def cache_kind(self) -> CacheKind:
        """What it keeps per request: a window, the current chunk, or every token."""
        chunk = getattr(self, "attention_chunk", None)
        if chunk is not None:
            return chunked(chunk)
        return sliding(self.sliding_window) if self.sliding_window is not None else FULL

    def cache_shape(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        return [(num_blocks, block_size, self.num_kv_heads, self.head_dim),
                (num_blocks, block_size, self.num_kv_heads, self.v_head_dim)]

    def bind(self, caches: list[torch.Tensor]) -> None:
        self.k_cache, self.v_cache = caches

    def forward(self, q_TNH, k_TGH, v_TGH, meta: AttentionMetadata) -> torch.Tensor:
        if self.k_scale != 1.0 or self.v_scale != 1.0:
            return self._scaled(q_TNH, k_TGH, v_TGH, meta)
        return self._forward(q_TNH, k_TGH, v_TGH, meta, self.scale)

    def _scaled(self, q_TNH, k_TGH, v_TGH, meta: AttentionMetadata) -> torch.Tensor:
        """An FP8 cache with the checkpoint's scales: K / k_scale and V / v_scale stored, the scores
        times k_scale (in the softmax scale), the output times v_scale."""
        o = self._forward(q_TNH, k_TGH / self.k_scale, v_TGH / self.v_scale, meta, self.scale * self.k_scale)
        return o * self.v_scale if self.v_scale != 1.0 else o

    def _forward(self, q_TNH, k_TGH, v_TGH, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        meta = meta.for_group(self.cache_group)
        self.ops.write_kv(k_TGH, v_TGH, self.k_cache, self.v_cache, meta.slot_mapping)
        if self.attention_chunk is not None:
            return self.ops.paged_attention(q_TNH, self.k_cache, self.v_cache, meta, scale, sinks=self.sinks,
                                            attention_chunk=self.attention_chunk)
        if self.sliding_window is None and self.sinks is None:
            return self.ops.paged_attention(q_TNH, self.k_cache, self.v_cache, meta, scale)
        return self.ops.paged_attention(q_TNH, self.k_cache, self.v_cache, meta, scale,
                                        sliding_window=self.sliding_window, sinks=self.sinks)


class PagedMLAAttention(nn.Module):
    """MLA over a compressed cache of [c_kv (L) | k_pe (R)] per token, attended in absorbed form."""

    op_kind = "attention"
    ops = TorchAttention()
    latent = True
    sliding_window = None
    attention_chunk = None
    sinks = None
    cache_kind = FULL
    cache_group = 0

    def __init__(self, kv_lora_rank: int, rope_dim: int, scale: float):
        super().__init__()
        self.kv_lora_rank, self.rope_dim, self.scale = kv_lora_rank, rope_dim, scale
        self.latent_cache: torch.Tensor | None = None
        self.k_scale = self.v_scale = 1.0  # FP8 cache scales (module docstring): the latent uses k_scale

    def _scales(self, latent_TC: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The latent to store and the score scale: latent / k_scale and scale * k_scale (the
        output is then multiplied by k_scale: `_unscale`); as they are at 1.0."""
        if self.k_scale == 1.0:
            return latent_TC, self.scale
        return latent_TC / self.k_scale, self.scale * self.k_scale

    def _unscale(self, o: torch.Tensor) -> torch.Tensor:
        return o if self.k_scale == 1.0 else o * self.k_scale

    def cache_shape(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        return [(num_blocks, block_size, self.kv_lora_rank + self.rope_dim)]

    def bind(self, caches: list[torch.Tensor]) -> None:
        (self.latent_cache,) = caches

    def forward(self, q_latent_TNL, q_pe_TNR, latent_TC, meta: AttentionMetadata) -> torch.Tensor:
        meta = meta.for_group(self.cache_group)
        latent_TC, scale = self._scales(latent_TC)
        self.ops.write_latent(latent_TC, self.latent_cache, meta.slot_mapping)
        return self._unscale(self.ops.mla_paged_attention(q_latent_TNL, q_pe_TNR, self.latent_cache, meta, scale))


class PagedDSAAttention(PagedMLAAttention):
    """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): MLA over the `topk` tokens the lightning
    indexer scores highest for each query (attention/backends/dsa.py). A layer with an indexer
    (index_head_dim given) keeps its keys, one row of index_head_dim per token, beside the latent
    in the same blocks, and leaves its selection in the step's metadata; a layer without one
    (GLM-5's "shared" layers) attends over the selection of the last layer that had one."""

    def __init__(self, kv_lora_rank: int, rope_dim: int, scale: float, topk: int, index_head_dim: int | None,
                 index_scale: float = 1.0, index_heads: int = 0):
        super().__init__(kv_lora_rank, rope_dim, scale)
        if topk < 1:
            raise ValueError(f"index_topk={topk} must be at least 1")
        self.topk, self.index_head_dim, self.index_scale = topk, index_head_dim, index_scale
        self.index_heads = index_heads  # the indexer's query heads (what a kernel warm-up compiles for)
        self.index_cache: torch.Tensor | None = None

    def cache_shape(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        shapes = super().cache_shape(num_blocks, block_size)
        if self.index_head_dim:
            shapes.append((num_blocks, block_size, self.index_head_dim))
        return shapes

    def bind(self, caches: list[torch.Tensor]) -> None:
        if self.index_head_dim:
            self.latent_cache, self.index_cache = caches
        else:
            (self.latent_cache,) = caches

    def forward(self, q_latent_TNL, q_pe_TNR, latent_TC, meta: AttentionMetadata,
                index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """index: the indexer's (q (T, heads, I), head weights (T, heads), keys (T, I)) of this
        step's tokens; None on a layer without an indexer."""
        meta = meta.for_group(self.cache_group)
        latent_TC, scale = self._scales(latent_TC)
        self.ops.write_latent(latent_TC, self.latent_cache, meta.slot_mapping)
        if self.index_head_dim:
            if index is None:
                raise ValueError("a DSA layer with an indexer needs its queries, weights and keys")
            q_TNI, w_TN, k_TI = index
            self.ops.write_latent(k_TI, self.index_cache, meta.slot_mapping)
            topk_TK = self.ops.dsa_topk(q_TNI, w_TN, self.index_cache, meta, self.topk, self.index_scale)
            meta.backend_plans["dsa_topk"] = topk_TK
        else:
            topk_TK = meta.backend_plans.get("dsa_topk")
            if topk_TK is None:
                raise ValueError("a DSA layer that shares the top-k of an earlier layer found none in this step "
                                 "(its model's first DSA layer must have an indexer)")
        return self._unscale(self.ops.sparse_mla_attention(q_latent_TNL, q_pe_TNR, self.latent_cache, meta, topk_TK,
                                                           scale))


class PagedRows(nn.Module):
    """Rows a layer computes per token, kept in paged blocks of one cache kind and read back with
    plain tensor ops (no attention backend): each of `widths` is a tensor (blocks, block_size,
    width). DeepSeek-V4 keeps two: a sliding window of its shared K=V and of its compressors' raw
    projections, and a full-kind cache of its compressed entries (one per finished group of m
    tokens, in the slot of the group's last token). Being ordinary paged blocks, they are
    prefix-cached, preempted, freed and moved between instances like any other group's.

    reads: what a decode query reads of them per cached token, for the speed-of-light accounting
    (`speed_of_light.CacheRead`), given by the owning layer. dtype: what `read` returns from an FP8
    cache (the layer's compute dtype; other caches are read as they are)."""

    cache_group = 0

    def __init__(self, kind: CacheKind, widths: list[int], dtype: torch.dtype = torch.float32):
        super().__init__()
        if not widths or min(widths) < 1:
            raise ValueError(f"row widths {widths} must be positive")
        self.cache_kind, self.widths, self.dtype = kind, list(widths), dtype
        self.caches: list[torch.Tensor | None] = [None] * len(widths)
        self.reads = None

    def cache_shape(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        return [(num_blocks, block_size, w) for w in self.widths]

    def bind(self, caches: list[torch.Tensor]) -> None:
        self.caches = list(caches)

    def write(self, rows: list[torch.Tensor], slots: torch.Tensor) -> None:
        """rows[i] (N, widths[i]) into the slots (N,) of tensor i."""
        for cache, r in zip(self.caches, rows):
            store_rows(cache.view(-1, cache.shape[-1]), slots, r)  # an FP8 cache saturates

    def read(self, i: int, slots: torch.Tensor) -> torch.Tensor:
        """Tensor i's rows at slots (any shape) -> (*slots.shape, width); an FP8 cache's widened
        exactly to `dtype`."""
        cache = self.caches[i]
        flat = cache.view(-1, cache.shape[-1])
        rows = flat.index_select(0, slots.reshape(-1)).view(*slots.shape, cache.shape[-1])
        return rows.to(self.dtype) if cache.dtype in FP8_MAX else rows


def slots_of(meta: AttentionMetadata, seq_TN: torch.Tensor, pos_TN: torch.Tensor) -> torch.Tensor:
    """The cache slots of positions pos (any shape, >= 0) of sequences seq (same shape) in meta's group."""
    bs = meta.block_size
    return meta.block_tables[seq_TN, pos_TN // bs].to(torch.int64) * bs + pos_TN % bs
