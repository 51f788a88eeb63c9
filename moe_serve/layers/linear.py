"""Linear layers and the dense SwiGLU MLP. The one place a quantized or fused GEMM would plug in."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_gemm import linear


class Linear(nn.Module):
    """y = x W^T (+ b). Weight layout (out_features, in_features), as in checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class DenseMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)). Used for dense layers and shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype=torch.float32):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, dtype=dtype)
        self.up_proj = Linear(hidden_size, intermediate_size, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
