"""Speculative decoding: draft tokens proposed on the host, verified by one target forward.

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
the runner keeps a copy of each verifying sequence's state before the step, and where a draft was
rejected puts it back and the scheduler counts the piece as not computed, so the accepted tokens
are computed again (as a chunk) in the next step; when every draft is accepted nothing is undone.

Methods: "ngram" (prompt lookup: `ngram.propose`, on the host before the step) and "mtp" (the
checkpoint's multi-token-prediction layer, run by the model runner after each step: `mtp.py`;
the scheduler reserves cache slots for its chained passes, `lookahead_tokens`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

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


class Speculator:
    """An engine core's drafts and their counts. `propose` gives each running request in decode its
    drafts for the next step; `record` counts a verified piece (vLLM's metrics, per rank)."""

    def __init__(self, cfg: SpeculativeConfig | None, max_model_len: int):
        self.cfg, self.max_model_len = cfg, max_model_len
        self.proposer = None
        if cfg is not None and cfg.method == "ngram":
            from moe_serve.spec_decode.ngram import propose

            self.proposer = propose
        k = cfg.num_speculative_tokens if cfg is not None else 0
        self.num_drafts = 0  # pieces verified with at least one draft token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k  # how often the draft at position j was accepted

    def record(self, k: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    @property
    def lookahead_tokens(self) -> int:
        """Cache slots a piece that samples reserves past its last token: MTP's chained passes
        write positions up to K - 1 past it."""
        cfg = self.cfg
        return cfg.num_speculative_tokens - 1 if cfg is not None and cfg.method == "mtp" else 0

    def draft_budget(self, req) -> int:
        """How many drafts req may carry: at most num_speculative_tokens, and never more than its
        remaining output allows (the verified step emits one token past them) nor past the
        context limit."""
        return min(self.cfg.num_speculative_tokens, req.max_new_tokens - req.num_output_tokens - 1,
                   self.max_model_len - req.num_tokens)

    def set_drafts(self, req, drafts: list[int]) -> None:
        """req's drafts for its next step, cut to its budget and to what its grammar allows."""
        drafts = drafts[:max(0, self.draft_budget(req))]
        if drafts and req.grammar is not None:
            drafts = req.grammar.allowed_prefix(drafts)
        req.spec_token_ids = drafts

    def propose(self, running) -> None:
        """N-gram drafts for every running request that decodes next."""
        cfg = self.cfg
        for req in running:
            if req.num_computed_tokens != req.num_tokens - 1:
                req.spec_token_ids = []
                continue
            k = self.draft_budget(req)
            drafts = self.proposer(req.all_token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max) if k > 0 else []
            self.set_drafts(req, drafts)

    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified piece: 1 + accepted drafts per piece."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
