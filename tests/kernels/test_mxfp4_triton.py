"""MXFP4 experts in the Triton grouped GEMM (weights read packed: each tile of e2m1 bytes is decoded
in registers and scaled by its e8m0 exponents as it loads) and the expert variants of the same
launches (per-expert biases, DeepSeek-V4's limited SwiGLU, GPT-OSS's clamped SwiGLU), against the
float64 oracle on the exactly dequantized weights. Random bytes cover every e2m1 code (the
subnormal, both zeros); scales 118..130 keep the products in range. Small shapes: the interpreter
runs these on the CPU."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules: see conftest.py

import warnings

import pytest

from moe_serve.kernels.grouped_gemm import config as cfg_mod
from moe_serve.kernels.grouped_gemm import experts_backend
from moe_serve.kernels.grouped_gemm import triton_kernel as tk
from moe_serve.kernels.grouped_gemm.mxfp4 import Mxfp4Weight
from moe_serve.kernels.grouped_gemm.reference import ClampedSwiGLU, fused_experts_float64, kernel_activation
from tests.kernels.test_grouped_gemm import SMALL, TALL, poisoned_workspace, rel_err, routing  # noqa: F401

DEVICE = "cpu" if tk.INTERPRETED or not torch.cuda.is_available() else "cuda"
# bf16: x, h and y are each rounded once to bf16 (the interpreter truncates: up to 2**-7 each), as
# in the dense kernel's tests; the weights are exact in bf16.
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
D, F, E = 64, 96, 5  # the down GEMM's k (F) ends in a partial tile of the 64- and 128-wide K tiles
# The decode config; 32-wide K tiles; a K tile of 16 (raised to one scale group, 32) with GROUP_SIZE_M 3.
CONFIGS = (cfg_mod.DECODE_CONFIG, SMALL, TALL)


class LimitedSwiGLU:
    """DeepSeek-V4's expert activation as moe_serve/models/deepseek_v4.py defines it (the backend
    knows it by class name and `limit`): silu(min(gate, limit)) * clamp(up, -limit, limit)."""

    def __init__(self, limit):
        self.limit = limit

    def __call__(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return torch.nn.functional.silu(gate) * up


ACTS = {"silu": "silu", "limited": LimitedSwiGLU(5.0), "unlimited": LimitedSwiGLU(None),
        "clamped": ClampedSwiGLU(1.702, 7.0)}


def mxfp4(E, R, C, gen, lo=118, hi=130):
    """Random packed weights: any byte, scales in [lo, hi]."""
    return Mxfp4Weight(torch.randint(0, 256, (E, R, C // 32, 16), dtype=torch.uint8, generator=gen).to(DEVICE),
                       torch.randint(lo, hi + 1, (E, R, C // 32), dtype=torch.uint8, generator=gen).to(DEVICE))


def mxfp4_layer(T, dtype, gen, bias):
    """x scaled so the gate / up products are a few units to a few tens (the clamps at 5 and 7 cut
    some, not all); biases of the same order."""
    w13, w2 = mxfp4(E, 2 * F, D, gen), mxfp4(E, D, F, gen)
    x = (torch.randn(T, D, generator=gen) * 0.1).to(dtype).to(DEVICE)
    b13 = (torch.randn(E, 2 * F, generator=gen) * 3).to(dtype).to(DEVICE) if bias else None
    b2 = (torch.randn(E, D, generator=gen) * 3).to(dtype).to(DEVICE) if bias else None
    return x, w13, w2, b13, b2


def run(x, w13, w2, weights, ids, cfg, b13, b2, act):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's exp overflows in sigmoid (to 0 / 1)
        return tk.fused_experts_triton(x, w13, w2, weights, ids, cfg, w13_bias=b13, w2_bias=b2, activation=act)


def oracle(x, w13, w2, weights, ids, b13, b2, act):
    return fused_experts_float64(x, w13.dequantize(torch.float64).cpu(), w2.dequantize(torch.float64).cpu(),
                                 weights.cpu(), ids.cpu(), w13_bias=b13, w2_bias=b2, activation=act)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act,bias", [("silu", False), ("silu", True), ("limited", False), ("unlimited", True),
                                      ("clamped", True), ("clamped", False)])
def test_mxfp4_experts_match_oracle(act, bias, dtype, poisoned_workspace):
    """T = 1, 5, 33 with K = 4, 2, 4 (pairs sent to -1 among them), each under another config
    (decode tile, 32-wide and 16-wide K tiles): every activation, with and without biases."""
    gen = torch.Generator().manual_seed(len(act) * 7 + bias + (dtype == torch.bfloat16))
    activation = ACTS[act]
    clamped = False
    for (T, K, skip), cfg in zip([(1, 4, 0.0), (5, 2, 0.3), (33, 4, 0.2)], CONFIGS):
        x, w13, w2, b13, b2 = mxfp4_layer(T, dtype, gen, bias)
        weights, ids = routing(T, E, K, gen, skip)
        weights, ids = weights.to(DEVICE), ids.to(DEVICE)
        ref = oracle(x, w13, w2, weights, ids, b13, b2, activation)
        got = run(x, w13, w2, weights, ids, cfg, b13, b2, activation)
        assert got.dtype == dtype and got.shape == (T, D)
        assert rel_err(got, ref) < RTOL[dtype], (T, cfg)
        gu = torch.einsum("td,efd->tef", x.double().cpu(), w13.dequantize(torch.float64).cpu())
        clamped |= bool((gu.abs() > 7).any())
    if act in ("limited", "clamped"):
        assert clamped  # the limits cut some products


def test_skipped_pairs_and_no_tokens_give_zeros(poisoned_workspace):
    """Every pair sent to -1 (experts held elsewhere): zeros, biases included; T = 0: nothing runs."""
    gen = torch.Generator().manual_seed(3)
    x, w13, w2, b13, b2 = mxfp4_layer(4, torch.float32, gen, True)
    ids = torch.full((4, 2), -1, dtype=torch.int32, device=DEVICE)
    got = run(x, w13, w2, torch.rand(4, 2, device=DEVICE), ids, None, b13, b2, ACTS["clamped"])
    assert torch.equal(got.cpu(), torch.zeros(4, D))
    empty = torch.empty(0, 2, dtype=torch.int32, device=DEVICE)
    assert run(x[:0], w13, w2, empty.float(), empty, None, b13, b2, "silu").shape == (0, D)


def decoded_by_kernel(w: Mxfp4Weight, cfg: dict) -> torch.Tensor:
    """(R, C) float32: expert 0 of w as the kernel decodes it, read out by one ungated launch over
    the C one-hot rows of the identity (c[p, n] = w[n, p], exactly: fp32 products of one term)."""
    from moe_serve.kernels.grouped_gemm.align import align_block_size

    _, R, C = w.shape
    a = torch.eye(C, device=DEVICE)
    routing = align_block_size(torch.zeros(C, 1, dtype=torch.int32, device=DEVICE), 1, cfg["BLOCK_SIZE_M"])
    S = routing.sorted_pair_ids_S.shape[0]
    launch = tk.fp4_gemm_launch(cfg, torch.float32)
    out = torch.full((C, R), float("nan"), device=DEVICE)
    blocks, sc = w.blocks.flatten(2), w.scales
    unused = torch.zeros(1, device=DEVICE)
    tk._grouped_gemm_kernel[(S // cfg["BLOCK_SIZE_M"] * -(-R // launch["BLOCK_SIZE_N"]),)](
        a, blocks, out, unused, routing.sorted_pair_ids_S, routing.expert_ids_B, routing.num_padded,
        R, C, S, C, 1, a.stride(0), a.stride(1), blocks.stride(0), blocks.stride(1), blocks.stride(2),
        out.stride(0), out.stride(1), sc, sc.stride(0), sc.stride(1), sc.stride(2), 0, unused, 0, 0,
        unused, 0, 0.0, 0.0, GATED=False, MUL_WEIGHT=False, ACT=0, HAS_BIAS=False, **launch)
    return out.T


@pytest.mark.parametrize("cfg", [cfg_mod.PREFILL_CONFIG, TALL], ids=["BK64", "BK16"])
def test_kernel_decodes_every_code_exactly(cfg):
    """Every byte value in many nibble positions of a 32-group (row r holds 0..255 rotated by 3r,
    cut to 128 bytes), scales from 2 (2**-125) to 252 (2**125) and, under the interpreter, 0 (2**-127: a
    float32 subnormal a GPU may flush): the kernel's decode equals dequantize_mxfp4 bit for bit
    (-0.0 aside: the read-out's sum gives +0.0), low nibble first, each group times its own scale."""
    R, G = 32, 8
    rows = torch.stack([torch.roll(torch.arange(256), 3 * r)[:G * 16] for r in range(R)]).to(torch.uint8)
    blocks = rows.view(1, R, G, 16)
    scale_set = [2, 3, 60, 100, 120, 126, 127, 128, 130, 140, 200, 252] + ([0] if tk.INTERPRETED else [127])
    scales = torch.tensor([scale_set[(r + g) % len(scale_set)] for r in range(R) for g in range(G)],
                          dtype=torch.uint8).view(1, R, G)
    w = Mxfp4Weight(blocks.to(DEVICE), scales.to(DEVICE))
    got = decoded_by_kernel(w, cfg).cpu()
    want = w.dequantize(torch.float32)[0].cpu()
    assert torch.equal(got, want)
    assert want[0, :4].tolist() == [0.0, 0.0, 0.5 * 2.0 ** -125, 0.0]  # bytes 0, 1 (low nibble first) at scale 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_backend_runs_mxfp4_and_the_variants_in_the_kernel(dtype, monkeypatch):
    """experts_backend("triton") sends MXFP4 experts (GPT-OSS's clamped SwiGLU with biases,
    DeepSeek-V4's limited one without), dense experts with a variant and block FP8 with one to the
    kernel, never to the torch ops' per-step dequantization; an activation the kernel has no form
    for still runs (torch ops)."""
    from moe_serve.kernels import grouped_gemm as gg
    from moe_serve.quantization.fp8 import BlockFp8Experts, quantize_blocks

    def no_torch_ops(*a, **k):
        raise AssertionError("ran the torch ops' MXFP4 path")

    monkeypatch.setattr(gg, "fused_experts_mxfp4", no_torch_ops)
    backend = experts_backend("triton", DEVICE)
    gen = torch.Generator().manual_seed(11)
    T, K = 6, 2
    weights, ids = routing(T, E, K, gen, 0.2)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    for act, bias in (("clamped", True), ("limited", False)):
        x, w13, w2, b13, b2 = mxfp4_layer(T, dtype, gen, bias)
        ref = oracle(x, w13, w2, weights, ids, b13, b2, ACTS[act])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            got = backend(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, activation=ACTS[act])
        assert rel_err(got, ref) < RTOL[dtype], act
    # dense weights in x's dtype with a variant, and block FP8 with one: the same kernel flags
    dense13, dense2 = (w.dequantize(torch.float32) / 8 for w in (w13, w2))
    ref = fused_experts_float64(x, dense13.double(), dense2.double(), weights, ids, w13_bias=b13, w2_bias=b2,
                                activation=ACTS["clamped"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = backend(x, dense13.to(dtype), dense2.to(dtype), weights, ids, w13_bias=b13, w2_bias=b2,
                      activation=ACTS["clamped"])
    assert rel_err(got, ref) < RTOL[dtype]
    if dtype == torch.bfloat16:
        q13, s13 = quantize_blocks(dense13[:, :F].contiguous(), (32, 32))
        u13, t13 = quantize_blocks(dense13[:, F:].contiguous(), (32, 32))
        q2, s2 = quantize_blocks(dense2, (32, 32))
        f13 = BlockFp8Experts(torch.cat([q13, u13], 1), torch.cat([s13, t13], 1), (32, 32), (F, F))
        f2 = BlockFp8Experts(q2, s2, (32, 32), (D,))
        ref = fused_experts_float64(x, f13.dequantize(torch.float64), f2.dequantize(torch.float64), weights, ids,
                                    activation=ACTS["limited"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            got = backend(x, f13, f2, weights, ids, activation=ACTS["limited"])
        assert rel_err(got, ref) < RTOL[dtype]
    # No kernel form: torch ops (dense), the same numbers as the torch backend.
    monkeypatch.undo()
    odd = lambda gu: torch.tanh(gu[..., :F]) * gu[..., F:]  # noqa: E731
    assert kernel_activation(odd) is None
    x32 = x.float()
    got = backend(x32, w13, w2, weights, ids, activation=odd)
    assert rel_err(got, oracle(x32, w13, w2, weights, ids, None, None, odd)) < 1e-5


def test_backend_declares_mxfp4_layers_for_warm_up():
    """in_kernel / warm_up know MXFP4 layers (GPT-OSS's and DeepSeek-V4's), the masked GEMM
    (DeepEP's low-latency layout) does not take them, and the warm-up compiles (records, here)
    each config's gate/up and down launch with the MXFP4 flags."""
    from types import SimpleNamespace

    from moe_serve.kernels import specialization as sp
    from moe_serve.layers.experts import Mxfp4Experts

    backend = experts_backend("triton", DEVICE)
    for act, bias in ((ACTS["clamped"], True), (ACTS["limited"], False)):
        with torch.device("meta"):
            experts = Mxfp4Experts(8, 64, 96, list(range(8)), torch.bfloat16, bias=bias, activation=act)
        moe = SimpleNamespace(experts=experts, gate=SimpleNamespace(top_k=2))
        assert backend.in_kernel(moe, torch.bfloat16) and not backend.masked_applies(experts)
        with sp.record() as launches:  # recorded, not run (meta tensors)
            backend.warm_up(moe, torch.bfloat16, low_latency_rows=128)
        assert {x.kernel for x in launches} == {sp.GEMM, sp.TOPK}  # no masked GEMM
        keys = {(x.constexprs, x.types["b_ptr"]) for x in launches if x.kernel == sp.GEMM}
        cx = [dict(c) for c, _ in keys]
        assert {t for _, t in keys} == {"*u8"} and all(c["B_FP4"] for c in cx)
        assert len(keys) == 2 * len(cfg_mod.DEFAULT_CONFIGS)  # gate/up and down per default config
        assert {(c["GATED"], c["ACT"], c["HAS_BIAS"]) for c in cx} == {
            (True, kernel_activation(act)[0], bias), (False, 0, bias)}
        assert all(c["BLOCK_SIZE_K"] >= 32 for c in cx)
    with torch.device("meta"):
        odd = Mxfp4Experts(8, 64, 96, list(range(8)), torch.bfloat16, bias=False, activation=lambda gu: gu)
    assert not backend.in_kernel(SimpleNamespace(experts=odd, gate=SimpleNamespace(top_k=2)), torch.bfloat16)
