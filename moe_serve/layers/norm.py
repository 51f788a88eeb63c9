"""RMSNorm: computed in float32, cast back, the way the reference models do it, by the norm backend
bound by moe_serve/platform.py (`ops`: moe_serve/kernels/norm.py; torch ops until then)."""
from __future__ import annotations

import torch
from torch import nn

from moe_serve.kernels.norm import TorchNorm


class RMSNorm(nn.Module):
    op_kind = "norm"
    ops = TorchNorm()

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) for h = x + residual (one call where the backend fuses them)."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
