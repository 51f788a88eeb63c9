"""The pre-norm decoder layer every supported architecture uses:
h = x + attn(input_layernorm(x)); out = h + ffn(post_attention_layernorm(h)).
The FFN is a dense MLP or an MoE block, registered under the checkpoint's module name."""
from __future__ import annotations

import torch
from torch import nn

from attention.metadata import AttentionMetadata
from expert_parallel.runtime.layer import MoE, run_to_end
from expert_parallel.runtime.step import NO_STEP, MoEStep
from moe_serve.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    # DecoderStack passes each such layer the previous one's FFN output unadded (`stages`' residual).
    defers_residual = True

    def __init__(self, hidden_size: int, eps: float, self_attn: nn.Module, ffn: nn.Module, ffn_name: str, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype)
        self.ffn_name = ffn_name
        self.add_module(ffn_name, ffn)

    def forward(self, x_TD: torch.Tensor, positions_T: torch.Tensor, meta: AttentionMetadata,
                step: MoEStep, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return run_to_end(self.stages(x_TD, positions_T, meta, step, rope))

    def stages(self, x_TD, positions_T, meta: AttentionMetadata, step: MoEStep, rope: tuple[torch.Tensor, torch.Tensor],
               residual: torch.Tensor | None = None, defer: bool = False):
        """Generator form: yields while an MoE block's communication is in flight. rope: the step's
        (cos, sin) rows (DecoderStack gathers them once for every layer). residual: the previous
        layer's FFN output, not yet added to x_TD (the add fused into the input norm); defer:
        return (h, FFN output) for the next norm to add, instead of their sum."""
        if residual is None:
            h_in, x = x_TD, self.input_layernorm(x_TD)
        else:
            h_in, x = self.input_layernorm.add_norm(x_TD, residual)
        a = self.self_attn(x, positions_T, meta, rope)
        h, x = self.post_attention_layernorm.add_norm(h_in, a)  # h = x + a, fused on the CPU
        ffn = getattr(self, self.ffn_name)
        out = (yield from ffn.stages(x, step)) if isinstance(ffn, MoE) else ffn(x)
        return (h, out) if defer else h + out
