"""GLM-4.5 (Glm4MoeForCausalLM): GQA attention with q/k/v bias (o without), per-head q/k RMSNorm
when use_qk_norm, RoPE over the first partial_rotary_factor of each head; dense MLP in the first
`first_k_dense_replace` layers, then routed experts with group-limited sigmoid routing and
e_score_correction_bias (DeepSeek-V3's router, as transformers' Glm4MoeTopkRouter computes it)
plus shared experts. Multi-token-prediction layers after the last layer are skipped at load."""
from __future__ import annotations

from expert_parallel.runtime.layer import MoE, MoEContext
from expert_parallel.runtime.router import GroupLimitedSigmoidRouter
from moe_serve.layers.attention import GQASelfAttention
from moe_serve.layers.linear import DenseMLP
from moe_serve.layers.rotary import RotaryEmbedding, rope_config
from moe_serve.models.base import CausalLM, DecoderStack
from moe_serve.models.decoder_layer import DecoderLayer


class Glm4MoeForCausalLM(CausalLM):
    expert_names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def __init__(self, hf: dict, moe: MoEContext, dtype):
        D, E = hf["hidden_size"], hf.get("n_routed_experts")
        heads = hf["num_attention_heads"]
        kv = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or D // heads
        eps = hf.get("rms_norm_eps", 1e-5)
        rope = rope_config(hf)
        # transformers' default for GLM-4.5 configs that do not say (kept for backward compatibility).
        factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
        rotary = RotaryEmbedding(int(head_dim * factor), rope, hf.get("max_position_embeddings", 4096))
        qk_norm_eps = eps if hf.get("use_qk_norm", False) else None
        first_dense = hf.get("first_k_dense_replace", 1)
        moe_ids = [i for i in range(hf["num_hidden_layers"]) if E and i >= first_dense]
        layers = []
        for i in range(hf["num_hidden_layers"]):
            attn = GQASelfAttention(D, heads, kv, head_dim, rotary, dtype,
                                    bias=bool(hf.get("attention_bias", False)), o_bias=False,
                                    qk_norm_eps=qk_norm_eps)
            if i in moe_ids:
                router = GroupLimitedSigmoidRouter(
                    D, E, hf["num_experts_per_tok"], hf.get("n_group") or 1, hf.get("topk_group") or 1,
                    bool(hf.get("norm_topk_prob", True)), float(hf.get("routed_scaling_factor", 1.0)))
                n_shared = hf.get("n_shared_experts") or 0
                shared = DenseMLP(D, hf["moe_intermediate_size"] * n_shared, dtype) if n_shared else None
                ffn = MoE(D, hf["moe_intermediate_size"], E, router, moe, dtype, shared_experts=shared,
                          layer_index=moe_ids.index(i))
            else:
                ffn = DenseMLP(D, hf["intermediate_size"], dtype)
            layers.append(DecoderLayer(D, eps, attn, ffn, "mlp", dtype))
        super().__init__(hf, DecoderStack(hf["vocab_size"], D, layers, eps, dtype, rotary), dtype)
