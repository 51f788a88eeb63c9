"""Packed int4 / int8 weights in Triton (moe_serve/kernels/packed_linear.py, grouped_gemm/triton_packed.py,
int8_quant.py): the linear layer and the grouped GEMM read the codes, group scales and offsets and
decode each tile in registers. Against float64 oracles built from PackedWeight.dequantize() (the
format's reference): int4 and int8, group sizes 16 / 24 / 32 / 64 / 128 and per channel (odd K
among them), with and without offsets, tokens routed unevenly, experts with no tokens, pairs of
other ranks. W8A8 against the same product over the per-token int8 activations of the torch
reference quantizer. Tiny shapes: the interpreter runs these on the CPU."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules: see conftest.py

import warnings

import pytest

from moe_serve.kernels.grouped_gemm import config as cfg_mod
from moe_serve.kernels.grouped_gemm import experts_backend
from moe_serve.kernels.grouped_gemm import triton_kernel as tk
from moe_serve.kernels.grouped_gemm.reference import ClampedSwiGLU, fused_experts_float64
from moe_serve.kernels.grouped_gemm.triton_packed import fused_experts_packed_triton
from moe_serve.kernels.int8_quant import quantize_int8_per_token, quantize_int8_per_token_reference
from moe_serve.kernels.packed_linear import packed_linear_triton
from moe_serve.quantization.packed import PackedWeight, quantize_reference
from tests.kernels.test_grouped_gemm import SMALL, TALL, poisoned_workspace, rel_err, routing  # noqa: F401

DEVICE = "cpu" if tk.INTERPRETED or not torch.cuda.is_available() else "cuda"
# bf16: x given; each dequantized weight tile, h and the output rounded once to bf16, which the
# interpreter does by truncation (each a bias toward zero of up to 2**-8): one rounding more than
# the dense kernel's tests (2e-2), whose weights are exact in bf16
RTOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
DTYPES = [torch.float32, torch.bfloat16]


def packed(shape, bits, group, gen, offsets=True):
    """A random weight rounded to `bits` in groups of `group` (asymmetric: min/max zero points),
    or, without offsets, symmetric codes with the offsets dropped (W = scale * q: codes never 0-centred,
    the product then has a large common part, which any slip in the codes would show)."""
    w = quantize_reference(torch.randn(*shape, generator=gen) / shape[-1] ** 0.5, bits, group, symmetric=not offsets)
    if not offsets:
        w = PackedWeight(bits, w.qweight, w.scales / 2 ** (bits - 1), None, group, w.shape)
    return w.to(DEVICE)


def linear_oracle(x, w, bias=None):
    y = x.double().cpu() @ w.dequantize(torch.float64).cpu().T
    return y if bias is None else y + bias.double().cpu()


# (K, group): groups the 128-wide K tile divides, narrowed ones (16: 128 -> 16), per channel over
# a K no tile divides (40, 96), and a group no power-of-two tile divides (24: one scale per element)
LINEAR_CASES = [(128, 32), (128, 64), (128, 128), (96, 96), (40, 40), (48, 24), (64, 16)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("bits", [4, 8])
def test_packed_linear_matches_oracle(bits, dtype):
    """N = 37 rows (a partial 64-wide N tile); M = 1, 5, 33 (the 16- and 32-row tiles), with and
    without offsets, with a bias on some cases; 3-d activations keep their leading shape."""
    gen = torch.Generator().manual_seed(bits * 10 + (dtype == torch.bfloat16))
    for i, (K, G) in enumerate(LINEAR_CASES):
        M = (1, 5, 33)[i % 3]
        w = packed((37, K), bits, G, gen, offsets=i % 2 == 0)
        bias = torch.randn(37, generator=gen).to(dtype).to(DEVICE) if i % 3 == 1 else None
        x = torch.randn(M, K, generator=gen).to(dtype).to(DEVICE)
        y = packed_linear_triton(x, w, bias)
        assert y.dtype == dtype and y.shape == (M, 37)
        assert rel_err(y, linear_oracle(x, w, bias)) < RTOL[dtype], (K, G, M)
    y3 = packed_linear_triton(x.view(1, M, K), w)
    assert y3.shape == (1, M, 37) and rel_err(y3[0], linear_oracle(x, w)) < RTOL[dtype]
    assert packed_linear_triton(x[:0], w).shape == (0, 37)


def test_packed_linear_fp16():
    gen = torch.Generator().manual_seed(5)
    w = packed((24, 64), 4, 32, gen)
    x = torch.randn(3, 64, generator=gen).half().to(DEVICE)
    assert rel_err(packed_linear_triton(x, w), linear_oracle(x, w)) < RTOL[torch.float16]


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_linear_zero_code(bits):
    """A symmetric weight compacted to a zero code (no offsets array, PackedWeight.zero, as CPU
    layers hold it): the kernel reads it as offsets -zero * scale."""
    gen = torch.Generator().manual_seed(7 + bits)
    w = quantize_reference(torch.randn(37, 128, generator=gen) / 8, bits, 32, symmetric=True).compact()
    assert w.offsets is None and w.zero == 2 ** (bits - 1)
    w = w.to(DEVICE)
    x = torch.randn(5, 128, generator=gen).to(DEVICE)
    assert rel_err(packed_linear_triton(x, w), linear_oracle(x, w)) < RTOL[torch.float32]


def test_int8_activation_quantization_matches_reference():
    """Per-token int8 codes and scales equal the torch reference's (a row of zeros scaled by 1; rows
    of magnitudes 1e-3 to 1e3); rows wider than one 1024-wide tile take the kernel's K loop."""
    gen = torch.Generator().manual_seed(2)
    for M, K in ((5, 96), (3, 2500)):
        x = torch.randn(M, K, generator=gen) * torch.logspace(-3, 3, M)[:, None]
        x[1] = 0.0
        q, s = quantize_int8_per_token(x.to(DEVICE))
        rq, rs = quantize_int8_per_token_reference(x)
        assert q.dtype == torch.int8 and torch.equal(q.cpu(), rq) and torch.equal(s.cpu(), rs)
        assert s[1] == 1 and not q[1].any() and q.abs().max() == 127


