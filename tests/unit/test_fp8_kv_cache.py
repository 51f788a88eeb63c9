"""The FP8 KV cache contract in the torch backend and the layers: writes store exactly torch's
saturating cast, reads widen exactly (attention over an FP8 cache equals attention over its float32
copy, and a float64 oracle), the layer's k_scale / v_scale, PagedRows, checkpoint scale names, and
what `moe-serve env` lists."""
from __future__ import annotations

import pytest
import torch

from attention.backends import dsa, reference
from attention.backends.invariant import attention_torch
from attention.cache_kinds import FULL
from attention.layer import PagedAttention, PagedMLAAttention, PagedRows
from attention.metadata import AttentionMetadata
from moe_serve.weights import _kv_scale_of

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _step():
    """Two decodes (contexts 5 and 9) then a prefill chunk of 3 after 4 cached tokens: blocks of 4."""
    tables = [[3, 1], [0, 2, 5], [4, 6]]
    return AttentionMetadata.build([1, 1, 3], [5, 9, 7], tables, 4)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_write_saturates_exactly_as_torch(dtype, src):
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(5, 2, 8, generator=g) * 300).to(src)
    k[0, 0, :4] = torch.tensor([1e6, -1e6, float("inf"), -float("inf")]).to(src)
    v = torch.randn(5, 2, 8, generator=g).to(src) * 1e-3  # subnormal range of both formats
    kc, vc = torch.zeros(4, 4, 2, 8, dtype=dtype), torch.zeros(4, 4, 2, 8, dtype=dtype)
    slots = torch.tensor([3, 0, 9, 15, 6])
    reference.write_kv(k, v, kc, vc, slots)
    for x, c in ((k, kc), (v, vc)):
        want = x.float().clamp(-MAX[dtype], MAX[dtype]).to(dtype)
        got = c.view(16, 2, 8)[slots]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        rest = torch.ones(16, dtype=torch.bool)
        rest[slots] = False
        assert not c.view(16, 2, 8)[rest].float().any()  # nothing else written
    assert kc.float().abs().max() == MAX[dtype] and kc.float().isfinite().all()


