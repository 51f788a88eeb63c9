"""Batch-invariant attention backends (`--batch-invariant`; see moe_serve/kernels/batch_invariant.py).

Contract: a query token's output is bitwise the same whatever else the step holds and however its
own sequence is cut: computed in a decode step, inside a prefill chunk, or recomputed after
preemption. By default it is not: decodes take one kernel (C: `decode_attention_f32`, its scores by
16-lane dot products; torch: one padded SDPA over the batch) and prefill chunks another (C: scores
by a transposed key panel; torch: SDPA per sequence with a mask), each summing in its own order.

Here every query token takes one path whatever its step: its scores against exactly the keys it
sees, read from the cache (the chunk's own keys are written there first, so a key is the same
bits in a decode and in a prefill), a float32 softmax over those, then the values. The key axis is
never split, and no reduction spans query tokens.
- `InvariantTorchAttention`: torch ops, one token at a time (shapes depend on the token alone);
- `InvariantCpuCAttention`: our C prefill kernel for every sequence of the step, decodes included
  (one query row per decode): its per-row sums do not depend on how many query rows share a call;
  layers it does not take (windows, sinks, other dtypes) and MLA run the torch form.
- `InvariantTritonAttention`: the Triton kernel's decode tile for every sequence, prefill chunks
  included (one program per query token, never split over keys: triton_paged.invariant_attention).
DeepSeek Sparse Attention (every backend, torch ops): `dsa_topk_torch` scores each query token
against exactly the indexer keys it sees and keeps its top-k in ascending position, and
`sparse_mla_torch` attends each token over its own selected rows only (no padding to the step's
widest selection), so neither depends on what else the step holds.
"""
from __future__ import annotations

import torch

from attention.backends import CpuCAttention, TorchAttention, TritonAttention
from attention.backends.dsa import index_scores
from attention.backends.reference import _first_key
from moe_serve.kernels import cpu_ops