@pytest.mark.parametrize("K,offsets", [(128, True), (96, False), (40, True), (1100, True)],
                         ids=["zero-points", "symmetric", "odd-K", "K-over-1024"])
def test_packed_linear_w8a8_matches_oracle(K, offsets):
    """Int8 x int8 tiles into one int32 accumulator (per-channel weights): equal (to fp32 rounding)
    to the float64 product of the reference quantizer's activations and the dequantized weights,
    and within the activations' quantization error (~1%) of the unquantized product."""
    gen = torch.Generator().manual_seed(K)
    w = packed((37, K), 8, K, gen, offsets)
    for M in (1, 33):
        x = torch.randn(M, K, generator=gen).to(DEVICE)
        xq, xs = quantize_int8_per_token_reference(x.cpu())
        ref = (xq.double() * xs.double()[:, None]) @ w.dequantize(torch.float64).cpu().T
        y = packed_linear_triton(x, w, act_quant=True)
        assert rel_err(y, ref) < 1e-5, M
        assert rel_err(y, linear_oracle(x, w)) < 3e-2


def test_packed_errors_name_the_tensor():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 48, device=DEVICE)
    with pytest.raises(ValueError, match="W8A8.*8-bit.*4-bit"):
        packed_linear_triton(x, packed((8, 48), 4, 48, gen), act_quant=True)
    with pytest.raises(ValueError, match=r"packed linear weight: W8A8 needs per-channel weights \(group size = K = "
                                         r"48\), not groups of 24"):
        packed_linear_triton(x, packed((8, 48), 8, 24, gen), act_quant=True)
    with pytest.raises(ValueError, match=r"weight of shape \(8, 64\) does not fit activations \(2, 48\)"):
        packed_linear_triton(x, packed((8, 64), 8, 32, gen))
    with pytest.raises(ValueError, match="dtype torch.float64"):
        packed_linear_triton(x.double(), packed((8, 48), 8, 48, gen))
    w13, w2 = packed((2, 32, 48), 8, 48, gen), packed((2, 48, 16), 4, 16, gen)
    ids = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="W8A8 .* w13 8-bit and w2 4-bit"):
        fused_experts_packed_triton(x, w13, w2, torch.ones(2, 1, device=DEVICE), ids, act_quant=True)


# ---- experts ---------------------------------------------------------------------------------------

D, F, E = 64, 48, 5  # F: no power-of-two K tile of the down GEMM divides it
# (bits, w13 group over D, w2 group over F, offsets, dtype): per group, per channel, a narrowed tile
# and a group no tile divides (24: a scale per element), without offsets (symmetric codes)
BF16, FP32 = torch.bfloat16, torch.float32
NAMES = {BF16: "bf16", FP32: "fp32"}
# bits: one width, or (w13's, w2's) as GGUF's Q4_K_M mixes them (4-bit gate/up, down a code a byte)
EXPERT_CASES = [(4, 32, 16, True, FP32), (4, 64, 48, False, BF16), (8, 16, 24, True, BF16), (8, 64, 48, True, FP32),
                (8, 32, 16, False, FP32), (4, 16, 24, True, BF16), ((4, 8), 32, 16, True, BF16)]
