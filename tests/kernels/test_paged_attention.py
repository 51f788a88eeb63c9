"""Triton paged attention and KV writes against the references, evaluated in float64.

Without a GPU the kernels run under the Triton interpreter on the CPU (TRITON_INTERPRET=1 is set
before the kernel modules are imported; see conftest.py); with one they are compiled. Block tables
come from a shuffled pool larger than needed (holes), sequences may share prefix blocks, contexts
span many blocks, and query heads outnumber kv heads (GQA).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules: see conftest.py

import pytest

from attention.backends import reference as ref
from attention.backends import triton_paged as tp
from attention.metadata import AttentionMetadata

DEVICE = "cpu" if tp.INTERPRETED or not torch.cuda.is_available() else "cuda"
# Norm-wise relative error against float64. The bf16 bound allows for the interpreter truncating
# fp32 -> bf16 (GPUs round to nearest) on the probabilities and the output.
RTOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
NUM_BLOCKS = 64


def make_meta(query_lens, seq_lens, block_size, gen, shared_prefix_blocks=0):
    """Metadata whose tables draw blocks from a shuffled pool; with shared_prefix_blocks > 0 every
    sequence starts with the same blocks (a prefix-cache hit), the rest are private."""
    pool = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    shared, pool = pool[:shared_prefix_blocks], pool[shared_prefix_blocks:]
    tables = []
    for s in seq_lens:
        n = -(-s // block_size) - shared_prefix_blocks
        tables.append(shared + pool[:n])
        pool = pool[n:]
    return AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=DEVICE)


def rel_err(out, expect):
    return ((out.double().cpu() - expect).norm() / expect.norm()).item()


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


# ---- KV writes ------------------------------------------------------------------------------------

def test_write_kv_and_latent_match_reference():
    gen = torch.Generator().manual_seed(0)
    bs, G, H, Hv, T = 4, 3, 10, 6, 9
    # Non-contiguous sources: views of a fused projection, as models produce them.
    # Same dtype as the cache: the interpreter truncates fp32 -> bf16 where torch rounds.
    kv = rand(gen, T, G, H + Hv, dtype=torch.bfloat16)
    k, v = kv[..., :H], kv[..., H:]
    slots = torch.randperm(NUM_BLOCKS * bs, generator=gen)[:T].to(DEVICE)
    caches = [torch.full((NUM_BLOCKS, bs, G, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
              for d in (H, Hv)]
    expect = [c.clone() for c in caches]
    tp.write_kv(k, v, *caches, slots)
    ref.write_kv(k, v, *expect, slots)
    for got, want in zip(caches, expect):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())

    lat = rand(gen, T, 20)
    cache = torch.full((NUM_BLOCKS, bs, 20), float("nan"), device=DEVICE)
    want = cache.clone()
    tp.write_latent(lat, cache, slots)
    ref.write_latent(lat, want, slots)
    assert torch.equal(cache.nan_to_num(), want.nan_to_num()) and torch.equal(cache.isnan(), want.isnan())
    # Padding tokens (slot -1) are skipped, not written anywhere.
    before = cache.clone()
    tp.write_latent(lat[:2], cache, torch.tensor([-1, -1], device=DEVICE))
    assert torch.equal(cache.nan_to_num(), before.nan_to_num())


# ---- paged attention ------------------------------------------------------------------------------

CASES = {
    # name: (query_lens, seq_lens, block_size, N, G, H, Hv, shared prefix blocks, num_splits)
    "decode_gqa_many_blocks": ([1, 1, 1], [3, 70, 133], 8, 8, 2, 32, 32, 0, None),
    "decode_split_k": ([1, 1], [150, 37], 16, 4, 1, 24, 24, 0, 4),
    "decode_shared_prefix_split": ([1, 1, 1], [40, 41, 66], 5, 6, 3, 16, 20, 3, 3),
    "prefill_causal": ([19], [19], 16, 4, 2, 32, 32, 0, None),
    "chunked_prefill_mixed": ([7, 1, 12], [30, 48, 12], 8, 8, 4, 20, 16, 0, None),
    "chunked_prefill_shared_split": ([9, 3], [33, 27], 8, 2, 2, 16, 16, 2, 2),
    # 128-wide heads (Qwen3, Mixtral)
    "chunked_prefill_head_dim_128": ([21, 1], [50, 70], 16, 8, 2, 128, 128, 0, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_matches_reference(case, dtype):
    qlens, slens, bs, N, G, H, Hv, shared, splits = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    meta = make_meta(qlens, slens, bs, gen, shared)
    k_cache = rand(gen, NUM_BLOCKS, bs, G, H, dtype=dtype)
    v_cache = rand(gen, NUM_BLOCKS, bs, G, Hv, dtype=dtype)
    q = rand(gen, sum(qlens), N, H, dtype=dtype)
    out = torch.full((sum(qlens), N, Hv), float("nan"), dtype=dtype, device=DEVICE)
    got = tp.paged_attention(q, k_cache, v_cache, meta, H ** -0.5, num_splits=splits, out_TNH=out)
    expect = ref.paged_attention(q.double().cpu(), k_cache.double().cpu(), v_cache.double().cpu(),
                                 _cpu(meta), H ** -0.5)
    assert got is out and rel_err(got, expect) < RTOL[dtype]


def test_fp16_decode_with_default_splits():
    gen = torch.Generator().manual_seed(3)
    meta = make_meta([1, 1], [90, 17], 16, gen)
    kc, vc = (rand(gen, NUM_BLOCKS, 16, 2, 16, dtype=torch.float16) for _ in range(2))
    q = rand(gen, 2, 4, 16, dtype=torch.float16)
    got = tp.paged_attention(q, kc, vc, meta, 0.25)
    expect = ref.paged_attention(q.double().cpu(), kc.double().cpu(), vc.double().cpu(), _cpu(meta), 0.25)
    assert rel_err(got, expect) < RTOL[torch.float16]


MLA_CASES = {
    # name: (query_lens, seq_lens, block_size, N, L, R, num_splits)
    "decode": ([1, 1, 1], [9, 64, 100], 16, 4, 64, 16, None),
    "decode_split_many_heads": ([1, 1], [77, 5], 8, 40, 32, 16, 3),
    # 128 heads over one latent (DeepSeek-V3's head count): two 64-head tiles per sequence and split,
    # launched side by side over the same latent rows; with and without split-K.
    "decode_128_heads": ([1, 1, 1], [21, 3, 40], 8, 128, 32, 16, None),
    "decode_128_heads_split": ([1, 1], [45, 9], 8, 128, 32, 16, 3),
    # DeepSeek's latent (512 + 64): the decode tile the GPU compiles (64 heads, 16 keys, 8 warps);
    # 72 heads are two head tiles, the second mostly masked.
    "decode_deepseek_latent_split": ([1, 1], [37, 20], 16, 72, 512, 64, 2),
    "chunked_prefill": ([6, 1], [20, 35], 8, 3, 32, 16, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(MLA_CASES))
def test_mla_paged_attention_matches_reference(case, dtype):
    qlens, slens, bs, N, L, R, splits = MLA_CASES[case]
    gen = torch.Generator().manual_seed(10 + len(case))
    meta = make_meta(qlens, slens, bs, gen)
    cache = rand(gen, NUM_BLOCKS, bs, L + R, dtype=dtype)
    q_lat = rand(gen, sum(qlens), N, L, dtype=dtype)
    q_pe = rand(gen, sum(qlens), N, R, dtype=dtype)
    out = torch.full((sum(qlens), N, L), float("nan"), dtype=dtype, device=DEVICE)
    scale = (L + R) ** -0.5
    got = tp.mla_paged_attention(q_lat, q_pe, cache, meta, scale, num_splits=splits, out_TNL=out)
    expect = ref.mla_paged_attention(q_lat.double().cpu(), q_pe.double().cpu(), cache.double().cpu(),
                                     _cpu(meta), scale)
    assert got is out and rel_err(got, expect) < RTOL[dtype]


def test_empty_batch_returns_empty():
    gen = torch.Generator().manual_seed(4)
    meta = make_meta([], [], 8, gen)
    kc = rand(gen, NUM_BLOCKS, 8, 1, 16)
    assert tp.paged_attention(rand(gen, 0, 2, 16), kc, kc, meta, 1.0).shape == (0, 2, 16)


def _cpu(meta: AttentionMetadata) -> AttentionMetadata:
    """The same metadata with its tensors on the CPU, for the float64 reference."""
    return AttentionMetadata(meta.query_start_loc.cpu(), meta.seq_lens.cpu(), meta.block_tables.cpu(),
                             meta.slot_mapping.cpu(), meta.block_size, meta.query_lens_cpu, meta.seq_lens_cpu,
                             meta.max_query_len, meta.max_seq_len)


# ---- sliding window and attention sinks (GPT-OSS) --------------------------------------------------

def naive_attention(q, k_cache, v_cache, meta, scale, window=None, sinks=None):
    """Token by token in float64: query at position p over keys max(0, p - window + 1) .. p read
    through the block table, each head's sink logit one more term of the softmax denominator."""
    q, k_cache, v_cache = q.double().cpu(), k_cache.double().cpu(), v_cache.double().cpu()
    T, N, _ = q.shape
    G, bs = k_cache.shape[2], k_cache.shape[1]
    out = torch.zeros(T, N, v_cache.shape[-1], dtype=torch.float64)
    t = 0
    for b in range(meta.num_seqs):
        ctx, q_len = meta.seq_lens_cpu[b], meta.query_lens_cpu[b]
        table = meta.block_tables[b].cpu().tolist()
        for i in range(q_len):
            p = ctx - q_len + i
            keys = range(max(0, p - window + 1) if window else 0, p + 1)
            k = torch.stack([k_cache[table[s // bs], s % bs] for s in keys])  # (S, G, H)
            v = torch.stack([v_cache[table[s // bs], s % bs] for s in keys])
            for n in range(N):
                g = n // (N // G)
                s = (k[:, g] @ q[t, n]) * scale
                z = torch.exp(s).sum() + (torch.exp(sinks[n].double().cpu()) if sinks is not None else 0)
                out[t, n] = (torch.exp(s)[:, None] * v[:, g]).sum(0) / z
            t += 1
    return out


WINDOW_CASES = {
    # name: (query_lens, seq_lens, block_size, N, G, H, Hv, shared prefix blocks, num_splits, window, sinks)
    "decode_window_sinks": ([1, 1, 1], [3, 70, 133], 8, 8, 2, 32, 32, 0, None, 20, True),
    "decode_window_sinks_split": ([1, 1], [150, 37], 16, 4, 1, 24, 24, 0, 4, 40, True),
    "decode_sinks_split": ([1, 1], [90, 17], 16, 4, 2, 16, 16, 0, 3, None, True),
    "prefill_window_sinks": ([19], [19], 4, 4, 2, 16, 16, 0, None, 8, True),
    "chunked_prefill_window_mixed": ([1, 1, 7, 12], [30, 9, 48, 12], 4, 8, 4, 20, 16, 0, None, 10, True),
    "chunked_prefill_window_shared": ([9, 3], [33, 27], 8, 2, 2, 16, 16, 2, None, 5, False),
}


@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_window_and_sinks_match_naive(case):
    """Both backends against the token-by-token oracle (the reference's batched decode with a
    per-window block plan, its windowed prefill chunks; the kernel's window-limited key loop, its
    sink term with and without split-K)."""
    qlens, slens, bs, N, G, H, Hv, shared, splits, window, with_sinks = WINDOW_CASES[case]
    gen = torch.Generator().manual_seed(100 + len(case))
    meta = make_meta(qlens, slens, bs, gen, shared)
    dtype = torch.bfloat16 if case == "decode_window_sinks" else torch.float32
    k_cache = rand(gen, NUM_BLOCKS, bs, G, H, dtype=dtype)
    v_cache = rand(gen, NUM_BLOCKS, bs, G, Hv, dtype=dtype)
    q = rand(gen, sum(qlens), N, H, dtype=dtype) * 2
    sinks = (torch.randn(N, generator=gen) * 2).to(DEVICE) if with_sinks else None
    expect = naive_attention(q, k_cache, v_cache, meta, H ** -0.5, window, sinks)
    ours = ref.paged_attention(q.double().cpu(), k_cache.double().cpu(), v_cache.double().cpu(), _cpu(meta),
                               H ** -0.5, sliding_window=window, sinks=None if sinks is None else sinks.cpu())
    assert rel_err(ours, expect) < 1e-10
    got = tp.paged_attention(q, k_cache, v_cache, meta, H ** -0.5, num_splits=splits, sliding_window=window,
                             sinks=sinks)
    assert rel_err(got, expect) < RTOL[dtype]
    # The window and the sinks change the result (the case checks them, not plain attention).
    plain = ref.paged_attention(q.double().cpu(), k_cache.double().cpu(), v_cache.double().cpu(), _cpu(meta),
                                H ** -0.5)
    assert rel_err(plain, expect) > 1e-2


# ---- chunked attention (Llama-4's local layers) -----------------------------------------------------

def dense_chunked_attention(q, k_cache, v_cache, query_lens, seq_lens, tables, scale, chunk, sinks=None):
    """Float64, each sequence's whole context gathered and one (Q, S) mask from the definition: query
    position p sees key position s iff s <= p and s // chunk == p // chunk."""
    q, k_cache, v_cache = q.double().cpu(), k_cache.double().cpu(), v_cache.double().cpu()
    N, G, bs = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    out, t = [], 0
    for q_len, ctx, table in zip(query_lens, seq_lens, tables):
        k = torch.stack([k_cache[table[s // bs], s % bs] for s in range(ctx)])  # (S, G, H)
        v = torch.stack([v_cache[table[s // bs], s % bs] for s in range(ctx)])
        qp = torch.arange(ctx - q_len, ctx)[:, None]
        kp = torch.arange(ctx)[None, :]
        mask = (kp <= qp) & (kp // chunk == qp // chunk)  # (Q, S)
        kv_head = torch.arange(N) // (N // G)
        s = torch.einsum("qnh,sgh->qngs", q[t:t + q_len], k)[:, torch.arange(N), kv_head] * scale  # (Q, N, S)
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double().cpu().view(1, N, 1).expand(q_len, N, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :ctx]
        out.append(torch.einsum("qns,sgh->qngh", p, v)[:, torch.arange(N), kv_head])
        t += q_len
    return torch.cat(out)


CHUNK_CASES = {
    # name: (query_lens, seq_lens, block_size, N, G, H, Hv, num_splits, chunk, sinks, dtype)
    "decode_chunks": ([1, 1, 1, 1], [3, 17, 40, 64], 4, 8, 2, 16, 16, None, 8, False, torch.float32),
    "decode_chunk_split": ([1, 1], [150, 37], 16, 4, 1, 24, 24, 4, 48, False, torch.float32),
    "decode_chunk_bf16": ([1, 1, 1], [9, 70, 133], 8, 8, 2, 32, 32, None, 16, False, torch.bfloat16),
    "prefill_over_chunks": ([19], [19], 4, 4, 2, 16, 16, None, 8, False, torch.float32),
    "chunked_prefill_mixed": ([1, 1, 7, 12], [30, 9, 48, 12], 4, 8, 4, 20, 16, None, 8, False, torch.float32),
    # chunks that do not align with blocks, long prefill tiles crossing chunk starts, sinks
    "unaligned_chunks_sinks": ([1, 5, 70], [23, 29, 100], 4, 4, 2, 16, 16, None, 6, True, torch.float32),
}


@pytest.mark.parametrize("case", list(CHUNK_CASES))
def test_chunked_attention_matches_dense_mask(case):
    """Both backends against the dense float64 chunk mask. Every table entry before the block of
    its sequence's first query's chunk start points at a block of NaNs (what a freed block may hold
    once reused): a backend that read it at all, masked or not, would return NaNs."""
    qlens, slens, bs, N, G, H, Hv, splits, chunk, with_sinks, dtype = CHUNK_CASES[case]
    gen = torch.Generator().manual_seed(200 + len(case))
    tables = make_meta(qlens, slens, bs, gen).block_tables.cpu().tolist()
    tables = [t[:-(-s // bs)] for t, s in zip(tables, slens)]
    stale = NUM_BLOCKS  # one more block, all NaN
    k_cache = torch.cat([rand(gen, NUM_BLOCKS, bs, G, H, dtype=dtype),
                         torch.full((1, bs, G, H), float("nan"), dtype=dtype, device=DEVICE)])
    v_cache = torch.cat([rand(gen, NUM_BLOCKS, bs, G, Hv, dtype=dtype),
                         torch.full((1, bs, G, Hv), float("nan"), dtype=dtype, device=DEVICE)])
    q = rand(gen, sum(qlens), N, H, dtype=dtype) * 2
    sinks = (torch.randn(N, generator=gen) * 2).to(DEVICE) if with_sinks else None
    expect = dense_chunked_attention(q, k_cache, v_cache, qlens, slens, tables, H ** -0.5, chunk, sinks)
    full = AttentionMetadata.build(qlens, slens, tables, bs)
    for t, q_len, ctx in zip(tables, qlens, slens):
        first = (ctx - q_len) // chunk * chunk // bs
        t[:first] = [stale] * first
    meta = AttentionMetadata.build(qlens, slens, tables, bs, device=DEVICE)
    ours = ref.paged_attention(q.double().cpu(), k_cache.double().cpu(), v_cache.double().cpu(), _cpu(meta),
                               H ** -0.5, sinks=None if sinks is None else sinks.cpu(), attention_chunk=chunk)
    assert rel_err(ours, expect) < 1e-10
    got = tp.paged_attention(q, k_cache, v_cache, meta, H ** -0.5, num_splits=splits, sinks=sinks,
                             attention_chunk=chunk)
    assert rel_err(got, expect) < RTOL[dtype]
    # The chunk mask changes the result (full causal attention over the whole context differs).
    plain = ref.paged_attention(q.double().cpu(), k_cache.double().cpu(), v_cache.double().cpu(), full, H ** -0.5,
                                sinks=None if sinks is None else sinks.cpu())
    assert rel_err(plain, expect) > 1e-2


# ---- FP8 caches (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) ----------------------------------------------

FP8 = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8_IDS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def fp8_probe_values(fp8: torch.dtype) -> torch.Tensor:
    """Float32 values that exercise every rounding case of a cast to fp8: each finite FP8 value,
    each midpoint between neighbours (ties, to even) and the float32 values either side of it,
    values past the finite max (saturated), signed zeros and magnitudes far below the smallest
    subnormal, and random values over the whole exponent range."""
    finite = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    finite = finite[torch.isfinite(finite)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    around = torch.cat([mids.nextafter(torch.tensor(1e30)), mids.nextafter(torch.tensor(-1e30))])
    big = FP8[fp8]
    edges = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-44, big * 1.01, -big * 1.01, big * 64, -big * 64, 3e38, -3e38])
    gen = torch.Generator().manual_seed(7)
    scattered = torch.randn(512, generator=gen) * torch.exp2(torch.randint(-30, 20, (512,), generator=gen).float())
    return torch.cat([finite, mids, around, edges, scattered])


def saturating_cast(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """The FP8 contract's stored value: the float input saturated to the finite max, cast (RTNE)."""
    return x.float().clamp(-FP8[fp8], FP8[fp8]).to(fp8)


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fp8", list(FP8), ids=FP8_IDS.get)
def test_fp8_writes_equal_torch_saturating_cast_bit_for_bit(fp8, src_dtype):
    """write_kv and write_latent into FP8 caches store exactly torch's saturating cast of each value
    (every FP8 value, ties, their float32 neighbours, overflow, underflow, signed zeros), leave
    every other slot untouched, and skip padding slots."""
    values = fp8_probe_values(fp8)
    if src_dtype == torch.float16:
        values = values.clamp(-65504, 65504)  # finite half-precision inputs
    G, H, Hv, bs = 3, 37, 21, 5  # odd widths
    T = -(-values.numel() // (G * (H + Hv)))
    vals = torch.cat([values, values[: T * G * (H + Hv) - values.numel()]])
    kv = vals.view(T, G, H + Hv).to(src_dtype).to(DEVICE)
    k, v = kv[..., :H], kv[..., H:]  # views of one projection, as a model makes them
    gen = torch.Generator().manual_seed(8)
    slots = torch.randperm(NUM_BLOCKS * bs, generator=gen)[:T + 1]
    slots[-1] = -1  # a padding token: written nowhere
    poison = torch.tensor(0x7F, dtype=torch.uint8).view(fp8)  # NaN in both formats
    k_cache, v_cache = (torch.full((NUM_BLOCKS, bs, G, d), poison.item(), dtype=fp8, device=DEVICE)
                        for d in (H, Hv))
    pad = torch.ones(1, G, 1, dtype=src_dtype, device=DEVICE)
    tp.write_kv(torch.cat([k, pad.expand(1, G, H)]), torch.cat([v, pad.expand(1, G, Hv)]), k_cache, v_cache,
                slots.to(DEVICE))
    for cache, src in ((k_cache, k), (v_cache, v)):
        flat = bytes_of(cache).view(NUM_BLOCKS * bs, G, -1)
        assert torch.equal(flat[slots[:-1]], bytes_of(saturating_cast(src.cpu(), fp8)))
        untouched = torch.ones(NUM_BLOCKS * bs, dtype=torch.bool)
        untouched[slots[:-1]] = False
        assert bool((flat[untouched] == 0x7F).all())

    lat = vals[: 6 * 91].view(6, 91).to(src_dtype).to(DEVICE)  # a latent row of odd width
    lat_cache = torch.full((NUM_BLOCKS, bs, 91), poison.item(), dtype=fp8, device=DEVICE)
    tp.write_latent(lat, lat_cache, slots[:6].to(DEVICE))
    assert torch.equal(bytes_of(lat_cache).view(NUM_BLOCKS * bs, 91)[slots[:6]],
                       bytes_of(saturating_cast(lat.cpu(), fp8)))


def fp8_cache(gen, fp8, *shape, spread: float = 1.0) -> torch.Tensor:
    """An FP8 cache of random values, some past the format's range before the cast (saturated)."""
    x = torch.randn(*shape, generator=gen) * spread
    return saturating_cast(x, fp8).to(DEVICE)


FP8_ATTN_CASES = {
    # name: (query_lens, seq_lens, block_size, N, G, H, Hv, num_splits, window, chunk, sinks, q dtype)
    "decode_gqa": ([1, 1, 1], [3, 70, 133], 8, 8, 2, 32, 32, None, None, None, False, torch.bfloat16),
    "decode_split_k_window_sinks": ([1, 1], [150, 37], 16, 4, 1, 24, 24, 4, 40, None, True, torch.float32),
    "chunked_prefill_mixed": ([7, 1, 12], [30, 48, 12], 5, 8, 4, 20, 12, None, None, None, False, torch.float32),
    "prefill_window_sinks": ([19, 1], [19, 9], 4, 4, 2, 16, 16, None, 8, None, True, torch.bfloat16),
    "chunked_attention_sinks": ([1, 5, 19], [23, 29, 40], 4, 4, 2, 16, 16, None, None, 6, True, torch.float32),
}


@pytest.mark.parametrize("fp8", list(FP8), ids=FP8_IDS.get)
@pytest.mark.parametrize("case", list(FP8_ATTN_CASES))
def test_paged_attention_over_fp8_caches_matches_float64(case, fp8):
    """Paged attention reading FP8 K/V caches (decode, split-K, prefill, chunked prefill, sliding
    window, sinks, chunked attention) equals the float64 reference over the caches widened exactly:
    the kernel widens each loaded value, no scale inside."""
    qlens, slens, bs, N, G, H, Hv, splits, window, chunk, with_sinks, dtype = FP8_ATTN_CASES[case]
    gen = torch.Generator().manual_seed(300 + len(case))
    meta = make_meta(qlens, slens, bs, gen)
    # e5m2 keys up to ~2^10: scores that only a wide format holds; e4m3 saturates a few at 448.
    k_cache = fp8_cache(gen, fp8, NUM_BLOCKS, bs, G, H, spread=200.0 if fp8 == torch.float8_e4m3fn else 1.0)
    v_cache = fp8_cache(gen, fp8, NUM_BLOCKS, bs, G, Hv)
    scale = (H ** -0.5) / (200.0 if fp8 == torch.float8_e4m3fn else 1.0)
    q = rand(gen, sum(qlens), N, H, dtype=dtype)
    sinks = (torch.randn(N, generator=gen) * 2).to(DEVICE) if with_sinks else None
    out = torch.full((sum(qlens), N, Hv), float("nan"), dtype=dtype, device=DEVICE)
    got = tp.paged_attention(q, k_cache, v_cache, meta, scale, num_splits=splits, out_TNH=out, sliding_window=window,
                             sinks=sinks, attention_chunk=chunk)
    expect = ref.paged_attention(q.double().cpu(), k_cache.cpu().double(), v_cache.cpu().double(), _cpu(meta), scale,
                                 sliding_window=window, sinks=None if sinks is None else sinks.cpu(),
                                 attention_chunk=chunk)
    assert got is out and rel_err(got, expect) < RTOL[dtype]


FP8_MLA_CASES = {
    # name: (query_lens, seq_lens, block_size, N, L, R, num_splits, q dtype)
    "decode_split": ([1, 1], [77, 5], 8, 40, 32, 16, 3, torch.float32),
    "decode_128_heads": ([1, 1, 1], [21, 3, 40], 8, 128, 32, 16, None, torch.bfloat16),
    "chunked_prefill_odd_latent": ([6, 1], [20, 35], 8, 3, 24, 8, None, torch.float32),
}


@pytest.mark.parametrize("fp8", list(FP8), ids=FP8_IDS.get)
@pytest.mark.parametrize("case", list(FP8_MLA_CASES))
def test_mla_attention_over_fp8_latent_matches_float64(case, fp8):
    """MLA over an FP8 latent cache (its c_kv both key and value, its k_pe the rope part) equals the
    float64 reference over the widened latent."""
    qlens, slens, bs, N, L, R, splits, dtype = FP8_MLA_CASES[case]
    gen = torch.Generator().manual_seed(400 + len(case))
    meta = make_meta(qlens, slens, bs, gen)
    cache = fp8_cache(gen, fp8, NUM_BLOCKS, bs, L + R)
    q_lat = rand(gen, sum(qlens), N, L, dtype=dtype)
    q_pe = rand(gen, sum(qlens), N, R, dtype=dtype)
    scale = (L + R) ** -0.5
    got = tp.mla_paged_attention(q_lat, q_pe, cache, meta, scale, num_splits=splits)
    expect = ref.mla_paged_attention(q_lat.double().cpu(), q_pe.double().cpu(), cache.cpu().double(), _cpu(meta),
                                     scale)
    assert rel_err(got, expect) < RTOL[dtype]