def _keys(cache: torch.Tensor, table: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows lo..hi-1 of one sequence's context, gathered through its block table into a fresh
    contiguous float32 tensor (the same shape and alignment whatever step reads them)."""
    bs = cache.shape[1]
    b0, b1 = lo // bs, (hi + bs - 1) // bs
    rows = cache.index_select(0, table[b0:b1].long()).flatten(0, 1)[lo - b0 * bs:hi - b0 * bs]
    return rows.to(torch.float32, copy=True).contiguous()


def _token(q_NH: torch.Tensor, k_SGH: torch.Tensor, v_SGH: torch.Tensor, scale: float,
           sink_N: torch.Tensor | None) -> torch.Tensor:
    """One query token's attention over the keys it sees: (N, Hv) float32."""
    N, H = q_NH.shape
    S, G, _ = k_SGH.shape
    q = q_NH.to(torch.float32, copy=True).view(G, N // G, H)
    s = torch.bmm(q, k_SGH.permute(1, 2, 0).contiguous()) * scale  # (G, R, S)
    if sink_N is not None:
        s = torch.cat([s, sink_N.float().view(G, N // G, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :S].contiguous()
    return torch.bmm(p, v_SGH.transpose(0, 1).contiguous()).reshape(N, -1)


def attention_torch(q_TNH, k_cache, v_cache, meta, scale: float, window=None, sinks=None, chunk=None) -> torch.Tensor:
    """reference.paged_attention's contract, one query token at a time (see the module docstring)."""
    out = torch.empty(q_TNH.shape[0], q_TNH.shape[1], v_cache.shape[-1], dtype=q_TNH.dtype, device=q_TNH.device)
    s = 0
    for b in range(meta.num_seqs):
        q_len, ctx = meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
        for i in range(q_len):
            pos = ctx - q_len + i
            lo = _first_key(pos, window, chunk)
            k = _keys(k_cache, meta.block_tables[b], lo, pos + 1)
            v = _keys(v_cache, meta.block_tables[b], lo, pos + 1)
            out[s + i] = _token(q_TNH[s + i], k, v, scale, sinks).to(out.dtype)
        s += q_len
    return out


def mla_torch(q_latent_TNL, q_pe_TNR, latent_cache, meta, scale: float) -> torch.Tensor:
    """reference.mla_paged_attention's contract (absorbed MLA: one latent row per key shared by
    every head), one query token at a time."""
    T, N, L = q_latent_TNL.shape
    out = torch.empty(T, N, L, dtype=q_latent_TNL.dtype, device=q_latent_TNL.device)
    s = 0
    for b in range(meta.num_seqs):
        q_len, ctx = meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
        for i in range(q_len):
            lat = _keys(latent_cache, meta.block_tables[b], 0, ctx - q_len + i + 1)  # (S, L + R)
            q = torch.cat([q_latent_TNL[s + i], q_pe_TNR[s + i]], dim=-1).to(torch.float32, copy=True)
            p = torch.softmax(torch.mm(q, lat.t().contiguous()) * scale, dim=-1)  # (N, S)
            out[s + i] = torch.mm(p, lat[:, :L].contiguous()).to(out.dtype)
        s += q_len
    return out


def dsa_topk_torch(q_TNI, w_TN, index_cache, meta, topk: int, scale: float) -> torch.Tensor:
    """dsa.dsa_topk's contract, one query token at a time: its scores against the keys of positions
    0 .. p (a fresh float32 copy), its top min(topk, p + 1) in ascending position, -1 after."""
    out = torch.full((q_TNI.shape[0], min(topk, meta.max_seq_len)), -1, dtype=torch.int64, device=q_TNI.device)
    s = 0
    for b in range(meta.num_seqs):
        q_len, ctx = meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
        for i in range(q_len):
            pos = ctx - q_len + i
            keys = _keys(index_cache, meta.block_tables[b], 0, pos + 1)
            scores = index_scores(q_TNI[s + i:s + i + 1].clone(), w_TN[s + i:s + i + 1].clone(), keys, scale)[0]
            k = min(topk, pos + 1)
            out[s + i, :k] = scores.topk(k).indices.sort().values
        s += q_len
    return out


def sparse_mla_torch(q_latent_TNL, q_pe_TNR, latent_cache, meta, topk_TK, scale: float) -> torch.Tensor:
    """dsa.sparse_mla_attention's contract, one query token at a time over its selected rows only,
    in ascending position (a GLM-5 shared layer's selection may come padded to another width)."""
    T, N, L = q_latent_TNL.shape
    bs = latent_cache.shape[1]
    flat = latent_cache.view(-1, latent_cache.shape[-1])
    out = torch.empty(T, N, L, dtype=q_latent_TNL.dtype, device=q_latent_TNL.device)
    s = 0
    for b in range(meta.num_seqs):
        table = meta.block_tables[b].long()
        for i in range(meta.query_lens_cpu[b]):
            pos = topk_TK[s + i]
            pos = pos[pos >= 0].sort().values
            lat = flat.index_select(0, table[pos // bs] * bs + pos % bs).to(torch.float32, copy=True)  # (k, L + R)
            q = torch.cat([q_latent_TNL[s + i], q_pe_TNR[s + i]], dim=-1).to(torch.float32, copy=True)
            p = torch.softmax(torch.mm(q, lat.t().contiguous()) * scale, dim=-1)  # (N, k)
            out[s + i] = torch.mm(p, lat[:, :L].contiguous()).to(out.dtype)
        s += meta.query_lens_cpu[b]
    return out


class InvariantTorchAttention(TorchAttention):
    name = "torch+bi"
    batch_invariant = True

    def capturable(self) -> "InvariantTorchAttention":
        return InvariantTorchAttention(self.device)

    def paged_attention(self, q_TNH, k_cache, v_cache, meta, scale: float, *, sliding_window=None, sinks=None,
                        attention_chunk=None) -> torch.Tensor:
        return attention_torch(q_TNH, k_cache, v_cache, meta, scale, sliding_window, sinks, attention_chunk)

    def mla_paged_attention(self, q_latent_TNL, q_pe_TNR, latent_cache, meta, scale: float) -> torch.Tensor:
        return mla_torch(q_latent_TNL, q_pe_TNR, latent_cache, meta, scale)

    def dsa_topk(self, q_TNI, w_TN, index_cache, meta, topk: int, scale: float) -> torch.Tensor:
        return dsa_topk_torch(q_TNI, w_TN, index_cache, meta, topk, scale)

    def sparse_mla_attention(self, q_latent_TNL, q_pe_TNR, latent_cache, meta, topk_TK, scale: float) -> torch.Tensor:
        return sparse_mla_torch(q_latent_TNL, q_pe_TNR, latent_cache, meta, topk_TK, scale)


class InvariantCpuCAttention(CpuCAttention):
    name = "cpu_c+bi"
    batch_invariant = True

    def capturable(self) -> InvariantTorchAttention:
        return InvariantTorchAttention(self.device)

    def paged_attention(self, q_TNH, k_cache, v_cache, meta, scale: float, *, sliding_window=None, sinks=None,
                        attention_chunk=None) -> torch.Tensor:
        plain = sliding_window is None and sinks is None and attention_chunk is None
        if (plain and q_TNH.dtype == torch.float32 and meta.query_start_loc.dtype == torch.int32
                and meta.query_start_loc.is_contiguous()
                and cpu_ops.decode_attention_fits(q_TNH, k_cache, v_cache, meta.block_tables, meta.seq_lens)):
            # every sequence, decodes included, through the prefill kernel: one order per query row
            out = torch.empty(q_TNH.shape[0], q_TNH.shape[1], v_cache.shape[-1], dtype=torch.float32)
            cpu_ops.prefill_attention(q_TNH, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                      0, meta.num_seqs, out, scale)
            return out
        return attention_torch(q_TNH, k_cache, v_cache, meta, scale, sliding_window, sinks, attention_chunk)

    mla_paged_attention = InvariantTorchAttention.mla_paged_attention
    dsa_topk = InvariantTorchAttention.dsa_topk
    sparse_mla_attention = InvariantTorchAttention.sparse_mla_attention


class InvariantTritonAttention(TritonAttention):
    """TritonAttention's contract, batch-invariant: `triton_paged.invariant_attention` /
    `invariant_mla_attention` for every step (the KV writes are copies, as by default)."""

    name = "triton+bi"
    batch_invariant = True

    def capturable(self) -> "InvariantTritonAttention":
        return self

    def paged_attention(self, q_TNH, k_cache, v_cache, meta, scale: float, *, num_splits=None, sliding_window=None,
                        sinks=None, attention_chunk=None) -> torch.Tensor:
        return self.kernels.invariant_attention(q_TNH, k_cache, v_cache, meta, scale, sliding_window=sliding_window,
                                                sinks=sinks, attention_chunk=attention_chunk)

    def mla_paged_attention(self, q_latent_TNL, q_pe_TNR, latent_cache, meta, scale: float, *,
                            num_splits=None) -> torch.Tensor:
        return self.kernels.invariant_mla_attention(q_latent_TNL, q_pe_TNR, latent_cache, meta, scale)

    # DSA: the torch forms (on the device), one query token at a time
    dsa_topk = InvariantTorchAttention.dsa_topk
    sparse_mla_attention = InvariantTorchAttention.sparse_mla_attention

    @staticmethod
    def steps(max_len: int, split: bool) -> list[tuple[str, list[int], list[int], int]]:
        """The kinds of step the layer launches: decode, and a chunked prefill beside a decode, both
        in the decode tile (never split)."""
        return [("decode", [1, 1], [1, 2], 1), ("prefill", [4, 1], [4, 9], 1)]

    def __repr__(self) -> str:
        return "InvariantTritonAttention()"
