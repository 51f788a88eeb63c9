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
DeepSeek Sparse Attention (dsa_topk, sparse MLA) has no invariant form yet and is refused.
"""
from __future__ import annotations

import torch

from attention.backends import CpuCAttention, TorchAttention, TritonAttention
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

    def dsa_topk(self, *args, **kw):
        raise ValueError(f"--batch-invariant: the {self.name.split('+')[0]} attention backend has no batch-invariant "
                         "form of DeepSeek Sparse Attention (its indexer's top-k and sparse MLA)")

    sparse_mla_attention = dsa_topk


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
    sparse_mla_attention = InvariantTorchAttention.dsa_topk

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

    dsa_topk = InvariantTorchAttention.dsa_topk
    sparse_mla_attention = InvariantTorchAttention.dsa_topk

    @staticmethod
    def steps(max_len: int, split: bool) -> list[tuple[str, list[int], list[int], int]]:
        """The kinds of step the layer launches: decode, and a chunked prefill beside a decode, both
        in the decode tile (never split)."""
        return [("decode", [1, 1], [1, 2], 1), ("prefill", [4, 1], [4, 9], 1)]

    def __repr__(self) -> str:
        return "InvariantTritonAttention()"
