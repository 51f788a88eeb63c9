"""Compressed and sparse attention (DeepSeek-V4): one shared K (= V) head over a sliding window of
the last `window` tokens plus compressed entries of the whole context, with a learned sink logit per
head. The layer stores and attends; the model (moe_serve/models/deepseek_v4.py) builds q, K and
the raw rows, and owns the weights (the compressors, the indexer's projections, the sinks).

- `Compressor`: one compressed series. Every token keeps its raw projections wkv(x), wgate(x); a
  group of m tokens (2m when groups overlap: the first half of the previous group's rows, the second
  half of its own) is pooled into one entry by a softmax over `wgate(x) + ape[j]` per channel,
  RMS-normed and rotated at position w * m. Heavily compressed layers (HCA) attend to every entry;
- `Indexer`: compressed sparse layers (CSA) have a lightning indexer (its own overlapping compressor
  at index_head_dim, queries from the q_a projection): a query attends to the `topk` entries of the
  highest sum_h w_h relu(q_h . k) / sqrt(I) among those complete at its position;
- `CompressedAttention`: the layer (op kind "compressed_attention"): two paged caches (`PagedRows`)
  and the backend bound by moe_serve/platform.py, which pools the groups a step completes and
  attends (attention/backends/compressed.py: torch ops, the step's rows in one batch; under
  --batch-invariant one entry and one query token at a time).

A query at p sees entry w once its group is complete ((w + 1) m - 1 <= p). Caches: one sliding group
keeps per token K and the compressors' raw rows for as long as a group being filled or the window
needs them (max(window, 2m, m') tokens); one full group keeps the entries (compressor and indexer),
each in the slot of its group's last token: (m - 1) of m slots stay unused, the price of indexing
them like every other block. Being paged blocks, both are prefix-cached, preempted, freed and sent
between instances like any other group.

Shape legend: T query rows, H heads, C head_dim, N indexer heads, I index_head_dim, S a group's span,
E compressed entries.
"""
from __future__ import annotations

import torch
from torch import nn

