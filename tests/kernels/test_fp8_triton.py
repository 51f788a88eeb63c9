"""Block-FP8 experts in the Triton grouped GEMM (weight-only: each weight tile is dequantized by its
blocks' scale_inv as it is loaded) against the float64 oracle over the dequantized weights, for
the default configs, scale blocks that do not divide the dimensions, and scale blocks along k
that a K tile does not divide (one scale per element then)."""
import pytest
import torch

from moe_serve.kernels.grouped_gemm import config as cfg_mod
from moe_serve.kernels.grouped_gemm import fused_experts
from moe_serve.kernels.grouped_gemm.reference import fused_experts_float64
from moe_serve.kernels.grouped_gemm.triton_kernel import fused_experts_triton
from moe_serve.quantization.fp8 import BlockFp8Experts, FP8, quantize_blocks
from tests.kernels.test_grouped_gemm import layer, rel_err, routing


def nan_fenced(s: torch.Tensor) -> torch.Tensor:
    """The scales as a view into a larger NaN-filled tensor: a kernel reading any scale past the
    real ones (say for the k rows of a tile beyond the weight's last column) turns its output NaN."""
    big = torch.full((*s.shape[:-2], s.shape[-2] + 1, s.shape[-1] + 1), float("nan"))
    big[..., :s.shape[-2], :s.shape[-1]] = s
    return big[..., :s.shape[-2], :s.shape[-1]]


def fp8_experts(w13, w2, block):
    F = w2.shape[2]
    q_g, s_g = quantize_blocks(w13[:, :F], block)
    q_u, s_u = quantize_blocks(w13[:, F:], block)
    q2, s2 = quantize_blocks(w2, block)
    return (BlockFp8Experts(torch.cat([q_g, q_u], 1), nan_fenced(torch.cat([s_g, s_u], 1)), block, (F, F)),
            BlockFp8Experts(q2, nan_fenced(s2), block, (w2.shape[1],)))


