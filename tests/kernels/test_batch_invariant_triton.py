"""--batch-invariant on the Triton backends (here: Triton's interpreter on the CPU): a row computed
alone is bitwise the row computed among others, wherever it sits, for the linear GEMM, the grouped
GEMM of the experts and paged attention (a query token decoded, or inside a prefill chunk, beside
decodes and other chunks); each also close to a float64 reference. Then the engine through the
Triton backends: a request's tokens and logprobs are bitwise the same alone and in company."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from attention.backends import triton_paged
from attention.backends.invariant import InvariantTritonAttention
from attention.metadata import AttentionMetadata
from moe_serve.kernels.batch_invariant import InvariantTritonExperts, InvariantTritonLinear
from moe_serve.kernels.grouped_gemm.reference import fused_experts_reference
from tests.interpreter_dot import rowwise_dot


@pytest.fixture(autouse=True, scope="module")
def _rowwise_dot():
    """The interpreter's tl.dot a row at a time (tests/interpreter_dot.py: numpy's BLAS is not
    invariant to a row's place in a tile on every CPU; our kernels are what is tested)."""
    restore = rowwise_dot()
    yield
    restore()


SIZES = (3, 33, 70)  # one row tile, two, three (the tiles are 32 rows)
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _alone_and_in_company(fn, target: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
    """fn(rows)'s row for `target` alone; asserts it is bitwise the same among others at the
    first, a middle and the last position of batches of each of SIZES."""
    alone = fn(target[None])[0]
    for n in SIZES:
        for at in (0, n // 2, n - 1):
            rows = others[:n].clone()
            rows[at] = target
            assert torch.equal(fn(rows)[at], alone), (n, at)
    return alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_row_alone_equals_row_in_batch(dtype):
    g = torch.Generator().manual_seed(0)
    K, N = 96, 80  # K: a whole and a part K tile; N: a whole and a part column tile
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    x = torch.randn(max(SIZES) + 1, K, generator=g).to(dtype)
    lin = InvariantTritonLinear("cpu")
    alone = _alone_and_in_company(lambda rows: lin(rows, w, b), x[-1], x[:-1])
    ref = x[-1].double() @ w.double().t() + b.double()
    torch.testing.assert_close(alone.double(), ref, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_token_alone_equals_token_in_batch(dtype):
    g = torch.Generator().manual_seed(1)
    E, D, F, K = 6, 160, 96, 2  # K tiles: 3 of 64 (the default configs: 2 of 128 or 3 of 64 by T)
    w13 = (torch.randn(E, 2 * F, D, generator=g) / 8).to(dtype)
    w2 = (torch.randn(E, D, F, generator=g) / 8).to(dtype)
    T = max(SIZES) + 1
    x = torch.randn(T, D, generator=g).to(dtype)
    # most tokens share the target's experts (3 and 1), so its rows move within their row blocks
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[::2] = torch.tensor([3, 1])
    ids[-1] = torch.tensor([3, 1])
    wts = torch.rand(T, K, generator=g)
    experts = InvariantTritonExperts("cpu")
    # a token's row: its activations, weights and ids (float32 holds each exactly)
    rows = torch.cat([x.float(), wts, ids.float()], dim=1)

    def run(r):
        return experts(r[:, :D].to(dtype), w13, w2, r[:, D:D + K].contiguous(), r[:, D + K:].long())

    alone = _alone_and_in_company(run, rows[-1], rows[:-1])
    ref = fused_experts_reference(x[-1:].double(), w13.double(), w2.double(), wts[-1:].double(), ids[-1:])[0]
    torch.testing.assert_close(alone.double(), ref, rtol=TOL[dtype], atol=TOL[dtype])
    # a pair held by another rank (id -1) gives a zero pair and is left out of the sum
    pairs = experts.pairs(x[-1:], w13, w2, wts[-1:], torch.tensor([[3, -1]]))
    assert torch.equal(pairs[0, 1], torch.zeros(D)) and torch.equal(pairs[0, 0], experts.pairs(
        x[-1:], w13, w2, wts[-1:], ids[-1:])[0, 0])


BS, G, QH, H = 4, 2, 2, 32  # block size, kv heads, query heads per kv head, head dim
TARGET_POS = 12  # the target query token's position in its sequence (13 keys visible)


def _cache(g):
    k = torch.randn(32, BS, G, H, generator=g)
    return k, torch.randn(32, BS, G, H, generator=g)


def _steps():
    """(query lengths, context lengths, the target sequence's index, the target row) of steps
    holding the target token: decoded alone, decoded among decodes, inside a prefill chunk alone,
    inside a chunk beside a decode and another chunk. The target sequence has blocks 0..4."""
    p = TARGET_POS
    return [([1], [p + 1], 0, 0), ([1, 1, 1], [7, p + 1, 20], 1, 1), ([5], [p + 3], 0, 2),
            ([1, 6, 3], [9, p + 2, 3], 1, 1 + 4)]


def _meta(q_lens, seq_lens, at):
    tables = []
    nxt = 5
    for b, s in enumerate(seq_lens):
        if b == at:
            tables.append(list(range(5)))
        else:
            n = -(-s // BS)
            tables.append(list(range(nxt, nxt + n)))
            nxt += n
    return AttentionMetadata.build(q_lens, seq_lens, tables, BS)


@pytest.mark.parametrize("window_sinks", [False, True], ids=["full", "window+sinks"])
def test_attention_token_alone_equals_token_in_any_step(window_sinks):
    g = torch.Generator().manual_seed(2)
    k_cache, v_cache = _cache(g)
    N = G * QH
    q_target = torch.randn(N, H, generator=g)
    window, sinks = (5, torch.randn(N, generator=g)) if window_sinks else (None, None)
    attn, scale = InvariantTritonAttention("cpu"), H ** -0.5
    outs = []
    for q_lens, seq_lens, at, row in _steps():
        q = torch.randn(sum(q_lens), N, H, generator=g)
        q[row] = q_target
        out = attn.paged_attention(q, k_cache, v_cache, _meta(q_lens, seq_lens, at), scale, sliding_window=window,
                                   sinks=sinks)
        outs.append(out[row])
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    lo = 0 if window is None else TARGET_POS - window + 1
    keys = k_cache[:5].flatten(0, 1)[lo:TARGET_POS + 1].double()  # (S, G, H): blocks 0..4 in order
    vals = v_cache[:5].flatten(0, 1)[lo:TARGET_POS + 1].double()
    ref = torch.empty(N, H, dtype=torch.float64)
    for n in range(N):
        s = keys[:, n // QH] @ q_target[n].double() * scale
        if sinks is not None:
            s = torch.cat([s, sinks[n:n + 1].double()])
        p = torch.softmax(s, 0)[:keys.shape[0]]
        ref[n] = p @ vals[:, n // QH]
    torch.testing.assert_close(outs[0].double(), ref, rtol=1e-5, atol=1e-5)


def test_mla_token_alone_equals_token_in_any_step():
    g = torch.Generator().manual_seed(3)
    N, L, R = 16, 32, 16
    lat = torch.randn(32, BS, L + R, generator=g)
    q_lat_t, q_pe_t = torch.randn(N, L, generator=g), torch.randn(N, R, generator=g)
    outs = []
    for q_lens, seq_lens, at, row in _steps():
        T = sum(q_lens)
        q_lat, q_pe = torch.randn(T, N, L, generator=g), torch.randn(T, N, R, generator=g)
        q_lat[row], q_pe[row] = q_lat_t, q_pe_t
        outs.append(triton_paged.invariant_mla_attention(q_lat, q_pe, lat, _meta(q_lens, seq_lens, at), 0.1)[row])
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    rows = lat[:5].flatten(0, 1)[:TARGET_POS + 1].double()
    p = torch.softmax(torch.cat([q_lat_t, q_pe_t], 1).double() @ rows.t() * 0.1, -1)
    torch.testing.assert_close(outs[0].double(), p @ rows[:, :L], rtol=1e-5, atol=1e-5)


ENGINE = r"""
import json, sys
from tests.interpreter_dot import rowwise_dot
rowwise_dot()
from moe_serve import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", block_size=4, kv_cache_memory=1 << 20, max_num_batched_tokens=8,
          batch_invariant=True, moe_backend="triton", attention_backend="triton", linear_backend="triton",
          norm_backend="torch", show_progress=False)
names = sorted({m.ops.name for m in llm.engine.runner.model.modules() if getattr(type(m), "op_kind", None)})
target = {"prompt_token_ids": [9, 8, 7, 6, 5, 4, 3, 200, 100, 17]}
params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)
def result(o):
    o = o.outputs[0]
    return [list(o.token_ids), [sorted((t, getattr(lp, "logprob", lp)) for t, lp in d.items()) for d in o.logprobs]]
alone = result(llm.generate(target, params)[0])
company = [{"prompt_token_ids": [5, 77, 301]}, target, {"prompt_token_ids": [450, 12, 13, 14, 15]}]
together = result(llm.generate(company, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2)
                                         for m in (4, 3, 2)])[1])
print(json.dumps({"alone": alone, "together": together, "names": names}))
"""


def test_engine_request_alone_equals_request_in_company(checkpoints):
    """The tiny qwen3_moe checkpoint through the Triton backends with --batch-invariant: the target
    prompt (chunked by the 8-token budget) alone, then beside a shorter and a longer request (its
    chunks and decodes share steps with theirs): tokens and logprobs equal bitwise."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", ENGINE, checkpoints["qwen3_moe"]], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["names"] == ["torch", "triton+bi"], got["names"]  # the norms: torch
    assert got["alone"] == got["together"]
    assert all(math.isfinite(lp) for step in got["alone"][1] for _, lp in step)
