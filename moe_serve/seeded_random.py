"""Counter-based random numbers for seeded sampling: a pure function of (seed, output position,
token id), so a seeded request draws the same numbers whatever else is in its batch, in any row,
and again after preemption (the recomputed step samples the same output position). No generator
state is kept per request and the whole batch's draws are a handful of elementwise tensor ops.

The mixer is MurmurHash3's 32-bit finaliser (a bijection on 32-bit words with full avalanche),
computed on int32 tensors: int32 products wrap modulo 2**32 (two's complement), which is the
arithmetic the finaliser wants, and right shifts are made logical by masking the sign bits that an
arithmetic shift drags in. int32 rather than int64 halves the memory traffic (the (Q, V) hash then
costs about what the engine generator's uniform_ costs). `fmix32_int` is the same function on
Python ints, the reference the tests hold the tensor version to.
"""
from __future__ import annotations

import math

import torch

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x85EBCA6B, 0xC2B2AE35
_GOLDEN = 0x9E3779B9  # separates the seed's halves and the position from the token stream


def to_int32(v: int) -> int:
    """The int32 whose two's-complement bits are the 32-bit word v."""
    v &= _M32
    return v - (1 << 32) if v >= 1 << 31 else v


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 fmix32 of int32 words (bit patterns; the sign is just the top bit)."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * to_int32(_C1)
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * to_int32(_C2)
    return h ^ ((h >> 16) & 0xFFFF)


def fmix32_int(h: int) -> int:
    """The same finaliser on a Python int (used once per request, for its seed)."""
    h ^= h >> 16
    h = (h * _C1) & _M32
    h ^= h >> 13
    h = (h * _C2) & _M32
    return h ^ (h >> 16)


def seed_key(seed: int) -> int:
    """Fold any Python int seed (negative or wider than 64 bits too) into a 32-bit key, as int32."""
    s = seed & ((1 << 64) - 1)
    return to_int32(fmix32_int((s & _M32) ^ fmix32_int(((s >> 32) ^ _GOLDEN) & _M32)))


def seeded_exponential(seed_key_Q: torch.Tensor, out_pos_Q: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) draws of shape (Q, V), one per (row's seed key, row's output position, token id).

    seed_key_Q and out_pos_Q are integer tensors (int32 keys from `seed_key`). The uniform behind
    each draw has 24 random bits, offset by half a step so it is never 0 or 1: the draws are
    finite and positive.
    """
    dev = seed_key_Q.device
    key_Q = fmix32(seed_key_Q.to(torch.int32) ^ fmix32(out_pos_Q.to(torch.int32) + to_int32(_GOLDEN)))
    tok_V = fmix32(torch.arange(vocab_size, device=dev, dtype=torch.int32) * 2 + 1)
    return exponential_from_bits((fmix32(key_Q[:, None] ^ tok_V[None, :]) >> 8) & 0xFFFFFF)


def exponential_from_bits(bits_QV: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws from 24-bit integers: -log((bits + 0.5) / 2**24), never 0."""
    # -log((bits + 0.5) / 2**24), rearranged to save a pass over (Q, V). In float32 the top bit
    # patterns give log(bits + 0.5) == 24 log 2, so the difference can round to 0 or below, where the
    # true draw is about 2**-25: clamped to that, a draw is never 0 (p / 0 would be NaN for a
    # token whose probability is 0, say one a grammar forbids, and argmax would pick it).
    return (bits_QV.to(torch.float32) + 0.5).log_().neg_().add_(24 * math.log(2)).clamp_min_(2.0 ** -25)
