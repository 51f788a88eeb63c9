"""Per-request sampling settings: one msgspec definition, validated once at construction, that
crosses the front-end <-> engine-core boundary as it is (vLLM's field names and meanings).

Importing this module does not import torch.
"""
from __future__ import annotations

import math

import msgspec

from moe_serve.structured_output.params import StructuredOutputsParams


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0  # EOS and stop_token_ids are masked out until this many tokens are generated
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the chosen one)
    # Per prompt token after the first: its logprob, its rank and this many top logprobs (vLLM's).
    # Computed from the raw model output like `logprobs`; a request asking for them never resumes
    # from prefix-cache hits before they are all computed (every position is run through the model).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI's penalties (-2..2): subtract frequency * count + presence * (count > 0) of each token
    # generated so far. vLLM's repetition_penalty (> 0, 1 = off) divides positive logits and
    # multiplies negative ones of every token seen in the prompt or the output.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100], added to the logits
    # Output constrained to a JSON schema / regex / choice / grammar (moe_serve/structured_output/).
    structured_outputs: StructuredOutputsParams | None = None
    # Router replay (RL rollouts): the logical top-k experts every MoE layer chose at every prompt
    # and output position but the last (moe_serve/engine/features/routed_experts.py).
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None and not self.logit_bias:
            self.logit_bias = None
        self.validate()

    @property
    def stop_strings(self) -> list[str]:
        return self.stop  # a list after __post_init__

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    def replace(self, **changes) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the field for any setting out of range. With vocab_size, token ids
        (logit_bias, stop_token_ids) are checked against the vocabulary too."""
        def number(name: str, v, lo: float, hi: float, lo_open: bool = False) -> None:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or \
                    not (lo < v if lo_open else lo <= v) or not v <= hi:
                lo_s = f"({lo}" if lo_open else f"[{lo}"
                raise ValueError(f"{name} must be a number in {lo_s}, {hi}], got {v!r}")

        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        number("temperature", self.temperature, 0.0, math.inf)
        number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if self.top_k is None or isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        number("min_p", self.min_p, 0.0, 1.0)
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool) or
                                                 not isinstance(self.prompt_logprobs, int) or
                                                 not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        number("repetition_penalty", self.repetition_penalty, 0.0, math.inf, lo_open=True)
        if math.isinf(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be finite, got {self.repetition_penalty!r}")
        if not isinstance(self.return_routed_experts, bool):
            raise ValueError(f"return_routed_experts must be a boolean, got {self.return_routed_experts!r}")
        if self.structured_outputs is not None and self.min_tokens > 0:
            raise ValueError("min_tokens cannot be combined with structured outputs: the grammar decides where "
                             "the output ends")
        for tid, bias in (self.logit_bias or {}).items():
            if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {tid!r}")
            number(f"logit_bias[{tid}]", bias, -100.0, 100.0)
        if vocab_size is not None:
            bad = next((t for t in (self.logit_bias or {}) if t >= vocab_size), None)
            if bad is not None:
                raise ValueError(f"logit_bias has token id {bad}, outside the vocabulary [0, {vocab_size})")
            bad = next((t for t in self.stop_token_ids if t >= vocab_size), None)
            if bad is not None:
                raise ValueError(f"stop_token_ids has {bad}, outside the vocabulary [0, {vocab_size})")


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n samples: a single sequence; a seeded request gets seed + i so samples differ."""
    seed = None if params.seed is None else params.seed + index
    return params.replace(n=1, seed=seed)
