"""Compressed and sparse attention (DeepSeek-V4, attention/compressed.py) in torch ops: the backend
of op kind "compressed_attention" that every later kernel (C, Triton) is to be checked against.

A layer's forward runs no Python loop over a step's decodes:
- `compress`: the (sequence, group) pairs whose last token this step computes are found with tensor
  ops on the host lengths (once a step per compression rate, kept in `backend_plans`), their raw rows
  gathered through the sliding group's block table and pooled in one call per compressor;
- `attend`: the step's leading decodes (one query row each) are one batch: every row gathers its
  own `window` keys and the entries complete at its position, padded to the longest of their
  contexts and masked past its own (in slices that bound the gathered memory). A prefill chunk's
  rows share one gather of the keys any of them sees (a loop over the step's prefill sequences).

The host lengths size the gathers (the longest context, which groups complete), so a step cannot be
held in a CUDA graph: a capture is refused (the engine then runs decode steps eagerly).

Shape legend: T query rows, H heads, C head_dim, W window, E entries (the step's longest context's),
K = W + E keys a row reads, N indexer heads, I index_head_dim, S a group's span.
"""
from __future__ import annotations

import torch

from attention.layer import slots_of
from attention.metadata import AttentionMetadata

# Key values (rows * K * C) a slice of decodes gathers at once: bounds the memory of long contexts.
_ROW_VALUES = 1 << 24


def decode_plan(meta: AttentionMetadata, device) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """(nd, longest, seq_D, pos_D): the step's leading decodes (one query row each, first in the
    batch), the longest of their contexts, and each row's sequence and position, from the device
    lengths; made once a step."""
    plan = meta.backend_plans.get("v4_decode")
    if plan is None:
        B = meta.num_seqs
        nd = B if meta.max_query_len == 1 and sum(meta.query_lens_cpu) == B else meta.leading_decodes
        longest = meta.max_seq_len if nd == B else max(meta.seq_lens_cpu[:nd], default=0)
        plan = (nd, longest, torch.arange(nd, device=device), meta.seq_lens[:nd].to(device, torch.int64) - 1)
        meta.backend_plans["v4_decode"] = plan
    return plan


