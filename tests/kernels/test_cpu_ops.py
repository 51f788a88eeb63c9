"""Our C kernels (moe_serve/kernels/cpu_ops) against float64 references, and how they are built and chosen.

Every kernel test runs once for each ISA of vec.h this CPU executes (the `isa` fixture: avx512 where
the CPU has AVX-512, avx2 where it has AVX2 and FMA, always the plain-C generic path; neon on aarch64),
each variant a library of its own (`cpu_ops.load_variant`) that the module's functions and the
backends call within the test. tests/kernels/test_cpu_ops_driver.py runs aarch64's paths under qemu."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from moe_serve.kernels import cpu_ops
from attention.backends import CpuCAttention
from moe_serve.kernels.grouped_gemm import CpuCExperts, fused_experts
from moe_serve.kernels.grouped_gemm.reference import fused_experts_reference
from tests.kernels.cpu_isa import isa  # noqa: F401  (a fixture: each test once per ISA build)
from tests.kernels.cpu_isa import by_thread_cases
from tests.kernels.cpu_isa import threads as _threads

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C kernels did not build here (no C compiler)")


def _case(T, D, F, E, K, dtype, seed=0, held_elsewhere=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    w13 = (torch.randn(E, 2 * F, D, generator=g) * D ** -0.5).to(dtype)
    w2 = (torch.randn(E, D, F, generator=g) * F ** -0.5).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if held_elsewhere:  # expert parallel: ids of experts on another rank arrive as -1
        ids = torch.where(torch.rand(T, K, generator=g) < 0.3, -1, ids)
    wts = torch.rand(T, K, generator=g)
    return x, w13, w2, wts, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,D,F,E,K", [(1, 64, 32, 8, 2), (5, 40, 24, 6, 3), (33, 128, 80, 16, 4),
                                       (7, 17, 9, 4, 2)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_float64_reference(dtype, T, D, F, E, K, threads, isa):
    """Shapes off the vector width (D=17, 40; F=9, 24; 2F and D not multiples of the 4-row tile),
    every row count 1..4 of a micro-tile, ids held elsewhere, one and two OpenMP threads."""
    x, w13, w2, wts, ids = _case(T, D, F, E, K, dtype, held_elsewhere=True)
    ref = fused_experts_reference(x.double(), w13.double(), w2.double(), wts.double(), ids)
    with _threads(threads):
        got = cpu_ops.moe_experts(x, w13, w2, wts, ids)
    assert got.dtype == torch.float32 and got.shape == (T, D)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_experts_per_thread_match_float64_and_one_thread_bitwise(dtype, isa):
    """Decode-sized routings that reach as many experts as there are threads (evenly) give whole
    experts to each thread (cases: tests/kernels/cpu_isa.py `by_thread_cases`). Against float64,
    and bit for bit the one-thread result (each token's pairs added in the same order)."""
    E, D, F = 12, 40, 24
    _, w13, w2, _, _ = _case(1, D, F, E, 1, dtype, seed=5)
    for ids, x, wts, got, serial in by_thread_cases(lambda x, wts, ids: cpu_ops.moe_experts(x, w13, w2, wts, ids),
                                                    cpu_ops.experts_by_thread_run, E, D,
                                                    torch.Generator().manual_seed(5)):
        ref = fused_experts_reference(x.double(), w13.double(), w2.double(), wts.double(), ids)
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(got, serial)


def test_silu_over_the_whole_float_range(isa):
    """The vectorised exp of SiLU at extreme gate values (saturation to 0 and to the identity, no
    NaN or inf): one expert whose gate rows pick single input columns of large magnitude."""
    F, D = 32, 33
    x = torch.ones(2, D)
    x[:, :F] = torch.linspace(-120.0, 120.0, F)
    w13 = torch.zeros(1, 2 * F, D)
    w13[0, :F, :F] = torch.eye(F)  # gate_f = x_f
    w13[0, F:, D - 1] = 1.0  # up_f = the constant column: 1
    w2 = torch.eye(D, F).unsqueeze(0)
    ids = torch.zeros(2, 1, dtype=torch.int64)
    wts = torch.ones(2, 1)
    ref = fused_experts_reference(x.double(), w13.double(), w2.double(), wts.double(), ids)
    got = cpu_ops.moe_experts(x, w13, w2, wts, ids)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), ref, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("T,D,F,E,K,held", [
    (17, 40, 12, 1, 1, False),   # one expert of exactly 17 rows: the smallest panel case, D off the vector width
    (34, 40, 12, 2, 1, False),   # rows shorter than a vector (bf16: the widening's masked tails)
    (100, 64, 32, 3, 2, True),   # panels of 48, 48 and a partial one; F/4 and D/8 row blocks
    (700, 256, 64, 2, 1, True),  # an expert beyond one panel group (1 MB of packed tokens)
    (300, 128, 80, 16, 4, True),  # experts on both sides of the panel threshold in one call
])
def test_panel_path_matches_float64_reference(T, D, F, E, K, held, threads, dtype, isa):
    """Experts with many rows (prefill) take the outer-product panel kernel, over float32 weights
    or bf16 ones (each block of 8 weight rows widened once for all its panels): partial panels,
    several panel groups, ids held elsewhere, experts below the threshold in the same call."""
    x, w13, w2, wts, ids = _case(T, D, F, E, K, dtype, seed=T + D, held_elsewhere=held)
    ref = fused_experts_reference(x.double(), w13.double(), w2.double(), wts.double(), ids)
    ran = cpu_ops.panel_groups_run()
    with _threads(threads):
        got = cpu_ops.moe_experts(x, w13, w2, wts, ids)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    rows = torch.bincount(ids[ids >= 0], minlength=E)
    groups = (1 << 20) // (D * 48 * 4) * 48  # rows per panel group (moe.c)
    want = sum(-(-int(n) // groups) for n in rows if n >= 17)
    assert want > 0 and cpu_ops.panel_groups_run() - ran == want  # the panel path ran, group by group


def test_bf16_experts_take_the_panels_where_torch_has_no_bf16_matmul(monkeypatch):
    """The cpu_c backend sends prefill-sized bf16 experts to the panel kernel where torch's bf16
    GEMMs have no matrix instructions (it would widen every expert's weights per call), and leaves
    them to torch where they have."""
    from moe_serve.kernels import cpu_gemm

    x, w13, w2, _, _ = _case(1, 64, 32, 4, 2, torch.bfloat16)
    big = torch.zeros(20 * 4, 2, dtype=torch.int64)  # past decode size: 20 rows per expert
    monkeypatch.setattr(cpu_gemm, "cpu_has_half_matmul", lambda: False)
    assert cpu_ops.panels_fit(w13, w2) and cpu_ops.use_for(x, w13, w2, big)
    monkeypatch.setattr(cpu_gemm, "cpu_has_half_matmul", lambda: True)
    assert not cpu_ops.panels_fit(w13, w2) and not cpu_ops.use_for(x, w13, w2, big)


def test_fused_experts_takes_it_where_it_is_written_for(isa):
    """The cpu_c experts backend runs the C kernel for decode-sized batches, for prefill-sized ones
    too where the panel path takes the weights (float32, F % 4 == 0, D % 8 == 0), torch's ops for
    other prefill shapes and always in its capturable form; all agree with the reference."""
    calls = []
    orig = cpu_ops.moe_experts

    def counting(*a, **k):
        calls.append((a[0].shape[0], a[0].shape[1]))
        return orig(*a, **k)

    for T, D, F in ((1, 64, 32), (8, 64, 32), (400, 64, 32), (400, 60, 30)):
        x, w13, w2, wts, ids = _case(T, D, F, 8, 2, torch.float32, seed=T)
        ref = fused_experts_reference(x.double(), w13.double(), w2.double(), wts.double(), ids)
        cpu_ops.moe_experts = counting
        try:
            backend = CpuCExperts("cpu")
            got = fused_experts(x, w13, w2, wts, ids, backend=backend)
            guarded = fused_experts(x, w13, w2, wts, ids, backend=backend.capturable())
        finally:
            cpu_ops.moe_experts = orig
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(guarded.double(), ref, rtol=1e-5, atol=1e-5)
    # not 400 rows at D=60/F=30 (no panel path: 16 rows per expert at most), never under the guard
    assert calls == [(1, 64), (8, 64), (400, 64)], calls


def test_built_once_and_torch_ops_without_a_compiler(tmp_path):
    """A fresh cache builds the library once (a second process loads it, no compiler run); with no
    compiler the kernels are off, the reason is logged, and the experts still compute right."""
    script = textwrap.dedent("""
        import logging, sys, torch
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        from moe_serve.kernels import cpu_ops
        from moe_serve.kernels.grouped_gemm import fused_experts
        from moe_serve.kernels.grouped_gemm.reference import fused_experts_reference
        print("available", cpu_ops.available())
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, 32, generator=g); w13 = torch.randn(4, 32, 32, generator=g); w2 = torch.randn(4, 32, 16, generator=g)
        ids = torch.tensor([[0, 1], [2, 3], [1, -1]]); wts = torch.rand(3, 2, generator=g)
        ref = fused_experts_reference(x.double(), w13.double(), w2.double(), wts.double(), ids)
        torch.testing.assert_close(fused_experts(x, w13, w2, wts, ids).double(), ref, rtol=1e-4, atol=1e-4)  # fp32 sums of 32 terms of ~5
        print("ok")
    """)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def run(**env):
        e = dict(os.environ, MOE_SERVE_CACHE=str(tmp_path), PYTHONPATH=repo)
        e.update(env)
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=e, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    first = run()
    assert "available True" in first and "cpu_ops: compiled" in first and "ok" in first
    built = list((tmp_path / "cpu_ops").glob("*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    second = run()
    assert "available True" in second and "compiled" not in second
    assert built[0].stat().st_mtime_ns == mtime
    bare = run(CC="/nonexistent/cc", PATH="/nonexistent", MOE_SERVE_CACHE=str(tmp_path / "empty"))
    assert "available False" in bare and "no C compiler" in bare and "ok" in bare


def test_isa_chosen_for_the_cpu_forced_by_env_and_named_in_status(tmp_path):
    """The default build is the CPU's widest ISA (-march=native), named in status() and its reason;
    MOE_SERVE_CPU_ISA builds another as a library of its own (the flags are in the cache key: a second
    file), one this CPU cannot execute or an unknown name is refused with a reason (torch ops then);
    load_variant leaves the process's default alone."""
    native = cpu_ops.native_isa()
    default = (os.environ.get("MOE_SERVE_CPU_ISA") or "native").lower()  # this process's choice
    default = native if default == "native" else default
    st = cpu_ops.status()
    assert st["available"] and st["isa"] == default and default in st["reason"]
    assert set(st) >= {"available", "reason", "path", "sources", "compiler", "isa"}
    other = next(i for i in cpu_ops.runnable_isas() if i != default)
    lib = cpu_ops.load_variant(other)
    assert lib.cpu_ops_isa().decode() == other and lib._name != st["path"]
    assert cpu_ops._lib().cpu_ops_isa().decode() == default and cpu_ops.status()["isa"] == default
    other = next(i for i in cpu_ops.runnable_isas() if i != native)  # avx2 on AVX-512, generic elsewhere

    script = ("import json; from moe_serve.kernels import cpu_ops; s = cpu_ops.status(); "
              "print(json.dumps([s['available'], s['isa'], s['reason'], s['path']]))")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def run(isa):
        e = dict(os.environ, MOE_SERVE_CACHE=str(tmp_path), PYTHONPATH=repo, MOE_SERVE_CPU_ISA=isa)
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=e, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])

    # both builds are in this process's cache already (its default, and `other` for the isa fixture):
    # copied into the runs' cache, each run finds its own by its key instead of compiling it again
    (tmp_path / "cpu_ops").mkdir()
    for built in {st["path"], cpu_ops.load_variant(other)._name}:
        shutil.copy(built, tmp_path / "cpu_ops")
    ok, got, reason, path = run(other)
    assert ok and got == other and f"MOE_SERVE_CPU_ISA={other}" in reason and native in reason
    ok, got, _, native_path = run("native")
    assert ok and got == native and native_path != path
    assert len(list((tmp_path / "cpu_ops").glob("*.so"))) == 2
    foreign = "neon" if cpu_ops._arch() != "aarch64" else "avx2"
    for bad, why in ((foreign, "cannot execute"), ("sse9", "unknown ISA")):
        ok, got, reason, _ = run(bad)
        assert not ok and got is None and why in reason and f"MOE_SERVE_CPU_ISA={bad}" in reason


def _rms64(h, w, eps):
    h = h.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("shape", [(1, 512), (7, 17), (33, 64), (3, 4, 40), (2048, 96)])
@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_matches_float64(shape, threads, isa):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 3
    r = torch.randn(*shape, generator=g)
    w = torch.randn(shape[-1], generator=g)
    with _threads(threads):
        assert cpu_ops.rms_norm_fits(x, w) and cpu_ops.rms_norm_fits(x, w, r)
        got = cpu_ops.rms_norm(x, w, 1e-6)
        h, got_r = cpu_ops.rms_norm(x, w, 1e-5, residual=r)
    torch.testing.assert_close(got.double(), _rms64(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    assert torch.equal(h, x + r)  # the residual sum is the same float32 add
    torch.testing.assert_close(got_r.double(), _rms64(x + r, w, 1e-5), rtol=1e-5, atol=1e-5)


def test_rms_norm_strided_rows_and_what_it_refuses(isa):
    """Rows of a wider tensor (a column slice, as q of a fused projection) are read in place; shapes
    the kernel does not take (non-contiguous rows, half precision) fall back to torch in RMSNorm."""
    from moe_serve.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 100, generator=g)
    x = wide[:, 10:74]
    w = torch.randn(64, generator=g)
    assert cpu_ops.rms_norm_fits(x, w)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6).double(), _rms64(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    cols = torch.randn(64, 6, generator=g).t()  # (6, 64) whose rows are strided: inner stride 6
    assert cols.shape == (6, 64) and not cpu_ops.rms_norm_fits(cols, w)
    assert not cpu_ops.rms_norm_fits(x.bfloat16(), w)
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(w)
    with torch.inference_mode():
        for t in (x, torch.randn(2, 3, 64, generator=g), torch.randn(64, 4, generator=g).t()):
            torch.testing.assert_close(norm(t).double(), _rms64(t, w, 1e-6), rtol=1e-5, atol=1e-5)
        r = torch.randn(6, 64, generator=g)
        h, n = norm.add_norm(x, r)
        assert torch.equal(h, x + r)
        torch.testing.assert_close(n.double(), _rms64(x + r, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("N,G,H,bs", [(8, 2, 64, 16), (4, 4, 40, 4), (12, 1, 16, 1), (2, 2, 17, 3)])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_matches_float64(N, G, H, bs, threads, isa):
    """One query per sequence over paged keys in scattered blocks (contexts 1 .. a few blocks, one
    of length 0 skipped by the caller is not passed), grouped heads, head sizes off the vector width."""
    g = torch.Generator().manual_seed(N * 100 + H)
    seq = [1, bs, 3 * bs + 1, 37]
    B = len(seq)
    nblocks = 64
    k_cache = torch.randn(nblocks, bs, G, H, generator=g)
    v_cache = torch.randn(nblocks, bs, G, H, generator=g)
    W = max(-(-s // bs) for s in seq)
    tables = torch.stack([torch.randperm(nblocks, generator=g)[:W] for _ in range(B)]).to(torch.int32)
    q = torch.randn(B, N, H, generator=g)
    scale = H ** -0.5
    with _threads(threads):
        lens = torch.tensor(seq, dtype=torch.int32)
        assert cpu_ops.decode_attention_fits(q, k_cache, v_cache, tables, lens)
        got = cpu_ops.decode_attention(q, k_cache, v_cache, tables, lens, scale)
    for b, s in enumerate(seq):
        pos = torch.arange(s)
        slots = tables[b, pos // bs].long() * bs + pos % bs
        k = k_cache.flatten(0, 1)[slots].double()  # (s, G, H)
        v = v_cache.flatten(0, 1)[slots].double()
        kq = k.repeat_interleave(N // G, dim=1)  # (s, N, H): head n reads kv head n // (N / G)
        vq = v.repeat_interleave(N // G, dim=1)
        p = torch.softmax(torch.einsum("nh,snh->ns", q[b].double(), kq) * scale, dim=-1)
        ref = torch.einsum("ns,snh->nh", p, vq)
        torch.testing.assert_close(got[b].double(), ref, rtol=1e-5, atol=1e-5)


def test_reference_backend_takes_it_for_the_decodes_of_a_mixed_step(isa):
    """The cpu_c attention backend runs a step's leading decodes through the C kernel (a mixed step
    with prefill chunks after them too) and gives what the torch backend's SDPA path gives."""
    from attention.backends import reference as ref
    from attention.metadata import AttentionMetadata

    g = torch.Generator().manual_seed(2)
    nb, bs, G, N, H = 16, 4, 2, 4, 32
    k = torch.randn(nb, bs, G, H, generator=g)
    v = torch.randn(nb, bs, G, H, generator=g)
    calls = []
    orig = cpu_ops.decode_attention

    def counting(q, *a):
        calls.append(q.shape[0])
        return orig(q, *a)

    for q_lens, seq_lens, tables in (([1, 1, 1], [6, 1, 10], [[3, 7], [0], [11, 2, 5]]),
                                     ([1, 1, 3, 6], [6, 2, 7, 6], [[3, 7], [0], [1, 4], [9, 12]])):
        meta = AttentionMetadata.build(q_lens, seq_lens, tables, bs)
        q = torch.randn(sum(q_lens), N, H, generator=g)
        cpu_ops.decode_attention = counting
        try:
            got = ref.paged_attention(q, k, v, meta, 0.2, fast=CpuCAttention())
        finally:
            cpu_ops.decode_attention = orig
        want = ref.paged_attention(q, k, v, AttentionMetadata.build(q_lens, seq_lens, tables, bs), 0.2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [3, 2]


@pytest.mark.parametrize("N,G,H,bs", [(8, 2, 64, 16), (4, 4, 40, 4), (3, 1, 16, 1), (6, 2, 96, 8)])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_attention_matches_float64(N, G, H, bs, threads, isa):
    """Causal query chunks over paged contexts in scattered blocks, against a float64 reference:
    whole prompts, a chunk after cached tokens (prefix hits, earlier chunks), single-token rows,
    a long chunk (scores across several 64-key blocks), grouped heads (1-4 query heads per kv head,
    so row blocks of 4 span queries), head sizes off the vector width, only sequences b0.. written."""
    g = torch.Generator().manual_seed(N * 10 + H + bs)
    q_lens = [1, 7, 5, 1, 150, 3]
    seq_lens = [9, 7, 40, 1, 150, 3]  # sequence 2: 35 cached tokens, then a chunk of 5
    nblocks = sum(-(-s // bs) for s in seq_lens) + 5
    k_cache = torch.randn(nblocks, bs, G, H, generator=g)
    v_cache = torch.randn(nblocks, bs, G, H, generator=g)
    W = max(-(-s // bs) for s in seq_lens)
    perm = torch.randperm(nblocks, generator=g)
    tables = torch.zeros(len(seq_lens), W, dtype=torch.int32)
    used = 0
    for b, s in enumerate(seq_lens):
        n = -(-s // bs)
        tables[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    qsl = torch.tensor([0] + list(torch.cumsum(torch.tensor(q_lens), 0)), dtype=torch.int32)
    T = int(qsl[-1])
    q = torch.randn(T, N, H, generator=g)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = torch.full((T, N, H), 7.0)
    scale = H ** -0.5
    with _threads(threads):
        assert cpu_ops.decode_attention_fits(q, k_cache, v_cache, tables, lens)
        cpu_ops.prefill_attention(q, k_cache, v_cache, tables, lens, qsl, 1, len(seq_lens), out, scale)
    assert (out[:int(qsl[1])] == 7.0).all()  # sequence 0 (before b0) untouched
    for b in range(1, len(seq_lens)):
        s, ql, q0 = seq_lens[b], q_lens[b], int(qsl[b])
        pos = torch.arange(s)
        slots = tables[b, pos // bs].long() * bs + pos % bs
        kq = k_cache.flatten(0, 1)[slots].double().repeat_interleave(N // G, dim=1)  # (s, N, H)
        vq = v_cache.flatten(0, 1)[slots].double().repeat_interleave(N // G, dim=1)
        sc = torch.einsum("inh,snh->nis", q[q0:q0 + ql].double(), kq) * scale  # (N, ql, s)
        visible = torch.arange(s)[None, :] <= (s - ql + torch.arange(ql))[:, None]
        p = torch.softmax(sc.masked_fill(~visible, float("-inf")), dim=-1)
        ref = torch.einsum("nis,snh->inh", p, vq)
        torch.testing.assert_close(out[q0:q0 + ql].double(), ref, rtol=1e-5, atol=1e-5)


def test_reference_backend_takes_it_for_prefill_chunks(isa):
    """The cpu_c attention backend runs a step's prefill chunks (after its decodes) in one C call
    and gives what the torch backend's per-sequence SDPA path gives (which runs no C kernel)."""
    from attention.backends import reference as ref
    from attention.metadata import AttentionMetadata

    g = torch.Generator().manual_seed(3)
    nb, bs, G, N, H = 16, 4, 2, 4, 32
    k = torch.randn(nb, bs, G, H, generator=g)
    v = torch.randn(nb, bs, G, H, generator=g)
    calls = []
    orig = cpu_ops.prefill_attention

    def counting(*a):
        calls.append(a[6])  # b0: the first sequence after the decodes
        return orig(*a)

    q_lens, seq_lens, tables = [1, 3, 6], [6, 7, 6], [[3, 7], [1, 4], [9, 12]]
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, bs)
    q = torch.randn(sum(q_lens), N, H, generator=g)
    cpu_ops.prefill_attention = counting
    try:
        got = ref.paged_attention(q, k, v, meta, 0.2, fast=CpuCAttention())
        want = ref.paged_attention(q, k, v, AttentionMetadata.build(q_lens, seq_lens, tables, bs), 0.2)
    finally:
        cpu_ops.prefill_attention = orig
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [1]


@pytest.mark.parametrize("M,K,N", [(1, 576, 576), (3, 40, 17), (2, 88, 33), (16, 64, 96), (5, 17, 1030)])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_bf16_weight_matches_float64(M, K, N, threads, isa, monkeypatch):
    """Decode rows over a bf16 weight (the weight-row prefetch runs past tile ends and the row tail
    N % 4 is taken; K's whole 32-value chunks take the even/odd path, then a 16-value step and a
    masked tail: K = 40, 88, 17), and the cpu_c linear backend routes such calls to it, bias included."""
    from moe_serve.kernels import cpu_gemm
    from moe_serve.kernels.linear import CpuCLinear

    monkeypatch.setattr(cpu_gemm, "cpu_has_half_matmul", lambda: True)  # torch's bf16 GEMM for prefill rows
    linear = CpuCLinear()

    g = torch.Generator().manual_seed(M * K + N)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).bfloat16()
    x = torch.randn(M, K, generator=g)
    b = torch.randn(N, generator=g).bfloat16()
    with _threads(threads):
        assert cpu_ops.linear_fits(x, w) and cpu_ops.linear_fits(x.bfloat16(), w)
        got = cpu_ops.linear(x, w)
        pub = linear(x.bfloat16(), w, b)
    ref = x.double() @ w.double().T
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    assert pub.dtype == torch.bfloat16
    want = (x.bfloat16().double() @ w.double().T + b.double())
    torch.testing.assert_close(pub.double(), want, rtol=1e-2, atol=1e-2)  # one bf16 rounding of the output
    assert not cpu_ops.linear_fits(torch.randn(cpu_ops.LINEAR_MAX_ROWS + 1, K), w)  # prefill rows: torch's GEMM


@pytest.mark.parametrize("M,K,N", [(17, 40, 16), (48, 100, 200), (96, 512, 576), (33, 17, 8)])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_bf16_panels_where_torch_has_no_bf16_matmul(M, K, N, threads, isa, monkeypatch):
    """Where torch's bf16 GEMMs have no matrix instructions (an AVX2 CPU: they would widen the whole
    weight per call), rows past the dot-product tiles take the panel kernel over the bf16 weight,
    each block of 8 rows widened once (K off the vector width: a masked tail; partial panels; a
    bias), up to LINEAR_PANEL_MAX_ROWS rows and N % 8 == 0; where they have them, torch keeps those."""
    from moe_serve.kernels import cpu_gemm
    from moe_serve.kernels.linear import CpuCLinear

    monkeypatch.setattr(cpu_gemm, "cpu_has_half_matmul", lambda: False)
    g = torch.Generator().manual_seed(M * K + N)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).bfloat16()
    x = torch.randn(M, K + 8, generator=g)[:, 5:5 + K]  # rows K + 8 apart
    b = torch.randn(N, generator=g).bfloat16()
    calls = []
    orig = cpu_ops.linear
    monkeypatch.setattr(cpu_ops, "linear", lambda *a: calls.append(a[0].shape) or orig(*a))
    with _threads(threads):
        assert cpu_ops.linear_fits(x, w)
        got = orig(x, w, b)
        pub = CpuCLinear()(x, w, b)
    ref = x.double() @ w.double().T + b.double()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pub.double(), ref, rtol=1e-5, atol=1e-5)
    assert calls == [x.shape]  # the backend ran the C kernel
    assert not cpu_ops.linear_fits(torch.randn(cpu_ops.LINEAR_PANEL_MAX_ROWS + 1, K), w)
    assert not cpu_ops.linear_fits(torch.randn(M, K), torch.randn(N + 1, K).bfloat16())  # N % 8
    monkeypatch.setattr(cpu_gemm, "cpu_has_half_matmul", lambda: True)
    assert not cpu_ops.linear_fits(x, w)


@pytest.mark.parametrize("M,K,N", [(1, 512, 512), (4, 40, 17), (5, 64, 96), (17, 33, 40), (48, 100, 8),
                                   (96, 128, 200)])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_float32_weight_matches_float64(M, K, N, threads, isa):
    """Float32 weights: the dot-product tiles up to 4 rows (any N), the panel kernel from 5 to 96
    rows (N % 8 == 0; partial panels, K off the vector width, more rows than threads have blocks),
    strided input rows and a bias; the cpu_c linear backend routes to it; prefill rows and N % 8 != 0 above
    4 rows stay with torch."""
    from moe_serve.kernels.linear import CpuCLinear

    linear = CpuCLinear()

    g = torch.Generator().manual_seed(M * K + N)
    w = torch.randn(N, K, generator=g) * K ** -0.5
    x = torch.randn(M, K + 8, generator=g)[:, 3:3 + K]  # rows K + 8 apart
    b = torch.randn(N, generator=g)
    with _threads(threads):
        assert cpu_ops.linear_fits(x, w)
        got = cpu_ops.linear(x, w, b)
        pub = linear(x, w, b)
    ref = x.double() @ w.double().T + b.double()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pub.double(), ref, rtol=1e-5, atol=1e-5)
    assert not cpu_ops.linear_fits(torch.randn(cpu_ops.LINEAR_PANEL_MAX_ROWS + 1, K), w)  # oneDNN's
    assert not cpu_ops.linear_fits(torch.randn(5, K), torch.randn(17, K))  # panel rows need N % 8 == 0


@pytest.mark.parametrize("hd,rot,norm", [(64, 64, True), (64, 64, False), (128, 64, True), (40, 24, False)])
@pytest.mark.parametrize("threads", [1, 2])
def test_norm_rope_matches_float64(hd, rot, norm, threads, isa):
    """Per-head RMSNorm and RoPE of q/k in one pass against a float64 rotate_half reference: token
    rows strided (q as a slice of a wider projection), partial rotary (rot < hd), odd positions."""
    from moe_serve.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(hd + rot)
    T, nh, P = 300, 4, 512
    wide = torch.randn(T, nh * hd + 24, generator=g)
    x = wide[:, 8:8 + nh * hd].view(T, nh, hd)  # rows nh * hd + 24 apart
    w = torch.rand(hd, generator=g) + 0.5 if norm else None
    pos = torch.randint(0, P, (T,), generator=g)
    rope = RotaryEmbedding(rot, {"rope_theta": 10000.0, "rope_type": "default"}, P)
    cos, sin = rope.tables(torch.device("cpu"))
    with _threads(threads):
        assert cpu_ops.norm_rope_fits(x, rot, cos, w)
        got = cpu_ops.norm_rope(x, cos, sin, pos, w, 1e-6)
    xd = x.double()
    if norm:
        xd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    freqs = (pos.float()[:, None] * rope.inv_freq[None]).double()  # the model's float32 angles
    c, s = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
    xr = xd[..., :rot]
    half = rot // 2
    rotated = xr * c + torch.cat([-xr[..., half:], xr[..., :half]], -1) * s
    ref = torch.cat([rotated, xd[..., rot:]], -1)
    assert got.shape == (T, nh, hd) and got.is_contiguous()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=2e-5)


def test_norm_rope_refuses_positions_outside_the_table(isa):
    from moe_serve.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(16, {"rope_theta": 10000.0, "rope_type": "default"}, 32)
    cos, sin = rope.tables(torch.device("cpu"))
    x = torch.randn(3, 2, 16)
    with pytest.raises(IndexError, match="32 positions"):
        cpu_ops.norm_rope(x, cos, sin, torch.tensor([0, 31, 32]))
    assert not cpu_ops.norm_rope_fits(x, 16, cos, torch.ones(8))  # a weight of the wrong size
    assert not cpu_ops.norm_rope_fits(x.double(), 16, cos)


def test_models_forward_runs_the_kernels(checkpoints):
    """A Qwen3-MoE prefill and decode on the CPU reach each C kernel the model forward is meant to
    use (their numbers are checked against transformers in tests/models): the experts' panel path,
    prefill and decode attention, q/k norm with RoPE, and the float32 linear layers."""
    from moe_serve import LLM, SamplingParams

    # eager: the wrappers are counted (a CPU graph replay calls the library directly; its own test
    # is tests/unit/test_cpu_graph.py)
    llm = LLM(checkpoints["qwen3_moe"], dtype="float32", show_progress=False, enforce_eager=True)
    calls = {}
    names = ("prefill_attention", "decode_attention", "norm_rope", "linear")
    origs = {n: getattr(cpu_ops, n) for n in names}

    def counting(name):
        def f(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return origs[name](*a, **k)
        return f

    ran = cpu_ops.panel_groups_run()
    for n in names:
        setattr(cpu_ops, n, counting(n))
    try:
        llm.generate([{"prompt_token_ids": list(range(3, 3 + 150))}], SamplingParams(max_tokens=3, ignore_eos=True))
    finally:
        for n in names:
            setattr(cpu_ops, n, origs[n])
    assert cpu_ops.panel_groups_run() > ran  # 150 tokens x top-3 over 8 experts: panels
    assert all(calls.get(n, 0) > 0 for n in names), calls


def test_bf16_model_prefill_through_the_bf16_panels_matches_transformers(checkpoints, tmp_path, monkeypatch):
    """A bfloat16 Qwen3-MoE on a CPU whose torch has no bf16 matrix instructions: its weights stay
    bf16, a 150-token prefill runs the experts through the panel kernel over them, and the linear
    layers' 150 rows through torch with the weight widened (not the float32 activations rounded to
    bf16), all in float32 activations: the last token's log-probs equal transformers' float32
    forward over the same bf16 checkpoint to float32 rounding."""
    import shutil

    from transformers import AutoModelForCausalLM

    from moe_serve import LLM, SamplingParams
    from moe_serve.kernels import cpu_gemm

    src = checkpoints["qwen3_moe"]
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(tmp_path)
    for f in os.listdir(src):
        if "token" in f:
            shutil.copy(os.path.join(src, f), tmp_path)
    monkeypatch.setattr(cpu_gemm, "cpu_has_half_matmul", lambda: False)
    llm = LLM(str(tmp_path), dtype="bfloat16", kv_cache_memory=1 << 22, show_progress=False)
    assert llm.engine.cfg.activation_dtype == torch.float32
    experts = [m for m in llm.engine.runner.model.modules() if hasattr(m, "w13")]
    assert experts and all(m.w13.dtype == torch.bfloat16 for m in experts)
    prompt = [(7 * i + 3) % 500 + 4 for i in range(150)]
    ran = cpu_ops.panel_groups_run()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    assert cpu_ops.panel_groups_run() > ran  # 150 tokens x top-k over 8 experts: bf16 panels
    oracle = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(oracle(torch.tensor([prompt])).logits[0, -1].double(), -1)
    ours = out[0].outputs[0].logprobs[0]
    assert len(ours) >= 5
    for t, lp in ours.items():
        assert abs(lp.logprob - float(ref[t])) < 1e-4, (t, lp.logprob, float(ref[t]))


@pytest.mark.parametrize("T,E,K", [(1, 16, 2), (5, 8, 1), (3, 128, 8), (2, 64, 64), (4, 6, 6)])
@pytest.mark.parametrize("over_topk", [True, False])
def test_topk_softmax_matches_float64(T, E, K, over_topk, isa, monkeypatch):
    """The routers' choice in one C call: each row's K largest logits in order (ties kept in expert
    order: a row with repeated values), weighted by a float64 softmax over those K or the whole row;
    the cpu_c linear backend routes routers to it, and a K it cannot take is refused."""
    from expert_parallel.runtime.router import SoftmaxTopKRouter
    from moe_serve.kernels.linear import CpuCLinear

    g = torch.Generator().manual_seed(T * E + K)
    logits = torch.randn(T, E, generator=g) * 3
    logits[-1, ::2] = 0.5  # ties in the last row
    w, ids = cpu_ops.topk_softmax(logits, K, over_topk)
    l64 = logits.double()
    for t in range(T):
        want = sorted(range(E), key=lambda e: (-l64[t, e].item(), e))[:K]
        assert ids[t].tolist() == want
        p = torch.softmax(l64[t, want] if over_topk else l64[t], 0)
        torch.testing.assert_close(w[t].double(), p if over_topk else p[want], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="k=65"):
        cpu_ops.topk_softmax(torch.randn(1, 80), 65, True)
    assert not cpu_ops.topk_softmax_fits(torch.randn(1, 80), 65) and not cpu_ops.topk_softmax_fits(logits, E + 1)
    # A router bound to the backend chooses in C, as the unbound one (torch) does.
    router = SoftmaxTopKRouter(32, E, K, renormalize=over_topk)
    torch.nn.init.normal_(router.weight, generator=g)
    x = torch.randn(T, 32, generator=g)
    w_torch, ids_torch = router(x)
    router.ops = CpuCLinear()
    calls = []
    c_call = cpu_ops.topk_softmax
    monkeypatch.setattr(cpu_ops, "topk_softmax", lambda *a: calls.append(a) or c_call(*a))
    w_c, ids_c = router(x)
    assert len(calls) == 1
    assert torch.equal(ids_c, ids_torch)
    torch.testing.assert_close(w_c, w_torch, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("G,H,Hv", [(2, 64, 64), (1, 16, 32)])
def test_write_kv_matches_index_copy(G, H, Hv, isa, monkeypatch):
    """New keys and values (rows of a wider qkv output: strided) land in their slots as torch's
    index_copy_ puts them, the other slots untouched; a slot past the cache is refused with nothing
    written; the cpu_c attention backend takes such writes."""
    from attention.backends import CpuCAttention, TorchAttention

    g = torch.Generator().manual_seed(G * H + Hv)
    nb, bs, T = 5, 4, 7
    qkv = torch.randn(T, 3 * G * max(H, Hv), generator=g)
    k = qkv[:, :G * H].view(T, G, H)
    v = torch.randn(T, 2 * G * Hv, generator=g)[:, G * Hv:].view(T, G, Hv)  # rows another stride apart
    slots = torch.randperm(nb * bs, generator=g)[:T]
    kc, vc = torch.randn(nb, bs, G, H, generator=g), torch.randn(nb, bs, G, Hv, generator=g)
    want, got, via = [(kc.clone(), vc.clone()) for _ in range(3)]
    TorchAttention().write_kv(k, v, *want, slots)
    assert cpu_ops.write_kv_fits(k, v, *got, slots)
    cpu_ops.write_kv(k, v, *got, slots)
    calls = []
    c_call = cpu_ops.write_kv
    monkeypatch.setattr(cpu_ops, "write_kv", lambda *a: calls.append(1) or c_call(*a))
    CpuCAttention().write_kv(k, v, *via, slots)
    assert calls == [1]
    for a, b in ((want, got), (want, via)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    before = [c.clone() for c in got]
    with pytest.raises(IndexError, match="outside the cache's 20"):
        cpu_ops.write_kv(k, v, *got, torch.cat([slots[:-1], torch.tensor([nb * bs])]))
    assert torch.equal(before[0], got[0]) and torch.equal(before[1], got[1])
    assert not cpu_ops.write_kv_fits(k, v, got[0].bfloat16(), got[1], slots)


def test_mark_slots_matches_the_torch_marks(isa, monkeypatch):
    """The speed-of-light meter's marks in one C call: the slots the ids route to, ids of -1 (or
    below) into entry 0, as the torch backend's three ops mark them; an id past the slots is
    refused with nothing marked; the cpu_c experts backend takes contiguous int64 ids."""
    from moe_serve.kernels.grouped_gemm import CpuCExperts, TorchExperts

    g = torch.Generator().manual_seed(3)
    S = 12
    ids = torch.randint(-2, S, (9, 4), generator=g)
    ids[0, 0] = -1
    want, got, via = (torch.zeros(S + 1, dtype=torch.int32) for _ in range(3))
    TorchExperts().mark_slots(want, ids)
    assert cpu_ops.mark_slots_fits(got, ids)
    cpu_ops.mark_slots(got, ids)
    calls = []
    c_call = cpu_ops.mark_slots
    monkeypatch.setattr(cpu_ops, "mark_slots", lambda *a: calls.append(1) or c_call(*a))
    CpuCExperts().mark_slots(via, ids)
    assert calls == [1] and torch.equal(got, want) and torch.equal(via, want)
    assert want[0] == 1 and want.sum() == 1 + len(set(ids[ids >= 0].tolist()))
    fresh = torch.zeros(S + 1, dtype=torch.int32)
    with pytest.raises(IndexError, match="past the 12 slots"):
        cpu_ops.mark_slots(fresh, torch.tensor([3, S]))
    assert not fresh.any()
    assert not cpu_ops.mark_slots_fits(fresh, ids.int()) and not cpu_ops.mark_slots_fits(fresh, ids.T)
