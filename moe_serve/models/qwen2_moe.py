"""Qwen2-MoE / Qwen1.5-MoE (Qwen2MoeForCausalLM): GQA attention with q/k/v bias (o without),
softmax top-k routing (renormalised when norm_topk_prob), and a shared expert in every MoE layer
scaled per token by sigmoid(shared_expert_gate(x)); dense MLP in `mlp_only_layers` and off the
sparse step. Sliding-window attention is not supported (refused at build)."""
from __future__ import annotations

from expert_parallel.runtime.layer import MoE, MoEContext
from expert_parallel.runtime.router import SoftmaxTopKRouter
from moe_serve.layers.attention import GQASelfAttention
from moe_serve.layers.experts import GatedSharedExpert
from moe_serve.layers.linear import DenseMLP
from moe_serve.layers.rotary import RotaryEmbedding, rope_config
from moe_serve.models.base import CausalLM, DecoderStack
from moe_serve.models.decoder_layer import DecoderLayer


class Qwen2MoeForCausalLM(CausalLM):
    # The MoE layer calls its shared part `shared_experts`; the checkpoint has two tensors groups.
    name_rewrites = ((r"\.mlp\.shared_expert\.", ".mlp.shared_experts.expert."),
                     (r"\.mlp\.shared_expert_gate\.", ".mlp.shared_experts.gate."))
    expert_names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def __init__(self, hf: dict, moe: MoEContext, dtype):
        if hf.get("use_sliding_window"):
            raise ValueError("Qwen2MoeForCausalLM with use_sliding_window=true is not supported")
        D, E = hf["hidden_size"], hf.get("num_experts")
        heads = hf["num_attention_heads"]
        kv = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or D // heads
        eps = hf.get("rms_norm_eps", 1e-6)
        rotary = RotaryEmbedding(head_dim, rope_config(hf), hf.get("max_position_embeddings", 4096))
        sparse_step = hf.get("decoder_sparse_step", 1) or 1
        mlp_only = set(hf.get("mlp_only_layers") or [])
        shared_size = hf.get("shared_expert_intermediate_size") or 0
        moe_ids = [i for i in range(hf["num_hidden_layers"]) if i not in mlp_only and E and (i + 1) % sparse_step == 0]
        layers = []
        for i in range(hf["num_hidden_layers"]):
            attn = GQASelfAttention(D, heads, kv, head_dim, rotary, dtype,
                                    bias=bool(hf.get("qkv_bias", True)), o_bias=False)
            if i in moe_ids:
                router = SoftmaxTopKRouter(D, E, hf["num_experts_per_tok"], bool(hf.get("norm_topk_prob", False)), dtype)
                shared = GatedSharedExpert(D, shared_size, dtype) if shared_size else None
                ffn = MoE(D, hf["moe_intermediate_size"], E, router, moe, dtype, shared_experts=shared, layer_index=moe_ids.index(i))
            else:
                ffn = DenseMLP(D, hf["intermediate_size"], dtype)
            layers.append(DecoderLayer(D, eps, attn, ffn, "mlp", dtype))
        super().__init__(hf, DecoderStack(hf["vocab_size"], D, layers, eps, dtype, rotary), dtype)
