"""int8 / int4 packed weights (PackedWeight) through quant.c's kernels (cpu_ops.quant) against float64
references built from PackedWeight.dequantize(), on every ISA of vec.h this CPU executes (the `isa`
fixture, as in test_cpu_ops.py): bits 4 and 8, with and without offsets or a zero code, odd N, group sizes of 32, 64,
128, K and ones that leave a tail inside each group, 1, 3 and 17 activation rows (the tiles' 1..4
rows and their remainders), one and two threads; prefill-sized calls through the panel GEMM (linear
layers and experts from quant.panel_min_rows() rows: weight blocks widened from the codes, partial blocks,
several panel groups, experts on both paths in one call; quant.panels_run() says the path ran); and the
refusals, each naming what it refuses."""
from __future__ import annotations


import pytest
import torch

from moe_serve.kernels import cpu_ops
from moe_serve.kernels.cpu_ops import quant
from moe_serve.quantization.packed import PackedWeight, pack_nibbles
from tests.kernels.cpu_isa import isa, isa_vnni  # noqa: F401  (fixtures: each test once per ISA build)
from tests.kernels.cpu_isa import by_thread_cases
from tests.kernels.cpu_isa import threads as _threads

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C kernels did not build here (no C compiler)")


def _packed(shape, bits, G, offsets, g):
    """Random codes, positive scales and (offsets) the signed formats' -2^(bits-1) * scale plus noise,
    so that the kernels' scale * sum(q x) + offset * sum(x) cancels as it does on real checkpoints;
    offsets "zero": no offsets array but the zero code 2^(bits-1) - 1 (PackedWeight.zero, what a
    compacted symmetric format holds), "both": that zero code and offsets of noise alone, "half": the
    zero code and float16 scales (PackedWeight.compact's form of GGUF Q4_0 / Q8_0)."""
    if offsets == "half":
        w = _packed(shape, bits, G, "zero", g)
        return PackedWeight(bits, w.qweight, w.scales.half(), None, G, shape, w.zero)
    if offsets in ("zero", "both"):
        w = _packed(shape, bits, G, offsets == "both", g)
        z = 2 ** (bits - 1) - 1
        off = w.offsets + (2 ** (bits - 1)) * w.scales if w.offsets is not None else None
        return PackedWeight(bits, w.qweight, w.scales, off, G, shape, z)
    K = shape[-1]
    q = torch.randint(0, 2 ** bits, shape, generator=g, dtype=torch.int64).to(torch.uint8)
    scales = torch.rand(*shape[:-1], K // G, generator=g) * 0.02 + 0.001
    off = None
    if offsets:
        off = -(2 ** (bits - 1)) * scales + 0.01 * torch.randn(*shape[:-1], K // G, generator=g)
    qw = pack_nibbles(q) if bits == 4 else q
    return PackedWeight(bits, qw, scales, off, G, shape)


def _bound(w: PackedWeight) -> torch.Tensor:
    """|W| elementwise by its two terms (|scale q| + |offset|), float64: the size of the sums."""
    k, G = w.shape[-1], w.group_size
    q = w.codes().double().reshape(*w.shape[:-1], k // G, G) - w.zero
    b = (q * w.scales.double().unsqueeze(-1)).abs()
    if w.offsets is not None:
        b = b + w.offsets.double().abs().unsqueeze(-1)
    return b.reshape(w.shape)


LINEAR_CASES = [(37, 128, 32), (37, 128, 64), (5, 256, 128), (19, 96, 96), (7, 80, 40), (3, 6, 6)]


@pytest.mark.parametrize("N,K,G", LINEAR_CASES)
@pytest.mark.parametrize("bits,offsets", [(8, True), (8, False), (8, "zero"), (8, "half"), (4, True), (4, False),
                                          (4, "zero"), (4, "both"), (4, "half")])
def test_quant_linear_matches_float64(N, K, G, bits, offsets, isa):
    g = torch.Generator().manual_seed(N * 1000 + K + G + bits)
    w = _packed((N, K), bits, G, offsets, g)
    W = w.dequantize().double()
    for M, threads in ((1, 1), (3, 2), (17, 1), (17, 2)):
        x = torch.randn(M, K, generator=g)
        with _threads(threads):
            y = quant.quant_linear(x, w)
        ref = x.double() @ W.T
        tol = 1e-5 * (x.double().abs() @ _bound(w).T) + 1e-6
        assert y.shape == (M, N) and y.dtype == torch.float32
        err = (y.double() - ref).abs()
        assert (err <= tol).all(), f"M={M} threads={threads}: max err {err.max():.3g} (tol {tol.min():.3g}..)"


def test_quant_linear_rows_apart_bias_and_half_activations(isa):
    """Activation rows with a stride (a view), a bias, leading dims kept, bf16 activations widened."""
    g = torch.Generator().manual_seed(1)
    w = _packed((21, 64), 4, 32, True, g)
    W = w.dequantize().double()
    big = torch.randn(3, 100, generator=g)
    x = big[:, 10:74]
    b = torch.randn(21, generator=g)
    y = quant.quant_linear(x, w, b)
    ref = x.double() @ W.T + b.double()
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)
    xb = torch.randn(2, 2, 64, generator=g).to(torch.bfloat16)
    y = quant.quant_linear(xb, w)
    assert y.shape == (2, 2, 21)
    assert torch.allclose(y.double(), xb.double() @ W.T, rtol=1e-5, atol=1e-5)


# (N, K, G, M): many activation rows (M: rows past quant.panel_min_rows(); 0: exactly that many) take
# the panel GEMM over whole blocks of 8 weight rows (the rest by the dot-product tiles): a partial
# block left, exact blocks, several panel groups (K = 4096: 48 rows a group), groups with a tail
# (int4: a chunk of 8 codes after 32), and N below one block (no panels at all).
PANEL_LINEAR_CASES = [(37, 128, 32, 0), (16, 96, 96, 30), (19, 4096, 128, 80), (11, 80, 40, 5), (5, 64, 32, 20)]


@pytest.mark.parametrize("N,K,G,M", PANEL_LINEAR_CASES)
@pytest.mark.parametrize("bits,offsets", [(8, True), (8, "zero"), (4, True), (4, False), (4, "both"), (4, "half")])
def test_quant_linear_panels_match_float64(N, K, G, M, bits, offsets, isa):
    """Prefill-sized calls widen each block of 8 weight rows once and run the panel micro-kernel over
    it (one row fewer: the dot-product tiles); against float64 over PackedWeight.dequantize(), one
    and two threads."""
    g = torch.Generator().manual_seed(N * 7 + K + G + M + bits)
    w = _packed((N, K), bits, G, offsets, g)
    W = w.dequantize().double()
    first = quant.panel_min_rows()
    for rows, threads in ((first + M, 1), (first + M, 2), (first - 1, 1)):
        x = torch.randn(rows, K, generator=g)
        ref = x.double() @ W.T
        tol = 1e-5 * (x.double().abs() @ _bound(w).T) + 1e-6
        ran = quant.panels_run()
        with _threads(threads):
            y = quant.quant_linear(x, w)
        assert quant.panels_run() - ran == (1 if N >= 8 and rows >= first else 0)
        err = (y.double() - ref).abs()
        assert (err <= tol).all(), f"{rows} rows, threads={threads}: max err {err.max():.3g}"


def _experts_ref(x, w13, w2, wts, ids):
    W13, W2 = w13.dequantize().double(), w2.dequantize().double()
    E, F = W13.shape[0], W13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if not 0 <= e < E:
                continue
            h = W13[e] @ x[t].double()
            a = torch.nn.functional.silu(h[:F]) * h[F:]
            out[t] += float(wts[t, k]) * (W2[e] @ a)
    return out


@pytest.mark.parametrize("bits13,bits2,offsets,G", [(8, 8, True, 32), (4, 4, True, 48), (4, 8, False, 32),
                                                    (8, 4, True, 96), (4, 8, "zero", 32), (4, 8, "half", 32)])
def test_quant_experts_match_float64(bits13, bits2, offsets, G, isa):
    """Routing of 1, 3 and 17 tokens over 5 experts, top 3, some ids held elsewhere (-1), one and two
    threads: the weighted SwiGLU expert sum against float64 over the dequantized weights."""
    E, D, F = 5, 96, 48
    g = torch.Generator().manual_seed(bits13 * 10 + bits2 + G)
    w13 = _packed((E, 2 * F, D), bits13, G, offsets, g)
    w2 = _packed((E, D, F), bits2, G if F % G == 0 else F, offsets, g)
    for T, threads in ((1, 1), (3, 2), (17, 2)):
        x = torch.randn(T, D, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(T)])
        ids = torch.where(torch.rand(T, 3, generator=g) < 0.2, -1, ids)
        wts = torch.rand(T, 3, generator=g)
        with _threads(threads):
            out = quant.quant_experts(x, w13, w2, wts, ids)
        ref = _experts_ref(x, w13, w2, wts, ids)
        assert out.shape == (T, D) and out.dtype == torch.float32
        scale = ref.abs().max().item()
        assert torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-4 * scale), \
            f"T={T}: max err {(out.double() - ref).abs().max():.3g} of {scale:.3g}"