def group_ends(meta: AttentionMetadata, m: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(seq_N, end_N): the groups of m tokens whose last token (end) this step computes, by sequence
    then position; None if none. Sequence b computes positions s - q .. s - 1, so it completes
    groups first // m .. s // m - 1. Made once a step per m, from the host lengths."""
    key = ("v4_groups", m)
    if key not in meta.backend_plans:
        s = torch.tensor(meta.seq_lens_cpu, dtype=torch.int64)
        first = s - torch.tensor(meta.query_lens_cpu, dtype=torch.int64)
        g0 = first // m
        n = s // m - g0
        total = int(n.sum())
        plan = None
        if total:
            seq = torch.repeat_interleave(torch.arange(len(n)), n)
            nth = torch.arange(total) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
            end = (g0[seq] + nth + 1) * m - 1
            plan = (seq.to(device, non_blocking=True), end.to(device, non_blocking=True))
        meta.backend_plans[key] = plan
    return meta.backend_plans[key]


def compress(layer, meta: AttentionMetadata, rope) -> None:
    """The entries of every group this step completes, into the slot of the group's last token."""
    dev = meta.slot_mapping.device
    ends = group_ends(meta, layer.m, dev)
    if ends is None:
        return
    seq_N, end_N = ends
    m = layer.m
    wmeta, emeta = meta.for_group(layer.rows.cache_group), meta.for_group(layer.entries.cache_group)
    group_N = (end_N + 1) // m - 1
    parts = [(layer.compressor, 1)] + ([(layer.indexer.compressor, 3)] if layer.indexer is not None else [])
    new = []
    for comp, row in parts:
        S = comp.span
        pos_NS = end_N[:, None] - S + 1 + torch.arange(S, device=dev)[None, :]
        slots = slots_of(wmeta, seq_N[:, None].expand(-1, S), pos_NS.clamp(min=0))
        new.append(comp.pool(layer.rows.read(row, slots), layer.rows.read(row + 1, slots), group_N == 0,
                             group_N * m, rope))
    layer.entries.write(new, slots_of(emeta, seq_N, end_N))


def top_entries(q_TNI: torch.Tensor, w_TN: torch.Tensor, keys_EI: torch.Tensor, ready_T: torch.Tensor,
                topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries each row attends to: (top (T, K) int64, ok (T, K) bool), K = min(topk, E), the top
    `topk` by sum_h w_h relu(q_h . k) / sqrt(I) of its first ready_T entries (ok False past them,
    and on padding). keys (E, I), shared by the rows, or (T, E, I), each row's own."""
    E, I = keys_EI.shape[-2], keys_EI.shape[-1]
    scores = torch.relu(torch.matmul(q_TNI.float(), keys_EI.float().transpose(-1, -2))) * I ** -0.5  # (T, N, E)
    score_TE = (scores * w_TN[:, :, None]).sum(dim=1)
    future = torch.arange(E, device=score_TE.device)[None, :] >= ready_T[:, None]
    score_TE = score_TE.masked_fill(future, float("-inf"))
    top = score_TE.topk(min(topk, E), dim=-1).indices
    return top, top < ready_T[:, None]


def _softmax_with_sinks(layer, q_THC, keys, visible_TK, sinks_H) -> torch.Tensor:
    """softmax(q . k * scale, with the sink logit per head) . k over the visible keys: (T, H, C).
    keys (K, C), shared by the rows, or (T, K, C), each row's own."""
    T = q_THC.shape[0]
    logits = torch.matmul(q_THC, keys.transpose(-1, -2)) * layer.scale  # (T, H, K)
    logits = logits.masked_fill(~visible_TK[:, None, :], float("-inf"))
    both = torch.cat([logits, sinks_H.to(logits.dtype)[None, :, None].expand(T, -1, 1)], dim=-1)
    both = both - both.max(dim=-1, keepdim=True).values
    probs = torch.softmax(both, dim=-1)[..., :-1].to(keys.dtype)
    return torch.matmul(probs, keys)


def _attend_decodes(layer, q_THC, index_q, seq_T, pos_T, E: int, meta: AttentionMetadata, sinks_H) -> torch.Tensor:
    """Decode rows, one per sequence, as one batch: each row gathers its window's keys (K = V) and
    of the step's first E entries those it attends to (all, masked past its own context, on HCA
    layers; the indexer's top-k on CSA). (T, H, C)."""
    dev, W = q_THC.device, layer.window
    wmeta = meta.for_group(layer.rows.cache_group)
    kpos_TW = pos_T[:, None] - W + 1 + torch.arange(W, device=dev)[None, :]
    visible = kpos_TW >= 0  # the window: p - W < k <= p
    keys = layer.rows.read(0, slots_of(wmeta, seq_T[:, None].expand(-1, W), kpos_TW.clamp(min=0)))
    if E:
        emeta = meta.for_group(layer.entries.cache_group)
        epos_E = (torch.arange(E, device=dev) + 1) * layer.m - 1
        eslots = slots_of(emeta, seq_T[:, None].expand(-1, E), epos_E[None, :].expand(seq_T.shape[0], -1))
        ready_T = (pos_T + 1) // layer.m
        if layer.indexer is not None:  # gather only the chosen entries, in position order
            top, ok = top_entries(*index_q, layer.entries.read(1, eslots), ready_T, layer.indexer.topk)
            top, order = top.sort(dim=-1)
            eslots, chosen = eslots.gather(1, top), ok.gather(1, order)
        else:
            chosen = torch.arange(E, device=dev)[None, :] < ready_T[:, None]
        keys = torch.cat([keys, layer.entries.read(0, eslots)], dim=1)
        visible = torch.cat([visible, chosen], dim=1)
    # Padding reads whatever its slot holds: zeroed, so a masked key adds exactly nothing.
    keys = keys.masked_fill(~visible[:, :, None], 0.0)
    return _softmax_with_sinks(layer, q_THC, keys, visible, sinks_H)


def _attend_sequence(layer, q_QHC, index_q, b: int, s: int, n: int, meta: AttentionMetadata, sinks_H):
    """A prefill chunk: its n rows (positions s - n .. s - 1) share one gather of the keys any of
    them sees (the window's from s - n - W + 1, the sequence's complete entries). (n, H, C)."""
    dev, W = q_QHC.device, layer.window
    pos_Q = torch.arange(s - n, s, device=dev)
    kpos = torch.arange(max(0, s - n - W + 1), s, device=dev)
    seq = torch.full((), b, dtype=torch.int64, device=dev)
    keys = layer.rows.read(0, slots_of(meta.for_group(layer.rows.cache_group), seq.expand(kpos.shape[0]), kpos))
    visible = (kpos[None, :] <= pos_Q[:, None]) & (kpos[None, :] > pos_Q[:, None] - W)
    E = s // layer.m if layer.entries is not None else 0
    if E:
        epos_E = (torch.arange(E, device=dev) + 1) * layer.m - 1
        eslots = slots_of(meta.for_group(layer.entries.cache_group), seq.expand(E), epos_E)
        ready_Q = (pos_Q + 1) // layer.m
        if layer.indexer is not None:
            top, ok = top_entries(*index_q, layer.entries.read(1, eslots), ready_Q, layer.indexer.topk)
            chosen = torch.zeros(n, E, dtype=torch.bool, device=dev).scatter_(1, top, ok)
        else:
            chosen = torch.arange(E, device=dev)[None, :] < ready_Q[:, None]
        keys = torch.cat([keys, layer.entries.read(0, eslots)], dim=0)
        visible = torch.cat([visible, chosen], dim=1)
    return _softmax_with_sinks(layer, q_QHC, keys, visible, sinks_H)


def attend(layer, q_THC: torch.Tensor, index_q, meta: AttentionMetadata, sinks_H: torch.Tensor) -> torch.Tensor:
    """The step's leading decodes as one batch (in slices bounding the gathered keys), then each
    prefill chunk: (T, H, C)."""
    nd, longest, seq_D, pos_D = decode_plan(meta, q_THC.device)
    T = q_THC.shape[0]
    if nd == T:  # decodes only: no copy into an output buffer
        return _decodes(layer, q_THC, index_q, seq_D, pos_D, longest, meta, sinks_H)
    out = torch.empty_like(q_THC)
    if nd:
        out[:nd] = _decodes(layer, q_THC[:nd], _rows(index_q, slice(0, nd)), seq_D, pos_D, longest, meta, sinks_H)
    row = nd
    for b in range(nd, meta.num_seqs):  # prefill chunks: a loop over sequences, each sharing its keys
        s, n = meta.seq_lens_cpu[b], meta.query_lens_cpu[b]
        if n:
            r = slice(row, row + n)
            out[r] = _attend_sequence(layer, q_THC[r], _rows(index_q, r), b, s, n, meta, sinks_H)
            row += n
    return out


def _rows(index_q, r: slice):
    return None if index_q is None else (index_q[0][r], index_q[1][r])


def _decodes(layer, q_THC, index_q, seq_T, pos_T, longest: int, meta: AttentionMetadata, sinks_H) -> torch.Tensor:
    """The decode rows in slices of at most _ROW_VALUES gathered key values (one slice at most contexts)."""
    E = longest // layer.m if layer.entries is not None else 0
    T = q_THC.shape[0]
    step = max(1, _ROW_VALUES // ((layer.window + E) * layer.hd))
    if step >= T:
        return _attend_decodes(layer, q_THC, index_q, seq_T, pos_T, E, meta, sinks_H)
    out = torch.empty_like(q_THC)
    for r0 in range(0, T, step):
        r = slice(r0, min(T, r0 + step))
        out[r] = _attend_decodes(layer, q_THC[r], _rows(index_q, r), seq_T[r], pos_T[r], E, meta, sinks_H)
    return out


class TorchCompressedAttention:
    """Torch ops ("torch"): what runs for every attention backend name until a kernel of this kind
    is registered under it (moe_serve/platform.py OPS["compressed_attention"])."""

    name = "torch"
    captures_graphs = False  # its gathers are sized from host lengths

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def capturable(self) -> "TorchCompressedAttention":
        return self

    # The module functions this backend runs (the batch-invariant subclass names its own).
    _compress, _attend = staticmethod(compress), staticmethod(attend)

    def compress(self, layer, meta: AttentionMetadata, rope) -> None:
        self._compress(layer, meta, rope)

    def attend(self, layer, q_THC, index_q, meta: AttentionMetadata, sinks_H) -> torch.Tensor:
        if q_THC.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("compressed attention in torch ops sizes its gathers from host lengths: a CUDA "
                               "graph cannot hold it")
        return self._attend(layer, q_THC, index_q, meta, sinks_H)

    def __repr__(self) -> str:
        return type(self).__name__ + "()"


# --- --batch-invariant (moe_serve/kernels/batch_invariant.py): the forms above batch a step's decodes
# into one padded gather and a prefill chunk's rows into another, and pool every group a step completes
# in one call, so a token's sums took shapes (and torch kernels) set by what else the step held.


def compress_invariant(layer, meta: AttentionMetadata, rope) -> None:
    """`compress`'s contract, one entry at a time: each entry pooled from its own span's rows alone
    (the same shapes whichever step completes its group, alone or beside others)."""
    dev = meta.slot_mapping.device
    ends = group_ends(meta, layer.m, dev)
    if ends is None:
        return
    seq_N, end_N = ends
    m = layer.m
    wmeta, emeta = meta.for_group(layer.rows.cache_group), meta.for_group(layer.entries.cache_group)
    parts = [(layer.compressor, 1)] + ([(layer.indexer.compressor, 3)] if layer.indexer is not None else [])
    new = [[] for _ in parts]
    for i in range(seq_N.shape[0]):
        seq, end = seq_N[i:i + 1], end_N[i:i + 1]
        group = (end + 1) // m - 1
        for j, (comp, row) in enumerate(parts):
            S = comp.span
            pos_1S = end[:, None] - S + 1 + torch.arange(S, device=dev)[None, :]
            slots = slots_of(wmeta, seq[:, None].expand(-1, S), pos_1S.clamp(min=0))
            new[j].append(comp.pool(layer.rows.read(row, slots), layer.rows.read(row + 1, slots), group == 0,
                                    group * m, rope))
    layer.entries.write([torch.cat(e) for e in new], slots_of(emeta, seq_N, end_N))


def _token_keys(layer, index_q, t: int, b: int, p: int, meta: AttentionMetadata) -> torch.Tensor:
    """The keys (= values) query row t (sequence b, position p) reads, in a fresh float32 tensor:
    its window's (positions p - W + 1 .. p), then the entries complete at p it attends to (all on
    HCA layers; the indexer's top-k among exactly those on CSA, in position order). (K, C)."""
    dev = layer.rows.caches[0].device
    kpos = torch.arange(max(0, p - layer.window + 1), p + 1, device=dev)
    seq = torch.full((), b, dtype=torch.int64, device=dev)
    keys = layer.rows.read(0, slots_of(meta.for_group(layer.rows.cache_group), seq.expand(kpos.shape[0]), kpos))
    ready = (p + 1) // layer.m if layer.entries is not None else 0
    if not ready:
        return keys.to(torch.float32, copy=True)
    epos = (torch.arange(ready, device=dev) + 1) * layer.m - 1
    eslots = slots_of(meta.for_group(layer.entries.cache_group), seq.expand(ready), epos)
    if layer.indexer is not None:
        ikeys = layer.entries.read(1, eslots).to(torch.float32, copy=True)  # (E, I)
        q_NI, w_N = (x[t].to(torch.float32, copy=True) for x in index_q)
        scores = torch.relu(torch.mm(q_NI, ikeys.t().contiguous())) * ikeys.shape[-1] ** -0.5  # (N, E)
        score_E = (scores * w_N[:, None]).sum(dim=0)
        eslots = eslots[score_E.topk(min(layer.indexer.topk, ready)).indices.sort().values]
    return torch.cat([keys, layer.entries.read(0, eslots)]).to(torch.float32, copy=True)


def attend_invariant(layer, q_THC: torch.Tensor, index_q, meta: AttentionMetadata, sinks_H) -> torch.Tensor:
    """`attend`'s contract, one query token at a time, decode or prefill alike: its scores against
    exactly the keys it reads (`_token_keys`, no padding), the sink logit per head, a float32
    softmax, then those keys as values. No reduction spans query tokens. (T, H, C)."""
    out = torch.empty_like(q_THC)
    sinks = sinks_H.to(torch.float32)[:, None]
    t = 0
    for b in range(meta.num_seqs):
        s, n = meta.seq_lens_cpu[b], meta.query_lens_cpu[b]
        for p in range(s - n, s):
            keys = _token_keys(layer, index_q, t, b, p, meta)
            q_HC = q_THC[t].to(torch.float32, copy=True)
            logits = torch.cat([torch.mm(q_HC, keys.t().contiguous()) * layer.scale, sinks], dim=-1)  # (H, K + 1)
            probs = torch.softmax(logits, dim=-1)[:, :-1].contiguous()
            out[t] = torch.mm(probs, keys).to(out.dtype)
            t += 1
    return out


class InvariantTorchCompressedAttention(TorchCompressedAttention):
    """TorchCompressedAttention's contract, batch-invariant (`compress_invariant`, `attend_invariant`):
    what --batch-invariant binds for every backend name (torch ops; on a GPU too)."""

    name = "torch+bi"
    batch_invariant = True

    _compress, _attend = staticmethod(compress_invariant), staticmethod(attend_invariant)
