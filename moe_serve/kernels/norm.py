"""RMSNorm backends: one object per way of running the norms, chosen once at start-up by
moe_serve/platform.py and bound to every RMSNorm (and to the attention layers' fused q/k norm and
RoPE).

- `TorchNorm` ("torch"): torch ops, computed in float32 and cast back as the reference models do;
- `CpuCNorm` ("cpu_c"): our C kernels (moe_serve/kernels/cpu_ops/norm.c) where they take the call: RMSNorm,
  fused with the residual add before it, and per-head q/k RMSNorm with RoPE in one pass.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_serve.kernels import cpu_ops


class TorchNorm:
    name = "torch"

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def capturable(self) -> "TorchNorm":
        return TorchNorm(self.device)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and weight.dtype == torch.float32:
            # One fused op; in float32 it equals the steps below bit for bit (checked). Half
            # precision keeps the explicit form: the reference rounds to dtype before the weight.
            return F.rms_norm(x, weight.shape, weight, eps)
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) for h = x + residual."""
        h = x + residual
        return h, self.rms_norm(h, weight, eps)

    def norm_rope(self, q_TNH: torch.Tensor, k_TGH: torch.Tensor, rotary, positions_T: torch.Tensor,
                  q_norm=None, k_norm=None):
        """Per-head q/k RMSNorm (when given) and RoPE in one pass, or None: the caller runs them apart."""
        return None

    def __repr__(self) -> str:
        return type(self).__name__ + "()"


class CpuCNorm(TorchNorm):
    name = "cpu_c"

    def capturable(self) -> TorchNorm:  # the torch ops a GPU would run
        return TorchNorm(self.device)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if cpu_ops.rms_norm_fits(x, weight):
            return cpu_ops.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if cpu_ops.rms_norm_fits(x, weight, residual):  # the add and the norm in one C call (the same sum)
            return cpu_ops.rms_norm(residual, weight, eps, residual=x)
        return super().add_rms_norm(x, residual, weight, eps)

    def norm_rope(self, q_TNH, k_TGH, rotary, positions_T, q_norm=None, k_norm=None):
        if rotary.interleaved:
            return None
        qw, kw = (q_norm.weight, k_norm.weight) if q_norm is not None else (None, None)
        cos, sin = rotary.tables(q_TNH.device)
        if not (cpu_ops.norm_rope_fits(q_TNH, rotary.dim, cos, qw) and cpu_ops.norm_rope_fits(k_TGH, rotary.dim, cos, kw)):
            return None
        return (cpu_ops.norm_rope(q_TNH, cos, sin, positions_T, qw, q_norm.eps if q_norm else 0.0),
                cpu_ops.norm_rope(k_TGH, cos, sin, positions_T, kw, k_norm.eps if k_norm else 0.0))