CONFIGS = (cfg_mod.DECODE_CONFIG, SMALL, TALL)


def experts_layer(bits, g13, g2, offsets, T, dtype, gen):
    b13, b2 = bits if isinstance(bits, tuple) else (bits, bits)
    w13, w2 = packed((E, 2 * F, D), b13, g13, gen, offsets), packed((E, D, F), b2, g2, gen, offsets)
    x = (torch.randn(T, D, generator=gen) * 2).to(dtype).to(DEVICE)
    return x, w13, w2


def experts_oracle(x, w13, w2, weights, ids, **kw):
    return fused_experts_float64(x, w13.dequantize(torch.float64).cpu(), w2.dequantize(torch.float64).cpu(),
                                 weights.cpu(), ids.cpu(), **kw)


@pytest.mark.parametrize("case", EXPERT_CASES,
                         ids=lambda c: f"int{'/'.join(map(str, c[0])) if isinstance(c[0], tuple) else c[0]}-g{c[1]}"
                                       f"-g{c[2]}{'' if c[3] else '-sym'}-{NAMES[c[4]]}")
def test_packed_experts_match_oracle(case, poisoned_workspace):
    """T = 1, 6, 33 with K = 2, 3, 2 under three configs (the decode tile; 32-wide K tiles; 16-wide
    with GROUP_SIZE_M 3): routing skewed to some experts, experts 1 and 3 given no tokens in the
    larger batches, pairs sent to -1 (held by another rank) among them."""
    bits, g13, g2, offsets, dtype = case
    gen = torch.Generator().manual_seed(sum(bits if isinstance(bits, tuple) else (bits,)) * 100 + g13 + g2 + offsets
                                        + (dtype == torch.bfloat16))
    for (T, K, skip, zero), cfg in zip([(1, 2, 0.0, ()), (6, 3, 0.3, (1, 3)), (33, 2, 0.2, (1, 3))], CONFIGS):
        x, w13, w2 = experts_layer(bits, g13, g2, offsets, T, dtype, gen)
        weights, ids = routing(T, E, K, gen, skip, zero_experts=zero)
        weights, ids = weights.to(DEVICE), ids.to(DEVICE)
        got = fused_experts_packed_triton(x, w13, w2, weights, ids, cfg)
        assert got.dtype == dtype and got.shape == (T, D)
        assert rel_err(got, experts_oracle(x, w13, w2, weights, ids)) < RTOL[dtype], (T, cfg)


def test_packed_experts_biases_and_clamped_activation(poisoned_workspace):
    """Per-expert biases on both GEMMs and GPT-OSS's clamped SwiGLU, as the dense kernel runs them."""
    gen = torch.Generator().manual_seed(7)
    x, w13, w2 = experts_layer(4, 32, 16, True, 9, torch.float32, gen)
    b13, b2 = torch.randn(E, 2 * F, generator=gen).to(DEVICE), torch.randn(E, D, generator=gen).to(DEVICE)
    weights, ids = routing(9, E, 2, gen, 0.2)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    act = ClampedSwiGLU(1.702, 1.0)  # a limit the products pass, so the clamps act
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's exp overflows in sigmoid (to 0 / 1)
        got = fused_experts_packed_triton(x, w13, w2, weights, ids, SMALL, w13_bias=b13, w2_bias=b2, activation=act)
    ref = experts_oracle(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, activation=act)
    assert rel_err(got, ref) < RTOL[torch.float32]


def test_packed_experts_w8a8(poisoned_workspace):
    """Int8 per-channel experts with x and h quantized per row: equal (to fp32 rounding) to the float64
    experts over the reference quantizer's x and h (h rounded to x's dtype first, as the kernel
    stores it), and within quantization error of the unquantized experts."""
    gen = torch.Generator().manual_seed(8)
    for cfg, T, offsets in ((cfg_mod.DECODE_CONFIG, 1, True), (SMALL, 13, False), (TALL, 35, True)):
        x, w13, w2 = experts_layer(8, D, F, offsets, T, torch.float32, gen)
        weights, ids = routing(T, E, 2, gen, 0.2, zero_experts=(2,))
        weights, ids = weights.to(DEVICE), ids.to(DEVICE)
        got = fused_experts_packed_triton(x, w13, w2, weights, ids, cfg, act_quant=True)
        W13, W2 = w13.dequantize(torch.float64).cpu(), w2.dequantize(torch.float64).cpu()
        xq, xs = quantize_int8_per_token_reference(x.cpu())
        xd = xq.double() * xs.double()[:, None]
        ref = torch.zeros(T, D, dtype=torch.float64)
        for t in range(T):
            for k in range(ids.shape[1]):
                e = int(ids[t, k])
                if e < 0:
                    continue
                gate, up = (W13[e] @ xd[t]).chunk(2)
                h = (torch.nn.functional.silu(gate) * up).float()[None]
                hq, hs = quantize_int8_per_token_reference(h)
                ref[t] += float(weights[t, k]) * (W2[e] @ (hq.double() * hs.double()[:, None])[0])
        assert rel_err(got, ref) < 1e-4, T
        assert rel_err(got, experts_oracle(x, w13, w2, weights, ids)) < 5e-2


