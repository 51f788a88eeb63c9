"""GGUF tensor types into what the engine holds: float types (F32, F16, BF16) as float tensors, the
block-quantized types llama.cpp writes most (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) converted
exactly into PackedWeight (moe_serve/quantization/packed.py: W = scale * q + offset per group), so
those weights stay packed. Every other type is refused, naming the tensor, the type and GGUF.

Each GGML block holds the codes of 32 or 256 consecutive values of a row with their f16 scale
(and min): a row of K values is K / block_size blocks. The conversion keeps the codes as unsigned
integers and turns each block's scale and min into one float32 scale and offset per group:

- Q4_0 (32: d, 16 nibble bytes): W = d * (q - 8): 4 bits, group 32, scale d, offset -8 d;
- Q4_1 (32: d, m, nibbles): W = d * q + m: 4 bits, group 32, offset m;
- Q5_0 / Q5_1 (32: d, [m], 32 high bits, nibbles): 5-bit codes in a byte: 8 bits, group 32,
  offset -16 d (Q5_0) or m (Q5_1);
- Q8_0 (32: d, 32 int8): W = d * q: 8 bits, the code q + 128 with offset -128 d;
- Q4_K / Q5_K (256: d, dmin, 12 bytes of eight 6-bit scales sc and mins m, [32 high-bit bytes],
  128 nibble bytes): W = d sc_j * q - dmin m_j per 32: 4 bits (Q4_K) or 8 bits (Q5_K), group 32,
  scale d * sc_j, offset -(dmin * m_j);
- Q6_K (256: 128 low-nibble bytes, 64 high-2-bit bytes, sixteen int8 scales sc, d): W = d sc_j (q - 32)
  per 16: 8 bits, group 16, scale d * sc_j, offset -32 d sc_j.

Those float32 products are exact (an f16 times a code of at most 8 bits), so `dequantize()` of the
result equals the format's own reference dequantization value for value (tests/unit/test_gguf_types.py
checks it against gguf-py's `gguf.quants.dequantize`).
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from moe_serve.quantization.packed import PackedWeight, pack_nibbles

FLOAT_TYPES = (T.F32, T.F16, T.BF16)
PACKED_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
SUPPORTED_TYPES = FLOAT_TYPES + PACKED_TYPES


def type_name(qtype: int) -> str:
    try:
        return T(qtype).name
    except ValueError:
        return f"unknown type id {qtype}"


def check_type(name: str, qtype: int, shape: tuple[int, ...]) -> None:
    """Refuse (ValueError naming the tensor, its type and GGUF) a tensor the engine cannot hold."""
    if qtype not in [int(t) for t in SUPPORTED_TYPES]:
        raise ValueError(f"GGUF tensor {name!r} has type {type_name(qtype)}, which this engine does not load; "
                         f"supported GGUF tensor types: {', '.join(t.name for t in SUPPORTED_TYPES)}")
    block = GGML_QUANT_SIZES[T(qtype)][0]
    if shape and shape[-1] % block:
        raise ValueError(f"GGUF tensor {name!r} ({type_name(qtype)}, shape {shape}): its rows of {shape[-1]} "
                         f"values are not whole blocks of {block}")


def is_packed(qtype: int) -> bool:
    return qtype in [int(t) for t in PACKED_TYPES]


def packed_layout(qtype: int) -> tuple[int, int]:
    """(bits, group size) of the PackedWeight a block-quantized type converts into."""
    t = T(qtype)
    bits = 4 if t in (T.Q4_0, T.Q4_1, T.Q4_K) else 8
    return bits, 16 if t == T.Q6_K else 32


def to_float(data: np.ndarray, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A float tensor (F32, F16, BF16) of the given logical shape, in its own dtype (a copy)."""
    raw = np.ascontiguousarray(data)
    if qtype == T.F32:
        t = torch.from_numpy(raw.view(np.float32).copy())
    elif qtype == T.F16:
        t = torch.from_numpy(raw.view(np.float16).copy())
    elif qtype == T.BF16:
        t = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
    else:
        raise ValueError(f"GGUF type {type_name(qtype)} is not a float type")
    return t.reshape(shape)


