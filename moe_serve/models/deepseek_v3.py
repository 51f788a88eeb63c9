"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention over a compressed paged cache,
dense first layers, routed + shared experts, group-limited sigmoid routing, yarn RoPE with mscale.

MLA shape legend: T tokens, N heads, P qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim,
L kv_lora_rank. The cache keeps [c_kv (L) | k_pe (R)] per token; attention runs in the absorbed
form: q_latent = q_nope @ W_UK, scores against c_kv, and the output mapped through W_UV.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from attention.layer import PagedMLAAttention
from attention.metadata import AttentionMetadata
from expert_parallel.runtime.layer import MoE, MoEContext
from expert_parallel.runtime.router import GroupLimitedSigmoidRouter
from moe_serve.layers.linear import DenseMLP, Linear
from moe_serve.layers.norm import RMSNorm
from moe_serve.layers.rotary import RotaryEmbedding, rope_config, yarn_get_mscale
from moe_serve.models.base import CausalLM, DecoderStack
from moe_serve.models.decoder_layer import DecoderLayer


class MLASelfAttention(nn.Module):
    def __init__(self, hf: dict, rotary: RotaryEmbedding, dtype):
        super().__init__()
        D, self.N = hf["hidden_size"], hf["num_attention_heads"]
        self.P, self.R, self.V = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
        self.L = hf["kv_lora_rank"]
        eps = hf.get("rms_norm_eps", 1e-6)
        bias = bool(hf.get("attention_bias", False))
        qk = self.P + self.R
        self.q_lora_rank = hf.get("q_lora_rank")
        if self.q_lora_rank:
            self.q_a_proj = Linear(D, self.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps, dtype)
            self.q_b_proj = Linear(self.q_lora_rank, self.N * qk, dtype=dtype)
        else:
            self.q_proj = Linear(D, self.N * qk, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(D, self.L + self.R, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.L, eps, dtype)
        self.kv_b_proj = Linear(self.L, self.N * (self.P + self.V), dtype=dtype)
        self.o_proj = Linear(self.N * self.V, D, bias=bias, dtype=dtype)
        self.rotary = rotary
        rope = rope_config(hf)
        scale = qk ** -0.5
        if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
            m = yarn_get_mscale(rope["factor"], rope["mscale_all_dim"])
            scale = scale * m * m
        # kv_b_proj's weight is read as W_UK / W_UV in the absorbed form: it stays in the model's dtype.
        self.kv_b_proj.weight_used_directly = True
        self.attn = PagedMLAAttention(self.L, self.R, scale)

    def forward(self, x_TD: torch.Tensor, positions_T: torch.Tensor, meta: AttentionMetadata,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T = x_TD.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(x_TD)) if self.q_lora_rank else None
        q = self.q_b_proj(q_resid) if self.q_lora_rank else self.q_proj(x_TD)
        q_nope, q_pe = q.view(T, self.N, self.P + self.R).split([self.P, self.R], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x_TD).split([self.L, self.R], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        cos, sin = rope
        q_pe = self.rotary.apply(q_pe, cos, sin)
        k_pe = self.rotary.apply(k_pe.reshape(T, 1, self.R), cos, sin).reshape(T, self.R)
        w_kv = self.kv_b_proj.weight.view(self.N, self.P + self.V, self.L)
        w_uk_NPL, w_uv_NVL = w_kv[:, : self.P], w_kv[:, self.P:]
        # on the linear backend, which has a batch-invariant form of these per-head products
        q_latent_TNL = self.kv_b_proj.ops.per_head(q_nope, w_uk_NPL.transpose(1, 2))
        o_TNL = self.attend(q_latent_TNL, q_pe, torch.cat([c_kv, k_pe], dim=-1), meta, x_TD, q_resid, rope)
        o_TNV = self.kv_b_proj.ops.per_head(o_TNL, w_uv_NVL)
        return self.o_proj(o_TNV.reshape(T, self.N * self.V))

    def attend(self, q_latent_TNL, q_pe_TNR, latent_TC, meta: AttentionMetadata, x_TD, q_resid, rope):
        """The paged attention call: (T, N, L). x_TD, q_resid (the normed q_a projection) and rope
        are for layers that compute more from them (DeepSeek-V3.2's indexer)."""
        return self.attn(q_latent_TNL, q_pe_TNR, latent_TC, meta)


class DeepseekV3ForCausalLM(CausalLM):
    expert_names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    @staticmethod
    def moe_layer_ids(hf: dict) -> list[int]:
        """The layers whose FFN is an MoE block: `mlp_layer_types` ("dense" / "sparse" per layer)
        where the config has it (DeepSeek-V3.2, GLM-5), else first_k_dense_replace and
        moe_layer_freq."""
        if not hf.get("n_routed_experts"):
            return []
        types = hf.get("mlp_layer_types")
        if types is not None:
            if len(types) != hf["num_hidden_layers"] or set(types) - {"dense", "sparse"}:
                raise ValueError(f"mlp_layer_types={types!r} must give 'dense' or 'sparse' for each of the "
                                 f"{hf['num_hidden_layers']} layers")
            return [i for i, t in enumerate(types) if t == "sparse"]
        first_dense, freq = hf.get("first_k_dense_replace", 0), hf.get("moe_layer_freq", 1) or 1
        return [i for i in range(hf["num_hidden_layers"]) if i >= first_dense and i % freq == 0]

    def attention(self, hf: dict, rotary: RotaryEmbedding, dtype, layer: int) -> nn.Module:
        return MLASelfAttention(hf, rotary, dtype)

    def __init__(self, hf: dict, moe: MoEContext, dtype):
        D = hf["hidden_size"]
        eps = hf.get("rms_norm_eps", 1e-6)
        rotary = RotaryEmbedding(hf["qk_rope_head_dim"], rope_config(hf), hf.get("max_position_embeddings", 4096),
                                 interleaved=bool(hf.get("rope_interleave", True)))
        moe_ids = self.moe_layer_ids(hf)
        layers = [self._decoder_layer(hf, rotary, moe, dtype, i, moe_ids.index(i) if i in moe_ids else None)
                  for i in range(hf["num_hidden_layers"])]
        super().__init__(hf, DecoderStack(hf["vocab_size"], D, layers, eps, dtype, rotary), dtype)
        self.mtp = None  # the multi-token-prediction layers, when speculative decoding asks for them

    def _decoder_layer(self, hf: dict, rotary: RotaryEmbedding, moe: MoEContext, dtype, i: int,
                       moe_index: int | None) -> DecoderLayer:
        """Decoder layer i: MLA, and an MoE block (the moe_index-th) or a dense MLP (None)."""
        D, E = hf["hidden_size"], hf.get("n_routed_experts")
        attn = self.attention(hf, rotary, dtype, i)
        if moe_index is not None:
            router = GroupLimitedSigmoidRouter(
                D, E, hf["num_experts_per_tok"], hf.get("n_group") or 1, hf.get("topk_group") or 1,
                bool(hf.get("norm_topk_prob", True)), float(hf.get("routed_scaling_factor", 1.0)))
            n_shared = hf.get("n_shared_experts") or 0
            shared = DenseMLP(D, hf["moe_intermediate_size"] * n_shared, dtype) if n_shared else None
            ffn = MoE(D, hf["moe_intermediate_size"], E, router, moe, dtype, shared_experts=shared,
                      layer_index=moe_index)
        else:
            ffn = DenseMLP(D, hf["intermediate_size"], dtype)
        return DecoderLayer(D, hf.get("rms_norm_eps", 1e-6), attn, ffn, "mlp", dtype)

    def add_mtp_layers(self, moe: MoEContext, dtype) -> int:
        """Build the checkpoint's multi-token-prediction layer (`num_nextn_predict_layers`, one on
        every released DeepSeek-V3/V3.2 and Kimi-K2 checkpoint) as `self.mtp[0]`: its decoder
        layer is an MoE layer after the model's own (the next MoE layer index). Returns its count."""
        from moe_serve.spec_decode.mtp import MTPLayer, one_mtp_layer, place_mtp_experts

        hf = self.hf
        n = one_mtp_layer(hf)
        L = self.num_hidden_layers
        moe_index = None
        if hf.get("n_routed_experts"):
            moe_index = self.num_moe_layers
            place_mtp_experts(moe, hf["n_routed_experts"], moe_index)
        block = self._decoder_layer(hf, self.model.rotary, moe, dtype, L, moe_index)
        self.mtp = nn.ModuleList([MTPLayer(hf["hidden_size"], hf["vocab_size"], hf.get("rms_norm_eps", 1e-6),
                                           block, dtype)])
        return n

    def checkpoint_name(self, name: str) -> str | None:
        """With the MTP layer built, `model.layers.{num_hidden_layers}.*` loads into it: enorm,
        hnorm, eh_proj and shared_head by their names, the decoder layer's tensors under `block`;
        its copy of the input embedding is the model's own (not loaded twice)."""
        if self.mtp is not None:
            m = re.match(rf"model\.layers\.{self.num_hidden_layers}\.(.*)$", name)
            if m:
                rest = m.group(1)
                if rest.startswith("embed_tokens."):
                    return None
                if rest.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head"):
                    return f"mtp.0.{rest}"
                return f"mtp.0.block.{rest}"
        return super().checkpoint_name(name)
