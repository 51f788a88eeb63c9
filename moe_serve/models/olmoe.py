"""OLMoE (OlmoeForCausalLM): GQA attention with q/k RMSNorm over the whole projection (not per
head) and optional clip_qkv, softmax top-k routing (renormalised when norm_topk_prob), sparse MoE
in every layer with experts of `intermediate_size`."""
from __future__ import annotations

from expert_parallel.runtime.layer import MoE, MoEContext
from expert_parallel.runtime.router import SoftmaxTopKRouter
from moe_serve.layers.attention import GQASelfAttention
from moe_serve.layers.rotary import RotaryEmbedding, rope_config
from moe_serve.models.base import CausalLM, DecoderStack
from moe_serve.models.decoder_layer import DecoderLayer


class OlmoeForCausalLM(CausalLM):
    expert_names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def __init__(self, hf: dict, moe: MoEContext, dtype):
        D = hf["hidden_size"]
        E = hf.get("num_experts") or hf.get("num_local_experts")
        heads = hf["num_attention_heads"]
        kv = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or D // heads
        if head_dim != D // heads:
            # transformers sizes k_norm as (hidden_size // heads) * kv_heads: equal only then.
            raise ValueError(f"OlmoeForCausalLM needs head_dim == hidden_size // num_attention_heads, got {head_dim}")
        eps = hf.get("rms_norm_eps", 1e-5)
        clip = hf.get("clip_qkv")
        rotary = RotaryEmbedding(head_dim, rope_config(hf), hf.get("max_position_embeddings", 4096))
        layers = []
        for i in range(hf["num_hidden_layers"]):
            attn = GQASelfAttention(D, heads, kv, head_dim, rotary, dtype,
                                    bias=bool(hf.get("attention_bias", False)), qk_norm_eps=eps, qk_norm="full",
                                    clip_qkv=None if clip is None else float(clip))
            router = SoftmaxTopKRouter(D, E, hf["num_experts_per_tok"], bool(hf.get("norm_topk_prob", False)), dtype)
            ffn = MoE(D, hf["intermediate_size"], E, router, moe, dtype, layer_index=i)
            layers.append(DecoderLayer(D, eps, attn, ffn, "mlp", dtype))
        super().__init__(hf, DecoderStack(hf["vocab_size"], D, layers, eps, dtype, rotary), dtype)
