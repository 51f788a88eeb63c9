"""Request checks shared by the front end (before a request is sent) and the engine core (which
checks again: its limits are the truth). Pure Python, no torch."""
from __future__ import annotations

from moe_serve.sampling_params import SamplingParams


def check_request(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int) -> int:
    """Raise ValueError naming the problem; returns the request's maximum number of new tokens."""
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("prompt must not be empty")
    bad = next((t for t in prompt_token_ids if isinstance(t, bool) or not isinstance(t, int) or t < 0
                or t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt_token_ids contains {bad!r}, outside the vocabulary [0, {vocab_size})")
    params.validate(vocab_size)
    if n >= max_model_len:
        raise ValueError(f"the prompt has {n} tokens; max_model_len={max_model_len} leaves no room "
                         f"for output (the prompt must be shorter than max_model_len)")
    if params.max_tokens is None:
        return max_model_len - n
    if n + params.max_tokens > max_model_len:
        raise ValueError(f"max_tokens={params.max_tokens} plus the prompt's {n} tokens exceeds "
                         f"max_model_len={max_model_len}")
    return params.max_tokens
