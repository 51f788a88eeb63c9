"""RMSNorm: computed in float32, cast back, the way the reference models do it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if x.is_cpu and cpu_ops.rms_norm_fits(x, self.weight):
            return cpu_ops.rms_norm(x, self.weight, self.eps)  # one C call (kernels/cpu_ops/norm.c)
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op; in float32 it equals the steps below bit for bit (checked). Half
            # precision keeps the explicit form: the reference rounds to dtype before the weight.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) for h = x + residual: one C call on the CPU where it fits, else the add and
        forward (the same numbers: the add is the same float32 sum)."""
        if x.is_cpu and cpu_ops.rms_norm_fits(x, self.weight, residual):
            return cpu_ops.rms_norm(residual, self.weight, self.eps, residual=x)
        h = x + residual
        return h, self(h)
