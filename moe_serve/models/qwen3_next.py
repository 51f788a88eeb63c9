"""Qwen3-Next (Qwen3NextForCausalLM) and Qwen3.5-MoE (Qwen3_5MoeForCausalLM, and the language model
of Qwen3_5MoeForConditionalGeneration), as transformers' qwen3_next and qwen3_5_moe models compute
them. Both are hybrids: `layer_types` says which layers are Gated DeltaNet linear attention and
which gated full attention (by default every `full_attention_interval`-th layer, 4, is full).

Every RMSNorm outside the linear-attention block (input / post-attention, the final norm and the
per-head q/k norms) is zero-centred: x * rsqrt(mean(x^2) + eps) * (1 + w), in float32, cast back.

Gated DeltaNet (`linear_attn`), with Hk key heads of dim dk and Hv value heads of dim dv:
  - projections: Qwen3-Next packs them per key head: in_proj_qkvz gives, for each key head,
    [q (dk) | k (dk) | v (Hv/Hk * dv) | z (Hv/Hk * dv)], and in_proj_ba [b (Hv/Hk) | a (Hv/Hk)];
    Qwen3.5 has in_proj_qkv ([q of all heads | k | v], already the convolution's channel order),
    in_proj_z, in_proj_b and in_proj_a;
  - a depthwise causal convolution of width `linear_conv_kernel_dim` over [q | k | v] (no bias),
    then SiLU; its state is the last K - 1 inputs of each sequence;
  - beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) (in float32);
  - the gated delta rule over q, k (l2-normalised, repeated to Hv heads: each key head serves
    Hv/Hk consecutive value heads), v, with q scaled by dk^-0.5 and a float32 recurrent state
    (Hv, dk, dv) per sequence;
  - the output's gated RMSNorm per value head: w * norm(o) * silu(z) (w not zero-centred), then
    out_proj.
  Both states live in the layer's StateCache (attention/cache_kinds.py), at the sequence's slot;
  the ops are the linear-attention backend bound by moe_serve/platform.py (moe_serve/kernels/gated_delta).

Gated attention (`self_attn`): q_proj gives, per head, [query (head_dim) | gate (head_dim)]; q/k
per-head norms, RoPE on the first partial_rotary_factor of each head (0.25 unless configured),
GQA over the paged cache (scale head_dim^-0.5), output * sigmoid(gate), o_proj.

FFN: Qwen3-Next: sparse MoE unless the layer is in `mlp_only_layers` or off the
`decoder_sparse_step`, where it is a dense SwiGLU MLP of intermediate_size; Qwen3.5-MoE: sparse MoE
in every layer. The MoE: softmax top-k routing (renormalised when norm_topk_prob; always in
Qwen3.5), plus a shared expert scaled per token by sigmoid(shared_expert_gate(x)).

Qwen3.5's text model turns positions by MRoPE (mrope_section): with text only, the temporal, height
and width positions of a token are all its position, so MRoPE is the plain RoPE above. Image and
video inputs are not served: a Qwen3_5MoeForConditionalGeneration checkpoint's config is its
`text_config` (moe_serve/config.py), its `model.language_model.*` tensors are loaded as `model.*`
and its vision tower (`model.visual.*`) is skipped. Multi-token-prediction tensors (`mtp.*`) are
skipped. Config values whose math is not computed here are refused by name.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attention.state import StateCache
from attention.layer import PagedAttention
from attention.metadata import AttentionMetadata
from expert_parallel.runtime.layer import MoE, MoEContext, run_to_end
from expert_parallel.runtime.router import SoftmaxTopKRouter
from expert_parallel.runtime.step import MoEStep
from moe_serve.kernels.gated_delta import LinearAttentionShape, TorchLinearAttention
from moe_serve.kernels.norm import TorchNorm
from moe_serve.layers.experts import GatedSharedExpert
from moe_serve.layers.linear import DenseMLP, Linear
from moe_serve.layers.rotary import RotaryEmbedding, rope_config
from moe_serve.models.base import CausalLM, DecoderStack

LAYER_TYPES = ("linear_attention", "full_attention")


class ZeroCenteredRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + weight), in float32, cast back to x's dtype (the weight is
    stored as the offset from 1, as checkpoints have it)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, 1.0 + self.weight.float(), self.eps).to(x.dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) for h = x + residual."""
        h = x + residual
        return h, self(h)


