"""The one interface a speculative-decoding method implements: a `Proposer` gives the requests that
decode next their draft tokens after each step. The `Speculator` (speculator.py) holds one, cuts
its drafts to each request's budget and grammar, and counts what verification accepts; the engine
core calls the Speculator, never a proposer or a method by name.

Contract, one rank's view (every rank of an expert-parallel job makes the same calls at the same turn):

    propose(view) -> [(request, drafts)] after every step that ran tokens on this rank, once the
                                        scheduler has counted the step: drafts (at most
                                        view.budget(request) tokens, [] for none) for the requests
                                        it names; a request it leaves out keeps the drafts it has.
                                        A proposer that runs the model (MTP) runs its passes here
                                        on every rank, drafting or not, so MoE collectives stay in step.
    propose_empty()                     after an empty lockstep step (expert parallelism, nothing
                                        scheduled here): the same collective passes with no tokens;
                                        nothing for a proposer that does not run the model.
    lookahead_tokens                    cache slots a sampling piece reserves past its last token
                                        for the proposer's own writes (MTP's chained passes: K - 1).

Drafts are one token per position, so verification by sampling and comparing (spec_decode.accept)
is exact. A proposer must not change a request's state other than through the drafts it returns.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from moe_serve.request import Request
    from moe_serve.sampler import SampleResult
    from moe_serve.scheduler import SchedulerOutput


@dataclass
class StepView:
    """What a proposer reads of the step that just ran. running: the scheduler's running requests
    after the step's update; out: the step's schedule; result: its sampled tokens (sampling-row
    order, drafts' rows included); last_accepted: request id -> sampling row of the last token it
    kept this step; budget: how many drafts a request may carry next step (may be <= 0)."""

    running: list["Request"]
    out: "SchedulerOutput"
    result: "SampleResult"
    last_accepted: dict[str, int]
    budget: Callable[["Request"], int]


def decodes_next(req: "Request") -> bool:
    """Whether req's next step is a decode (every known token but the last computed): the only
    requests that carry drafts."""
    return req.num_computed_tokens == req.num_tokens - 1


class Proposer(ABC):
    """A speculative-decoding method's drafts (see the module docstring for the contract)."""

    lookahead_tokens: int = 0

    @abstractmethod
    def propose(self, view: StepView) -> list[tuple["Request", list[int]]]:
        """Drafts for the requests that decode next, after a step that ran tokens."""

    def propose_empty(self) -> None:
        """After an empty lockstep step: a proposer that runs the model enters its collectives."""
