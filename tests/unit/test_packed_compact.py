"""Packed weights in fewer bytes on a CPU (moe_serve/prepare.py `compact_packed_weights`): a packed
Linear and packed experts whose loaded offsets are exactly -z * scale keep the zero code z instead,
and scales float16 holds exactly are kept in float16; they serve the same values (against
PackedWeight.dequantize of the weight as loaded, float64), free those bytes, keep asymmetric offsets
and float32 scales float16 cannot hold, and refuse a later weight that does not fit the compacted
form, naming what."""
from __future__ import annotations

import pytest
import torch

from moe_serve.layers.experts import PackedExperts
from moe_serve.layers.linear import Linear
from moe_serve.prepare import compact_packed_weights
from moe_serve.quantization.packed import PackedWeight, quantize_reference


def _weights(shape, bits, G, symmetric, seed, half=False):
    """quantize_reference's weight; half: its scales rounded to float16 values (still float32, the
    offsets -2^(bits-1) times them), as a GGUF Q4_0 / Q8_0 block's d."""
    g = torch.Generator().manual_seed(seed)
    w = quantize_reference(torch.randn(*shape, generator=g) * 0.1, bits, G, symmetric)
    if half:
        s = w.scales.half().float()
        w = PackedWeight(bits, w.qweight, s, -float(2 ** (bits - 1)) * s, G, w.shape)
    return w


@pytest.mark.parametrize("bits", [4, 8])
def test_linear_drops_symmetric_offsets(bits):
    model = torch.nn.Module()
    model.sym, model.asym = Linear(64, 24), Linear(64, 24)
    sym, asym = _weights((24, 64), bits, 32, True, 1, half=True), _weights((24, 64), bits, 32, False, 2)
    for lin, w in ((model.sym, sym), (model.asym, asym)):
        lin.to_packed(bits, 32)
        lin.load_packed(w)
    freed = compact_packed_weights(model, torch.device("cpu"))
    assert freed == sym.offsets.numel() * 4 + sym.scales.numel() * 2
    assert model.sym.qoffsets is None and model.sym.packed_zero == 2 ** (bits - 1)
    assert model.sym.qscales.dtype == torch.float16
    assert model.asym.qoffsets is not None and model.asym.packed_zero == 0
    assert model.asym.qscales.dtype == torch.float32
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    for lin, w in ((model.sym, sym), (model.asym, asym)):
        ref = x.double() @ w.dequantize().double().T
        assert torch.allclose(lin(x).double(), ref, rtol=1e-5, atol=1e-5)
    model.sym.load_packed(_weights((24, 64), bits, 32, True, 4, half=True))  # the same form again: taken
    with pytest.raises(ValueError, match="scales are not all exact in float16"):
        model.sym.load_packed(_weights((24, 64), bits, 32, True, 5))
    with pytest.raises(ValueError, match=f"not -{2 ** (bits - 1)} \\* scales"):
        model.sym.load_packed(asym)
    assert compact_packed_weights(model, torch.device("meta")) == 0  # not off a CPU


def test_experts_drop_a_part_only_in_every_layer():
    """gate/up symmetric in both layers: dropped in both; down asymmetric in one layer: kept in both."""
    E, D, F = 3, 64, 32
    model = torch.nn.Module()
    model.a = PackedExperts(E, D, F, list(range(E)), torch.float32, (4, 8), (32, 32))
    model.b = PackedExperts(E, D, F, list(range(E)), torch.float32, (4, 8), (32, 32))
    ws = {}
    for name, m in (("a", model.a), ("b", model.b)):
        for e in range(E):
            for kind, shape, bits in (("gate", (F, D), 4), ("up", (F, D), 4), ("down", (D, F), 8)):
                w = _weights(shape, bits, 32, not (name == "b" and kind == "down"), 100 * (name == "b") + 10 * e + len(kind))
                m.load(e, kind, w)
                ws[name, e, kind] = w
    before = {n: m.op_weights() for n, m in (("a", model.a), ("b", model.b))}
    dense = {n: (w13.dequantize(), w2.dequantize()) for n, (w13, w2) in before.items()}
    compact_packed_weights(model, torch.device("cpu"))
    for n, m in (("a", model.a), ("b", model.b)):
        assert m.w13_offsets is None and m.w2_offsets is not None and m.zeros == (8, 0)
        w13, w2 = m.op_weights()
        assert torch.allclose(w13.dequantize(), dense[n][0], rtol=0, atol=1e-6)
        assert torch.equal(w2.dequantize(), dense[n][1])
    model.a.load(1, "up", _weights((F, D), 4, 32, True, 99))
    with pytest.raises(ValueError, match=r"expert 1 gate: its offsets are not -8 \* scales"):
        model.a.load(1, "gate", _weights((F, D), 4, 32, False, 98))
