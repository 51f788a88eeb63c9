"""An engine core's speculative decoding: the method's `Proposer` (chosen by `make_proposer`), the
rollback of per-sequence state, each request's draft budget and the acceptance counts. The core
calls it at fixed points of its step and never names a method:

    before_forward(out)                        a step that runs tokens is about to run
    rollback(out, kept) -> request ids         drafts verified; before the scheduler counts the step
    after_step(running, out, result, last)     the scheduler counted the step: drafts for the next
    propose_empty()                            an empty lockstep step ran (expert parallelism)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from moe_serve.protocol import SpecDecodeStats
from moe_serve.spec_decode.base import Proposer, StepView
from moe_serve.spec_decode.rollback import StateRollback

if TYPE_CHECKING:
    from moe_serve.spec_decode import SpeculativeConfig


def make_proposer(cfg: "SpeculativeConfig | None", runner) -> Proposer | None:
    """The proposer of cfg.method (None: speculative decoding is off). runner: the rank's
    ModelRunner, whose model and step outputs a proposer that runs the model (MTP) reads."""
    if cfg is None:
        return None
    if cfg.method == "ngram":
        from moe_serve.spec_decode.ngram import NgramProposer

        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if cfg.method == "mtp":
        from moe_serve.spec_decode.mtp import MtpProposer

        return MtpProposer(runner, cfg.num_speculative_tokens)
    raise ValueError(f"speculative decoding method {cfg.method!r} has no proposer")


class Speculator:
    """Drafts and their counts for one engine core (see the module docstring for when the core calls
    what). `record` counts a verified piece (vLLM's metrics, per rank)."""

    def __init__(self, cfg: "SpeculativeConfig | None", max_model_len: int, runner=None):
        self.cfg, self.max_model_len = cfg, max_model_len
        self.proposer = make_proposer(cfg, runner)
        # Only a model with per-sequence state has anything to undo beyond not counting tokens.
        self.states = StateRollback(runner) if cfg is not None and getattr(runner, "state_layers", None) else None
        k = cfg.num_speculative_tokens if cfg is not None else 0
        self.num_drafts = 0  # pieces verified with at least one draft token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k  # how often the draft at position j was accepted

    @property
    def lookahead_tokens(self) -> int:
        """Cache slots a piece that samples reserves past its last token for the proposer's writes."""
        return self.proposer.lookahead_tokens if self.proposer is not None else 0

    # --- the step's points --------------------------------------------------------------------
    def before_forward(self, out) -> None:
        if self.states is not None:
            self.states.before_forward(out)

    def rollback(self, out, kept: dict[str, list[int]]) -> set[str]:
        """The requests whose piece the scheduler must count as not computed (their per-sequence
        state is back to before the step); kept: the tokens each request kept this step."""
        return self.states.after_verify(out, kept) if self.states is not None else set()

    def after_step(self, running, out, result, last_accepted: dict[str, int]) -> None:
        """The next step's drafts (see base.StepView for the arguments)."""
        if self.proposer is not None:
            for req, drafts in self.proposer.propose(StepView(running, out, result, last_accepted, self.draft_budget)):
                self.set_drafts(req, drafts)

    def propose_empty(self) -> None:
        if self.proposer is not None:
            self.proposer.propose_empty()

    # --- drafts and counts --------------------------------------------------------------------
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

    def record(self, k: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified piece: 1 + accepted drafts per piece."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
                               num_accepted_tokens=self.num_accepted_tokens,
                               accepted_per_pos=list(self.accepted_per_pos))
