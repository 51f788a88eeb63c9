"""The C attention kernels (moe_serve/kernels/cpu_ops/attention.c, fp8.h) over FP8 key/value caches
(--kv-cache-dtype fp8_e4m3 / fp8_e5m2), on every ISA of vec.h this CPU executes: writes bit-identical
to torch's `x.clamp(-max, max).to(dtype)` over every float32 rounding case, reads that widen every
byte exactly to torch's float32, and decode and prefill attention against a float64 reference over
the torch-widened cache. tests/kernels/test_cpu_ops_driver.py checks the same per ISA in C (aarch64
under qemu included)."""
from __future__ import annotations


import pytest
import torch

from moe_serve.kernels import cpu_ops
from tests.kernels.cpu_isa import isa  # noqa: F401  (a fixture: each test once per ISA build)
from tests.kernels.cpu_isa import threads as _threads

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C kernels did not build here (no C compiler)")

FP8 = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}


def _rounding_cases() -> torch.Tensor:
    """float32 values covering every rounding case of both formats: each of the 65536 top halves of
    the bit pattern (sign, exponent, the mantissa's top 7 bits: every FP8 code, every round bit, both
    signs, zeros, float32 subnormals, inf, NaN) with low halves exact ties, just off them and one
    ulp away; then the torch-widened FP8 values themselves and the midpoints between neighbours."""
    hi = torch.arange(65536, dtype=torch.int64) << 16
    lows = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x5A5A], dtype=torch.int64)
    bits = (hi[:, None] | lows[None, :]).flatten()
    x = (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)
    extra = []
    for dt, _ in FP8.values():
        v = torch.arange(256, dtype=torch.uint8).view(dt).float()
        v = v[torch.isfinite(v)].unique()
        extra += [v, (v[1:].double() + v[:-1].double()).div(2).float()]
    return torch.cat([x, *extra])


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_write_kv_fp8_is_torchs_clamp_then_cast(fmt, isa):
    """write_kv into an FP8 cache stores exactly torch's bytes for every finite input (ties to even,
    subnormals, saturation at the finite max, infinities saturated too), NaN as a NaN."""
    dt, mx = FP8[fmt]
    x = _rounding_cases()
    H, G = 61, 2  # rows of 122 bytes: the vectorised conversion and its tail
    T = -(-x.numel() // (G * H))
    x = torch.cat([x, torch.zeros(T * G * H - x.numel())]).view(T, G, H)
    v = -x.flip(0)
    bs = 16
    nb = -(-T // bs)
    kc, vc = torch.zeros(nb, bs, G, H, dtype=dt), torch.zeros(nb, bs, G, H, dtype=dt)
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(0))[:T]
    assert cpu_ops.write_kv_fits(x, v, kc, vc, slots)
    cpu_ops.write_kv(x, v, kc, vc, slots)
    for src, cache in ((x, kc), (v, vc)):
        got = cache.view(nb * bs, G, H)[slots]
        want = src.clamp(-mx, mx).to(dt)
        nan = src.isnan()
        assert got.float()[nan].isnan().all()
        assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])


@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("flush_denormal", [False, True])
def test_fp8_reads_widen_every_byte_exactly(fmt, flush_denormal, isa):
    """A context of one key: the output is its value row (weight exactly 1), so decode and prefill
    give each of the 256 bytes widened (vector lanes and tails: rows of 256 and 23) bit for bit as
    torch widens it, inf and NaN included; also with MXCSR's flush-to-zero / denormals-are-zero set."""
    dt, _ = FP8[fmt]
    codes = torch.arange(256, dtype=torch.uint8)
    vc = torch.stack([codes, codes.roll(7)]).view(dt).view(2, 1, 1, 256)
    kc = torch.ones(2, 1, 1, 8, dtype=dt)
    q = torch.randn(2, 1, 8)
    tables = torch.tensor([[1], [0]], dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    assert torch.set_flush_denormal(flush_denormal) or not flush_denormal  # x86 and aarch64 have the mode
    try:
        with _threads(1):
            got = cpu_ops.decode_attention(q, kc, vc, tables, lens, 0.5)
            pre = torch.full((2, 1, 256), 7.0)
            cpu_ops.prefill_attention(q, kc, vc, tables, lens, torch.tensor([0, 1, 2], dtype=torch.int32), 0, 2, pre,
                                      0.5)
            tail = cpu_ops.decode_attention(q, kc, vc[..., :23].contiguous(), tables, lens, 0.5)
    finally:
        torch.set_flush_denormal(False)
    want = vc.float().view(2, 256)[[1, 0]]
    for out in (got.view(2, 256), pre.view(2, 256), tail.view(2, 23)):
        w = want[:, :out.shape[1]]
        nan = w.isnan()
        assert torch.equal(out.isnan(), nan)
        assert torch.equal(out[~nan], w[~nan])  # exact (-0 comes out +0: 1 * -0 added to a zero accumulator)


def _fp8_cache(shape, dt, mx, g) -> torch.Tensor:
    """Values over several binades (FP8 subnormals and the saturated max included), as FP8."""
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-10, 4, shape, generator=g).float())
    return (x * mx / 8).clamp(-mx, mx).to(dt)


