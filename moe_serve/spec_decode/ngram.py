"""N-gram drafts (prompt lookup): the tokens that followed the last earlier occurrence of the
context's final n tokens, trying the longest n first (from prompt_lookup_max down to
prompt_lookup_min). Pure Python over numpy, on the host, per request and step: `NgramProposer`
runs no model, so an empty lockstep step has nothing to do."""
from __future__ import annotations

import numpy as np

from moe_serve.spec_decode.base import Proposer, StepView, decodes_next


def propose(tokens: list[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k draft tokens for a context `tokens` (prompt + output so far); [] when its last n
    tokens occur nowhere earlier for any n in [n_min, n_max]."""
    t = np.asarray(tokens, dtype=np.int64)
    L = t.shape[0]
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        tail = t[L - n:]
        # windows starting at 0 .. L - n - 1 (an occurrence must end before the context's end)
        win = np.lib.stride_tricks.sliding_window_view(t[:L - 1], n)
        hits = np.flatnonzero((win == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent occurrence: what followed it
            return t[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    """Prompt-lookup drafts for every running request: [] for one that does not decode next (its
    drafts from an earlier step must not outlive a preemption or a chunk). `lookup` is the search,
    `propose` above (tokens, k, n_min, n_max) -> drafts."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.lookup = propose

    def propose(self, view: StepView):
        drafts = []
        for req in view.running:
            k = view.budget(req) if decodes_next(req) else 0
            drafts.append((req, self.lookup(req.all_token_ids, k, self.n_min, self.n_max) if k > 0 else []))
        return drafts
