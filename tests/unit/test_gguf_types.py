"""GGUF tensor types: every block-quantized type we load converts into a PackedWeight whose
`dequantize()` equals gguf-py's reference `gguf.quants.dequantize` value for value (random blocks:
every code, every scale byte, random finite f16 scales), float types load as they are stored, and
other types are refused naming the tensor, the type and GGUF.

gguf-py quantizes the legacy types (Q4_0 ... Q8_0) but only dequantizes the K-quants, so the tests'
K-quant writers are here (`quantize_k`), following the block layouts; gguf-py's dequantization
checks them (a round trip within the format's rounding error).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from moe_serve.quantization import gguf_types

# Where each type's f16 fields sit in its block (random bytes there could be inf / nan).
_F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2),
               T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(qtype: T, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random bytes of a tensor of logical shape (..., N, K) in qtype, its f16 fields finite."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    rows = int(np.prod(shape[:-1]))
    b = rng.integers(0, 256, size=(rows * shape[-1] // block, size), dtype=np.uint8)
    for at in _F16_FIELDS[qtype]:
        b[:, at:at + 2] = (rng.standard_normal(b.shape[0]) * 0.05).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(*shape[:-1], shape[-1] // block * size)


@pytest.mark.parametrize("qtype", gguf_types.PACKED_TYPES, ids=lambda t: t.name)
def test_packed_equals_gguf_reference(qtype):
    shape = (3, 4, 512)  # stacked experts (E, N, K): two K-quant blocks or 16 legacy blocks a row
    raw = random_blocks(qtype, shape, seed=int(qtype))
    w = gguf_types.to_packed(raw, int(qtype), shape)
    bits, group = gguf_types.packed_layout(int(qtype))
    assert (w.bits, w.group_size, w.shape) == (bits, group, shape)
    ref = torch.from_numpy(dequantize(raw, qtype).astype(np.float32)).reshape(shape)
    ours = w.dequantize(torch.float32)
    assert torch.isfinite(ref).all()
    assert torch.equal(ours, ref), (ours - ref).abs().max()
    # one expert alone, as the loader's per-expert view takes it
    assert torch.equal(w.select(1).dequantize(), ref[1])


# The symmetric types' zero codes (their offsets are exactly -z * scale); the others keep offsets.
_ZERO = {T.Q4_0: 8, T.Q5_0: 16, T.Q8_0: 128, T.Q6_K: 32}
# The types whose scale is the block's float16 d itself: float16 holds every scale.
_HALF = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}


@pytest.mark.parametrize("qtype", gguf_types.PACKED_TYPES, ids=lambda t: t.name)
def test_compact_keeps_the_values(qtype):
    """PackedWeight.compact drops the offsets of exactly the symmetric types for their zero code,
    keeps float16 scales for the types whose scale is a float16 d, and the compacted weight still
    equals gguf-py's dequantization value for value; offsets that are not -z * scale (a min, or one
    offset changed) are kept."""
    shape = (3, 4, 512)
    raw = random_blocks(qtype, shape, seed=int(qtype) + 7)
    w = gguf_types.to_packed(raw, int(qtype), shape)
    c = w.compact()
    ref = torch.from_numpy(dequantize(raw, qtype).astype(np.float32)).reshape(shape)
    assert torch.equal(c.dequantize(), ref), (c.dequantize() - ref).abs().max()
    assert (c.offsets is None, c.zero) == ((True, _ZERO[qtype]) if qtype in _ZERO else (False, 0))
    if qtype in _HALF:
        assert c.scales.dtype == torch.float16
    saved = (w.offsets.numel() * 4 if c.offsets is None else 0) + (w.scales.numel() * 2 if c.scales.dtype ==
                                                                     torch.float16 else 0)
    assert c.nbytes == w.nbytes - saved
    if qtype in _ZERO:
        off = w.offsets.clone()
        off.view(-1)[5] += 1e-3
        bent = type(w)(w.bits, w.qweight, w.scales, off, w.group_size, w.shape).compact()
        assert bent.offsets is not None and bent.zero == 0


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K],
                         ids=lambda t: t.name)
def test_quantized_values_close(qtype):
    """Quantizing a float weight (gguf-py's own quantizer, or ours for K-quants) and loading it
    gives back the weight within the format's rounding error."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(8, 512, generator=g) * 0.1).numpy()
    raw = quantize_any(x, qtype)
    w = gguf_types.to_packed(raw, int(qtype), x.shape).dequantize()
    bits = {T.Q4_0: 4, T.Q4_1: 4, T.Q4_K: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q5_K: 5, T.Q6_K: 6, T.Q8_0: 8}[qtype]
    step = np.abs(x).max() * 2 / (2 ** bits - 1)
    assert np.abs(w.numpy() - x).max() < step * 1.2
    assert torch.equal(w, torch.from_numpy(dequantize(raw, qtype)).reshape(x.shape))


def test_float_types():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    for qtype, dtype in ((T.F32, torch.float32), (T.F16, torch.float16), (T.BF16, torch.bfloat16)):
        raw = x.to(dtype).view(torch.uint8).numpy()  # the file's bytes, as the reader hands them
        t = gguf_types.to_float(raw, int(qtype), (5, 64))
        assert t.dtype == dtype and torch.equal(t, x.to(dtype))


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.IQ4_XS, T.IQ2_XXS, T.TQ1_0, T.MXFP4, T.Q8_1, T.I32])
def test_other_types_refused(qtype):
    with pytest.raises(ValueError, match=rf"GGUF tensor 'blk.0.ffn_down_exps.weight' has type {qtype.name}"):
        gguf_types.check_type("blk.0.ffn_down_exps.weight", int(qtype), (4, 256, 256))


