"""DeepSeek-V4's compressed / sparse attention layer (attention/compressed.py) and its torch backend
(attention/backends/compressed.py), on their own: against an oracle written from the definition
(window, pooled entries, the indexer's top-k, sinks) over a schedule of prefill chunks, mixed steps
and decodes; a step's decodes as one batch equal to each decoded alone, with the same ops whatever
the batch size (no loop over sequences); the backend is the one moe_serve/platform.py resolves and
binds. Caches start as NaN and unused table entries point at a NaN block: a masked read that leaked
into an output would show."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from attention.backends.compressed import TorchCompressedAttention
from attention.compressed import CompressedAttention, Compressor, Indexer, rope_tail
from attention.metadata import AttentionMetadata
from moe_serve import platform

D, H, C, QR, W, BS = 16, 2, 8, 8, 3, 4
LENS = [9, 14, 5, 21, 11]
# Tokens each step computes per sequence: prefill chunks; two decodes beside three chunks; decodes.
SCHEDULE = [[7, 10, 2, 12, 6], [1, 1, 2, 8, 4], [1, 1, 1, 1, 1]]


class Rope:
    def cos_sin(self, pos: torch.Tensor):
        f = pos.float()[:, None] * torch.tensor([1.0, 0.1])
        return f.cos(), f.sin()


def _layer(kind: str, m: int) -> CompressedAttention:
    g = torch.Generator().manual_seed(3)
    comp = Compressor(D, C, m, kind == "csa", 1e-6, torch.float32)
    # Eight index heads: a score is 0 (relu of every head) rarely, so the top-k has no tie at its cut.
    idx = Indexer(D, QR, 8, 4, 2, m, 1e-6, torch.float32) if kind == "csa" else None
    for mod in (comp, idx):
        for p in (mod.parameters() if mod is not None else []):
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    layer = CompressedAttention(H, C, W, max(W, 2 * m), torch.float32, comp, idx)
    nb = 1 + sum(-(-n // BS) for n in LENS)  # block 0: never used, NaN (what padding reads)
    layer.rows.cache_group, layer.entries.cache_group = 1, 0
    for rows in (layer.rows, layer.entries):
        rows.bind([torch.full(s, float("nan")) for s in rows.cache_shape(nb, BS)])
    return layer


def _tables() -> list[list[int]]:
    tables, nxt = [], 1
    for n in LENS:
        k = -(-n // BS)
        tables.append(list(range(nxt, nxt + k)))
        nxt += k
    return tables


class Tokens:
    """Every sequence's per-token inputs, fixed by (sequence, position): a step recomputes the same."""

    def __init__(self, layer: CompressedAttention):
        g = torch.Generator().manual_seed(5)
        self.layer = layer
        self.x = [torch.randn(n, D, generator=g) for n in LENS]
        self.q = [torch.randn(n, H, C, generator=g) for n in LENS]
        self.kv = [torch.randn(n, C, generator=g) for n in LENS]
        self.q_resid = [torch.randn(n, QR, generator=g) for n in LENS]
        self.sinks = torch.randn(H, generator=g)

    def step(self, seqs: list[int], q_lens: list[int], seq_lens: list[int], mode=None) -> torch.Tensor:
        """The layer's forward over one step of these sequences (in this order); mode: a dispatch
        mode around the layer's call only."""
        tables = _tables()
        meta = AttentionMetadata.build(q_lens, seq_lens, [tables[b] for b in seqs], BS)
        meta.group_tables[1] = (meta.block_tables, meta.slot_mapping)
        rows = [slice(s - q, s) for q, s in zip(q_lens, seq_lens)]

        def cat(per_seq):
            return torch.cat([per_seq[b][r] for b, r in zip(seqs, rows)])

        x, pos = cat(self.x), torch.cat([torch.arange(r.start, r.stop) for r in rows])
        layer, rope = self.layer, Rope()
        raw = [cat(self.kv)] + layer.compressor.raw(x)
        index_q = None
        if layer.indexer is not None:
            raw += layer.indexer.compressor.raw(x)
            index_q = layer.indexer.queries(cat(self.q_resid), x, *rope.cos_sin(pos))
        q = cat(self.q)
        with mode or contextlib.nullcontext():
            return layer(q, raw, index_q, meta, rope, self.sinks)

    def oracle(self, b: int, p: int) -> torch.Tensor:
        """(H, C): the query of sequence b at position p, from the definition."""
        layer, rope, m = self.layer, Rope(), self.layer.m
        x = self.x[b][: p + 1]
        keys = [self.kv[b][max(0, p - W + 1): p + 1]]
        ready = (p + 1) // m
        if ready:
            def entries(comp):
                kv, gate = comp.raw(x)
                out = []
                for w in range(ready):
                    span = torch.arange((w + 1) * m - comp.span, (w + 1) * m).clamp(min=0)
                    out.append(comp.pool(kv[span][None], gate[span][None], torch.tensor([w == 0]),
                                         torch.tensor([w * m]), rope))
                return torch.cat(out)

            ent = entries(layer.compressor)
            if layer.indexer is not None:
                idx = layer.indexer
                q, w = idx.queries(self.q_resid[b][p:p + 1], x[p:p + 1], *rope.cos_sin(torch.tensor([p])))
                score = (torch.relu(q[0] @ entries(idx.compressor).T) * idx.I ** -0.5 * w[0][:, None]).sum(0)
                ent = ent[score.topk(min(idx.topk, ready)).indices.sort().values]
            keys.append(ent)
        k = torch.cat(keys)
        logits = torch.cat([self.q[b][p] @ k.T * C ** -0.5, self.sinks[:, None]], dim=1)
        return torch.softmax(logits, dim=1)[:, :-1] @ k