def _reference(q_NH, k_cache, v_cache, table, s, bs, N, G, scale, visible=None):
    """softmax(scale q k^T) v in float64 over the torch-widened cache rows of one sequence."""
    pos = torch.arange(s)
    slots = table[pos // bs].long() * bs + pos % bs
    kq = k_cache.flatten(0, 1)[slots].double().repeat_interleave(N // G, dim=1)  # (s, N, H)
    vq = v_cache.flatten(0, 1)[slots].double().repeat_interleave(N // G, dim=1)
    sc = torch.einsum("inh,snh->nis", q_NH.double(), kq) * scale
    if visible is not None:
        sc = sc.masked_fill(~visible, float("-inf"))
    return torch.einsum("nis,snh->inh", torch.softmax(sc, dim=-1), vq)


@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("N,G,H,Hv,bs", [(8, 2, 64, 64, 16), (4, 4, 40, 24, 4), (12, 1, 16, 80, 1), (3, 3, 17, 33, 3)])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_fp8_matches_float64(fmt, N, G, H, Hv, bs, threads, isa):
    """One query per sequence over FP8 caches in scattered blocks (contexts of 1, a block, several
    blocks and a tail, 37), grouped heads (4 query heads a key: the 4-row score path), head sizes
    off the vector width, value rows wider and narrower than the keys."""
    dt, mx = FP8[fmt]
    g = torch.Generator().manual_seed(N * 100 + H + Hv)
    seq = [1, bs, 3 * bs + 1, 37]
    nblocks = 64
    k_cache = _fp8_cache((nblocks, bs, G, H), dt, mx, g)
    v_cache = _fp8_cache((nblocks, bs, G, Hv), dt, mx, g)
    W = max(-(-s // bs) for s in seq)
    tables = torch.stack([torch.randperm(nblocks, generator=g)[:W] for _ in seq]).to(torch.int32)
    q = torch.randn(len(seq), N, H, generator=g) / mx * 8
    scale = H ** -0.5
    lens = torch.tensor(seq, dtype=torch.int32)
    with _threads(threads):
        assert cpu_ops.decode_attention_fits(q, k_cache, v_cache, tables, lens)
        got = cpu_ops.decode_attention(q, k_cache, v_cache, tables, lens, scale)
    for b, s in enumerate(seq):
        ref = _reference(q[b:b + 1], k_cache, v_cache, tables[b], s, bs, N, G, scale)[0]
        torch.testing.assert_close(got[b].double(), ref, rtol=1e-5, atol=1e-5 * mx / 8)


@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("N,G,H,Hv,bs", [(8, 2, 64, 64, 16), (3, 1, 40, 24, 4), (6, 2, 17, 72, 3)])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_attention_fp8_matches_float64(fmt, N, G, H, Hv, bs, threads, isa):
    """Causal query chunks over FP8 caches: whole prompts, a chunk after cached tokens, one-token
    rows, a long chunk; only sequences b0.. written."""
    dt, mx = FP8[fmt]
    g = torch.Generator().manual_seed(N * 10 + H + bs)
    q_lens, seq_lens = [1, 7, 5, 1, 90, 3], [9, 7, 40, 1, 90, 3]
    nblocks = sum(-(-s // bs) for s in seq_lens) + 5
    k_cache = _fp8_cache((nblocks, bs, G, H), dt, mx, g)
    v_cache = _fp8_cache((nblocks, bs, G, Hv), dt, mx, g)
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
    q = torch.randn(T, N, H, generator=g) / mx * 8
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = torch.full((T, N, Hv), 7.0)
    scale = H ** -0.5
    with _threads(threads):
        assert cpu_ops.decode_attention_fits(q, k_cache, v_cache, tables, lens)
        cpu_ops.prefill_attention(q, k_cache, v_cache, tables, lens, qsl, 1, len(seq_lens), out, scale)
    assert (out[:int(qsl[1])] == 7.0).all()
    for b in range(1, len(seq_lens)):
        s, ql, q0 = seq_lens[b], q_lens[b], int(qsl[b])
        visible = torch.arange(s)[None, :] <= (s - ql + torch.arange(ql))[:, None]
        ref = _reference(q[q0:q0 + ql], k_cache, v_cache, tables[b], s, bs, N, G, scale, visible)
        torch.testing.assert_close(out[q0:q0 + ql].double(), ref, rtol=1e-5, atol=1e-5 * mx / 8)


def test_fits_take_fp8_caches_of_one_format_only(isa):
    """Both caches FP8 of one format (or both float32) with float32 queries and rows; mixed formats,
    bf16 caches and bf16 rows go elsewhere."""
    q, rows = torch.randn(2, 4, 16), torch.randn(3, 2, 16)
    tables, lens, slots = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32), torch.arange(3)
    e4, e5 = (torch.zeros(2, 4, 2, 16, dtype=dt) for dt in (torch.float8_e4m3fn, torch.float8_e5m2))
    f32, bf16 = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16)
    for k, v, ok in ((e4, e4, True), (e5, e5, True), (f32, f32, True), (e4, e5, False), (e4, f32, False),
                     (bf16, bf16, False)):
        assert cpu_ops.decode_attention_fits(q, k, v, tables, lens) is ok
        assert cpu_ops.write_kv_fits(rows, rows, k, v, slots) is ok
    assert not cpu_ops.decode_attention_fits(q.bfloat16(), e4, e4, tables, lens)
    assert not cpu_ops.write_kv_fits(rows.bfloat16(), rows.bfloat16(), e4, e4, slots)


def test_mismatched_caches_are_refused_by_name(isa):
    """Called without the fits check, the wrappers refuse caches the kernels do not read, naming their
    dtypes, before any C call."""
    q, rows = torch.randn(1, 2, 16), torch.randn(1, 1, 16)
    e4, f32 = torch.zeros(1, 4, 1, 16, dtype=torch.float8_e4m3fn), torch.zeros(1, 4, 1, 16)
    tables, lens, qsl = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.tensor(
        [0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="decode_attention: key/value caches of torch.float8_e4m3fn / torch.float32"):
        cpu_ops.decode_attention(q, e4, f32, tables, lens, 1.0)
    with pytest.raises(ValueError, match="prefill_attention: key/value caches of torch.bfloat16"):
        cpu_ops.prefill_attention(q, f32.bfloat16(), f32.bfloat16(), tables, lens, qsl, 0, 1, torch.zeros(1, 2, 16),
                                  1.0)
    with pytest.raises(ValueError, match="write_kv: key/value caches of torch.float32 / torch.float8_e4m3fn"):
        cpu_ops.write_kv(rows, rows, f32, e4, torch.zeros(1, dtype=torch.int64))


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_fp8_kernels_are_the_float32_kernels_on_the_widened_cache(fmt, isa):
    """Widening is exact and the arithmetic after it the float32 path's: decode and prefill over an FP8
    cache give bit for bit what they give over torch's float32 widening of it (grouped and ungrouped
    heads, tails, contexts across blocks, 2 threads)."""
    dt, mx = FP8[fmt]
    g = torch.Generator().manual_seed(7)
    for N, G, H, Hv, bs in ((8, 2, 64, 48, 16), (3, 1, 33, 20, 3)):
        k8, v8 = _fp8_cache((40, bs, G, H), dt, mx, g), _fp8_cache((40, bs, G, Hv), dt, mx, g)
        tables = torch.randperm(40, generator=g)[:36].view(3, 12).to(torch.int32)
        lens = torch.tensor([1, 5 * bs + 2, 12 * bs], dtype=torch.int32)
        q = torch.randn(3, N, H, generator=g) / mx * 8
        qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
        with _threads(2):
            outs = []
            for k, v in ((k8, v8), (k8.float(), v8.float())):
                pre = torch.zeros(3, N, Hv)
                cpu_ops.prefill_attention(q, k, v, tables, lens, qsl, 0, 3, pre, 0.3)
                outs.append((cpu_ops.decode_attention(q, k, v, tables, lens, 0.3), pre))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