class GatedRMSNorm(nn.Module):
    """The linear-attention output's norm: weight * norm(x) (rounded to x's dtype first), times
    silu(z) in float32, cast back; over the last dim (one value head)."""

    def __init__(self, dim: int, eps: float, dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor, z: torch.Tensor, pointwise=None) -> torch.Tensor:
        """pointwise(fn, t): how the gate's silu runs (the layer backend's), else torch's."""
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        gate = F.silu(z.float()) if pointwise is None else pointwise(F.silu, z.float())
        return ((self.weight * normed.to(x.dtype)) * gate).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer: (T, D) -> (T, D), its states at `meta.state_slots`.
    split_projections: Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a; else Qwen3-Next's
    per-key-head packed in_proj_qkvz and in_proj_ba."""

    op_kind = "linear_attention"
    ops = TorchLinearAttention()

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int,
                 conv_width: int, eps: float, dtype, split_projections: bool):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads={num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={num_k_heads}")
        self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim = num_k_heads, num_v_heads, k_dim, v_dim
        self.key_dim, self.value_dim = num_k_heads * k_dim, num_v_heads * v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.split_projections = split_projections
        if split_projections:
            self.in_proj_qkv = Linear(hidden_size, self.conv_dim, dtype=dtype)
            self.in_proj_z = Linear(hidden_size, self.value_dim, dtype=dtype)
            self.in_proj_b = Linear(hidden_size, num_v_heads, dtype=dtype)
            self.in_proj_a = Linear(hidden_size, num_v_heads, dtype=dtype)
        else:
            self.in_proj_qkvz = Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, dtype=dtype)
            self.in_proj_ba = Linear(hidden_size, 2 * num_v_heads, dtype=dtype)
        # The checkpoint's (channels, 1, width) depthwise filters; run by the backend, not by Conv1d.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_width, groups=self.conv_dim, bias=False,
                                padding=conv_width - 1, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads, dtype=dtype))
        self.norm = GatedRMSNorm(v_dim, eps, dtype)
        self.out_proj = Linear(self.value_dim, hidden_size, dtype=dtype)
        self.state = StateCache([(self.conv_dim, conv_width - 1), (num_v_heads, k_dim, v_dim)], [dtype, torch.float32])
        self.linear_attention_shape = LinearAttentionShape(num_v_heads, k_dim, v_dim, self.conv_dim, conv_width)

    def _project(self, x_TD: torch.Tensor):
        """[q | k | v] rows in the convolution's channel order (T, conv_dim), z (T, Hv, dv), b and a (T, Hv)."""
        T, Hk, Hv, dv = x_TD.shape[0], self.num_k_heads, self.num_v_heads, self.v_dim
        if self.split_projections:
            return (self.in_proj_qkv(x_TD), self.in_proj_z(x_TD).view(T, Hv, dv), self.in_proj_b(x_TD),
                    self.in_proj_a(x_TD))
        r = Hv // Hk
        per_head = 2 * self.k_dim + 2 * r * dv
        q, k, v, z = self.in_proj_qkvz(x_TD).view(T, Hk, per_head).split([self.k_dim, self.k_dim, r * dv, r * dv],
                                                                          dim=-1)
        b, a = self.in_proj_ba(x_TD).view(T, Hk, 2 * r).split([r, r], dim=-1)
        qkv_TC = torch.cat([q.reshape(T, Hk * self.k_dim), k.reshape(T, Hk * self.k_dim), v.reshape(T, Hv * dv)],
                           dim=-1)
        return qkv_TC, z.reshape(T, Hv, dv), b.reshape(T, Hv), a.reshape(T, Hv)

    def forward(self, x_TD: torch.Tensor, positions_T: torch.Tensor, meta: AttentionMetadata,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """positions_T and rope are unused (no positions in linear attention): the signature of the
        attention layers, so a decoder layer calls either the same way."""
        if meta.state_slots is None:
            raise ValueError("a Gated DeltaNet layer needs the step's state slots (AttentionMetadata.state_slots)")
        T, Hk, Hv = x_TD.shape[0], self.num_k_heads, self.num_v_heads
        conv_state_SCW, state_SHKV = self.state.caches
        slots_B, query_lens, context_lens = meta.state_slots, meta.query_lens_cpu, meta.context_lens_cpu
        qkv_TC, z_THV, b_TH, a_TH = self._project(x_TD)
        qkv_TC = self.ops.causal_conv1d(qkv_TC, self.conv1d.weight[:, 0], None, conv_state_SCW, slots_B, query_lens,
                                        context_lens, activation="silu")
        q, k, v = qkv_TC.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q_THK, k_THK = q.reshape(T, Hk, self.k_dim), k.reshape(T, Hk, self.k_dim)
        if Hv != Hk:  # each key head serves Hv / Hk consecutive value heads
            q_THK = q_THK[:, :, None, :].expand(T, Hk, Hv // Hk, self.k_dim).reshape(T, Hv, self.k_dim)
            k_THK = k_THK[:, :, None, :].expand(T, Hk, Hv // Hk, self.k_dim).reshape(T, Hv, self.k_dim)
        beta_TH = self.ops.pointwise(torch.sigmoid, b_TH)
        g_TH = -self.A_log.float().exp() * self.ops.pointwise(F.softplus, a_TH.float() + self.dt_bias)
        o_THV = self.ops.gated_delta_rule(q_THK, k_THK, v.reshape(T, Hv, self.v_dim), g_TH, beta_TH, state_SHKV,
                                          slots_B, query_lens, context_lens, self.k_dim ** -0.5, use_qk_l2norm=True)
        return self.out_proj(self.norm(o_THV, z_THV, self.ops.pointwise).reshape(T, self.value_dim))


class GatedAttention(nn.Module):
    """Full attention with an output gate: q_proj gives [query | gate] per head; zero-centred
    per-head q/k norms, partial RoPE, paged GQA, output * sigmoid(gate), o_proj."""

    op_kind = "norm"  # RoPE through the norm backend's fused q/k pass, where it has one
    ops = TorchNorm()

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary: RotaryEmbedding,
                 eps: float, dtype, bias: bool):
        super().__init__()
        if rotary.dim > head_dim or rotary.dim % 2:
            raise ValueError(f"rotary dim {rotary.dim} must be even and at most head_dim={head_dim}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Linear(hidden_size, 2 * num_heads * head_dim, bias=bias, dtype=dtype)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias, dtype=dtype)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias, dtype=dtype)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=bias, dtype=dtype)
        self.q_norm = ZeroCenteredRMSNorm(head_dim, eps, dtype)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, eps, dtype)
        self.rotary = rotary
        self.attn = PagedAttention(num_heads, num_kv_heads, head_dim, head_dim ** -0.5)

    def forward(self, x_TD: torch.Tensor, positions_T: torch.Tensor, meta: AttentionMetadata,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """rope: the step's (cos, sin) rows of `rotary`'s tables (gathered once for every layer)."""
        T, N, G, Hd = x_TD.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, gate = self.q_proj(x_TD).view(T, N, 2 * Hd).split([Hd, Hd], dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x_TD).view(T, G, Hd))
        v = self.v_proj(x_TD).view(T, G, Hd)
        q, k = self._rope(q, k, positions_T, rope)
        o = self.attn(q, k, v, meta).reshape(T, N * Hd)
        return self.o_proj(o * self.o_proj.ops.sigmoid(gate.reshape(T, N * Hd)))

    def _rope(self, q_TNH, k_TGH, positions_T, rope):
        fused = self.ops.norm_rope(q_TNH, k_TGH, self.rotary, positions_T)
        if fused is not None:
            return fused
        cos, sin = rope
        r = self.rotary.dim
        if r == self.head_dim:
            return self.rotary.apply(q_TNH, cos, sin), self.rotary.apply(k_TGH, cos, sin)
        return (torch.cat([self.rotary.apply(q_TNH[..., :r], cos, sin), q_TNH[..., r:]], dim=-1),
                torch.cat([self.rotary.apply(k_TGH[..., :r], cos, sin), k_TGH[..., r:]], dim=-1))


class HybridDecoderLayer(nn.Module):
    """h = x + mixer(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h)), the mixer
    named `linear_attn` or `self_attn` as in the checkpoint, the norms zero-centred."""

    def __init__(self, hidden_size: int, eps: float, layer_type: str, mixer: nn.Module, mlp: nn.Module, dtype):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = ZeroCenteredRMSNorm(hidden_size, eps, dtype)
        self.mixer_name = "linear_attn" if layer_type == "linear_attention" else "self_attn"
        self.add_module(self.mixer_name, mixer)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(hidden_size, eps, dtype)
        self.mlp = mlp

    def forward(self, x_TD: torch.Tensor, positions_T: torch.Tensor, meta: AttentionMetadata,
                step: MoEStep, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return run_to_end(self.stages(x_TD, positions_T, meta, step, rope))

    def stages(self, x_TD, positions_T, meta: AttentionMetadata, step: MoEStep,
               rope: tuple[torch.Tensor, torch.Tensor]):
        """Generator form: yields while an MoE block's communication is in flight."""
        a = getattr(self, self.mixer_name)(self.input_layernorm(x_TD), positions_T, meta, rope)
        h, x = self.post_attention_layernorm.add_norm(x_TD, a)
        out = (yield from self.mlp.stages(x, step)) if isinstance(self.mlp, MoE) else self.mlp(x)
        return h + out


# transformers' Qwen3NextConfig / Qwen3_5MoeTextConfig defaults, used where config.json leaves a field out.
DEFAULTS = {"head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "hidden_act": "silu",
            "attention_bias": False, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "partial_rotary_factor": 0.25}


def layer_types(hf: dict) -> list[str]:
    """Each layer's kind: config.json's `layer_types`, or, as transformers derives it, full
    attention every `full_attention_interval`-th layer (4 by default) and linear attention else."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        interval = hf.get("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if len(types) != n or set(types) - set(LAYER_TYPES):
        raise ValueError(f"layer_types={types!r}: need {n} of 'linear_attention' / 'full_attention'")
    return list(types)


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next; Qwen3.5-MoE (below) is the same model with split linear-attention projections
    and an MoE in every layer."""

    # The MoE layer calls its shared part `shared_experts`: the checkpoint has two tensor groups.
    name_rewrites = ((r"\.mlp\.shared_expert\.", ".mlp.shared_experts.expert."),
                     (r"\.mlp\.shared_expert_gate\.", ".mlp.shared_experts.gate."))
    expert_names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    split_projections = False  # in_proj_qkvz / in_proj_ba

    def __init__(self, hf: dict, moe: MoEContext, dtype):
        c = {**DEFAULTS, **hf}
        self.check_config(c)
        D, E = c["hidden_size"], c.get("num_experts") or 0
        heads = c["num_attention_heads"]
        kv = c.get("num_key_value_heads") or heads
        head_dim, eps = c["head_dim"], c["rms_norm_eps"]
        rope = rope_config(c)
        rotary = RotaryEmbedding(int(head_dim * rope.get("partial_rotary_factor", c["partial_rotary_factor"])), rope,
                                 c["max_position_embeddings"])
        types = layer_types(c)
        moe_ids = [i for i in range(c["num_hidden_layers"]) if E and self.is_sparse(c, i)]
        shared_size = c.get("shared_expert_intermediate_size") or 0
        layers = []
        for i, kind in enumerate(types):
            if kind == "linear_attention":
                mixer = GatedDeltaNet(D, c["linear_num_key_heads"], c["linear_num_value_heads"],
                                      c["linear_key_head_dim"], c["linear_value_head_dim"],
                                      c["linear_conv_kernel_dim"], eps, dtype, self.split_projections)
            else:
                mixer = GatedAttention(D, heads, kv, head_dim, rotary, eps, dtype, bias=bool(c["attention_bias"]))
            if i in moe_ids:
                router = SoftmaxTopKRouter(D, E, c["num_experts_per_tok"], bool(c.get("norm_topk_prob", True)), dtype)
                shared = GatedSharedExpert(D, shared_size, dtype) if shared_size else None
                mlp = MoE(D, c["moe_intermediate_size"], E, router, moe, dtype, shared_experts=shared,
                          layer_index=moe_ids.index(i))
            else:
                mlp = DenseMLP(D, c["intermediate_size"], dtype)
            layers.append(HybridDecoderLayer(D, eps, kind, mixer, mlp, dtype))
        stack = DecoderStack(c["vocab_size"], D, layers, eps, dtype, rotary, norm_cls=ZeroCenteredRMSNorm)
        super().__init__(hf, stack, dtype)

    @classmethod
    def check_config(cls, c: dict) -> None:
        if c["hidden_act"] != "silu":
            raise ValueError(f"{cls.__name__} with hidden_act={c['hidden_act']!r} is not supported (only 'silu')")

    @staticmethod
    def is_sparse(c: dict, i: int) -> bool:
        """Whether layer i has the sparse MoE (else a dense MLP), as transformers decides it."""
        return i not in (c.get("mlp_only_layers") or []) and (i + 1) % (c.get("decoder_sparse_step") or 1) == 0

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith("mtp."):
            return None  # the multi-token-prediction head
        return super().checkpoint_name(name)


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE's language model: Qwen3-Next with in_proj_qkv / in_proj_z / in_proj_b /
    in_proj_a and an MoE in every layer, its top-k weights renormalised (transformers' Qwen3.5-MoE
    has no mlp_only_layers, decoder_sparse_step or norm_topk_prob: a config giving them another
    meaning is refused). Its tensors may also be named as in the image-text checkpoint
    (`model.language_model.*`)."""

    split_projections = True

    @classmethod
    def check_config(cls, c: dict) -> None:
        super().check_config(c)
        for key, computed in (("mlp_only_layers", []), ("decoder_sparse_step", 1), ("norm_topk_prob", True)):
            if key in c and c[key] != computed:
                raise ValueError(f"{cls.__name__} with {key}={c[key]!r} is not supported: transformers' Qwen3.5-MoE "
                                 f"computes {key}={computed!r} (an MoE in every layer, top-k weights renormalised)")

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith("model.visual."):
            return None  # the vision tower: image inputs are not served
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        return super().checkpoint_name(name)


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """The language model of a Qwen3.5-MoE image-text checkpoint (config: its `text_config`)."""
