"""Grouped-query self-attention block (Mixtral, Qwen2/3-MoE, OLMoE, GLM-4.5, Llama-style):
projections, optional q/k RMSNorm (per head, or over the whole projection as OLMoE has it),
optional clipping of q/k/v, RoPE over the whole head or its first `rotary.dim` channels (partial
rotary), then paged attention through the backend chosen for the device."""
from __future__ import annotations

import torch
from torch import nn

from attention.layer import PagedAttention
from attention.metadata import AttentionMetadata
from moe_serve.kernels.norm import TorchNorm
from moe_serve.layers.linear import Linear
from moe_serve.layers.norm import RMSNorm
from moe_serve.layers.rotary import RotaryEmbedding


class GQASelfAttention(nn.Module):
    op_kind = "norm"  # its fused q/k norm + RoPE
    ops = TorchNorm()

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, dtype, bias: bool = False,
                 qk_norm_eps: float | None = None, qk_norm: str = "head", o_bias: bool | None = None,
                 clip_qkv: float | None = None, sliding_window: int | None = None, sinks: bool = False):
        """bias: on q/k/v (and o unless `o_bias` says otherwise). qk_norm: "head" (Qwen3, GLM-4.5:
        RMSNorm over each head's vector) or "full" (OLMoE: over the whole q / k projection), used
        when qk_norm_eps is given. clip_qkv: clamp q, k, v to [-clip, clip] after the norms.
        sliding_window, sinks: passed to PagedAttention (GPT-OSS)."""
        super().__init__()
        if qk_norm not in ("head", "full"):
            raise ValueError(f"qk_norm={qk_norm!r} is not one of 'head', 'full'")
        if rotary.dim > head_dim or rotary.dim % 2:
            raise ValueError(f"rotary dim {rotary.dim} must be even and at most head_dim={head_dim}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Linear(hidden_size, num_heads * head_dim, bias=bias, dtype=dtype)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias, dtype=dtype)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias, dtype=dtype)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=bias if o_bias is None else o_bias, dtype=dtype)
        self.qk_norm = qk_norm
        if qk_norm_eps is not None:
            q_dim, k_dim = (head_dim, head_dim) if qk_norm == "head" else (num_heads * head_dim, num_kv_heads * head_dim)
            self.q_norm = RMSNorm(q_dim, qk_norm_eps, dtype)
            self.k_norm = RMSNorm(k_dim, qk_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.clip_qkv = clip_qkv
        self.rotary = rotary
        self.rotary_dim = rotary.dim
        self.attn = PagedAttention(num_heads, num_kv_heads, head_dim, head_dim ** -0.5,
                                   sliding_window=sliding_window, sinks=sinks)

    # q, k and v's projections as one GEMM (moe_serve/prepare.py fuse_projections): the stacked
    # weight and bias, of which q_proj, k_proj and v_proj's own parameters are then row views.
    qkv_weight: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None

    def fusable_projections(self) -> list[list[str]]:
        return [["q_proj", "k_proj", "v_proj"]]

    def set_fused(self, names: list[str], weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.qkv_weight, self.qkv_bias = weight, bias

    # Packed q, k and v (moe_serve/prepare.py): one packed Linear over their stacked codes, run by
    # q_proj's backend; held outside the module tree (its parameters are the layers' own storage).
    qkv_packed = None

    def set_fused_packed(self, names: list[str], linear) -> None:
        self.__dict__["qkv_packed"] = linear

    def forward(self, x_TD: torch.Tensor, positions_T: torch.Tensor, meta: AttentionMetadata,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """rope: the step's (cos, sin) rows of `rotary`'s tables (gathered once for every layer)."""
        T = x_TD.shape[0]
        if self.qkv_weight is not None:
            q, k, v = self.q_proj.ops(x_TD, self.qkv_weight, self.qkv_bias).split(
                [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features], dim=-1)
        elif self.qkv_packed is not None:
            q, k, v = self.q_proj.ops.packed(self.qkv_packed, x_TD).split(
                [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features], dim=-1)
        else:
            q, k, v = self.q_proj(x_TD), self.k_proj(x_TD), self.v_proj(x_TD)
        if self.q_norm is not None and self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = self._norm_rope(q, k, positions_T, rope)
        o = self.attn(q, k, v, meta)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))

    def _norm_rope(self, q: torch.Tensor, k: torch.Tensor, positions_T: torch.Tensor, rope):
        """Per-head q/k norm (where the model has it) and RoPE; (T, heads, head_dim) each."""
        head_norm = self.q_norm is not None and self.qk_norm == "head"
        fused = self.ops.norm_rope(q, k, self.rotary, positions_T, *((self.q_norm, self.k_norm) if head_norm else ()))
        if fused is not None:
            return fused
        if head_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        if self.rotary_dim == self.head_dim:
            return self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        # partial rotary (GLM-4.5): the first rotary_dim channels of each head turn, the rest pass
        r = self.rotary_dim
        return (torch.cat([self.rotary.apply(q[..., :r], cos, sin), q[..., r:]], dim=-1),
                torch.cat([self.rotary.apply(k[..., :r], cos, sin), k[..., r:]], dim=-1))