@pytest.mark.parametrize("bits13,bits2,offsets,G", [(4, 4, True, 32), (8, 4, False, 48), (4, 8, "zero", 32),
                                                    (4, 4, "half", 32)])
def test_quant_experts_by_thread_match_float64(bits13, bits2, offsets, G, isa):
    """Decode-sized routings that reach as many experts as there are threads (evenly) give whole
    experts to each thread (cases: tests/kernels/cpu_isa.py `by_thread_cases`). Against float64 over
    the dequantized weights, and bit for bit the one-thread result (each token's pairs added in the
    same order, with the same operations)."""
    E, D, F = 12, 96, 48
    g = torch.Generator().manual_seed(bits13 * 7 + bits2 + G)
    w13 = _packed((E, 2 * F, D), bits13, G, offsets, g)
    w2 = _packed((E, D, F), bits2, G if F % G == 0 else F, offsets, g)
    for ids, x, wts, out, serial in by_thread_cases(lambda x, wts, ids: quant.quant_experts(x, w13, w2, wts, ids),
                                                    quant.experts_by_thread_run, E, D, g):
        ref = _experts_ref(x, w13, w2, wts, ids)
        scale = ref.abs().max().item()
        assert torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-4 * scale), \
            f"T={ids.shape[0]}: max err {(out.double() - ref).abs().max():.3g} of {scale:.3g}"
        assert torch.equal(out, serial)