def test_partial_block_refused():
    with pytest.raises(ValueError, match=r"'blk.0.attn_q.weight' \(Q4_K.*not whole blocks of 256"):
        gguf_types.check_type("blk.0.attn_q.weight", int(T.Q4_K), (64, 128))


# ---- the tests' K-quant writers (gguf-py dequantizes these types but does not quantize them) ----

def quantize_any(x: np.ndarray, qtype: T) -> np.ndarray:
    """A float32 array (..., K) in qtype's bytes (..., K / block * size)."""
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        return quantize_k(x, qtype)
    return quantize(np.ascontiguousarray(x, dtype=np.float32), qtype)


def _f16_bytes(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the f16 value as float32, its two bytes (n, 2))."""
    h = v.astype(np.float16)
    return h.astype(np.float32), h.view(np.uint8).reshape(-1, 2)


def quantize_k(x: np.ndarray, qtype: T) -> np.ndarray:
    """Q4_K / Q5_K (asymmetric 32-value sub-blocks, 6-bit scales and mins under f16 d and dmin) or
    Q6_K (symmetric 16-value sub-blocks, int8 scales under f16 d), rounding to the nearest code."""
    lead, k = x.shape[:-1], x.shape[-1]
    xb = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 256)
    n = xb.shape[0]
    if qtype == T.Q6_K:
        g = xb.reshape(n, 16, 16)
        sub = np.abs(g).max(-1) / 31
        d, d_bytes = _f16_bytes(sub.max(-1) / 127)
        sc = np.where(d[:, None] > 0, np.round(sub / np.where(d > 0, d, 1)[:, None]), 0).clip(-127, 127)
        eff = d[:, None] * sc
        q = np.where(eff[..., None] != 0, np.round(g / np.where(eff != 0, eff, 1)[..., None]), 0) + 32
        q = q.clip(0, 63).astype(np.uint8).reshape(n, 2, 128)
        ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)  # (n, 2, 64)
        hi = (q >> 4).reshape(n, 2, 4, 32)
        qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # (n, 2, 32)
        out = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8), d_bytes],
                             axis=1)
        return out.reshape(*lead, k // 256 * 210)
    levels = 15 if qtype == T.Q4_K else 31
    g = xb.reshape(n, 8, 32)
    lo = np.minimum(g.min(-1), 0)
    scale = (g.max(-1) - lo) / levels
    d, d_bytes = _f16_bytes(scale.max(-1) / 63)
    dmin, dmin_bytes = _f16_bytes((-lo).max(-1) / 63)
    sc = np.round(scale / np.where(d > 0, d, 1)[:, None]).clip(0, 63).astype(np.uint8)
    mn = np.round(-lo / np.where(dmin > 0, dmin, 1)[:, None]).clip(0, 63).astype(np.uint8)
    eff, off = d[:, None] * sc, dmin[:, None] * mn
    q = np.where(eff[..., None] > 0, np.round((g + off[..., None]) / np.where(eff > 0, eff, 1)[..., None]), 0)
    q = q.clip(0, levels).astype(np.uint8).reshape(n, 256)
    scales = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)
    r = q.reshape(n, 4, 2, 32)
    qs = ((r[:, :, 0] & 0x0F) | ((r[:, :, 1] & 0x0F) << 4)).reshape(n, 128)
    parts = [d_bytes, dmin_bytes, scales]
    if qtype == T.Q5_K:
        bits5 = (q >> 4).reshape(n, 8, 32)
        parts.append(np.bitwise_or.reduce(bits5 << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    parts.append(qs)
    size = GGML_QUANT_SIZES[qtype][1]
    return np.concatenate(parts, axis=1).astype(np.uint8).reshape(*lead, k // 256 * size)


def test_llama_cpp_written_file_converts_exactly():
    """The SmolLM2 GGUF the default model is built from (written by llama.cpp's tools: Q4_1 layers,
    a Q8_0 embedding): every block-quantized tensor of one layer, and the embedding, convert to
    PackedWeights equal to gguf-py's dequantization; the file itself (a dense Llama) is refused as a
    model naming its architecture."""
    from moe_serve.config import ModelConfig
    from moe_serve.default_model.gguf_source import find_smollm2_gguf
    from moe_serve.quantization.gguf_file import reader

    path, problem = find_smollm2_gguf()
    assert path is not None, problem
    r = reader(path)  # gguf.GGUFReader, read once (the refusal below reads the same)
    tensors = [t for t in r.tensors if t.name == "token_embd.weight" or t.name.startswith("blk.0.")]
    seen = set()
    for t in tensors:
        if not gguf_types.is_packed(int(t.tensor_type)):
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        ref = torch.from_numpy(dequantize(t.data, t.tensor_type)).reshape(shape)
        assert torch.equal(gguf_types.to_packed(t.data, int(t.tensor_type), shape).dequantize(), ref), t.name
        seen.add(t.tensor_type.name)
    assert seen == {"Q4_1", "Q8_0"}
    with pytest.raises(ValueError, match=r"architecture 'llama' without experts .*a dense Llama"):
        ModelConfig.from_path(path)
