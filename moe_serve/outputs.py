"""Results as users see them, shaped like vLLM's (RequestOutput.outputs[i].text / token_ids / ...)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token (prompt logprobs and the top-n entries)
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # per token: {token id: Logprob}, chosen token included
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    # SamplingParams.return_routed_experts: numpy int16 [prompt + output tokens - 1, MoE layers, k],
    # the logical experts each MoE layer routed every position to (moe_serve/routed_experts.py).
    routed_experts: Any = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs (vLLM's shape): None for the first prompt token, then per
    # prompt token {token id: Logprob} holding that token and the top prompt_logprobs ones.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