def test_refusals_name_what_they_refuse():
    g = torch.Generator().manual_seed(2)
    w = _packed((4, 6), 4, 3, True, g)  # a valid PackedWeight, but int4 with an odd group size
    assert not quant.quant_linear_fits(torch.randn(1, 6), w)
    with pytest.raises(ValueError, match="odd group_size=3"):
        quant.quant_linear(torch.randn(1, 6), w)
    w = _packed((4, 64), 8, 32, True, g)
    with pytest.raises(ValueError, match="last dim 64"):
        quant.quant_linear(torch.randn(1, 32), w)
    with pytest.raises(ValueError, match="activations must be"):
        quant.quant_linear(torch.randn(1, 64, dtype=torch.float64), w)
    w.scales = torch.rand(2, 4).T  # right shape, not contiguous
    with pytest.raises(ValueError, match="scales must be a contiguous"):
        quant.quant_linear(torch.randn(1, 64), w)
    with pytest.raises(ValueError, match="not a PackedWeight"):
        quant.quant_linear(torch.randn(1, 64), torch.randn(4, 64))
    w13, w2 = _packed((2, 8, 32), 8, 32, False, g), _packed((2, 32, 4), 8, 4, False, g)
    x, ids, wts = torch.randn(1, 32), torch.tensor([[0, 1]]), torch.rand(1, 2)
    with pytest.raises(ValueError, match="gate_up: a PackedWeight of shape"):
        quant.quant_experts(x, w13.select(0), w2, wts, ids)
    with pytest.raises(ValueError, match=r"\(E, 2F, D\) and \(E, D, F\)"):
        quant.quant_experts(x, w13, _packed((2, 32, 16), 8, 16, False, g), wts, ids)
    with pytest.raises(ValueError, match="topk ids"):
        quant.quant_experts(x, w13, w2, wts, ids[:, :1])
    with pytest.raises(ValueError, match="integer dtype"):
        quant.quant_experts(x, w13, w2, wts, ids.float())
    assert quant.quant_experts_fits(x, w13, w2, wts, ids)


