"""Our C decode step of Gated DeltaNet layers (moe_serve/kernels/cpu_ops/gated_delta.c, the "cpu_c" linear
attention backend) against the reference ops of moe_serve/kernels/gated_delta/reference.py, on every ISA
of vec.h this CPU executes (the `isa` fixture, as in test_cpu_ops.py)."""
from __future__ import annotations

import pytest
import torch

from moe_serve.kernels import cpu_ops
from moe_serve.kernels.gated_delta import CpuCLinearAttention
from moe_serve.kernels.gated_delta import reference as ref
from moe_serve import platform
from tests.gated_delta_batch import Batch, Dims

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C kernels did not build here (no C compiler)")


@pytest.fixture(params=cpu_ops.runnable_isas())
def isa(request, monkeypatch):
    """The test runs on vec.h's `request.param` build, its own library swapped in for the default."""
    lib = cpu_ops.load_variant(request.param)
    assert lib.cpu_ops_isa().decode() == request.param
    monkeypatch.setattr(cpu_ops, "_lib", lambda: lib)
    return request.param

WIDE = Dims(H=4, K=128, V=72, C=300, KW=4, slots=12)  # V and C not multiples of a vector


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dims", [Dims(), WIDE], ids=["small", "wide"])
@pytest.mark.parametrize("lens", [dict(query_lens=[1] * 6, context_lens=[3, 1, 0, 8, 2, 0]),
                                  dict(query_lens=[1, 1, 40, 1], context_lens=[2, 0, 5, 7]),
                                  dict(query_lens=[1] * 5, context_lens=[4] * 5)],
                         ids=["decodes-some-fresh", "decodes-then-prefill", "decodes"])
def test_cpu_c_backend_matches_reference(lens, dims, threads, isa):
    """Outputs and every state slot (the untouched ones too) as the reference leaves them."""
    want = Batch(**lens, dims=dims, seed=threads)
    got = want.copy_caches()
    nd = lens["query_lens"].index(40) if 40 in lens["query_lens"] else len(lens["query_lens"])
    assert cpu_ops.gated_delta_step_fits(got.q[:nd], got.k[:nd], got.v[:nd], got.state)
    assert cpu_ops.conv_step_fits(got.x[:nd], got.w, got.bias, got.conv_state)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ops = CpuCLinearAttention()
        o_got, y_got = got.delta(ops.gated_delta_rule), got.conv(ops.causal_conv1d)
        y_plain = got.copy_caches().conv(ops.causal_conv1d, activation=None)
    finally:
        torch.set_num_threads(old)
    o_want, y_want = want.delta(ref.gated_delta_rule), want.conv(ref.causal_conv1d)
    torch.testing.assert_close(o_got, o_want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got.state, want.state, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(y_got, y_want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.conv_state, want.conv_state)
    torch.testing.assert_close(y_plain, want.copy_caches().conv(ref.causal_conv1d, activation=None), rtol=1e-5,
                               atol=1e-5)


def test_cpu_c_reads_heads_from_the_convolutions_rows(isa):
    """q, k and v as the layer hands them: views of the convolution's output rows (a token stride
    of every channel), taken in place; without l2 normalisation too."""
    d = WIDE
    B, T = 3, 3
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(T, 2 * d.H * d.K + d.H * d.V, generator=g)
    q, k, v = qkv.split([d.H * d.K, d.H * d.K, d.H * d.V], dim=-1)
    q, k, v = q.view(T, d.H, d.K), k.view(T, d.H, d.K), v.view(T, d.H, d.V)
    assert q.stride(0) == qkv.shape[1] and cpu_ops.gated_delta_step_fits(q, k, v, torch.empty(4, d.H, d.K, d.V))
    gdecay, beta = -torch.rand(T, d.H, generator=g), torch.rand(T, d.H, generator=g)
    slots = torch.tensor([2, 0, 3])
    for l2 in (True, False):
        state = torch.randn(4, d.H, d.K, d.V, generator=g)
        want_state = state.clone()
        o = CpuCLinearAttention().gated_delta_rule(q, k, v, gdecay, beta, state, slots, [1] * B, [5, 0, 2], 0.3,
                                                   use_qk_l2norm=l2)
        o_want = ref.gated_delta_rule(q.contiguous(), k.contiguous(), v.contiguous(), gdecay, beta, want_state, slots,
                                      [1] * B, [5, 0, 2], 0.3, use_qk_l2norm=l2)
        torch.testing.assert_close(o, o_want, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(state, want_state, rtol=2e-5, atol=2e-5)


def test_cpu_c_is_the_cpu_default_for_linear_attention():
    choice = platform.choose("cpu")
    assert choice.linear_attention_backend == "cpu_c"
    ops = platform.resolve_ops(torch.device("cpu"), choice.moe_backend, choice.attention_backend,
                               linear_attention=choice.linear_attention_backend)
    assert isinstance(ops.linear_attention, CpuCLinearAttention)
