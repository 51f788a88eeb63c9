"""Rejected drafts, undone. The paged caches need nothing: a request counts as computed only the
tokens verification accepted (`num_computed_tokens`), and the next step overwrites the slots past
it before anything reads them. Per-sequence state (linear attention's conv and recurrent states,
updated in place token by token) cannot be cut back that way: `StateRollback` has the runner copy
each verifying sequence's state before the step, and where a draft was rejected puts the copy back
and has the scheduler count the whole piece as not computed, so the accepted tokens are computed
again (as a chunk) in the next step. When every draft is accepted nothing is undone.

This module decides when; the tensor copies are the runner's (`ModelRunner.snapshot_states`,
`restore_states`).
"""
from __future__ import annotations


class StateRollback:
    """The rollback of one rank's per-sequence state, for a runner whose model keeps some
    (`runner.state_layers` not empty). `before_forward` before every step that runs tokens;
    `after_verify` once its drafts are verified, before the scheduler counts the step."""

    def __init__(self, runner):
        self.runner = runner

    def before_forward(self, out) -> None:
        """Copy the state of every request that verifies drafts this step (the rest are not undone)."""
        self.runner.snapshot_states([s.request for s in out.scheduled if s.draft_ids])

    def after_verify(self, out, sampled: dict[str, list[int]]) -> set[str]:
        """The requests whose state goes back to before the step (some draft rejected: fewer tokens
        kept than the piece ran), restored now; the scheduler counts their pieces as not computed.
        sampled: the tokens each request kept this step."""
        rollback = {s.request.request_id for s in out.scheduled
                    if s.samples and s.draft_ids and len(sampled[s.request.request_id]) <= len(s.draft_ids)}
        if rollback:
            self.runner.restore_states(rollback)
        return rollback
