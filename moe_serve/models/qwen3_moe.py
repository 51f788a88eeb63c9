"""Qwen3-MoE (Qwen3MoeForCausalLM): GQA attention with per-head q/k RMSNorm, softmax top-k routing
(renormalised when norm_topk_prob), dense MLP in `mlp_only_layers` and off the sparse step."""
from __future__ import annotations

from expert_parallel.runtime.layer import MoE, MoEContext
from expert_parallel.runtime.router import SoftmaxTopKRouter
from moe_serve.layers.attention import GQASelfAttention
from moe_serve.layers.linear import DenseMLP
from moe_serve.layers.rotary import RotaryEmbedding, rope_config
from moe_serve.models.base import CausalLM, DecoderStack
from moe_serve.models.decoder_layer import DecoderLayer


class Qwen3MoeForCausalLM(CausalLM):
    expert_names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def __init__(self, hf: dict, moe: MoEContext, dtype):
        D = hf["hidden_size"]
        E = hf.get("num_experts") or hf.get("num_local_experts")
        heads, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
        head_dim = hf.get("head_dim") or D // heads
        eps = hf.get("rms_norm_eps", 1e-6)
        rotary = RotaryEmbedding(head_dim, rope_config(hf), hf.get("max_position_embeddings", 4096))
        sparse_step = hf.get("decoder_sparse_step", 1) or 1
        mlp_only = set(hf.get("mlp_only_layers") or [])
        moe_ids = [i for i in range(hf["num_hidden_layers"]) if i not in mlp_only and E and (i + 1) % sparse_step == 0]
        layers = []
        for i in range(hf["num_hidden_layers"]):
            attn = GQASelfAttention(D, heads, kv, head_dim, rotary, dtype,
                                    bias=bool(hf.get("attention_bias", False)), qk_norm_eps=eps)
            if i in moe_ids:
                router = SoftmaxTopKRouter(D, E, hf["num_experts_per_tok"], bool(hf.get("norm_topk_prob", False)), dtype)
                ffn = MoE(D, hf["moe_intermediate_size"], E, router, moe, dtype, layer_index=moe_ids.index(i))
            else:
                ffn = DenseMLP(D, hf["intermediate_size"], dtype)
            layers.append(DecoderLayer(D, eps, attn, ffn, "mlp", dtype))
        super().__init__(hf, DecoderStack(hf["vocab_size"], D, layers, eps, dtype, rotary), dtype)
