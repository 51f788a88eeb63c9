"""Mixtral (MixtralForCausalLM): GQA attention, sparse MoE in every layer, softmax top-k renormalised."""
from __future__ import annotations

from expert_parallel.runtime.layer import MoE, MoEContext
from expert_parallel.runtime.router import SoftmaxTopKRouter
from moe_serve.layers.attention import GQASelfAttention
from moe_serve.layers.rotary import RotaryEmbedding, rope_config
from moe_serve.models.base import CausalLM, DecoderStack
from moe_serve.models.decoder_layer import DecoderLayer


class MixtralForCausalLM(CausalLM):
    # transformers 5 names the block "mlp"; checkpoints on the Hub name it "block_sparse_moe".
    name_rewrites = ((r"\.mlp\.", ".block_sparse_moe."),)
    expert_names = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
                    "down_proj": "down"}

    def __init__(self, hf: dict, moe: MoEContext, dtype):
        D, E = hf["hidden_size"], hf["num_local_experts"]
        heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or D // heads
        eps = hf.get("rms_norm_eps", 1e-5)
        rotary = RotaryEmbedding(head_dim, rope_config(hf), hf.get("max_position_embeddings", 4096))
        layers = []
        for i in range(hf["num_hidden_layers"]):
            attn = GQASelfAttention(D, heads, kv, head_dim, rotary, dtype)
            router = SoftmaxTopKRouter(D, E, hf["num_experts_per_tok"], renormalize=True, dtype=dtype)
            ffn = MoE(D, hf["intermediate_size"], E, router, moe, dtype, layer_index=i)
            layers.append(DecoderLayer(D, eps, attn, ffn, "block_sparse_moe", dtype))
        super().__init__(hf, DecoderStack(hf["vocab_size"], D, layers, eps, dtype, rotary), dtype)