def test_no_pairs_here_and_no_tokens(poisoned_workspace):
    """Every pair sent to -1 (experts held elsewhere): zeros; T = 0: nothing runs."""
    gen = torch.Generator().manual_seed(3)
    x, w13, w2 = experts_layer(4, 32, 16, True, 4, torch.float32, gen)
    ids = torch.full((4, 2), -1, dtype=torch.int32, device=DEVICE)
    got = fused_experts_packed_triton(x, w13, w2, torch.rand(4, 2, device=DEVICE), ids)
    assert torch.equal(got.cpu(), torch.zeros(4, D))
    empty = torch.empty(0, 2, dtype=torch.int32, device=DEVICE)
    assert fused_experts_packed_triton(x[:0], w13, w2, empty.float(), empty).shape == (0, D)


def test_triton_backends_run_packed_weights_in_the_kernels(monkeypatch):
    """experts_backend("triton") and TritonLinear send packed weights to the packed kernels, never to
    the torch ops' per-call dequantization (the packed layers as the loaders leave them: offsets
    always present, zeros where the checkpoint has none)."""
    from moe_serve.kernels import grouped_gemm as gg
    from moe_serve.kernels.linear import TritonLinear
    from moe_serve.layers.linear import Linear

    gen = torch.Generator().manual_seed(11)
    x, w13, w2 = experts_layer(4, 32, 16, True, 6, torch.bfloat16, gen)
    weights, ids = routing(6, E, 2, gen, 0.2)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    ref = experts_oracle(x, w13, w2, weights, ids)
    layer = Linear(64, 37, bias=True)
    layer.to_packed(8, 32)
    lw = packed((37, 64), 8, 32, gen)
    layer.load_packed(lw)
    layer.bias.data.normal_(generator=gen)
    layer = layer.to(DEVICE)
    lref = linear_oracle(x, lw, layer.bias.detach())

    def no_dequantize(*a, **k):
        raise AssertionError("dequantized the packed weight per call")

    monkeypatch.setattr(gg, "fused_experts_mxfp4", no_dequantize)
    monkeypatch.setattr(PackedWeight, "dequantize", no_dequantize)
    got = experts_backend("triton", DEVICE)(x, w13, w2, weights, ids)
    assert rel_err(got, ref) < RTOL[torch.bfloat16]
    y = TritonLinear(DEVICE).packed(layer, x.float())
    assert rel_err(y, lref) < RTOL[torch.float32]


def test_engine_serves_a_w4a16_checkpoint_through_the_packed_kernels(tmp_path, monkeypatch):
    """A compressed-tensors W4A16 checkpoint (group 32, zero points: llm-compressor's packing by the
    package itself) served with the Triton backends: every packed linear layer and the experts run in
    the packed kernels (none dequantized per call), and the greedy tokens equal transformers' on the
    package's own decompressed weights (a differing token only at a top-2 tie)."""
    from moe_serve import LLM, SamplingParams
    from moe_serve.kernels import specialization as sp
    from tests.models.test_compressed_tensors import build_qwen3_moe_128, oracle, write_checkpoint
    from tests.models.test_hf_parity import assert_same_greedy, hf_greedy

    src = build_qwen3_moe_128(str(tmp_path / "src"))
    dst = str(tmp_path / "w4a16")
    model = oracle(src, write_checkpoint(src, dst, dict(num_bits=4, symmetric=False, strategy="group", group_size=32)),
                   str(tmp_path / "oracle"))
    # attention in torch ops: its kernels have their own tests, and the interpreter's time goes here
    llm = LLM(dst, dtype="float32", kv_cache_memory=1 << 22, show_progress=False, moe_backend="triton",
              attention_backend="torch", linear_backend="triton", max_num_batched_tokens=16)
    prompts = [[5, 77, 301, 42], [9, 8, 7, 6, 5, 4, 3, 200, 100, 17, 18, 19, 20, 21, 22, 23, 24, 25]]  # 2 chunks
    def no_dequantize(*a, **k):
        raise AssertionError("dequantized a packed weight while serving")

    monkeypatch.setattr(PackedWeight, "dequantize", no_dequantize)
    with sp.record(run=True) as launches:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=4))
    assert {sp.PACKED_GEMM, sp.PACKED_LINEAR} <= {x.kernel for x in launches}
    monkeypatch.undo()  # the oracle's transformers model is plain torch
    for p, o in zip(prompts, outs):
        assert_same_greedy(model, p, o.outputs[0].token_ids, hf_greedy(model, p, 4))


