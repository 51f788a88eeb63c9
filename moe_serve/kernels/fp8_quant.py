"""Activations quantized to FP8 per token per group of channels (DeepSeek-V3's recipe for its FP8
GEMMs, as vLLM runs it): each row's channels are cut into groups of `group` (128), and each group
is scaled so its largest magnitude maps to FP8's largest value; the group's float32 scale (amax /
448) travels beside the FP8 values. With block-FP8 weights this makes both GEMM operands FP8, so
the product runs on FP8 tensor cores (sm_89+) and is rescaled per K block in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@triton.jit(do_not_specialize=("stride_sm",))  # the scales' row stride (K / 128): no variant per model
def _quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm,
                  GROUP: tl.constexpr, FP8_MAX_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.where(amax > 0, amax / FP8_MAX_C, 1.0)
    q = tl.clamp(x / scale, -FP8_MAX_C, FP8_MAX_C)
    tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + g, scale)


_INTERPRETED = type(_quant_kernel).__name__ == "InterpretedFunction"


def quantize_per_token_group_reference(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in torch ops (any device): (M, K) -> FP8 (M, K), float32 scales (M, ceil(K / group))."""
    M, K = x.shape
    n = triton.cdiv(K, group)
    padded = torch.zeros(M, n * group, dtype=torch.float32, device=x.device)
    padded[:, :K] = x.to(torch.float32)
    g = padded.view(M, n, group)
    amax = g.abs().amax(-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(M, n * group)[:, :K].contiguous()
    return q, scale


def quantize_per_token_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) activations -> FP8 values and per-(row, group) float32 scales, one Triton launch.
    Under the CPU interpreter the kernel stores its scaled, clamped float32 values and torch rounds
    them to FP8: the interpreter's own float32 -> FP8 conversion rounds some values wrongly (127.7
    became 64), which compiled code does not; everything else is the kernel's."""
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.float32 if _INTERPRETED else FP8, device=x.device)
    s = torch.empty((M, triton.cdiv(K, group)), dtype=torch.float32, device=x.device)
    if M == 0:
        return q.to(FP8), s
    if x.stride(1) != 1:
        x = x.contiguous()
    _quant_kernel[(M, s.shape[1])](x, q, s, K, x.stride(0), q.stride(0), s.stride(0), GROUP=group, FP8_MAX_C=FP8_MAX)
    return (q.to(FP8) if _INTERPRETED else q), s
