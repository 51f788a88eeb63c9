"""Rotary position embeddings: default, linear, llama3 and yarn (with DeepSeek's mscale).

RoPE settings come from `rope_scaling` (as configs on the Hub have them) or `rope_parameters` (as
transformers 5 writes them); `rope_config` folds both into one dict. cos/sin are computed from
positions in float32 exactly as the reference implementation does, so float32 outputs match.
"""
from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_config(hf: dict) -> dict:
    """One flat dict with rope_type, rope_theta and the scaling fields, from either config style."""
    params = dict(hf.get("rope_parameters") or {})
    if "rope_type" not in params and params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("rope_parameters nested per layer type are not supported")
    scaling = dict(hf.get("rope_scaling") or {})
    params = {**scaling, **params}
    params.setdefault("rope_type", params.pop("type", "default") if "type" in params else "default")
    if "rope_theta" not in params:
        params["rope_theta"] = hf.get("rope_theta", 10000.0)
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type={params['rope_type']!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings",
                          hf.get("original_max_position_embeddings", hf.get("max_position_embeddings")))
    return params


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: dict, dim: int, base: float, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = params.get("factor") or max_pos / params["original_max_position_embeddings"]
    orig = params["original_max_position_embeddings"]
    attn = params.get("attention_factor")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if attn is None:
        attn = (yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all)
                if mscale and mscale_all else yarn_get_mscale(factor))
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extra_factor = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra_factor) + (1.0 / pos_freqs) * extra_factor
    return inv, float(attn)


def inv_freq_and_scale(params: dict, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    base = float(params["rope_theta"])
    kind = params["rope_type"]
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / params["factor"], 1.0
    if kind == "llama3":
        factor, lo, hi = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(medium, smoothed, inv_l), 1.0
    return _yarn(params, dim, base, max_pos)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to (T, heads, dim) tensors given integer positions (T,).

    interleaved=True is DeepSeek's layout, and Llama-4's complex form (pair i is the complex number
    x_2i + j x_2i+1, times e^(j p theta_i)): rotation pairs are (x0, x1), (x2, x3), ... The pairs are
    de-interleaved into halves first (the same permutation for q and k, so dot products are those of
    the reference), then rotated as usual.
    """

    def __init__(self, dim: int, params: dict, max_position: int, interleaved: bool = False):
        super().__init__()
        self.dim = dim
        self.interleaved = interleaved
        self.max_position = max_position
        inv, self.attention_scaling = inv_freq_and_scale(params, dim, max_position)
        self.register_buffer("inv_freq", inv, persistent=False)
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    def _cos_sin_table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of every position up to max_position, (P, 1, dim) each, made once: a
        step then reads its rows with one index_select each instead of recomputing them in every
        layer. The same float32 operations per element as computing them on the fly, so the values
        are equal. The sin table carries rotate_half's sign (-sin on the first half), so applying
        RoPE is one roll and three elementwise ops (see `apply`)."""
        if self._table is None or self._table[0].device != device:
            cos, sin = self._compute(torch.arange(self.max_position, device=device))
            half = self.dim // 2
            sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
            self._table = (cos[:, None, :], sin[:, None, :])
        return self._table

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and signed sin tables as (P, dim) contiguous rows (for kernels that read them by
        position themselves)."""
        cos, sin = self._cos_sin_table(device)
        return cos.view(cos.shape[0], cos.shape[2]), sin.view(sin.shape[0], sin.shape[2])

    def _compute(self, positions_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions_T.to(torch.float32)[:, None] * self.inv_freq.to(positions_T.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def cos_sin(self, positions_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, 1, dim) cos and signed sin of the positions, for `apply` (the model gathers them
        once a step, for every layer: models/base.py DecoderStack)."""
        cos, sin = self._cos_sin_table(positions_T.device)
        return cos.index_select(0, positions_T), sin.index_select(0, positions_T)

    def apply(self, x_THD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              interleaved: bool | None = None) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] = roll(x) times the sign
        that the signed sin already holds (exactly the reference's products). interleaved: this
        call's layout where it differs from the embedding's (DeepSeek-V3.2's indexer rotates its
        halves, its MLA interleaved pairs, from the same tables)."""
        dtype = x_THD.dtype
        if self.interleaved if interleaved is None else interleaved:
            T, H, D = x_THD.shape
            x_THD = x_THD.view(T, H, D // 2, 2).transpose(2, 3).reshape(T, H, D)
        if cos.dtype != dtype:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return torch.addcmul(x_THD * cos, x_THD.roll(self.dim // 2, dims=-1), sin)
