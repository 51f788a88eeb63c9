"""MiniMax-M2 (MiniMaxM2ForCausalLM), as transformers' MiniMaxM2 computes it.

Attention: GQA without biases; q and k each pass one RMSNorm over the whole projection (all heads
together, not per head), then RoPE turns the first `rotary_dim` channels of each head (partial
rotary; the rest pass through). Every layer's FFN is a sparse MoE block of SwiGLU experts, routed
by sigmoid scores of the router logits: the top k are chosen on score + e_score_correction_bias,
and their weights are the chosen experts' scores divided by their sum (no scaling factor, no
shared expert). DeepSeek-V3's router with one expert group computes this (its 1e-20 guard on
the sum is below float32's resolution unless every chosen score is under 1e-13).

Checkpoints name the block `block_sparse_moe`, with per-expert w1 (gate), w3 (up), w2 (down) and
the correction bias beside the router (`block_sparse_moe.e_score_correction_bias`), as the Hub
ships them and transformers writes them; multi-token-prediction modules numbered after the last
layer are skipped at load. Config values that say the checkpoint computes something else (no q/k
norm or a per-head one, softmax scoring, no routing bias, shared experts, lightning-attention
layers, a routed scaling factor, an activation other than SiLU) are refused by name.
"""
from __future__ import annotations

from expert_parallel.runtime.layer import MoE, MoEContext
from expert_parallel.runtime.router import GroupLimitedSigmoidRouter
from moe_serve.layers.attention import GQASelfAttention
from moe_serve.layers.rotary import RotaryEmbedding, rope_config
from moe_serve.models.base import CausalLM, DecoderStack
from moe_serve.models.decoder_layer import DecoderLayer

# transformers' MiniMaxM2Config defaults, used where config.json leaves a field out.
DEFAULT_HEAD_DIM = 128
DEFAULT_ROPE_THETA = 5000000.0

# Fields of MiniMax-M2 configs with the one value transformers' model computes.
_REQUIRED_VALUES = {"use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
                    "use_routing_bias": True, "hidden_act": "silu", "routed_scaling_factor": 1.0}


def check_config(hf: dict) -> None:
    """Refuse, naming the field, config values whose math transformers' MiniMax-M2 does not compute."""
    for key, want in _REQUIRED_VALUES.items():
        if key in hf and hf[key] != want:
            raise ValueError(f"MiniMaxM2ForCausalLM with {key}={hf[key]!r} is not supported (only {key}={want!r})")
    if hf.get("shared_intermediate_size"):
        raise ValueError(f"MiniMaxM2ForCausalLM with shared_intermediate_size={hf['shared_intermediate_size']!r} "
                         f"(shared experts) is not supported")
    kinds = hf.get("attn_type_list") or []
    if any(k != 1 for k in kinds):
        raise ValueError(f"MiniMaxM2ForCausalLM with attn_type_list={kinds!r} is not supported: only full-attention "
                         f"layers (1), not lightning attention (0)")


def rotary_dim(hf: dict, rope: dict, head_dim: int) -> int:
    """Channels of each head that RoPE turns, with transformers' precedence: partial_rotary_factor in
    the RoPE parameters, then at the top level, then the Hub's `rotary_dim`, else the whole head."""
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if factor is None:
        factor = hf["rotary_dim"] / head_dim if hf.get("rotary_dim") is not None else 1.0
    return int(head_dim * factor)


class MiniMaxM2ForCausalLM(CausalLM):
    # Our correction bias lives on the router (`gate`); checkpoints keep it beside it. transformers 5's
    # in-memory names (`mlp.`, fused experts) load too.
    name_rewrites = ((r"\.mlp\.", ".block_sparse_moe."),
                     (r"\.block_sparse_moe\.e_score_correction_bias$",
                      ".block_sparse_moe.gate.e_score_correction_bias"))
    expert_names = {"w1": "gate", "w3": "up", "w2": "down"}

    def __init__(self, hf: dict, moe: MoEContext, dtype):
        check_config(hf)
        D, E = hf["hidden_size"], hf["num_local_experts"]
        heads = hf["num_attention_heads"]
        kv = hf["num_key_value_heads"]
        head_dim = hf.get("head_dim", DEFAULT_HEAD_DIM)
        eps = hf.get("rms_norm_eps", 1e-6)
        rope = rope_config({"rope_theta": DEFAULT_ROPE_THETA, **hf})
        rotary = RotaryEmbedding(rotary_dim(hf, rope, head_dim), rope, hf.get("max_position_embeddings", 196608))
        layers = []
        for i in range(hf["num_hidden_layers"]):
            attn = GQASelfAttention(D, heads, kv, head_dim, rotary, dtype, qk_norm_eps=eps, qk_norm="full")
            router = GroupLimitedSigmoidRouter(D, E, hf["num_experts_per_tok"], n_group=1, topk_group=1,
                                               renormalize=True, routed_scaling_factor=1.0)
            ffn = MoE(D, hf["intermediate_size"], E, router, moe, dtype, layer_index=i)
            layers.append(DecoderLayer(D, eps, attn, ffn, "block_sparse_moe", dtype))
        super().__init__(hf, DecoderStack(hf["vocab_size"], D, layers, eps, dtype, rotary), dtype)