@pytest.mark.parametrize("bits13,bits2,offsets,G", [(8, 8, True, 16), (4, 4, True, 48), (4, 8, False, 24),
                                                    (8, 4, "zero", 16), (4, 8, "half", 16)])
def test_quant_experts_panels_match_float64(bits13, bits2, offsets, G, isa):
    """Prefill-sized routing: experts with quant.panel_min_rows() rows or more take the panel path
    (gate/up, SiLU-and-mul and the routing weight in its epilogue, down), the others the dot-product
    tiles, in one call; ids held elsewhere; one and two threads; against float64 over the
    dequantized weights."""
    E, D, F, T = 4, 96, 48, 70
    g = torch.Generator().manual_seed(bits13 * 3 + bits2 + G)
    w13 = _packed((E, 2 * F, D), bits13, G, offsets, g)
    w2 = _packed((E, D, F), bits2, G, offsets, g)
    x = torch.randn(T, D, generator=g)
    # experts 0 and 1 take most tokens (panels), 2 and 3 a few (dot-product tiles)
    p = torch.tensor([0.45, 0.45, 0.05, 0.05])
    ids = torch.stack([torch.multinomial(p, 2, generator=g) for _ in range(T)])
    ids = torch.where(torch.rand(T, 2, generator=g) < 0.1, -1, ids)
    wts = torch.rand(T, 2, generator=g)
    assert quant.panels_fit(w13, w2)
    assert not quant.panels_fit(_packed((E, 12, 32), 8, 32, False, g), _packed((E, 32, 6), 8, 6, False, g))  # F = 6
    rows = torch.bincount(ids[ids >= 0], minlength=E)
    first = quant.panel_min_rows()
    assert (rows >= first).any() and ((rows > 0) & (rows < first)).any()
    ref = _experts_ref(x, w13, w2, wts, ids)
    scale = ref.abs().max().item()
    for threads in (1, 2):
        ran = quant.panels_run()
        with _threads(threads):
            out = quant.quant_experts(x, w13, w2, wts, ids)
        assert quant.panels_run() - ran == int((rows >= first).sum())  # one panel group an expert here
        assert torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-4 * scale), \
            f"threads={threads}: max err {(out.double() - ref).abs().max():.3g} of {scale:.3g}"


