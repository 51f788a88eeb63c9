"""Speculative decoding: draft tokens proposed after each step, verified by one target forward.

A running request in decode may carry draft tokens (`Request.spec_token_ids`). The scheduler then
schedules its last known token plus the drafts as one piece of 1 + k tokens (each a token of the
step's budget), the input batch writes the drafts after the known tokens of the request's row, and
the step samples at every one of the 1 + k positions, each as if the drafts before it were accepted
(position j's sampling sees j more output tokens: seeded noise, min_tokens, penalties and a
structured-output grammar's mask follow; drafts are cut to what the grammar allows).
Verification (`accept`) keeps the sampled tokens up to and including the first that differs from
the draft at its place. Sampling then comparing is exact for any draft that is a single token per
position (n-gram drafts, greedy MTP drafts): the token emitted at each position is the target's own
sample given the accepted prefix, so greedy output equals the plain engine's and a seeded request
reproduces its plain run.

Rollback: the cache holds K/V of all 1 + k tokens after the step, but the request counts as computed
only the tokens that were accepted (`num_computed_tokens`); the slots past it are overwritten by the
next step before anything reads them, and blocks are registered for prefix caching only up to it.
Models with per-sequence state (linear attention) update it in place for every token of a piece:
that state is copied before the step and put back where a draft was rejected (`rollback.py`).

The package's parts: `base.py` the `Proposer` interface (the contract every method keeps),
`speculator.py` the `Speculator` the engine core calls (the method's proposer, made by
`make_proposer`; draft budgets, rollback, counts), `rollback.py` (per-sequence state), `verify.py`
(verify steps padded to their own graph ladder, and its graphs captured). Methods: "ngram" (prompt
lookup on the host: `ngram.py`) and "mtp" (the checkpoint's multi-token-prediction layer, run after
every step on every EP rank: `mtp.py`; the scheduler reserves cache slots for its chained passes,
`lookahead_tokens`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from moe_serve.spec_decode.speculator import Speculator, make_proposer

__all__ = ["METHODS", "SpeculativeConfig", "Speculator", "accept", "make_proposer"]
METHODS = ("ngram", "mtp")
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """From `--speculative-config` JSON or an `LLM(speculative_config=...)` dict; None: off."""
        if value is None or value == "" or value == {}:
            return None
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {unknown}; known: {list(_KEYS)}")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method={method!r} is not one of {list(METHODS)}")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens={k!r} must be an integer >= 1")
        if method == "mtp":
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if key in value:
                    raise ValueError(f"speculative_config.{key} applies to method 'ngram' only")
            return cls(method, k)
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        for key, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{key}={v!r} must be an integer >= 1")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min={lo} is above prompt_lookup_max={hi}")
        return cls(method, k, lo, hi)


def accept(sampled: list[int], drafts: list[int]) -> list[int]:
    """The tokens a piece emits: its sampled tokens (one per position, len(drafts) + 1) up to and
    including the first that is not the draft at its place."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return sampled[:n + 1]