def test_engine_serves_a_w8a8_checkpoint_with_int8_activations(tmp_path, monkeypatch):
    """A compressed-tensors W8A8 int8 checkpoint (int8 weights per channel, activations int8 per
    token, dynamic) served with the Triton backends where the platform quantizes activations (CUDA:
    `int8_activation_quant`, made to say so here): every packed linear layer and the experts launch
    their W8A8 form (A_INT8, with the activation quantizer), and the greedy tokens equal transformers'
    on the package's decompressed weights with each quantized layer's input rounded to int8 per
    token as the scheme says (a differing token only at a top-2 tie); the first token's log-
    probability is that model's to float32 rounding, and not the float-activation model's."""
    from moe_serve import LLM, SamplingParams, platform
    from moe_serve.kernels import specialization as sp
    from tests.models.test_compressed_tensors import W8A8_ACT, build_qwen3_moe_128, oracle, write_checkpoint
    from tests.models.test_hf_parity import assert_same_greedy, hf_greedy

    src = build_qwen3_moe_128(str(tmp_path / "src"))
    dst = str(tmp_path / "w8a8")
    dequant = write_checkpoint(src, dst, dict(num_bits=8, symmetric=True, strategy="channel"), fmt="int-quantized",
                               activations=W8A8_ACT)
    model = oracle(src, dequant, str(tmp_path / "oracle"))

    def int8_per_token(x):  # the scheme's input quantization, written from its definition
        s = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
        v = (x / s).clamp(-127, 127)
        return torch.sign(v) * torch.floor(v.abs() + 0.5) * s

    # transformers' eager experts call F.linear per expert, as nn.Linear does: every quantized
    # layer's input is rounded there; the head and the routers (left float by the recipe) are not.
    model.config._experts_implementation = "eager"
    float_weights = {model.lm_head.weight.data_ptr()} | {m.gate.weight.data_ptr() for m in model.modules()
                                                         if hasattr(m, "gate") and hasattr(m, "experts")}
    linear = torch.nn.functional.linear

    def quantized_linear(x, w, b=None):
        return linear(x if w.data_ptr() in float_weights else int8_per_token(x), w, b)

    monkeypatch.setattr(platform, "int8_activation_quant", lambda device: True)
    llm = LLM(dst, dtype="float32", kv_cache_memory=1 << 22, show_progress=False, moe_backend="triton",
              attention_backend="torch", linear_backend="triton")
    prompts = [[5, 77, 301, 42], [9, 8, 7, 6, 5, 4, 3, 200]]
    with sp.record(run=True) as launches:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=3, logprobs=0))
    forms = {(x.kernel, dict(x.constexprs).get("A_INT8")) for x in launches}
    assert {(sp.PACKED_GEMM, True), (sp.PACKED_LINEAR, True)} <= forms, forms
    assert (sp.PACKED_GEMM, False) not in forms and (sp.PACKED_LINEAR, False) not in forms
    assert sp.INT8_QUANT in {x.kernel for x in launches}
    monkeypatch.undo()

    def first_logprob(p, t):  # the oracle's log-probability of token t after prompt p
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([p])).logits[0, -1].double(), -1)[t].item()

    ours = [(p, o.outputs[0].token_ids[0], o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob)
            for p, o in zip(prompts, outs)]
    weight_only = [abs(first_logprob(p, t) - lp) for p, t, lp in ours]
    monkeypatch.setattr(torch.nn.functional, "linear", quantized_linear)
    w8a8 = [abs(first_logprob(p, t) - lp) for p, t, lp in ours]
    # ours is the int8-activation model's, to float32 rounding; float activations give another
    assert max(w8a8) < 1e-4 and min(weight_only) > 1e-3, (w8a8, weight_only)
    for p, o in zip(prompts, outs):
        assert_same_greedy(model, p, o.outputs[0].token_ids, hf_greedy(model, p, 3))
