"""The DSA ops (attention/backends/dsa.py) against a float64 reference written token by token: the
indexer's top-k selection over a paged key cache (causal, chunked prefill beside decodes, contexts
shorter than k), and MLA over the selected tokens; with every context within k, dense MLA."""
from __future__ import annotations

import pytest
import torch

from attention.backends import dsa, reference
from attention.metadata import AttentionMetadata

N, I, NI, L, R = 4, 16, 6, 32, 8  # MLA heads, indexer head dim, indexer heads, latent, rope dims
BS = 4


def _step(query_lens, seq_lens, seed=0, dtype=torch.float32):
    """A packed step over paged caches whose block tables are scattered (and unused blocks hold noise)."""
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-s // BS) for s in seq_lens) + 5
    perm = torch.randperm(nblocks, generator=g).tolist()
    tables = []
    for s in seq_lens:
        tables.append([perm.pop() for _ in range(-(-s // BS))])
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BS)
    T = sum(query_lens)
    x = dict(q_idx=torch.randn(T, NI, I, generator=g), w=torch.randn(T, NI, generator=g),
             index_cache=torch.randn(nblocks, BS, I, generator=g),
             q_lat=torch.randn(T, N, L, generator=g), q_pe=torch.randn(T, N, R, generator=g),
             latent=torch.randn(nblocks, BS, L + R, generator=g))
    return meta, tables, {k: v.to(dtype) for k, v in x.items()}


def _rows(meta):
    """(row, sequence, position) of every query row."""
    out, t = [], 0
    for b, (q, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        for i in range(q):
            out.append((t, b, s - q + i))
            t += 1
    return out


def _token(cache, table, pos):
    return cache[table[pos // BS], pos % BS].double()


def _oracle_scores(meta, tables, x, row, b, pos):
    """float64 index score of every position 0..pos for one query row."""
    scale = I ** -0.5
    keys = torch.stack([_token(x["index_cache"], tables[b], s) for s in range(pos + 1)])  # (S, I)
    per_head = torch.relu(x["q_idx"][row].double() @ keys.T * scale)  # (NI, S)
    return x["w"][row].double() @ per_head


CASES = [dict(query_lens=[1, 1, 1], seq_lens=[3, 20, 9]),  # decodes, one context under k
         dict(query_lens=[1, 1, 14, 5], seq_lens=[30, 6, 14, 23]),  # decodes then prefill chunks
         dict(query_lens=[9], seq_lens=[40])]  # a chunk deep into a context


@pytest.mark.parametrize("topk", [1, 8])
@pytest.mark.parametrize("case", CASES, ids=["decodes", "mixed", "chunk"])
def test_topk_selection_matches_float64(case, topk):
    meta, tables, x = _step(**case)
    got = dsa.dsa_topk(x["q_idx"], x["w"], x["index_cache"], meta, topk, I ** -0.5)
    assert got.shape == (sum(case["query_lens"]), min(topk, max(case["seq_lens"])))
    checked = 0
    for row, b, pos in _rows(meta):
        scores = _oracle_scores(meta, tables, x, row, b, pos)
        k = min(topk, pos + 1)
        order = scores.argsort(descending=True)
        if k <= pos:  # a cut: the data must not put a near-tie on it
            assert scores[order[k - 1]] - scores[order[k]] > 1e-5
        assert set(got[row, :k].tolist()) == set(order[:k].tolist()), (row, pos)
        assert (got[row, k:] == -1).all()
        checked += k <= pos
    assert checked > 0 or topk > 40


@pytest.mark.parametrize("case", CASES, ids=["decodes", "mixed", "chunk"])
def test_sparse_attention_matches_float64(case):
    meta, tables, x = _step(**case, seed=1)
    sel = dsa.dsa_topk(x["q_idx"], x["w"], x["index_cache"], meta, 8, I ** -0.5)
    scale = (L + R) ** -0.5
    got = dsa.sparse_mla_attention(x["q_lat"], x["q_pe"], x["latent"], meta, sel, scale)
    for row, b, pos in _rows(meta):
        picked = [p for p in sel[row].tolist() if p >= 0]
        rows = torch.stack([_token(x["latent"], tables[b], p) for p in picked])  # (k, L+R)
        q = torch.cat([x["q_lat"][row], x["q_pe"][row]], -1).double()  # (N, L+R)
        want = torch.softmax(q @ rows.T * scale, -1) @ rows[:, :L]
        torch.testing.assert_close(got[row].double(), want, rtol=1e-5, atol=1e-5)


def test_short_contexts_are_dense_mla():
    """Every context within k: DSA is dense MLA (the reference's)."""
    meta, _, x = _step([1, 1, 5, 3], [4, 7, 5, 8], seed=2)
    sel = dsa.dsa_topk(x["q_idx"], x["w"], x["index_cache"], meta, 8, I ** -0.5)
    got = dsa.sparse_mla_attention(x["q_lat"], x["q_pe"], x["latent"], meta, sel, 0.2)
    want = reference.mla_paged_attention(x["q_lat"], x["q_pe"], x["latent"], meta, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sparse_attention_bounds_its_gathered_rows(monkeypatch):
    """Rows attended a few at a time (a bound on the gathered latent) give the same result."""
    meta, _, x = _step(**CASES[1], seed=3)
    sel = dsa.dsa_topk(x["q_idx"], x["w"], x["index_cache"], meta, 8, I ** -0.5)
    whole = dsa.sparse_mla_attention(x["q_lat"], x["q_pe"], x["latent"], meta, sel, 0.2)
    monkeypatch.setattr(dsa, "_ROW_VALUES", 3 * 8 * (L + R))
    meta.backend_plans.clear()
    torch.testing.assert_close(dsa.sparse_mla_attention(x["q_lat"], x["q_pe"], x["latent"], meta, sel, 0.2), whole)
