"""Counter-based random numbers for seeded sampling: a pure function of (seed, output position,
token id), so a seeded request draws the same numbers whatever else is in its batch, in any row,
and again after preemption (the recomputed step samples the same output position). No generator
state is kept per request and the whole batch's draws are a handful of elementwise tensor ops.

The mixer is MurmurHash3's 32-bit finaliser (a bijection on 32-bit words with full avalanche).
Values are kept in int64 tensors below 2**32; a product of two such values may wrap past 2**63,
but its low 32 bits, all that is kept, are the same either way (two's complement).
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x85EBCA6B, 0xC2B2AE35
_GOLDEN = 0x9E3779B9  # separates the seed's halves and the position from the token stream


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 fmix32 of int64 values in [0, 2**32); result in the same range."""
    h = h ^ (h >> 16)
    h = (h * _C1) & _M32
    h = h ^ (h >> 13)
    h = (h * _C2) & _M32
    return h ^ (h >> 16)


def fmix32_int(h: int) -> int:
    """The same finaliser on a Python int (used once per request, for its seed)."""
    h ^= h >> 16
    h = (h * _C1) & _M32
    h ^= h >> 13
    h = (h * _C2) & _M32
    return h ^ (h >> 16)


def seed_key(seed: int) -> int:
    """Fold any Python int seed (negative or wider than 64 bits too) into a 32-bit key."""
    s = seed & ((1 << 64) - 1)
    return fmix32_int((s & _M32) ^ fmix32_int(((s >> 32) ^ _GOLDEN) & _M32))


def seeded_exponential(seed_key_Q: torch.Tensor, out_pos_Q: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) draws of shape (Q, V), one per (row's seed, row's output position, token id).

    The uniform behind each draw has 24 random bits, offset by half a step so it is never 0 or 1
    (the draws are finite and positive).
    """
    key_Q = fmix32(seed_key_Q ^ fmix32((out_pos_Q + _GOLDEN) & _M32))
    tok_V = fmix32((torch.arange(vocab_size, device=seed_key_Q.device, dtype=torch.int64) * 2 + 1) & _M32)
    bits_QV = fmix32(key_Q[:, None] ^ tok_V[None, :]) >> 8
    u_QV = (bits_QV.to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u_QV)