from attention.backends.compressed import TorchCompressedAttention
from attention.cache_kinds import FULL, sliding
from attention.layer import PagedRows
from attention.metadata import AttentionMetadata
from moe_serve.layers.linear import Linear
from moe_serve.layers.norm import RMSNorm


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last 2 * cos.shape[-1] channels of x (T, [H,] C) as interleaved pairs, in float32
    (transformers' apply_rotary_pos_emb for V4); cos/sin (T, R/2), broadcast over heads."""
    R = 2 * cos.shape[-1]
    cos = cos.to(x.dtype).repeat_interleave(2, dim=-1)
    sin = sin.to(x.dtype).repeat_interleave(2, dim=-1)
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    nope, rope = x[..., :-R], x[..., -R:]
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + turned.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


class Compressor(nn.Module):
    """One compressed series: raw rows wkv(x), wgate(x) per token (2 x width when groups overlap),
    `ape` (m, that width) added to the gates by place in the group, `norm` after pooling."""

    def __init__(self, hidden: int, head_dim: int, m: int, overlap: bool, eps: float, dtype):
        super().__init__()
        k = 2 if overlap else 1
        self.m, self.head_dim, self.overlap = m, head_dim, overlap
        self.wkv = Linear(hidden, k * head_dim, dtype=dtype)
        self.wgate = Linear(hidden, k * head_dim, dtype=dtype)
        self.ape = nn.Parameter(torch.zeros(m, k * head_dim, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, eps, dtype)

    @property
    def span(self) -> int:
        """Tokens an entry pools over: its group (and the previous one when groups overlap)."""
        return 2 * self.m if self.overlap else self.m

    def raw(self, x_TD: torch.Tensor) -> list[torch.Tensor]:
        """The rows every token keeps until its groups are pooled: wkv(x), wgate(x)."""
        return [self.wkv(x_TD), self.wgate(x_TD)]

    def pool(self, kv_NSW: torch.Tensor, gate_NSW: torch.Tensor, first_group_N: torch.Tensor,
             positions_N: torch.Tensor, rope) -> torch.Tensor:
        """Entries (N, head_dim) from the raw rows of their `span` tokens (in position order);
        first_group_N: entries of group 0, which have no previous group; positions_N: w * m; rope:
        cos_sin(positions) of the compressed entries' RoPE."""
        m, hd = self.m, self.head_dim
        if self.overlap:
            kv = torch.cat([kv_NSW[:, :m, :hd], kv_NSW[:, m:, hd:]], dim=1)
            gate = torch.cat([gate_NSW[:, :m, :hd] + self.ape[:, :hd], gate_NSW[:, m:, hd:] + self.ape[:, hd:]], dim=1)
            prev = torch.zeros(gate.shape[1], dtype=torch.bool, device=gate.device)
            prev[:m] = True
            none = first_group_N[:, None, None] & prev[None, :, None]
            kv = kv.masked_fill(none, 0.0)
            gate = gate.masked_fill(none, float("-inf"))
        else:
            kv, gate = kv_NSW, gate_NSW + self.ape
        w = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        pooled = self.norm((kv * w).sum(dim=1))
        return rope_tail(pooled, *rope.cos_sin(positions_N))


class Indexer(nn.Module):
    """CSA's lightning indexer: wq_b (queries from the q_a projection), weights_proj (per-head
    weights), and its own overlapping compressor at index_head_dim."""

    def __init__(self, hidden: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int, m: int, eps: float,
                 dtype):
        super().__init__()
        self.N, self.I, self.topk = n_heads, head_dim, int(topk)
        if self.topk < 1:
            raise ValueError(f"index_topk={self.topk} must be at least 1")
        self.wq_b = Linear(q_lora_rank, self.N * self.I, dtype=dtype)
        self.weights_proj = Linear(hidden, self.N, dtype=dtype)
        self.compressor = Compressor(hidden, self.I, m, True, eps, dtype)

    def queries(self, q_resid_TR: torch.Tensor, x_TD: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """(q (T, N, I) rotated at the queries' positions, w (T, N) float32 scaled by N^-1/2): what
        the backend scores the index keys with."""
        T = x_TD.shape[0]
        q = rope_tail(self.wq_b(q_resid_TR).view(T, self.N, self.I), cos, sin)
        return q, self.weights_proj(x_TD).float() * self.N ** -0.5


class CompressedAttention(nn.Module):
    """The paged caches of one V4 attention layer and its attention over them (`ops`: the backend).

    rows (sliding group): K (= V) then, per compressor, its raw wkv and wgate rows; entries (full
    group, compressed layers only): the pooled entries, then the indexer's keys (CSA). The compressor
    and indexer are the model's modules (their weights load under the model's names): held here,
    not registered as children."""

    op_kind = "compressed_attention"
    ops = TorchCompressedAttention()

    def __init__(self, num_heads: int, head_dim: int, window: int, window_span: int, dtype,
                 compressor: Compressor | None = None, indexer: Indexer | None = None):
        super().__init__()
        from moe_serve.speed_of_light import CacheRead

        self.H, self.hd, self.window = num_heads, head_dim, window
        self.scale = head_dim ** -0.5
        self.m = compressor.m if compressor is not None else None
        self.parts = (compressor, indexer)
        widths = [head_dim]
        for comp in (compressor, indexer.compressor if indexer is not None else None):
            if comp is not None:
                widths += [comp.wkv.weight.shape[0]] * 2
        elem = torch.empty((), dtype=dtype).element_size()
        # Row 0 is K of the window; the raw rows are read once per finished group.
        self.rows = PagedRows(sliding(window_span), widths, dtype)
        self.rows.reads = CacheRead("sliding", head_dim * elem, window)
        self.entries = None
        if compressor is not None:
            index = indexer.I if indexer is not None else 0
            self.entries = PagedRows(FULL, [head_dim] + ([index] if indexer is not None else []), dtype)
            # One entry per finished group of m: every entry (HCA), or the index keys of all and the
            # top-k entries (CSA). A step that finishes a group pools its raw rows: kv and gate, the
            # head_dim each compressor keeps of each of its span's rows.
            pool = 2 * (head_dim + index) * elem
            span = compressor.span
            assert indexer is None or indexer.compressor.span == span
            self.entries.reads = (
                CacheRead("full", head_dim * elem, group=self.m, pool_span=span, pool_bytes_per_token=pool)
                if indexer is None else
                CacheRead("sparse", head_dim * elem, indexer.topk, index * elem, group=self.m,
                          pool_span=span, pool_bytes_per_token=pool))

    @property
    def compressor(self) -> Compressor | None:
        return self.parts[0]

    @property
    def indexer(self) -> Indexer | None:
        return self.parts[1]

    def forward(self, q_THC: torch.Tensor, rows: list[torch.Tensor], index_q, meta: AttentionMetadata, rope,
                sinks_H: torch.Tensor) -> torch.Tensor:
        """rows: this step's rows of the sliding cache (widths as `rows.widths`); index_q: the
        indexer's (q, w) (`Indexer.queries`) on CSA layers, else None; rope: the compressed
        entries' RoPE (cos_sin). Returns (T, H, C), the queries' rotated channels not rotated back."""
        self.rows.write(rows, meta.for_group(self.rows.cache_group).slot_mapping)
        if self.compressor is not None:
            self.ops.compress(self, meta, rope)
        return self.ops.attend(self, q_THC, index_q, meta, sinks_H)
