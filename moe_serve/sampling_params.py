"""Per-request sampling settings, validated once at submission (vLLM's field names and meanings)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the chosen one)
    prompt_logprobs: int | None = None  # accepted for API compatibility; not computed
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    _stop_list: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the field for any setting out of range."""
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature is None or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_p is None or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is None or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.min_p is None or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if any(not isinstance(s, str) or s == "" for s in self._stop_list):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
