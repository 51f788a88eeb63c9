"""The pre-norm decoder layer every supported architecture uses:
h = x + attn(input_layernorm(x)); out = h + ffn(post_attention_layernorm(h)).
The FFN is a dense MLP or an MoE block, registered under the checkpoint's module name."""
from __future__ import annotations

import torch
from torch import nn

from attention.metadata import AttentionMetadata
from moe_serve.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, hidden_size: int, eps: float, self_attn: nn.Module, ffn: nn.Module, ffn_name: str, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype)
        self.ffn_name = ffn_name
        self.add_module(ffn_name, ffn)

    def forward(self, x_TD: torch.Tensor, positions_T: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = x_TD + self.self_attn(self.input_layernorm(x_TD), positions_T, meta)
        return h + getattr(self, self.ffn_name)(self.post_attention_layernorm(h))