def _f64_attention(q, k, v, scale, q_pos, k_pos):
    """float64 causal attention of queries at q_pos over keys at k_pos: (Q, N, Hv)."""
    N, G = q.shape[1], k.shape[1]
    k, v = k.double().repeat_interleave(N // G, 1), v.double().repeat_interleave(N // G, 1)
    s = torch.einsum("qnh,snh->nqs", q.double(), k) * scale
    s = s.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("nqs,snh->qnh", torch.softmax(s, -1), v)


@pytest.mark.parametrize("dtype", FP8)
def test_paged_attention_reads_fp8_widened(dtype):
    """Decodes and a prefill chunk over FP8 caches: exactly attention over the caches' float32
    copies (the read is an exact widening), and the float64 oracle over the stored values."""
    g = torch.Generator().manual_seed(1)
    meta = _step()
    kc = (torch.randn(7, 4, 2, 16, generator=g) * 3).to(dtype)
    vc = torch.randn(7, 4, 2, 16, generator=g).to(dtype)
    q = torch.randn(5, 4, 16, generator=g)
    out = reference.paged_attention(q, kc, vc, meta, 0.25)
    assert torch.allclose(out, reference.paged_attention(q, kc.float(), vc.float(), meta, 0.25), atol=1e-6)
    assert torch.allclose(attention_torch(q, kc, vc, meta, 0.25), out, atol=1e-5)
    win = reference.paged_attention(q, kc, vc, meta, 0.25, sliding_window=3, sinks=torch.zeros(4))
    assert torch.allclose(win, reference.paged_attention(q, kc.float(), vc.float(), meta, 0.25, sliding_window=3,
                                                         sinks=torch.zeros(4)), atol=1e-6)
    rows = 0
    for b, (q_len, ctx) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        table = meta.block_tables[b].long()
        k = kc.float()[table].flatten(0, 1)[:ctx]
        v = vc.float()[table].flatten(0, 1)[:ctx]
        want = _f64_attention(q[rows:rows + q_len], k, v, 0.25, torch.arange(ctx - q_len, ctx), torch.arange(ctx))
        assert torch.allclose(out[rows:rows + q_len].double(), want, atol=1e-5)
        rows += q_len


@pytest.mark.parametrize("dtype", FP8)
def test_mla_and_dsa_read_fp8_widened(dtype):
    g = torch.Generator().manual_seed(2)
    meta = _step()
    lat = (torch.randn(7, 4, 24, generator=g) * 2).to(dtype)
    idx = torch.randn(7, 4, 8, generator=g).to(dtype)
    ql, qp = torch.randn(5, 4, 16, generator=g), torch.randn(5, 4, 8, generator=g)
    out = reference.mla_paged_attention(ql, qp, lat, meta, 0.3)
    assert torch.allclose(out, reference.mla_paged_attention(ql, qp, lat.float(), meta, 0.3), atol=1e-6)
    qi, w = torch.randn(5, 2, 8, generator=g), torch.rand(5, 2, generator=g)
    top = dsa.dsa_topk(qi, w, idx, meta, 3, 0.5)
    assert torch.equal(top, dsa.dsa_topk(qi, w, idx.float(), meta, 3, 0.5))
    sparse = dsa.sparse_mla_attention(ql, qp, lat, meta, top, 0.3)
    assert torch.allclose(sparse, dsa.sparse_mla_attention(ql, qp, lat.float(), meta, top, 0.3), atol=1e-6)


def _roundtrip(x, dtype, scale):
    return (x.double() / scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype).double() * scale


@pytest.mark.parametrize("ks, vs", [(1.0, 1.0), (0.01, 4.0), (3.0, 0.002)])
def test_layer_applies_kv_scales(ks, vs):
    """PagedAttention with k_scale / v_scale: the float64 oracle over K and V as an FP8 cache with
    those scales keeps them (saturation included: K / 0.01 passes 448)."""
    dtype = torch.float8_e4m3fn
    g = torch.Generator().manual_seed(3)
    layer = PagedAttention(4, 2, 16, 0.25)
    layer.bind([torch.zeros(4, 4, 2, 16, dtype=dtype), torch.zeros(4, 4, 2, 16, dtype=dtype)])
    layer.k_scale, layer.v_scale = ks, vs
    meta = AttentionMetadata.build([6], [6], [[2, 0]], 4)
    q, k, v = (torch.randn(6, n, 16, generator=g) * 2 for n in (4, 2, 2))
    out = layer(q, k, v, meta)
    want = _f64_attention(q, _roundtrip(k, dtype, ks), _roundtrip(v, dtype, vs), 0.25, torch.arange(6), torch.arange(6))
    assert torch.allclose(out.double(), want, atol=1e-5)
    if ks == 0.01:
        assert layer.k_cache.float().abs().max() == 448.0  # saturated, as the oracle


def test_mla_layer_applies_k_scale():
    dtype = torch.float8_e5m2
    g = torch.Generator().manual_seed(4)
    layer = PagedMLAAttention(16, 8, 0.3)
    layer.bind([torch.zeros(3, 4, 24, dtype=dtype)])
    layer.k_scale = 0.125
    meta = AttentionMetadata.build([5], [5], [[1, 2]], 4)
    ql, qp, lat = torch.randn(5, 4, 16, generator=g), torch.randn(5, 4, 8, generator=g), torch.randn(5, 24, generator=g)
    out = layer(ql, qp, lat, meta)
    kept = _roundtrip(lat, dtype, 0.125)  # (S, L + R): the key is all of it, the value its first L
    s = torch.einsum("qnc,sc->nqs", torch.cat([ql, qp], -1).double(), kept) * 0.3
    s = s.masked_fill(torch.arange(5)[None, None, :] > torch.arange(5)[None, :, None], float("-inf"))
    want = torch.einsum("nqs,sl->qnl", torch.softmax(s, -1), kept[:, :16])
    assert torch.allclose(out.double(), want, atol=1e-5)


def test_paged_rows_fp8():
    rows = PagedRows(FULL, [8, 4], dtype=torch.bfloat16)
    rows.bind([torch.zeros(2, 4, 8, dtype=torch.float8_e4m3fn), torch.zeros(2, 4, 4, dtype=torch.float8_e4m3fn)])
    a, b = torch.randn(3, 8) * 1000, torch.randn(3, 4)
    slots = torch.tensor([5, 1, 7])
    rows.write([a, b], slots)
    got = rows.read(0, slots.view(3, 1))
    assert got.dtype == torch.bfloat16 and got.shape == (3, 1, 8)
    assert torch.equal(got.view(3, 8).float(), a.clamp(-448, 448).to(torch.float8_e4m3fn).float())
    from moe_serve.speed_of_light import CacheRead, cache_read_of

    rows.reads = CacheRead("full", 8 * 2, pool_bytes_per_token=12 * 2)  # counted in bf16 by its owner
    assert cache_read_of(rows) == CacheRead("full", 8, pool_bytes_per_token=12)


@pytest.mark.parametrize("name, want", [
    ("model.layers.3.self_attn.k_scale", (3, "k")),
    ("model.layers.3.self_attn.attn.v_scale", (3, "v")),
    ("model.layers.12.self_attn.k_proj.output_scale", (12, "k")),
    ("model.layers.1.self_attn.v_proj.v_scale", (1, "v")),
    ("language_model.model.layers.2.self_attn.qkv_proj.k_scale", (2, "k")),
    ("model.layers.1.self_attn.kv_scale", (1, "kv")),
    ("model.layers.1.self_attn.q_proj.output_scale", None),
    ("model.layers.1.self_attn.k_proj.v_scale", None),
    ("model.layers.1.self_attn.k_proj.weight", None),
    ("model.layers.1.self_attn.k_proj.weight_scale_inv", None),
])
def test_checkpoint_kv_scale_names(name, want):
    assert _kv_scale_of(name) == want


def test_env_lists_kv_cache_dtypes():
    from moe_serve.entrypoints.env import collect

    kv = collect()["kv_cache_dtypes"]
    assert set(kv["torch"]) == set(kv["cpu_c"]) == {"auto", "fp8_e4m3", "fp8_e5m2"}
    assert "triton" in kv


def test_weight_update_cannot_change_live_kv_scales():
    """Scales in a weight update: loaded where nothing serves with them yet; refused, naming the
    tensor, where the layer serves an FP8 cache with other values (its cache holds K / old scale)."""
    from torch import nn

    from moe_serve.weights import _TensorLoader

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([nn.Module()])
            self.model.layers[0].self_attn = nn.Module()
            self.model.layers[0].self_attn.attn = PagedAttention(2, 1, 4, 0.5)

    class One:
        def __init__(self, t):
            self.t = t

        def get_tensor(self, name):
            return self.t

    model = Tiny()
    loader = _TensorLoader(model, torch.float32, {}, None)
    loader.load("model.layers.0.self_attn.k_scale", One(torch.tensor(0.5)), "<update>")
    loader.finish_kv_scales()
    attn = model.model.layers[0].self_attn.attn
    assert attn.checkpoint_kv_scales == (0.5, 1.0) and attn.k_scale == 1.0  # applied by the runner, not here
    attn.k_scale, attn.kv_scales_live = 0.5, True
    loader = _TensorLoader(model, torch.float32, {}, None)
    loader.load("model.layers.0.self_attn.k_scale", One(torch.tensor(0.5)), "<update>")  # unchanged: fine
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.v_scale.*cannot change while serving"):
        loader.load("model.layers.0.self_attn.v_scale", One(torch.tensor(2.0)), "<update>")
