"""Grouped-query self-attention block (Mixtral, Qwen3-MoE, Llama-style): projections, optional
per-head q/k RMSNorm, RoPE, then paged attention through the backend chosen for the device."""
from __future__ import annotations

import torch
from torch import nn

from attention.layer import PagedAttention
from attention.metadata import AttentionMetadata
from moe_serve.layers.linear import Linear
from moe_serve.layers.norm import RMSNorm
from moe_serve.layers.rotary import RotaryEmbedding


class GQASelfAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, attention_backend: str, dtype, bias: bool = False,
                 qk_norm_eps: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Linear(hidden_size, num_heads * head_dim, bias=bias, dtype=dtype)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias, dtype=dtype)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias, dtype=dtype)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=bias, dtype=dtype)
        if qk_norm_eps is not None:  # Qwen3: RMSNorm over each head's vector before RoPE
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, dtype)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary
        self.attn = PagedAttention(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, attention_backend)

    def forward(self, x_TD: torch.Tensor, positions_T: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x_TD.shape[0]
        q = self.q_proj(x_TD).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x_TD).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_TD).view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rotary.cos_sin(positions_T)
        q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        o = self.attn(q, k, v, meta)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))
