"""Llama-4 (Llama4ForCausalLM, and the language model of Llama4ForConditionalGeneration), as
transformers' Llama4 text model computes it.

Attention: GQA (biases on q/k/v/o when attention_bias), scale head_dim^-0.5, in two kinds of layer
chosen by `no_rope_layers` (1: RoPE, 0: NoPE; by default every `no_rope_layer_interval`-th layer is
NoPE):
  - RoPE layers turn q and k in Llama-4's complex form (the pairs (x0, x1), (x2, x3), ... rotate:
    RotaryEmbedding's interleaved layout, whose de-interleaving is the same permutation of q and k,
    so scores are unchanged), in float32; then, with `use_qk_norm`, q and k each pass a weightless
    L2 norm over each head (x * rsqrt(mean(x^2) + rms_norm_eps), in float32);
  - NoPE layers have neither; with `attn_temperature_tuning`, q of the token at position p is
    scaled by log1p(floor((p + 1) / floor_scale)) * attn_scale + 1.
`layer_types` says which layers attend in chunks ("chunked_attention": the query at p sees keys
(p // c) * c .. p, c = attention_chunk_size) and which causally over everything ("full_attention");
without it, as transformers derives it, the RoPE layers are chunked when attention_chunk_size is
set (the NoPE layers then carry the long context).

FFN: the MoE layers (`moe_layers`; by default every `interleave_moe_layer_step`-th layer, the last
of each step) route each token to its top k experts by router logit, with weight sigmoid(logit)
and no normalisation, the weight scaling the expert's input: y = shared(x) + sum_k expert_k(w_k * x)
(MoE's weights_on_inputs), the shared expert a SwiGLU MLP of intermediate_size like the experts.
The other layers have a dense SwiGLU MLP of intermediate_size_mlp.

Checkpoints name the FFN `feed_forward` with `router`, `shared_expert` and the experts as fused
3-D tensors in transformers' (in, out) layout: gate_up_proj (E, D, 2F) ([gate | up] columns) and
down_proj (E, F, D), read per expert this rank holds and transposed. Llama4ForConditionalGeneration
checkpoints: the config is config.json's `text_config` (moe_serve/config.py), the tensors
`language_model.model.*` and `language_model.lm_head.*`; the vision tower and the projector are
skipped, as image inputs are not served. Config values whose math this does not compute (an
activation other than SiLU, unknown layer types, chunked layers without a chunk size) are refused by
name.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from attention.layer import PagedAttention
from attention.metadata import AttentionMetadata
from expert_parallel.runtime.layer import MoE, MoEContext
from expert_parallel.runtime.router import TopKSigmoidRouter
from moe_serve.layers.linear import DenseMLP, Linear
from moe_serve.layers.rotary import RotaryEmbedding, rope_config
from moe_serve.models.base import CausalLM, DecoderStack
from moe_serve.models.decoder_layer import DecoderLayer

# transformers' Llama4TextConfig defaults, used where config.json leaves a field out.
DEFAULTS = {"head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 4096 * 32,
            "intermediate_size_mlp": 16384, "num_experts_per_tok": 1, "num_local_experts": 16,
            "interleave_moe_layer_step": 1, "use_qk_norm": True, "no_rope_layer_interval": 4,
            "attention_chunk_size": 8192, "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
            "attention_bias": False, "hidden_act": "silu"}

_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.feed_forward)\.experts\.(?P<proj>gate_up_proj|down_proj)$")
_OTHER_TOWERS = ("vision_model.", "multi_modal_projector.")
_LANGUAGE_MODEL = "language_model."


def text_fields(hf: dict) -> dict:
    """The config with transformers' defaults filled in, checked: refused, by name, where the model
    would compute something this file does not."""
    c = {**DEFAULTS, **hf}
    n = c["num_hidden_layers"]
    if c["hidden_act"] != "silu":
        raise ValueError(f"Llama4 with hidden_act={c['hidden_act']!r} is not supported (only 'silu')")
    no_rope = c.get("no_rope_layers") or [int((i + 1) % c["no_rope_layer_interval"] != 0) for i in range(n)]
    if len(no_rope) < n or set(no_rope[:n]) - {0, 1}:
        raise ValueError(f"no_rope_layers={no_rope!r}: need a 0 (NoPE) or 1 (RoPE) for each of the {n} layers")
    chunk = c["attention_chunk_size"]
    types = c.get("layer_types") or ["chunked_attention" if rope and chunk is not None else "full_attention"
                                     for rope in no_rope[:n]]
    if len(types) != n or set(types) - {"chunked_attention", "full_attention"}:
        raise ValueError(f"layer_types={types!r}: need {n} of 'chunked_attention' / 'full_attention'")
    if "chunked_attention" in types and (chunk is None or chunk < 1):
        raise ValueError(f"layer_types has chunked_attention layers but attention_chunk_size={chunk!r}")
    moe_layers = c.get("moe_layers")
    if moe_layers is None:
        step = c["interleave_moe_layer_step"]
        moe_layers = list(range(step - 1, n, step))
    if any(not 0 <= i < n for i in moe_layers):
        raise ValueError(f"moe_layers={moe_layers!r}: layer ids must be in [0, {n})")
    return {**c, "no_rope_layers": [bool(r) for r in no_rope[:n]], "layer_types": types,
            "moe_layers": sorted(set(moe_layers))}


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama4TextL2Norm: x * rsqrt(mean(x^2) + eps) over the last dim, in float32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(nn.Module):
    """One Llama-4 attention layer: RoPE (rotary) and q/k L2 norm (qk_norm_eps) on RoPE layers,
    temperature tuning ((floor_scale, attn_scale)) on NoPE layers, chunked or full paged attention."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, *, bias: bool,
                 rotary: RotaryEmbedding | None, qk_norm_eps: float | None, temperature: tuple[float, float] | None,
                 attention_chunk: int | None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Linear(hidden_size, num_heads * head_dim, bias=bias, dtype=dtype)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias, dtype=dtype)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias, dtype=dtype)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=bias, dtype=dtype)
        self.rotary, self.qk_norm_eps, self.temperature = rotary, qk_norm_eps, temperature
        self.attn = PagedAttention(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, attention_chunk=attention_chunk)

    def forward(self, x_TD: torch.Tensor, positions_T: torch.Tensor, meta: AttentionMetadata,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """rope: the step's (cos, sin) rows of the model's interleaved RoPE (DecoderStack gathers them)."""
        T = x_TD.shape[0]
        q = self.q_proj(x_TD).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x_TD).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_TD).view(T, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            cos, sin = rope
            q = self.rotary.apply(q.float(), cos, sin).to(q.dtype)
            k = self.rotary.apply(k.float(), cos, sin).to(k.dtype)
        if self.qk_norm_eps is not None:
            q, k = _l2_norm(q, self.qk_norm_eps), _l2_norm(k, self.qk_norm_eps)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scale_T = torch.log1p(torch.floor((positions_T.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scale_T[:, None, None]).to(q.dtype)
        o = self.attn(q, k, v, meta)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


class Llama4ForCausalLM(CausalLM):
    name_rewrites = ((r"\.feed_forward\.router\.", ".feed_forward.gate."),
                     (r"\.feed_forward\.shared_expert\.", ".feed_forward.shared_experts."))
    expert_names: dict = {}  # experts only as fused 3-D tensors, loaded by load_checkpoint_tensor

    def __init__(self, hf: dict, moe: MoEContext, dtype):
        c = text_fields(hf)
        D, E = c["hidden_size"], c["num_local_experts"]
        heads = c["num_attention_heads"]
        kv = c.get("num_key_value_heads") or heads
        head_dim = c["head_dim"] or D // heads
        eps = c["rms_norm_eps"]
        rotary = RotaryEmbedding(head_dim, rope_config(c), c["max_position_embeddings"], interleaved=True)
        temperature = (float(c["floor_scale"]), float(c["attn_scale"])) if c["attn_temperature_tuning"] else None
        layers = []
        for i in range(c["num_hidden_layers"]):
            use_rope = c["no_rope_layers"][i]
            attn = Llama4Attention(D, heads, kv, head_dim, dtype, bias=bool(c["attention_bias"]),
                                   rotary=rotary if use_rope else None,
                                   qk_norm_eps=eps if use_rope and c["use_qk_norm"] else None,
                                   temperature=None if use_rope else temperature,
                                   attention_chunk=c["attention_chunk_size"]
                                   if c["layer_types"][i] == "chunked_attention" else None)
            if i in c["moe_layers"]:
                router = TopKSigmoidRouter(D, E, c["num_experts_per_tok"])
                ffn = MoE(D, c["intermediate_size"], E, router, moe, dtype,
                          shared_experts=DenseMLP(D, c["intermediate_size"], dtype),
                          layer_index=c["moe_layers"].index(i), weights_on_inputs=True)
            else:
                ffn = DenseMLP(D, c["intermediate_size_mlp"], dtype)
            layers.append(DecoderLayer(D, eps, attn, ffn, "feed_forward", dtype))
        super().__init__(hf, DecoderStack(c["vocab_size"], D, layers, eps, dtype, rotary), dtype)
        self._moe = {f"model.layers.{i}.feed_forward": layer.feed_forward
                     for i, layer in enumerate(self.model.layers) if isinstance(layer.feed_forward, MoE)}

    def load_checkpoint_tensor(self, name: str, raw: str, f) -> list[str] | None:
        """The fused expert tensors, (E, D, 2F) gate_up_proj and (E, F, D) down_proj: each expert
        this rank holds read alone and transposed to our (out, in) rows. None for other tensors."""
        m = _FUSED_EXPERTS.match(name)
        if m is None or m.group("prefix") not in self._moe:
            return None
        moe = self._moe[m.group("prefix")]
        ex = moe.experts
        gate_up = m.group("proj") == "gate_up_proj"
        E, D, F = moe.num_experts, ex.w2.shape[1], ex.F
        sl = f.get_slice(raw)
        shape, want = tuple(sl.get_shape()), (E, D, 2 * F) if gate_up else (E, F, D)
        if shape != want:
            raise ValueError(f"tensor {raw!r} has shape {shape}, expected {want}")
        for e in ex.slots_of:
            ex.load(e, "gate_up" if gate_up else "down", sl[e].t())
        return [f"{m.group('prefix')}.experts.{'w13' if gate_up else 'w2'}"]


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    """The language model of a Llama-4 image-text checkpoint: its tensors without the
    `language_model.` prefix; the vision tower and projector are not loaded."""

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(_OTHER_TOWERS):
            return None
        if name.startswith(_LANGUAGE_MODEL):
            name = name[len(_LANGUAGE_MODEL):]
        return super().checkpoint_name(name)
