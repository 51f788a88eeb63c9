"""What every model shares: the decoder stack's outer loop, logits, and checkpoint name handling.

A model file builds its layers from shared modules (attention, MoE, linear, norm) and names them as
the Hugging Face checkpoint does, so most tensors load by name; expert tensors are routed to the
MoE layer's stacked weights by `weights.py`.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from attention.metadata import AttentionMetadata
from expert_parallel.runtime.layer import MoE, run_to_end
from expert_parallel.runtime.overlap import run_interleaved
from expert_parallel.runtime.step import NO_STEP, MoEStep
from moe_serve.layers.embedding import Embedding, LMHead
from moe_serve.layers.norm import RMSNorm
from moe_serve.layers.rotary import RotaryEmbedding


class DecoderStack(nn.Module):
    """model.embed_tokens -> layers -> model.norm, with HF's module names. The step's rows of the
    model's RoPE tables (`rotary`, shared by its layers) are gathered once, before the layers, and
    passed to each. norm_cls: the final norm's class (Qwen3-Next's is zero-centred)."""

    def __init__(self, vocab_size: int, hidden_size: int, layers: list[nn.Module], eps: float, dtype,
                 rotary: RotaryEmbedding, norm_cls: type[nn.Module] = RMSNorm):
        super().__init__()
        self.rotary = rotary
        self.embed_tokens = Embedding(vocab_size, hidden_size, dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = norm_cls(hidden_size, eps, dtype)

    def forward(self, ids_T, positions_T, meta: AttentionMetadata, step: MoEStep = NO_STEP) -> torch.Tensor:
        return run_to_end(self.stages(ids_T, positions_T, meta, step))

    def stages(self, ids_T, positions_T, meta: AttentionMetadata, step: MoEStep = NO_STEP):
        # Between layers that take it (defers_residual), a layer's FFN output travels unadded and
        # the next norm adds it (one fused call on the CPU, not an add and then a norm).
        h, pending = self.embed_tokens(ids_T), None
        rope = self.rotary.cos_sin(positions_T)
        for layer in self.layers:
            if getattr(layer, "defers_residual", False):
                h, pending = yield from layer.stages(h, positions_T, meta, step, rope, pending, defer=True)
                continue
            if pending is not None:
                h, pending = h + pending, None
            h = yield from layer.stages(h, positions_T, meta, step, rope)
        if pending is None:
            return self.norm(h)
        if isinstance(self.norm, RMSNorm):
            return self.norm.add_norm(h, pending)[1]
        return self.norm(h + pending)


class CausalLM(nn.Module):
    """Base of every model: `forward` gives hidden states, `compute_logits` the sampled rows' logits."""

    # (pattern, replacement) rewrites applied to checkpoint names before matching our parameters.
    name_rewrites: tuple[tuple[str, str], ...] = ()

    def __init__(self, hf: dict, model: DecoderStack, dtype):
        super().__init__()
        self.hf = hf
        self.model = model
        self.num_hidden_layers = hf["num_hidden_layers"]
        self.lm_head = LMHead(hf["vocab_size"], hf["hidden_size"], dtype)
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, ids_T, positions_T, meta: AttentionMetadata, step: MoEStep = NO_STEP) -> torch.Tensor:
        """Hidden states of every token; `step` is what the MoE layers need of this step (the
        runner builds it: runtime/step.py), as `meta` is what attention needs."""
        return self.model(ids_T, positions_T, meta, step)

    def forward_microbatches(self, batches: list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]],
                             step: MoEStep = NO_STEP) -> torch.Tensor:
        """Run micro-batches interleaved (see expert_parallel/runtime/overlap.py); hidden states in order."""
        outs = run_interleaved([self.model.stages(ids, pos, meta, step.for_microbatch(mb))
                                for mb, (ids, pos, meta) in enumerate(batches)])
        return torch.cat(outs, dim=0)

    @property
    def num_moe_layers(self) -> int:
        """How many MoE layers the model has (their `layer_index` runs 0 .. this - 1)."""
        return sum(isinstance(m, MoE) for m in self.modules())

    def compute_logits(self, h_BD: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h_BD)

    def checkpoint_name(self, name: str) -> str | None:
        """Map a checkpoint tensor name to ours; None for tensors that are not used (skipped)."""
        if "rotary_emb.inv_freq" in name:
            return None
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= self.num_hidden_layers:
            return None  # e.g. DeepSeek-V3's multi-token-prediction layer(s) after the last layer
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None
        for pat, rep in self.name_rewrites:
            name = re.sub(pat, rep, name)
        return name
