"""Activations quantized to int8 per token, dynamically (the activation half of W8A8 over packed
int8 weights, moe_serve/quantization/packed.py): each row is scaled so its largest magnitude maps
to 127, rounded to the nearest integer (halves away from zero) and kept as int8 beside its float32
scale (amax / 127; 1 for a row of zeros). With int8 weights both GEMM operands are int8, so the
product runs on the integer tensor cores with int32 accumulation (moe_serve/kernels/packed_tiles.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

INT8_MAX = 127.0


@triton.jit
def _int8_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr):
    """One row: a pass for its amax, a pass to scale, round and store (a row is read twice: it
    stays in L1/L2 between the passes at the hidden sizes served)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    m = tl.max(amax, axis=0)
    scale = tl.where(m > 0, m / 127.0, 1.0)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs < K
        v = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=mask, other=0.0).to(tl.float32) / scale
        v = tl.minimum(tl.maximum(v, -127.0), 127.0)
        # round half away from zero: the conversion truncates toward zero
        q = tl.where(v >= 0, v + 0.5, v - 0.5).to(tl.int32)
        tl.store(q_ptr + row * stride_qm + k0 + offs, q.to(tl.int8), mask=mask)
    tl.store(s_ptr + row, scale)


INTERPRETED = type(_int8_quant_kernel).__name__ == "InterpretedFunction"


def quantize_int8_per_token_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in torch ops (any device): (M, K) -> int8 (M, K), float32 scales (M,)."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(-1) if x.shape[-1] else torch.zeros(x.shape[0], device=x.device)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    v = (xf / scale[:, None]).clamp(-INT8_MAX, INT8_MAX)
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)
    return q.to(torch.int8), scale


def int8_quant_launch(K: int) -> dict:
    """Constexprs of `_int8_quant_kernel`: one 1024-wide tile whatever K (K is a runtime loop bound),
    so the hidden and intermediate sizes of every model share one compiled variant."""
    return dict(BLOCK_K=1024)


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) bf16 / fp16 / fp32 activations -> int8 values and per-row float32 scales (M,), one launch."""
    if x.dim() != 2:
        raise ValueError(f"int8 activation quantization: x must be (M, K), got shape {tuple(x.shape)}")
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    s = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M == 0:
        return q, s
    if x.stride(1) != 1:
        x = x.contiguous()
    _int8_quant_kernel[(M,)](x, q, s, K, x.stride(0), q.stride(0), **int8_quant_launch(K))
    return q, s