@pytest.mark.parametrize("kind, m", [("hca", 4), ("csa", 2)])
def test_steps_match_the_definition(kind, m):
    tok = Tokens(_layer(kind, m))
    done = [0] * len(LENS)
    for q_lens in SCHEDULE:
        seq_lens = [d + q for d, q in zip(done, q_lens)]
        out = tok.step(list(range(len(LENS))), q_lens, seq_lens)
        assert torch.isfinite(out).all()
        want = torch.cat([torch.stack([tok.oracle(b, p) for p in range(d, s)]) for b, (d, s) in
                          enumerate(zip(done, seq_lens))])
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        done = seq_lens


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind, m", [("hca", 4), ("csa", 2)])
def test_decodes_are_one_batch_equal_to_each_alone(kind, m):
    """A step of decodes gives each sequence what a step of it alone gives, and runs as many ops for
    two sequences as for five (its groups completing alike): no loop over the sequences."""
    tok = Tokens(_layer(kind, m))
    B = len(LENS)
    tok.step(list(range(B)), [n - 1 for n in LENS], [n - 1 for n in LENS])  # every sequence but its last token
    c_all, c_two = CountOps(), CountOps()
    batch = tok.step(list(range(B)), [1] * B, LENS, c_all)
    alone = torch.cat([tok.step([b], [1], [LENS[b]]) for b in range(B)])
    torch.testing.assert_close(batch, alone, rtol=1e-6, atol=1e-6)
    # Sequences 1 and 4 (14 and 11 tokens) complete a group of 2 and no group of 4, as the five do.
    tok.step([1, 4], [1, 1], [LENS[1], LENS[4]], c_two)
    assert c_two.n == c_all.n, (c_two.n, c_all.n)


class CountingCompressed(TorchCompressedAttention):
    name = "cpu_c"
    calls = 0

    def attend(self, layer, q_THC, index_q, meta, sinks_H):
        type(self).calls += 1
        return super().attend(layer, q_THC, index_q, meta, sinks_H)


def test_backend_is_resolved_with_the_attention_backend_and_bound(monkeypatch):
    """The compressed-attention backend follows the attention backend's name (torch ops where that
    name has no class of this kind); one class and one entry in platform.OPS add one."""
    cpu = torch.device("cpu")
    for name in ("torch", "cpu_c", "triton"):
        ops = platform.resolve_ops(cpu, "torch", name)
        assert type(ops.compressed_attention) is TorchCompressedAttention
        assert type(ops.capturable().compressed_attention) is TorchCompressedAttention
    monkeypatch.setitem(platform.OPS["compressed_attention"], "cpu_c", CountingCompressed)
    ops = platform.resolve_ops(cpu, "torch", "cpu_c")
    assert ops.table().startswith("experts=torch, attention=cpu_c, linear=torch")  # its name is the attention's
    assert "attention=triton (compressed_attention=torch)" in platform.resolve_ops(cpu, "torch", "triton").table()
    layer = _layer("csa", 2)
    model = nn.ModuleList([layer])
    platform.bind_ops(model, ops)
    assert layer.ops is ops.compressed_attention
    CountingCompressed.calls = 0
    Tokens(layer).step([0], [4], [4])
    assert CountingCompressed.calls == 1


def test_rope_tail_rotates_only_the_tail():
    x = torch.randn(3, H, C)
    cos, sin = Rope().cos_sin(torch.tensor([0, 1, 2]))
    y = rope_tail(x, cos, sin)
    assert torch.equal(y[..., :C - 4], x[..., :C - 4])
    torch.testing.assert_close(rope_tail(y, cos, -sin), x)
