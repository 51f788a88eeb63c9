"""MXFP4 expert weights (OCP microscaling FP4, as GPT-OSS ships them) for the grouped expert op.

Layout on disk and in memory (uint8, never expanded whole):
  blocks (E, R, C / 32, 16): two e2m1 values per byte, the low nibble first (element 2i is
      `byte & 0xF`, element 2i + 1 is `byte >> 4`); R output rows, C input columns.
  scales (E, R, C / 32): one e8m0 exponent per 32 values, value = e2m1 * 2 ** (scale - 127).
An e2m1 nibble is sign (bit 3), exponent (bits 1-2) and mantissa (bit 0): the 16 values in
`FP4_VALUES`. The rows are the projection's output features, so (E, 2F, D) for gate/up and
(E, D, F) for down: our w13 / w2 layouts, with each block row a whole row of the dense weight.

The Triton grouped GEMM (triton_kernel.py, B_FP4) reads these bytes as they are and decodes each
weight tile in registers (the CUDA expert backend). The torch ops' path, `fused_experts_mxfp4`,
dequantizes only the experts the step routes a token to (all local experts when host reads of the
routing ids are not allowed, as in a captured decode), into one temporary stack, and runs the
dense op on it: memory is one layer's active experts at a time, never a dense copy of the model.
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

    def dequantize(self, dtype: torch.dtype, experts: torch.Tensor | None = None,
                   workspace: str | None = None) -> torch.Tensor:
        """(n, R, C) dense weights of the given experts (all when None), exactly: every MXFP4 value
        is a small float times a power of two, representable in float32 and bfloat16 alike.
        workspace: a name whose buffer is reused from call to call (the result is valid until the
        next call with that name)."""
        blocks, scales = self.blocks, self.scales
        if experts is not None:
            blocks, scales = blocks.index_select(0, experts), scales.index_select(0, experts)
        return dequantize_mxfp4(blocks, scales, dtype, workspace)


_PAIR_DTYPE = {torch.float32: torch.float64, torch.bfloat16: torch.int32, torch.float16: torch.int32,
               torch.float64: torch.complex128}


@functools.lru_cache(maxsize=None)
def _tables(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per byte value: its two e2m1 values as one element of twice the width (256,), so decoding is
    one index_select of whole pairs (10x advanced indexing's speed on the CPU, measured); per e8m0
    byte: 2 ** (b - 127) (256,)."""
    fp4 = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = torch.arange(256)
    pairs = torch.stack([fp4[b & 0xF], fp4[b >> 4]], dim=1).to(dtype).contiguous()
    scale = torch.ldexp(torch.ones(256), b - 127)  # 255 (NaN in e8m0) -> inf: never in a real checkpoint
    return pairs.view(_PAIR_DTYPE[dtype]).view(256).to(device), scale.to(dtype=dtype, device=device)


_WORKSPACES: dict = {}


def _workspace(name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused flat buffer: fresh memory of this size costs page faults at every step (measured:
    about a third of the dequantization time for one layer's routed experts)."""
    key = (name, dtype, device, torch.is_inference_mode_enabled())  # an inference tensor is read-only outside
    buf = _WORKSPACES.get(key)
    if buf is None or buf.numel() < n:
        buf = _WORKSPACES[key] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                     workspace: str | None = None) -> torch.Tensor:
    """blocks (..., R, G, 16) and scales (..., R, G) uint8 -> (..., R, G * 32) in dtype."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    pairs, scale = _tables(dtype, blocks.device)
    *lead, G, B = blocks.shape
    idx = blocks.reshape(-1).int()
    if workspace is None:
        vals = pairs.index_select(0, idx)
    else:
        vals = torch.index_select(pairs, 0, idx, out=_workspace(workspace, idx.numel(), pairs.dtype, pairs.device))
    vals = vals.view(dtype).view(*lead, G, 2 * B)
    vals.mul_(scale.index_select(0, scales.reshape(-1).int()).view(*lead, G, 1))
    return vals.view(*lead, G * 2 * B)


# Most bytes of dequantized expert weights alive at once: larger expert sets run in chunks (a layer
# of GPT-OSS-120B's 128 experts would be 12.7 GB in float32).
MAX_DEQUANT_BYTES = 512 << 20


def fused_experts_mxfp4(x_TD, w13: Mxfp4Weight, w2: Mxfp4Weight, topk_weights_TK, topk_ids_TK, *,
                        w13_bias=None, w2_bias=None, activation="silu", dense=None,
                        dtype: torch.dtype = torch.float32, host_reads: bool = True) -> torch.Tensor:
    """The grouped expert op over MXFP4 weights: the routed experts (every local expert when there
    are as many pairs, or when no host read is allowed) are dequantized to `dtype` into reused
    (A, 2F, D) / (A, D, F) buffers, ids remapped onto them, and the dense op runs; at most
    MAX_DEQUANT_BYTES of experts at a time (chunks' outputs summed in float32). dense: the experts
    backend that runs the dequantized weights (the reference op when None)."""
    from moe_serve.kernels.grouped_gemm.reference import fused_experts_reference

    dense = dense or fused_experts_reference

    E = w13.shape[0]  # any weight with shape and dequantize (MXFP4, block FP8)
    ids_TK = topk_ids_TK
    dev = ids_TK.device
    if host_reads and x_TD.shape[0] * ids_TK.shape[1] < E:
        flat = ids_TK.reshape(-1)
        experts = torch.unique(flat[flat >= 0])  # sorted; one host read (a memory load on the CPU)
        remap = torch.full((E + 1,), -1, dtype=ids_TK.dtype, device=dev)
        remap[experts] = torch.arange(experts.numel(), dtype=ids_TK.dtype, device=dev)
        ids_TK = remap[torch.where(ids_TK >= 0, ids_TK, E)]
    else:
        experts = None
    A = E if experts is None else experts.numel()
    per_expert = (w13.shape[1] * w13.shape[2] + w2.shape[1] * w2.shape[2]) * torch.empty((), dtype=dtype).element_size()
    n = max(1, MAX_DEQUANT_BYTES // per_expert)
    out = None
    for c0 in range(0, A, n):
        c1 = min(c0 + n, A)
        sel = torch.arange(c0, c1, device=dev) if experts is None else experts[c0:c1]
        if experts is None and A <= n:
            sel = None  # all of them, as they are
        ids = ids_TK if A <= n else torch.where((ids_TK >= c0) & (ids_TK < c1), ids_TK - c0, -1)
        y = dense(x_TD, _dequantize(w13, dtype, sel, "w13"), _dequantize(w2, dtype, sel, "w2"),
                          topk_weights_TK, ids,
                          w13_bias=w13_bias if w13_bias is None or sel is None else w13_bias.index_select(0, sel),
                          w2_bias=w2_bias if w2_bias is None or sel is None else w2_bias.index_select(0, sel),
                          activation=activation)
        if A <= n:
            return y
        out = y.to(torch.float32) if out is None else out.add_(y.to(torch.float32))
    if out is None:  # no expert routed here
        return torch.zeros_like(x_TD)
    return out.to(x_TD.dtype)


def _dequantize(w, dtype: torch.dtype, experts, workspace: str) -> torch.Tensor:
    """MXFP4 into a reused buffer; another weight kind (block FP8) its own way."""
    if isinstance(w, Mxfp4Weight):
        return w.dequantize(dtype, experts, workspace)
    return w.dequantize(dtype, experts)