def to_packed(data: np.ndarray, qtype: int, shape: tuple[int, ...]) -> PackedWeight:
    """A block-quantized tensor's bytes (rows of whole blocks) as a PackedWeight of the logical
    shape (..., N, K), exactly (see the module docstring)."""
    t = T(qtype)
    block, size = GGML_QUANT_SIZES[t]
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, size)
    codes, scales, offsets = _DECODE[t](blocks)
    bits, group = packed_layout(qtype)
    lead, k = tuple(shape[:-1]), shape[-1]
    q = torch.from_numpy(codes).reshape(*lead, k)
    return PackedWeight(bits, pack_nibbles(q) if bits == 4 else q.contiguous(),
                        torch.from_numpy(scales).reshape(*lead, k // group).contiguous(),
                        torch.from_numpy(offsets).reshape(*lead, k // group).contiguous(), group, shape)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per block (n, 2) as float32 (n,)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32).reshape(-1)


def _nibbles_halves(qs: np.ndarray) -> np.ndarray:
    """(n, 16 * c) bytes -> (n, 32 * c) codes: in each run of 16 bytes the low nibbles are its 32
    values' first 16 and the high nibbles the next 16 (Q4_0 / Q5_0 / Q4_1 / Q5_1 order); K-quants
    use the same rule over runs of 32 bytes (64 values)."""
    n, m = qs.shape
    half = 16 if m == 16 else 32
    r = qs.reshape(n, m // half, 1, half)
    return np.concatenate([r & 0x0F, r >> 4], axis=2).reshape(n, -1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """(n, count // 8) bytes as a little-endian bit array (n, count) of 0/1."""
    return np.unpackbits(qh, axis=1, bitorder="little")[:, :count]


def _q4_0(b):
    d = _f16(b[:, :2])
    return _nibbles_halves(b[:, 2:]), d[:, None], (-8 * d)[:, None]


def _q4_1(b):
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return _nibbles_halves(b[:, 4:]), d[:, None], m[:, None]


def _q5(b, has_min: bool):
    d = _f16(b[:, :2])
    o = 4 if has_min else 2
    high = _high_bits(b[:, o:o + 4], 32)
    codes = _nibbles_halves(b[:, o + 4:]) | (high << 4)
    off = _f16(b[:, 2:4]) if has_min else -16 * d
    return codes.astype(np.uint8), d[:, None], off[:, None]


def _q8_0(b):
    d = _f16(b[:, :2])
    return b[:, 2:] ^ np.uint8(0x80), d[:, None], (-128 * d)[:, None]


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes -> eight 6-bit scales and eight 6-bit mins (n, 8) each: bytes
    0-3 hold scales 0-3 (low 6 bits), 4-7 mins 0-3; scales and mins 4-7 take their low 4 bits from
    bytes 8-11 (low and high nibble) and their top 2 bits from the top bits of bytes 0-3 / 4-7."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b):
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    return _nibbles_halves(b[:, 16:]), d[:, None] * sc, -(dmin[:, None] * mn)


def _q5_k(b):
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    n = b.shape[0]
    # qh: 32 bytes; bit i of byte j is the fifth bit of value 32 i + j.
    high = ((b[:, 16:48][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).reshape(n, 256)
    codes = _nibbles_halves(b[:, 48:]) | (high << 4)
    return codes.astype(np.uint8), d[:, None] * sc, -(dmin[:, None] * mn)


def _q6_k(b):
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    # Two halves of 128 values: in half h, ql's 64 bytes give values 0-63 (low nibbles) and 64-127
    # (high nibbles); qh's 32 bytes give the top two bits of values 32 s + j at bits 2 s.
    low = ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    low = (low & 0x0F).reshape(n, 256)
    high = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (high & 0x03).reshape(n, 256)
    scale = d[:, None] * sc
    return (low | (high << 4)).astype(np.uint8), scale, -32 * scale


_DECODE = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: lambda b: _q5(b, False), T.Q5_1: lambda b: _q5(b, True),
           T.Q8_0: _q8_0, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}
