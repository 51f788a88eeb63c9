"""GPT-OSS's expert variant of the grouped expert op: expert biases, the clamped SwiGLU
((up + 1) * gate * sigmoid(1.702 gate), gate <= 7, |up| <= 7) and MXFP4 weights dequantized inside
the op, each path against a float64 token-by-token oracle; MXFP4 decoding against transformers'
own unpacking of the same bytes."""
import pytest
import torch

from moe_serve.kernels.grouped_gemm import TorchExperts, fused_experts
from moe_serve.kernels.grouped_gemm.mxfp4 import Mxfp4Weight, dequantize_mxfp4
from moe_serve.kernels.grouped_gemm.reference import ClampedSwiGLU, fused_experts_float64, fused_experts_reference
from tests.checkpoints import pack_mxfp4
from tests.kernels.test_grouped_gemm import rel_err, routing

ACT = ClampedSwiGLU(1.702, 7.0)


def gpt_oss_layer(T, D, F, E, gen, scale=3.0):
    """Weights wide enough that the clamp at 7 really cuts some gate / up values."""
    x = torch.randn(T, D, generator=gen)
    w13 = torch.randn(E, 2 * F, D, generator=gen) * scale * D ** -0.5
    w2 = torch.randn(E, D, F, generator=gen) * F ** -0.5
    b13 = torch.randn(E, 2 * F, generator=gen)
    b2 = torch.randn(E, D, generator=gen)
    return x, w13, w2, b13, b2


def test_mxfp4_decoding_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 24, 96, generator=gen) * torch.exp2(torch.randint(-6, 4, (3, 24, 1), generator=gen).float())
    blocks, scales = pack_mxfp4(w)
    assert blocks.shape == (3, 24, 3, 16) and scales.shape == (3, 24, 3) and blocks.dtype == torch.uint8
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    theirs = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.float32)  # (E, C, R)
    assert torch.equal(ours, theirs.transpose(1, 2))
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), ours)  # exact in bf16 too
    assert rel_err(ours, w.double()) < 0.2  # a real quantization of w (4-bit: ~10% error)
    q = Mxfp4Weight(blocks, scales)
    assert q.shape == (3, 24, 96)
    assert torch.equal(q.dequantize(torch.float32, torch.tensor([2, 0])), ours[[2, 0]])


@pytest.mark.parametrize("T,K,skip", [(1, 4, 0.0), (3, 2, 0.0), (40, 4, 0.3), (5, 3, 1.0)])
def test_gpt_oss_variant_matches_float64(T, K, skip):
    gen = torch.Generator().manual_seed(T * 13 + K)
    D, F, E = 64, 32, 8
    x, w13, w2, b13, b2 = gpt_oss_layer(T, D, F, E, gen)
    weights, ids = routing(T, E, K, gen, skip)
    kw = dict(w13_bias=b13, w2_bias=b2, activation=ACT)
    ref = fused_experts_float64(x, w13, w2, weights, ids, **kw)
    gate_up = torch.einsum("td,efd->tef", x.double(), w13.double()) + b13.double()
    assert (gate_up[..., :F] > 7).any() and (gate_up[..., F:].abs() > 7).any()  # the clamp matters
    outs = {"reference": fused_experts_reference(x, w13, w2, weights, ids, **kw),
            "public": fused_experts(x, w13, w2, weights, ids, **kw)}
    bq, sq = pack_mxfp4(w13)
    b2q, s2q = pack_mxfp4(w2)
    q13, q2 = Mxfp4Weight(bq, sq), Mxfp4Weight(b2q, s2q)
    ref_q = fused_experts_float64(x, q13.dequantize(torch.float64), q2.dequantize(torch.float64), weights, ids, **kw)
    outs_q = {"mxfp4": fused_experts(x, q13, q2, weights, ids, **kw)}
    # every local expert dequantized, no host read of the ids
    outs_q["mxfp4 device-side"] = fused_experts(x, q13, q2, weights, ids, backend=TorchExperts(host_reads=False), **kw)
    for name, got in [*((n, (g, ref)) for n, g in outs.items()), *((n, (g, ref_q)) for n, g in outs_q.items())]:
        out, expect = got
        if skip == 1.0:
            assert torch.equal(out, torch.zeros(T, D)), name
        else:
            assert rel_err(out, expect) < 1e-5, name
    # Without biases and with SiLU the variant arguments give the plain op's numbers.
    assert torch.equal(fused_experts(x, w13, w2, weights, ids, w13_bias=None, activation="silu"),
                       fused_experts(x, w13, w2, weights, ids))


def test_mxfp4_experts_in_chunks(monkeypatch):
    """Expert sets larger than MAX_DEQUANT_BYTES run in chunks, routed-only and whole-layer alike,
    with the numbers of one pass."""
    from moe_serve.kernels.grouped_gemm import mxfp4

    gen = torch.Generator().manual_seed(5)
    x, w13, w2, b13, b2 = gpt_oss_layer(12, 64, 32, 8, gen)
    weights, ids = routing(12, 8, 3, gen, 0.2)
    q13, q2 = (Mxfp4Weight(*pack_mxfp4(w)) for w in (w13, w2))
    kw = dict(w13_bias=b13, w2_bias=b2, activation=ACT)
    ref = fused_experts_float64(x, q13.dequantize(torch.float64), q2.dequantize(torch.float64), weights, ids, **kw)
    monkeypatch.setattr(mxfp4, "MAX_DEQUANT_BYTES", 3 * 64 * 32 * 3 * 4)  # 3 experts at a time
    assert rel_err(fused_experts(x[:2], q13, q2, weights[:2], ids[:2], **kw), ref[:2]) < 1e-5  # 6 pairs < 8
    assert rel_err(fused_experts(x, q13, q2, weights, ids, **kw), ref) < 1e-5
    assert rel_err(fused_experts(x, q13, q2, weights, ids, backend=TorchExperts(host_reads=False), **kw), ref) < 1e-5
