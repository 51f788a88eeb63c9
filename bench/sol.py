"""Decode speed of light: bytes a decode step must read, and the memory bandwidth that reads them.

Decode of a mixture-of-experts model is memory-bound: every step reads the weights it uses once,
whatever the batch. So the fastest possible step is

    bytes_per_step / bandwidth,  bytes_per_step = non-expert weights
                                                 + distinct experts touched * bytes per expert
                                                 + KV cache bytes read (every cached token of every sequence)

- Non-expert weights: attention, norms, routers, shared experts, dense layers and the LM head. The
  input embedding table is not counted (a step gathers one row per token, negligible), unless it is
  tied to the LM head, which reads all of it.
- Distinct experts per MoE layer: top_k for one sequence; for B sequences under uniform routing the
  expected count is E * (1 - (1 - k/E)^B) (each expert is missed by one token with probability 1 - k/E).
- Bandwidth: measured on the same device in the same run with a large tensor copy, counting the
  bytes read plus the bytes written.

Only torch and moe_serve.speed_of_light (itself torch only) are imported here: bench/decode_sol.py runs this
on GPU machines without the server stack.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from moe_serve.speed_of_light import measure_bandwidth as _engine_measure


def measure_bandwidth(device: torch.device | str, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Copy bandwidth in bytes/s (read + write), best of `repeats`: the engine's own measure
    (moe_serve/speed_of_light.py), with a larger default buffer for benchmarks."""
    return _engine_measure(device, nbytes, repeats)


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected number of distinct experts hit by `batch` tokens, each routed to `top_k` of
    `num_experts` uniformly at random (without replacement per token)."""
    if batch <= 0:
        return 0.0
    if batch == 1:
        return float(top_k)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


@dataclass(frozen=True)
class DecodeBytes:
    """What one decode step reads, for a model as this engine builds it (one rank, EP=1)."""

    non_expert_bytes: int  # weights read every step, whatever the routing (see module docstring)
    embedding_bytes: int  # the input embedding table, not counted (0 when tied: then it is the LM head)
    expert_bytes: int  # one routed expert of one layer: w13 (2F x D) + w2 (D x F)
    num_moe_layers: int
    num_experts: int
    top_k: int
    kv_bytes_per_token: int  # K and V (or MLA latent) of one token over all layers

    def step_bytes(self, batch: int, context_tokens: int) -> float:
        """Bytes of one decode step of `batch` sequences holding `context_tokens` cached tokens in all."""
        experts = expected_distinct_experts(self.num_experts, self.top_k, batch)
        return (self.non_expert_bytes + self.num_moe_layers * experts * self.expert_bytes
                + context_tokens * self.kv_bytes_per_token)

    def sol_tokens_per_s(self, batch: int, context_tokens: int, bandwidth: float) -> float:
        """Output tokens/s at speed of light: `batch` tokens per step of step_bytes / bandwidth."""
        return batch * bandwidth / self.step_bytes(batch, context_tokens)

    def as_dict(self) -> dict:
        return asdict(self)


def decode_bytes_of(llm) -> DecodeBytes:
    """The byte model of a loaded `moe_serve.LLM` (reads its modules, not the checkpoint files)."""
    runner = llm.engine.runner
    kv_per_token = runner.kv_cache_bytes // (runner.num_blocks * runner.cfg.cache.block_size)
    return decode_bytes_of_model(runner.model, kv_per_token)


def decode_bytes_of_model(model, kv_bytes_per_token: int) -> DecodeBytes:
    """The byte model of a built model (`CausalLM`), given its KV bytes per cached token."""
    from expert_parallel.runtime.layer import MoE

    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # parameters() already drops tied duplicates; be explicit anyway
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    moe_layers = [m for m in model.modules() if isinstance(m, MoE)]
    routed = sum(m.experts.w13.numel() * m.experts.w13.element_size()
                 + m.experts.w2.numel() * m.experts.w2.element_size() for m in moe_layers)
    first = moe_layers[0]
    expert_bytes = ((first.experts.w13.numel() * first.experts.w13.element_size()
                     + first.experts.w2.numel() * first.experts.w2.element_size()) // first.experts.w13.shape[0])
    emb = model.model.embed_tokens.weight
    tied = model.lm_head.weight.data_ptr() == emb.data_ptr()
    embedding = 0 if tied else emb.numel() * emb.element_size()
    return DecodeBytes(non_expert_bytes=total - routed - embedding, embedding_bytes=embedding,
                       expert_bytes=expert_bytes, num_moe_layers=len(moe_layers),
                       num_experts=first.num_experts, top_k=first.gate.top_k, kv_bytes_per_token=kv_bytes_per_token)


def gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"
