"""The Triton DSA kernels (the indexer's scores + top-k, attention/backends/triton_dsa.py, and the
paged attention kernel's SPARSE mode) against the torch ops of attention/backends/dsa.py, in the
interpreter on the CPU (compiled where there is a GPU): decodes, prefill chunks beside them, contexts
shorter than k, scattered block tables, split-K over the selection."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules: see conftest.py

import pytest

from attention.backends import dsa
from attention.backends import triton_dsa as td
from attention.backends import triton_paged as tp
from attention.metadata import AttentionMetadata

DEVICE = "cpu" if tp.INTERPRETED or not torch.cuda.is_available() else "cuda"
NI, ID, N, L, R, BS = 16, 32, 16, 64, 16, 8  # 16 indexer heads: a score tied at 0 (every relu 0) is rare
CASES = [dict(query_lens=[1, 1, 1], seq_lens=[5, 40, 19]),
         dict(query_lens=[1, 1, 12, 6], seq_lens=[33, 3, 12, 29])]


def _step(query_lens, seq_lens, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-s // BS) for s in seq_lens) + 4
    pool = torch.randperm(nblocks, generator=g).tolist()
    tables = [[pool.pop() for _ in range(-(-s // BS))] for s in seq_lens]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BS, device=DEVICE)
    T = sum(query_lens)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    return meta, dict(q=r(T, NI, ID), w=r(T, NI).float(), keys=r(nblocks, BS, ID), q_lat=r(T, N, L), q_pe=r(T, N, R),
                      latent=r(nblocks, BS, L + R))


@pytest.mark.parametrize("case", CASES, ids=["decodes", "mixed"])
def test_index_topk_matches_torch(case):
    meta, x = _step(**case, seed=0)
    got = td.dsa_topk(x["q"], x["w"], x["keys"], meta, 8, ID ** -0.5)
    want = dsa.dsa_topk(x["q"], x["w"], x["keys"], meta, 8, ID ** -0.5)
    assert got.shape == want.shape
    assert [sorted(r) for r in got.tolist()] == [sorted(r) for r in want.tolist()]


def test_index_topk_in_row_groups(monkeypatch):
    """Rows scored a few at a time (the bound on a long prefill's score buffer) select the same."""
    meta, x = _step(**CASES[1], seed=1)
    whole = td.dsa_topk(x["q"], x["w"], x["keys"], meta, 8, ID ** -0.5)
    monkeypatch.setattr(td, "_ROW_VALUES", 3 * meta.max_seq_len)
    meta.backend_plans.clear()
    assert torch.equal(td.dsa_topk(x["q"], x["w"], x["keys"], meta, 8, ID ** -0.5), whole)


@pytest.mark.parametrize("case, splits", [(CASES[0], 1), (CASES[0], 3), (CASES[1], 1)],
                         ids=["decodes", "decodes-split", "mixed"])  # split-K is a decode launch
def test_sparse_mla_matches_torch(case, splits):
    meta, x = _step(**case, seed=2)
    sel = dsa.dsa_topk(x["q"], x["w"], x["keys"], meta, 8, ID ** -0.5)
    got = tp.sparse_mla_attention(x["q_lat"], x["q_pe"], x["latent"], meta, sel, 0.1, num_splits=splits)
    want = dsa.sparse_mla_attention(x["q_lat"], x["q_pe"], x["latent"], meta, sel, 0.1)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


FP8 = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _fp8(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """The FP8 cache contract's stored value of x: saturated to the finite max, cast (RTNE)."""
    return x.float().cpu().clamp(-FP8[fp8], FP8[fp8]).to(fp8).to(DEVICE)


@pytest.mark.parametrize("fp8", list(FP8), ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("case", CASES, ids=["decodes", "mixed"])
def test_index_topk_and_sparse_mla_over_fp8_caches(case, fp8):
    """FP8 index keys and an FP8 latent (--kv-cache-dtype fp8*): the indexer's scores select what
    the torch ops select over the caches widened to float32, and the sparse MLA over the selection
    (decodes split over it) equals the torch ops over the widened latent; the FP8 keys do change
    the selection's inputs (not a no-op cast), and some keys past e4m3's range saturate."""
    meta, x = _step(**case, seed=3)
    keys = _fp8(x["keys"] * 200, fp8)  # some past 448: saturated in e4m3
    assert fp8 != torch.float8_e4m3fn or bool((keys.float().abs() == 448).any())
    latent = _fp8(x["latent"], fp8)
    sel = td.dsa_topk(x["q"], x["w"], keys, meta, 8, ID ** -0.5)
    want = dsa.dsa_topk(x["q"], x["w"], keys.float(), meta, 8, ID ** -0.5)
    assert [sorted(r) for r in sel.tolist()] == [sorted(r) for r in want.tolist()]
    for splits in (1, 3) if max(case["query_lens"]) == 1 else (1,):
        got = tp.sparse_mla_attention(x["q_lat"], x["q_pe"], latent, meta, sel, 0.1, num_splits=splits)
        expect = dsa.sparse_mla_attention(x["q_lat"], x["q_pe"], latent.float(), meta, sel, 0.1)
        torch.testing.assert_close(got, expect, rtol=2e-5, atol=2e-5)
    assert not torch.equal(latent.float(), x["latent"])
