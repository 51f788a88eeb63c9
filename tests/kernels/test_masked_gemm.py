"""The masked grouped GEMM (expert-major layout, a valid-row count per expert: DeepEP's low-latency
output) against a float64 oracle, and the MoE layer's choice of it for such dispatch outputs.

Without a GPU the kernel runs under the Triton interpreter (conftest.py). Rows past each expert's
count hold NaN in x and in the intermediate workspace, so reading one would show; the output's rows
past the count start as a sentinel and must keep it (nothing is written there).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules: see conftest.py

import pytest

from moe_serve.kernels.grouped_gemm import config as cfg_mod
from moe_serve.kernels.grouped_gemm import masked
from tests.kernels.test_grouped_gemm import DEVICE, SMALL, TALL, poisoned_workspace, rel_err  # noqa: F401

RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SENTINEL = -7.0


def masked_float64(x_ECD, count_E, w13, w2):
    """Per expert, its first count rows through SwiGLU in float64; other rows zero."""
    E, C, D = x_ECD.shape
    F = w2.shape[2]
    out = torch.zeros(E, C, D, dtype=torch.float64)
    for e in range(E):
        n = int(count_E[e])
        x = x_ECD[e, :n].double()
        g, u = w13[e, :F].double(), w13[e, F:].double()
        h = torch.nn.functional.silu(x @ g.T) * (x @ u.T)
        out[e, :n] = h @ w2[e].double().T
    return out


def expert_major(E, C, D, F, counts, dtype, gen):
    x = torch.randn(E, C, D, generator=gen)
    for e, n in enumerate(counts):
        x[e, n:] = float("nan")  # never read
    w13 = torch.randn(E, 2 * F, D, generator=gen) / D ** 0.5
    w2 = torch.randn(E, D, F, generator=gen) / F ** 0.5
    return x.to(dtype), w13.to(dtype), w2.to(dtype), torch.tensor(counts, dtype=torch.int32)


def check(got, ref, counts, dtype):
    for e, n in enumerate(counts):
        assert torch.all(got[e, n:].float() == SENTINEL), f"expert {e}: rows past count {n} were written"
    valid = torch.cat([got[e, :n].double().cpu() for e, n in enumerate(counts)])
    ref_valid = torch.cat([ref[e, :n] for e, n in enumerate(counts)])
    assert torch.isfinite(valid).all()
    assert rel_err(valid, ref_valid) < RTOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("config", [SMALL, TALL, cfg_mod.DECODE_CONFIG], ids=["small", "tall", "decode"])
def test_masked_matches_float64(dtype, config, poisoned_workspace):  # noqa: F811
    # C not a multiple of any BLOCK_SIZE_M; counts 0, partial (inside the first and a later tile), full.
    E, C, D, F = 5, 37, 72, 40
    counts = [0, 5, 37, 20, 16]
    gen = torch.Generator().manual_seed(config["BLOCK_SIZE_M"] + (dtype == torch.float32))
    x, w13, w2, count = expert_major(E, C, D, F, counts, dtype, gen)
    ref = masked_float64(x, count, w13, w2)
    out = torch.full((E, C, D), SENTINEL, dtype=dtype, device=DEVICE)
    got = masked.masked_experts_triton(x.to(DEVICE), count.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), config,
                                       out_ECD=out)
    assert got.data_ptr() == out.data_ptr() and got.shape == (E, C, D) and got.dtype == dtype
    check(got.cpu(), ref, counts, dtype)


def test_masked_random_counts_and_fp8_weights(poisoned_workspace):  # noqa: F811
    from moe_serve.quantization.fp8 import quantize_blocks

    E, C, D, F, block = 4, 24, 64, 48, (16, 32)
    gen = torch.Generator().manual_seed(3)
    counts = torch.randint(0, C + 1, (E,), generator=gen).tolist()
    x, w13, w2, count = expert_major(E, C, D, F, counts, torch.bfloat16, gen)
    q_g, s_g = quantize_blocks(w13[:, :F].float(), block)
    q_u, s_u = quantize_blocks(w13[:, F:].float(), block)
    q2, s2 = quantize_blocks(w2.float(), block)
    from moe_serve.quantization.fp8 import BlockFp8Experts

    w13q = BlockFp8Experts(torch.cat([q_g, q_u], 1), torch.cat([s_g, s_u], 1), block, (F, F))
    w2q = BlockFp8Experts(q2, s2, block, (D,))
    ref = masked_float64(x, count, w13q.dequantize(torch.float64), w2q.dequantize(torch.float64))
    out = torch.full((E, C, D), SENTINEL, dtype=torch.bfloat16)
    got = masked.masked_experts_triton(x, count, w13q.q, w2q.q, SMALL, out_ECD=out, w13_scale=w13q.scale_inv,
                                       w2_scale=w2q.scale_inv, scale_block=block)
    check(got, ref, counts, torch.bfloat16)


def test_masked_rejects_mismatched_shapes():
    x = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match="count_E"):
        masked.masked_experts_triton(x, torch.zeros(3, dtype=torch.int32), torch.zeros(2, 6, 8), torch.zeros(2, 8, 3))


def test_moe_layer_runs_the_masked_kernel_on_deepep_low_latency_output():
    """The DeepEP low-latency receive, built by the dispatcher's own pure function from an (E, C, D)
    buffer and counts, goes to the masked kernel on the Triton backend (y in the same layout, valid
    rows equal to the generic grouped GEMM's on the flat form) and to the generic path otherwise."""
    from expert_parallel.runtime.dispatch.deepep import low_latency_output
    from expert_parallel.runtime.layer import GroupedExperts, expert_outputs, masked_applies
    from moe_serve.kernels.grouped_gemm import TorchExperts, TritonExperts

    E, C, D, F = 3, 20, 48, 32
    counts = [7, 0, 20]
    gen = torch.Generator().manual_seed(11)
    x, w13, w2, count = expert_major(E, C, D, F, counts, torch.float32, gen)
    x = torch.nan_to_num(x, nan=0.0)  # DeepEP's buffer past the counts: stale data, not NaN
    experts = GroupedExperts(E, D, F, list(range(E)), torch.float32)
    experts.w13.data.copy_(w13)
    experts.w2.data.copy_(w2)
    sent = low_latency_output(x.to(torch.bfloat16), count, handle=None, dtype=torch.float32)
    triton, torch_ops = TritonExperts(x.device), TorchExperts(x.device)
    assert masked_applies(sent, experts, triton) and not masked_applies(sent, experts, torch_ops)
    y_masked = expert_outputs(sent, experts, triton, num_tokens=9)
    y_generic = expert_outputs(sent, experts, torch_ops)
    assert y_masked.shape == y_generic.shape == (E * C, D)
    rows = torch.cat([torch.arange(e * C, e * C + n) for e, n in enumerate(counts)])
    ref = masked_float64(sent.expert_major[0], count, w13, w2).reshape(E * C, D)[rows]
    assert rel_err(y_masked[rows], ref) < 1e-5 and rel_err(y_generic[rows], ref) < 1e-5