def _act8(x: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float32 rounded to int8 per group of G as quant.c's int8-activation path does (d =
    max|x| / 127 in float32, round(x / d) with ties to even): (codes as float64, d float64 (M, K/G))."""
    M, K = x.shape
    xg = x.reshape(M, K // G, G)
    d = xg.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(xg / torch.where(d > 0, d, 1)), 0).clamp(-127, 127)
    return q.reshape(M, K).double(), d.squeeze(-1).double()


def _act8_linear_ref(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """y = sum_g scale * d * sum (q - zero) * xq + offsets * sum x, in float64 (the path's arithmetic)."""
    G, (N, K) = w.group_size, w.shape
    xq, d = _act8(x, G)
    codes = (w.codes().double() - w.zero).reshape(N, K // G, G)
    dots = torch.einsum("ngk,mgk->mng", codes, xq.reshape(-1, K // G, G))
    y = (dots * w.scales.double().unsqueeze(0) * d.unsqueeze(1)).sum(-1)
    if w.offsets is not None:
        y += x.double().reshape(-1, K // G, G).sum(-1) @ w.offsets.double().T
    return y


def _with_act8(w: PackedWeight) -> PackedWeight:
    w = PackedWeight(w.bits, w.qweight, w.scales, w.offsets, w.group_size, w.shape, w.zero)
    w.act8 = True
    return w


# (bits, G, offsets): Q4_0 / Q8_0's 32 (several groups a step), 64, GPTQ's 128, per channel (G = K:
# one group over several steps), an explicit zero point (offsets), float16 scales
ACT8_CASES = [(4, 32, "half"), (8, 32, "half"), (4, 64, "zero"), (4, 128, True), (8, 256, "zero"), (8, 64, False),
              (4, 16, "zero")]


@pytest.mark.parametrize("bits,G,offsets", ACT8_CASES)
def test_int8_activations_match_their_arithmetic(bits, G, offsets, isa_vnni):
    """--cpu-int8-activations' decode path (vpdpbusd with AVX-512 VNNI, vpmaddubsw on AVX-512 without
    it and AVX2, plain C elsewhere): each
    activation row rounded to int8 per weight group and integer products, against that arithmetic in
    float64 (the rounding reproduced exactly), 1, 3, 5 and one row fewer than the panel GEMM's rows
    (the tiles' 1..4 rows and their remainders), one and two threads; the float path's answer is not it (the rounding shows), and
    prefill-sized calls stay float."""
    assert quant.act8_vector() == isa_vnni.startswith(("avx512", "avx2"))  # vector tiles there, plain C elsewhere
    K, N = 256, 21
    g = torch.Generator().manual_seed(bits * 100 + G)
    w = _with_act8(_packed((N, K), bits, G, offsets, g))
    tiles = min(quant.panel_min_rows(), quant.act8_panel_min_rows() or quant.panel_min_rows())  # their rows' bound
    for M, threads in ((1, 1), (3, 2), (5, 1), (tiles - 1, 2)):
        x = torch.randn(M, K, generator=g)
        ran = quant.act8_run()
        with _threads(threads):
            y = quant.quant_linear(x, w)
        assert quant.act8_run() - ran == 1
        ref = _act8_linear_ref(x, w)
        tol = 1e-5 * (x.double().abs() @ _bound(w).T) + 1e-6
        err = (y.double() - ref).abs()
        assert (err <= tol).all(), f"M={M} threads={threads}: max err {err.max():.3g}"
        plain = quant.quant_linear(x, PackedWeight(bits, w.qweight, w.scales, w.offsets, G, w.shape, w.zero))
        assert not torch.allclose(plain, y, rtol=1e-6, atol=1e-6)
    big = torch.randn(quant.panel_min_rows(), K, generator=g)
    ran, panels = quant.act8_run(), quant.act8_panels_run()
    y = quant.quant_linear(big, w)
    assert quant.act8_run() == ran  # not the tiles: a panel
    if _vnni(isa_vnni):  # the int8 panel: the same arithmetic
        assert quant.act8_panels_run() == panels + 1
        err = (y.double() - _act8_linear_ref(big, w)).abs()
        assert (err <= 1e-5 * (big.double().abs() @ _bound(w).T) + 1e-6).all(), f"max err {err.max():.3g}"
    else:  # the float panel GEMM
        assert quant.act8_panels_run() == panels
        assert torch.allclose(y.double(), big.double() @ w.dequantize().double().T, rtol=1e-4, atol=1e-4)


def _vnni(isa: str) -> bool:
    """Whether the build `isa` (cpu_isa's isa_vnni) has AVX-512 VNNI (its native build on a CPU with it)."""
    from moe_serve.kernels import cpu_ops

    vnni = isa == "avx512" and "avx512_vnni" in cpu_ops._cpu_flags().split()
    assert (quant.act8_panel_min_rows() is not None) == vnni
    return vnni


@pytest.mark.parametrize("bits,G,offsets", ACT8_CASES)
def test_int8_activation_panel_matches_its_arithmetic(bits, G, offsets, isa_vnni):
    """Prefill-sized calls with int8 activations: with AVX-512 VNNI, quant.c's int8 panel (blocks of
    16 outputs, 8 activation rows a micro-tile) from its first row count (16), against float64 of the
    rounded arithmetic: whole and partial blocks of outputs (N = 37), whole and partial micro-tiles
    of rows, one and two threads; other builds take the float panel (or, under its rows, the tiles).
    With VNNI, K = 256 + G: the rows' dwords are transposed 16 at a time, and for G of 16 and 32 the
    last 16 are partial."""
    K, N = 256 + (G if _vnni(isa_vnni) else 0), 37
    g = torch.Generator().manual_seed(bits * 1000 + G)
    w = _with_act8(_packed((N, K), bits, G, offsets, g))
    first = quant.act8_panel_min_rows() or 16
    for M, threads in ((first, 1), (first + 5, 2), (24, 2), (41, 1)):
        x = torch.randn(M, K, generator=g)
        panels = quant.act8_panels_run()
        with _threads(threads):
            y = quant.quant_linear(x, w)
        assert quant.act8_panels_run() - panels == int(_vnni(isa_vnni)), M
        if _vnni(isa_vnni) or M < quant.panel_min_rows():
            err = (y.double() - _act8_linear_ref(x, w)).abs()
            assert (err <= 1e-5 * (x.double().abs() @ _bound(w).T) + 1e-6).all(), f"M={M}: max err {err.max():.3g}"
        else:
            assert torch.allclose(y.double(), x.double() @ w.dequantize().double().T, rtol=1e-4, atol=1e-4)


def test_int8_activations_fall_back_where_a_step_splits_groups(isa_vnni):
    """Weights whose groups do not fit the 16 lanes of a step (G = 48 int4: 6 lanes a group) or whose
    K is not a whole number of steps take the float path (the counter does not move)."""
    g = torch.Generator().manual_seed(3)
    for bits, K, G in ((4, 192, 48), (4, 96, 32), (8, 96, 32)):
        w = _with_act8(_packed((9, K), bits, G, "zero", g))
        x = torch.randn(2, K, generator=g)
        ran = quant.act8_run()
        y = quant.quant_linear(x, w)
        assert quant.act8_run() == ran, (bits, K, G)
        assert torch.allclose(y.double(), x.double() @ w.dequantize().double().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits13,bits2,G", [(4, 4, 32), (8, 8, 32), (4, 8, 64)])
def test_int8_activation_experts_match_their_arithmetic(bits13, bits2, G, isa_vnni):
    """Experts with int8 activations (gate/up over the tokens' rows, down over SiLU(gate) * up rounded
    again): against float64 of the same arithmetic, decode-sized routings on both expert paths (row
    blocks, and whole experts a thread), and with AVX-512 VNNI a prefill-sized one (each expert about
    18 rows: the int8 panel; other builds give those the float panel, test_quant_experts_panels_*)."""
    E, D, F = 8, 128, 128
    g = torch.Generator().manual_seed(bits13 * 10 + bits2 + G)
    w13 = _with_act8(_packed((E, 2 * F, D), bits13, G, "half", g))
    w2 = _with_act8(_packed((E, D, F), bits2, G, "zero", g))
    first = quant.act8_panel_min_rows()  # experts with that many rows: the int8 panel, the others the tiles
    for T, threads in ((1, 1), (2, 2), (5, 2)) + (((72, 2),) if first else ()):
        x = torch.randn(T, D, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
        wts = torch.rand(T, 2, generator=g)
        ran, panels = quant.act8_run(), quant.act8_panels_run()
        with _threads(threads):
            out = quant.quant_experts(x, w13, w2, wts, ids)
        counts = torch.bincount(ids.flatten(), minlength=E)
        assert quant.act8_run() - ran == 2 * int(((counts > 0) & (counts < (first or 10**9))).sum())
        assert quant.act8_panels_run() - panels == (2 * int((counts >= first).sum()) if first else 0)
        ref = torch.zeros(T, D, dtype=torch.float64)
        for t in range(T):
            for k in range(2):
                e = int(ids[t, k])
                h = _act8_linear_ref(x[t:t + 1], w13.select(e)).squeeze(0)
                a = (torch.nn.functional.silu(h[:F]) * h[F:]).float()
                ref[t] += float(wts[t, k]) * _act8_linear_ref(a.unsqueeze(0), w2.select(e)).squeeze(0)
        scale = ref.abs().max().item()
        # the reference's SiLU(gate) * up is float64 rounded once, the kernel's float32: an activation at
        # a rounding tie may land one int8 step apart, so the tolerance is that step's size
        assert torch.allclose(out.double(), ref, rtol=0, atol=2e-3 * scale), \
            f"T={T}: max err {(out.double() - ref).abs().max():.3g} of {scale:.3g}"