@pytest.mark.parametrize("block", [(128, 128), (16, 32), (32, 24)], ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("config", cfg_mod.DEFAULT_CONFIGS, ids=lambda c: f"BM{c['BLOCK_SIZE_M']}")
def test_fp8_experts_match_oracle_on_dequantized_weights(block, config):
    T, D, F, E, K = 11, 72, 40, 5, 2
    gen = torch.Generator().manual_seed(block[0] + block[1] + config["BLOCK_SIZE_M"])
    x, w13, w2 = layer(T, D, F, E, torch.bfloat16, gen)
    w13q, w2q = fp8_experts(w13.float(), w2.float(), block)
    weights, ids = routing(T, E, K, gen, 0.2)
    ref = fused_experts_float64(x, w13q.dequantize(torch.float64), w2q.dequantize(torch.float64), weights, ids)
    got = fused_experts_triton(x, w13q.q, w2q.q, weights, ids, config, w13_scale=w13q.scale_inv,
                               w2_scale=w2q.scale_inv, scale_block=block)
    assert got.dtype == torch.bfloat16 and got.shape == (T, D)
    assert rel_err(got, ref) < 2e-2  # bf16 activations and intermediate, fp32 accumulation
    # The public op routes block-FP8 experts to this kernel on the triton backend, and the torch
    # backend (dequantize the routed experts, dense op) agrees.
    public = fused_experts(x, w13q, w2q, weights, ids, backend="triton")
    assert rel_err(public, ref) < 2e-2
    assert rel_err(fused_experts(x.float(), w13q, w2q, weights, ids, backend="torch"), ref) < 1e-5


def test_fp8_scale_shapes_are_checked():
    gen = torch.Generator().manual_seed(0)
    x, w13, w2 = layer(3, 32, 16, 2, torch.bfloat16, gen)
    w13q, w2q = fp8_experts(w13.float(), w2.float(), (16, 16))
    weights, ids = routing(3, 2, 1, gen)
    assert w13q.q.dtype == FP8
    with pytest.raises(ValueError, match="scale shapes"):
        fused_experts_triton(x, w13q.q, w2q.q, weights, ids, w13_scale=w13q.scale_inv[:, :1],
                             w2_scale=w2q.scale_inv, scale_block=(16, 16))


@pytest.mark.parametrize("M", [1, 5, 70])
@pytest.mark.parametrize("block,bias", [((128, 128), False), ((16, 24), True)], ids=["128x128", "16x24-bias"])
def test_fp8_linear_matches_float64_on_dequantized_weights(M, block, bias):
    from moe_serve.kernels.fp8_linear import fp8_linear_triton
    from moe_serve.quantization.fp8 import dequantize_blocks

    gen = torch.Generator().manual_seed(M + block[1])
    N, K = 90, 56
    w = torch.randn(N, K, generator=gen) / K ** 0.5
    q, s = quantize_blocks(w, block)
    s = nan_fenced(s)
    x = torch.randn(3, M, K, generator=gen).to(torch.bfloat16)  # leading dims kept
    b = torch.randn(N, generator=gen).to(torch.bfloat16) if bias else None
    ref = x.double() @ dequantize_blocks(q, s, block, torch.float64).T + (b.double() if bias else 0)
    got = fp8_linear_triton(x, q, s, block, b)
    assert got.shape == (3, M, N) and got.dtype == torch.bfloat16
    assert rel_err(got, ref) < 1e-2
    with pytest.raises(ValueError, match="scale_inv"):
        fp8_linear_triton(x, q, torch.ones(s.shape[0] + 1, s.shape[1]), block)


def test_engine_fp8_checkpoint_on_the_triton_expert_backend(checkpoints, tmp_path):
    """A block-FP8 checkpoint served with the Triton expert kernel (interpreted here) gives the
    torch backend's greedy tokens."""
    from moe_serve import LLM, SamplingParams
    from tests.models.test_fp8 import make_fp8_checkpoint

    path = str(tmp_path / "fp8")
    make_fp8_checkpoint(checkpoints["qwen3_moe"], path, (32, 24))
    prompts = [{"prompt_token_ids": p} for p in ([5, 77, 301, 42], [9, 8, 7, 6, 5, 4, 3])]
    sp = SamplingParams(temperature=0, max_tokens=4)
    got = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, dtype="float32", moe_backend=backend, kv_cache_memory=1 << 20, show_progress=False)
        got[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert got["triton"] == got["torch"]


@pytest.mark.parametrize("config", cfg_mod.DEFAULT_CONFIGS, ids=lambda c: f"BM{c['BLOCK_SIZE_M']}")
def test_w8a8_experts_match_oracle_with_quantized_activations(config):
    """W8A8: activations quantized per token per 128 channels (the test's own float64 quantizer
    for the oracle), FP8 x FP8 per K tile rescaled by both scales."""
    from moe_serve.kernels.fp8_quant import quantize_per_token_group_reference as quant

    T, D, F, E, K = 9, 200, 136, 4, 2  # two K blocks of 128 in both GEMMs, the second partial
    block = (128, 128)
    gen = torch.Generator().manual_seed(config["BLOCK_SIZE_M"])
    x, w13, w2 = layer(T, D, F, E, torch.bfloat16, gen)
    w13q, w2q = fp8_experts(w13.float(), w2.float(), block)
    weights, ids = routing(T, E, K, gen, 0.2)
    xq, xs = quant(x, 128)
    x_deq = (xq.double() * xs.double().repeat_interleave(128, 1)[:, :D])
    # The oracle quantizes the intermediate the same way; float64 from there on.
    ref = torch.zeros(T, D, dtype=torch.float64)
    W13, W2 = w13q.dequantize(torch.float64), w2q.dequantize(torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if e < 0:
                continue
            gu = W13[e] @ x_deq[t]
            h = (torch.nn.functional.silu(gu[:F]) * gu[F:]).to(torch.bfloat16)[None]
            hq, hs = quant(h, 128)
            h_deq = hq.double() * hs.double().repeat_interleave(128, 1)[:, :F]
            ref[t] += float(weights[t, k]) * (W2[e] @ h_deq[0])
    got = fused_experts_triton(x, w13q.q, w2q.q, weights, ids, config, w13_scale=w13q.scale_inv,
                               w2_scale=w2q.scale_inv, scale_block=block, act_quant=True)
    assert rel_err(got, ref) < 2e-2
    # Activation quantization is a real approximation: the weight-only result differs from it.
    w8a16 = fused_experts_triton(x, w13q.q, w2q.q, weights, ids, config, w13_scale=w13q.scale_inv,
                                 w2_scale=w2q.scale_inv, scale_block=block)
    assert not torch.equal(got, w8a16)


@pytest.mark.parametrize("M", [1, 40])
def test_w8a8_linear_matches_float64_with_quantized_activations(M):
    from moe_serve.kernels.fp8_linear import fp8_linear_triton
    from moe_serve.kernels.fp8_quant import quantize_per_token_group_reference as quant
    from moe_serve.quantization.fp8 import dequantize_blocks

    gen = torch.Generator().manual_seed(M)
    N, K, block = 150, 300, (128, 128)
    w = torch.randn(N, K, generator=gen) / K ** 0.5
    q, s = quantize_blocks(w, block)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    xq, xs = quant(x, 128)
    x_deq = xq.double() * xs.double().repeat_interleave(128, 1)[:, :K]
    ref = x_deq @ dequantize_blocks(q, s, block, torch.float64).T
    got = fp8_linear_triton(x, q, s, block, act_quant=True)
    assert rel_err(got, ref) < 1e-2


@pytest.mark.parametrize("M, K", [(1, 128), (5, 300), (3, 7)])
def test_activation_quant_kernel_matches_reference(M, K):
    """The per-token-group FP8 quantization kernel itself (the interpreter here: its scaled values,
    rounded to FP8 by torch) gives the reference's FP8 values and scales exactly: partial last
    groups, an all-zero group (scale 1), values at the clamp."""
    from moe_serve.kernels import fp8_quant

    gen = torch.Generator().manual_seed(M * K)
    x = (torch.randn(M, K, generator=gen) * 50).to(torch.bfloat16)
    x[0, : min(K, 128)] = 0  # a group of zeros
    if K > 130:
        x[-1, 130] = 1e4  # one huge value sets its group's scale
    q, s = fp8_quant.quantize_per_token_group(x, 128)
    q_ref, s_ref = fp8_quant.quantize_per_token_group_reference(x, 128)
    assert q.dtype == FP8 and q.shape == (M, K) and s.shape == (M, -(-K // 128))
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert s[0, 0] == 1.0
