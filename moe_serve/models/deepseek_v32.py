"""DeepSeek-V3.2 (DeepseekV32ForCausalLM) and GLM-5 (GlmMoeDsaForCausalLM): DeepSeek-V3's model
with DeepSeek Sparse Attention. Each layer's MLA reads only the `index_topk` cached tokens its
lightning indexer scores highest for the query (attention/layer.py PagedDSAAttention).

The indexer, per token: queries q = wq_b(q_resid) as index_n_heads heads of index_head_dim (q_resid
is the MLA's normed q_a projection), one key k = LayerNorm(wk(x)) shared by the heads, both rotated
on their first qk_rope_head_dim values (DeepSeek-V3.2 rotates halves, GLM-5 interleaved pairs: the
MLA itself rotates interleaved pairs in both), and head weights weights_proj(x) / sqrt(heads). A
token's score for query p is sum_h w_h relu(q_h . k * index_head_dim^-0.5); keys are cached per
token beside the latent. transformers scores in float32 without the released kernels' Hadamard
rotation and FP8 keys (the rotation leaves dot products unchanged); so do we.

GLM-5 runs the indexer only on its "full" layers (`indexer_types`, or the pattern / frequency its
Hub config gives); a "shared" layer attends over the selection of the last full layer before it.
"""
from __future__ import annotations

import torch
from torch import nn

from attention.layer import PagedDSAAttention
from attention.metadata import AttentionMetadata
from moe_serve.layers.linear import Linear
from moe_serve.layers.rotary import RotaryEmbedding
from moe_serve.models.deepseek_v3 import DeepseekV3ForCausalLM, MLASelfAttention


class Indexer(nn.Module):
    def __init__(self, hf: dict, rotary: RotaryEmbedding, interleaved: bool, dtype):
        super().__init__()
        D, q_rank = hf["hidden_size"], hf.get("q_lora_rank")
        if not q_rank:
            raise ValueError("DeepSeek Sparse Attention needs q_lora_rank (its indexer reads the q_a projection)")
        self.N, self.I, self.R = hf["index_n_heads"], hf["index_head_dim"], hf["qk_rope_head_dim"]
        if self.R > self.I:
            raise ValueError(f"qk_rope_head_dim={self.R} is larger than index_head_dim={self.I}")
        self.wq_b = Linear(q_rank, self.N * self.I, dtype=dtype)
        self.wk = Linear(D, self.I, dtype=dtype)
        self.k_norm = nn.LayerNorm(self.I, eps=1e-6, dtype=dtype)
        self.weights_proj = Linear(D, self.N, dtype=dtype)
        self.rotary, self.interleaved = rotary, interleaved

    def forward(self, x_TD: torch.Tensor, q_resid_TQ: torch.Tensor, rope) -> tuple[torch.Tensor, ...]:
        """(q (T, N, I), head weights (T, N) float32, keys (T, I))."""
        T, R = x_TD.shape[0], self.R
        cos, sin = rope
        q = self.wq_b(q_resid_TQ).view(T, self.N, self.I)
        k = self.k_norm(self.wk(x_TD)).view(T, 1, self.I)
        q = torch.cat([self.rotary.apply(q[..., :R], cos, sin, interleaved=self.interleaved), q[..., R:]], dim=-1)
        k = torch.cat([self.rotary.apply(k[..., :R], cos, sin, interleaved=self.interleaved), k[..., R:]], dim=-1)
        w = self.weights_proj(x_TD).float() * self.N ** -0.5
        return q, w, k.view(T, self.I)


class DSASelfAttention(MLASelfAttention):
    def __init__(self, hf: dict, rotary: RotaryEmbedding, dtype, has_indexer: bool, indexer_interleaved: bool):
        super().__init__(hf, rotary, dtype)
        topk = int(hf.get("index_topk", 2048))
        self.indexer = Indexer(hf, rotary, indexer_interleaved, dtype) if has_indexer else None
        self.attn = PagedDSAAttention(self.L, self.R, self.attn.scale, topk,
                                      hf["index_head_dim"] if has_indexer else None, hf["index_head_dim"] ** -0.5,
                                      hf["index_n_heads"])

    def attend(self, q_latent_TNL, q_pe_TNR, latent_TC, meta: AttentionMetadata, x_TD, q_resid, rope):
        index = self.indexer(x_TD, q_resid, rope) if self.indexer is not None else None
        return self.attn(q_latent_TNL, q_pe_TNR, latent_TC, meta, index)


def indexer_types(hf: dict) -> list[str]:
    """"full" (runs its indexer) or "shared" per layer, as transformers' GLM-5 config derives it:
    `indexer_types`, else `index_topk_pattern` ("F"/"S" per layer), else every `index_topk_freq`-th
    layer from `index_skip_topk_offset` on. DeepSeek-V3.2 configs have none of them: every layer full."""
    n = hf["num_hidden_layers"]
    types = hf.get("indexer_types")
    if types is None and hf.get("index_topk_pattern") is not None:
        pattern = hf["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    if types is None:
        freq, offset = max(hf.get("index_topk_freq", 1), 1), hf.get("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(types) != n or set(types) - {"full", "shared"}:
        raise ValueError(f"indexer_types={types!r} must give 'full' or 'shared' for each of the {n} layers")
    if types[0] != "full":
        raise ValueError(f"indexer_types={types!r}: the first layer must run its indexer ('full'); a 'shared' "
                         "layer reuses the selection of the full layer before it")
    return types


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    indexer_interleaved = False  # the indexer rotates halves (the MLA interleaved pairs)

    def attention(self, hf: dict, rotary: RotaryEmbedding, dtype, layer: int) -> nn.Module:
        types = indexer_types(hf)  # the MTP layer after the last one runs its own indexer
        full = layer >= len(types) or types[layer] == "full"
        return DSASelfAttention(hf, rotary, dtype, full, self.indexer_interleaved)


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    indexer_interleaved = True
