"""The CPU experts' grouped-GEMM path against the float64 oracle: skipped pairs, experts with no
token, one token, and no device-to-host read inside (it compiles as one graph)."""
import pytest
import torch

from moe_serve.kernels.grouped_gemm import TorchExperts, fused_experts
from moe_serve.kernels.grouped_gemm.grouped_mm import fused_experts_grouped, fused_experts_single_token, grouped_mm_available
from moe_serve.kernels.grouped_gemm.reference import fused_experts_float64
from tests.sync_guard import HostSyncError, NoHostSync
from tests.kernels.test_grouped_gemm import layer, rel_err, routing

pytestmark = pytest.mark.skipif(not grouped_mm_available(torch.float32, "cpu"),
                                reason="this torch has no CPU grouped GEMM (the loop is used instead)")


# (T, D, F, E, K, skip fraction, experts with no token): D and F multiples of 4 (16-byte strides).
GROUPED_CASES = {
    "one_token_top1": (1, 40, 24, 3, 1, 0.0, ()),
    "one_token_top8": (1, 48, 40, 10, 8, 0.25, ()),
    "odd_tokens_skips": (13, 40, 24, 6, 2, 0.3, (2, 4)),
    "many_tokens": (70, 32, 24, 9, 3, 0.1, (5,)),
    "all_skipped": (5, 32, 16, 4, 2, 1.0, ()),
}


@pytest.mark.parametrize("case", list(GROUPED_CASES))
def test_grouped_matches_float64_oracle(case):
    T, D, F, E, K, skip, zero = GROUPED_CASES[case]
    gen = torch.Generator().manual_seed(len(case) * 11 + T)
    x, w13, w2 = layer(T, D, F, E, torch.float32, gen)
    weights, ids = routing(T, E, K, gen, skip, zero)
    ref = fused_experts_float64(x, w13, w2, weights, ids)
    got = fused_experts_grouped(x, w13, w2, weights, ids)
    assert got.dtype == torch.float32 and got.shape == (T, D)
    if case == "all_skipped":
        assert torch.equal(got, torch.zeros(T, D))
    else:
        assert rel_err(got, ref) < 1e-5
    if skip == 0.0:  # no id is -1: the one-rank path that skips their masking gives the same numbers
        assert torch.equal(fused_experts_grouped(x, w13, w2, weights, ids, all_local=True), got)
    # The torch backend takes this path for float32 where only device-side paths are allowed (its
    # capturable form) and gives the same numbers; otherwise a single token takes the per-token
    # path, and on the cpu_c backend decode-sized batches take the C kernel (moe_serve/kernels/cpu_ops): the
    # same sums in another order.
    assert torch.equal(fused_experts(x, w13, w2, weights, ids, backend=TorchExperts("cpu", host_reads=False)), got)
    for backend in ("torch", "cpu_c"):
        public = fused_experts(x, w13, w2, weights, ids, backend=backend)
        if case == "all_skipped":
            assert torch.equal(public, torch.zeros(T, D)), backend
        else:
            assert rel_err(public, ref) < 1e-5, backend


@pytest.mark.parametrize("K,skip", [(1, 0.0), (4, 0.0), (8, 0.4), (3, 1.0)])
def test_single_token_matches_float64_oracle(K, skip):
    gen = torch.Generator().manual_seed(K * 7 + int(skip * 10))
    x, w13, w2 = layer(1, 48, 40, 10, torch.float32, gen)
    weights, ids = routing(1, 10, K, gen, skip)
    ref = fused_experts_float64(x, w13, w2, weights, ids)
    got = fused_experts_single_token(x, w13, w2, weights, ids)  # the path where the C kernel is not built
    public = fused_experts(x, w13, w2, weights, ids, backend="cpu_c")  # the C kernel where it is
    if skip == 1.0:
        assert torch.equal(got, torch.zeros(1, 48)) and torch.equal(public, torch.zeros(1, 48))
    else:
        assert rel_err(got, ref) < 1e-5 and rel_err(public, ref) < 1e-5
    # Half-precision tokens over float32 expert weights (prepare.py's layout on CPUs without bf16).
    for backend in ("torch", "cpu_c"):
        got_bf16 = fused_experts(x.bfloat16(), w13, w2, weights, ids, backend=backend)
        assert got_bf16.dtype == torch.bfloat16
        if skip < 1.0:
            assert rel_err(got_bf16.float(), ref) < 2e-2, backend


def test_unaligned_shapes_take_the_loop():
    gen = torch.Generator().manual_seed(5)
    x, w13, w2 = layer(9, 33, 17, 7, torch.float32, gen)  # 33 * 4 bytes is not a multiple of 16
    weights, ids = routing(9, 7, 2, gen, 0.2)
    got = fused_experts(x, w13, w2, weights, ids, backend="torch")
    assert rel_err(got, fused_experts_float64(x, w13, w2, weights, ids)) < 1e-5


def test_grouped_has_no_host_sync():
    gen = torch.Generator().manual_seed(3)
    x, w13, w2 = layer(8, 32, 16, 6, torch.float32, gen)
    weights, ids = routing(8, 6, 2, gen, 0.2)
    with NoHostSync():
        got = fused_experts_grouped(x, w13, w2, weights, ids)
    assert rel_err(got, fused_experts_float64(x, w13, w2, weights, ids)) < 1e-5
    # The guard does catch a sync: the per-expert loop reads its counts on the host.
    from moe_serve.kernels.grouped_gemm.reference import fused_experts_reference

    with pytest.raises(HostSyncError), NoHostSync():
        fused_experts_reference(x, w13, w2, weights, ids)


def test_grouped_path_never_calls_bincount(monkeypatch):
    """CUDA's bincount reads the largest id back to the host, a sync no CUDA graph can hold (and the
    CPU's sync guard cannot see inside an aten kernel): the path counts a fixed number of experts
    with scatter_add, with and without elsewhere-held pairs, GPT-OSS's biases included."""
    gen = torch.Generator().manual_seed(5)
    x, w13, w2 = layer(6, 32, 16, 5, torch.float32, gen)
    weights, ids = routing(6, 5, 2, gen, 0.3, ())
    want = fused_experts_float64(x, w13, w2, weights, ids)

    def no_bincount(*a, **k):
        raise AssertionError("torch.bincount in the grouped path")

    monkeypatch.setattr(torch, "bincount", no_bincount)
    assert rel_err(fused_experts_grouped(x, w13, w2, weights, ids), want) < 1e-5
    b13, b2 = torch.randn(5, 32, generator=gen), torch.randn(5, 32, generator=gen)
    fused_experts_grouped(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, activation="silu")
