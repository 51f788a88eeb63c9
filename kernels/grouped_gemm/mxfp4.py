"""MXFP4 expert weights (OCP microscaling FP4, as GPT-OSS ships them) for the grouped expert op.

Layout on disk and in memory (uint8, never expanded whole):
  blocks (E, R, C / 32, 16): two e2m1 values per byte, the low nibble first (element 2i is
      `byte & 0xF`, element 2i + 1 is `byte >> 4`); R output rows, C input columns.
  scales (E, R, C / 32): one e8m0 exponent per 32 values, value = e2m1 * 2 ** (scale - 127).
An e2m1 nibble is sign (bit 3), exponent (bits 1-2) and mantissa (bit 0): the 16 values in
`FP4_VALUES`. The rows are the projection's output features, so (E, 2F, D) for gate/up and
(E, D, F) for down: our w13 / w2 layouts, with each block row a whole row of the dense weight.

`fused_experts_mxfp4` dequantizes only the experts the step routes a token to (all local experts
when host reads of the routing ids are not allowed, as in a captured decode), into one temporary
stack, and runs the dense op on it: memory is one layer's active experts at a time, never a dense
copy of the model.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class Mxfp4Weight(NamedTuple):
    """One stacked expert projection in MXFP4: blocks (E, R, G, 16) and scales (E, R, G) uint8."""

    blocks: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        E, R, G, B = self.blocks.shape
        return E, R, G * B * 2

    def dequantize(self, dtype: torch.dtype, experts: torch.Tensor | None = None) -> torch.Tensor:
        """(n, R, C) dense weights of the given experts (all when None), exactly: every MXFP4 value
        is a small float times a power of two, representable in float32 and bfloat16 alike."""
        blocks, scales = self.blocks, self.scales
        if experts is not None:
            blocks, scales = blocks.index_select(0, experts), scales.index_select(0, experts)
        return dequantize_mxfp4(blocks, scales, dtype)


@functools.lru_cache(maxsize=None)
def _tables(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per byte value: its two e2m1 values (256, 2); per e8m0 byte: 2 ** (b - 127) (256,)."""
    fp4 = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = torch.arange(256)
    pairs = torch.stack([fp4[b & 0xF], fp4[b >> 4]], dim=1)
    scale = torch.ldexp(torch.ones(256), b - 127)  # 255 (NaN in e8m0) -> inf: never in a real checkpoint
    return pairs.to(dtype=dtype, device=device), scale.to(dtype=dtype, device=device)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks (..., R, G, 16) and scales (..., R, G) uint8 -> (..., R, G * 32) in dtype."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    pairs, scale = _tables(dtype, blocks.device)
    *lead, G, B = blocks.shape
    vals = pairs[blocks.int()].view(*lead, G, 2 * B)  # one gather of value pairs per byte
    vals.mul_(scale[scales.int()].unsqueeze(-1))
    return vals.view(*lead, G * 2 * B)


def fused_experts_mxfp4(x_TD, w13: Mxfp4Weight, w2: Mxfp4Weight, topk_weights_TK, topk_ids_TK, *,
                        w13_bias=None, w2_bias=None, activation="silu", backend: str = "torch",
                        dtype: torch.dtype = torch.float32, host_reads: bool = True) -> torch.Tensor:
    """The grouped expert op over MXFP4 weights: the routed experts are dequantized to `dtype` into
    one temporary (A, 2F, D) / (A, D, F) stack, ids remapped onto it, and the dense op runs."""
    from kernels.grouped_gemm import fused_experts

    E = w13.shape[0]  # any weight with shape and dequantize (MXFP4, block FP8)
    if host_reads and x_TD.shape[0] * topk_ids_TK.shape[1] < E:
        ids = topk_ids_TK.reshape(-1)
        active = torch.unique(ids[ids >= 0])  # sorted; one host read (a memory load on the CPU)
        remap = torch.full((E + 1,), -1, dtype=topk_ids_TK.dtype, device=topk_ids_TK.device)
        remap[active] = torch.arange(active.numel(), dtype=topk_ids_TK.dtype, device=topk_ids_TK.device)
        topk_ids_TK = remap[torch.where(topk_ids_TK >= 0, topk_ids_TK, E)]
        w13_d, w2_d = w13.dequantize(dtype, active), w2.dequantize(dtype, active)
        if w13_bias is not None:
            w13_bias = w13_bias.index_select(0, active)
        if w2_bias is not None:
            w2_bias = w2_bias.index_select(0, active)
    else:  # every local expert (as many pairs as experts, or no host read allowed)
        w13_d, w2_d = w13.dequantize(dtype), w2.dequantize(dtype)
    return fused_experts(x_TD, w13_d, w2_d, topk_weights_TK, topk_ids_TK, backend=backend,
                         w13_bias=w13_bias, w2_bias=w2_bias, activation=activation)
