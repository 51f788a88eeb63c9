"""The interface a per-step capability implements to plug into the engine core.

The core's step is a fixed sequence, and it calls every registered feature, in registration order,
at each of these points (one rank's view; every rank of an expert-parallel job calls the same hooks
at the same turn, so a hook may enter a collective):

    admit(req, new)                     a request is being added, before it is queued: mark it from
                                        its NewRequest, or raise ValueError to refuse it (it ends at
                                        once, the message in stop_reason)
    on_request_added(req)               a request was queued in the scheduler (admitted)
    on_input(field, items)              a front-end input arrived: CoreInput.<field> (a field named in
                                        `inputs`), a non-empty list; before the turn's step
    agreement() -> Struct | None        once per turn, before the step: this rank's fields
    apply_agreement(agreed, group)      the same turn, every rank: the fields combined over ranks
    after_schedule(sched)               the step's batch is known (maybe empty)
    before_forward(sched)               right before the model runs (an empty lockstep forward too)
    after_forward(sched, result, s)     right after it: result (None for an empty forward), s seconds
    on_outputs(outputs) -> outputs      the step's outputs are built; return them (changed or not)
    on_idle()                           a turn with no step anywhere (the burst is over)
    take_outputs() -> [EngineCoreOutput]  outputs made outside a step's own, taken every turn, with or
                                        without a step (a request ended by work that finished between
                                        steps; a report on a request that is not scheduled yet)
    claims_abort(request_id) -> bool    an abort of a request the scheduler no longer holds: True when
                                        the feature answers it later (in take_outputs), once its own
                                        work on the request has ended
    busy() -> bool                      work in flight outside the step: the idle loop polls sooner
    stats() -> Struct | None            this feature's own figures (named fields), any time
    on_call(call) -> UtilityResult|None a front-end utility call of a method in `calls`
    take_results() -> [UtilityResult]   answers to calls that were due at an agreed turn
    shutdown()                          the job stops (every rank at the same turn)

Agreement contract: `agreement()` returns a msgspec Struct whose fields are all ints; the core loop
packs every contributor's fields into ONE int64 tensor (order: contributors in registration order,
fields in declaration order: nothing positional is written by hand) and reduces it with MAX over
the ranks; a field annotated `MinInt` is combined with MIN instead (packed negated). With one
process the agreed struct is the rank's own. A feature with nothing to agree on returns None, and
must return None (or a struct) on every rank alike: the layout is the same everywhere.

Stats contract: `stats()` returns a msgspec Struct of named fields; `EngineStats` holds it under the
feature's `name` when it declares that field (the built-in ones), else in `EngineStats.features`.

Admission and outputs contract: `admit` runs for every new request, in registration order, before
the core queues it (or waits for its grammar); a ValueError refuses the request. Whatever a feature
returns from `take_outputs` or keeps out of `on_outputs` is its to answer: every request ends with
exactly one finished output, from the step or from the feature.

Hooks must not read another feature's private state, and the core never names a feature: a new
one is a class plus one line in `moe_serve/engine/features/__init__.py` (`FEATURES`).
"""
from __future__ import annotations

from typing import Annotated, Any

import msgspec

MIN = "min"  # the marker of a field combined with MIN over ranks
MinInt = Annotated[int, MIN]


class StepFeature:
    """A capability that acts at fixed points of every step. Every hook has a do-nothing default:
    a feature overrides the ones it needs. `name` keys its stats and its agreement fields."""

    name: str = ""
    calls: tuple[str, ...] = ()  # front-end utility methods it answers (UtilityCall.method)
    inputs: tuple[str, ...] = ()  # CoreInput fields (lists) it receives (on_input)

    def admit(self, req, new) -> None:
        """req: the Request about to be queued; new: its NewRequest. Raise ValueError to refuse it."""

    def on_request_added(self, req) -> None:
        pass

    def on_input(self, field: str, items: list) -> None:
        pass

    def agreement(self) -> msgspec.Struct | None:
        return None

    def apply_agreement(self, agreed: msgspec.Struct | None, group=None) -> None:
        """agreed: the agreement() struct combined over ranks; group: the ranks' CPU group (None:
        one process)."""

    def after_schedule(self, sched) -> None:
        pass

    def before_forward(self, sched) -> None:
        pass

    def after_forward(self, sched, result, seconds: float) -> None:
        pass

    def on_outputs(self, outputs: list) -> list:
        return outputs

    def on_idle(self) -> bool:
        """Returns True when something changed that the front end should hear of (new stats)."""
        return False

    def take_outputs(self) -> list:
        return []

    def claims_abort(self, request_id: str) -> bool:
        return False

    def busy(self) -> bool:
        return False

    def stats(self) -> msgspec.Struct | None:
        return None

    def on_call(self, call) -> Any:
        """A UtilityCall of one of `calls`: its UtilityResult now, or None (answered later, from
        take_results)."""
        return None

    def take_results(self) -> list:
        return []

    def cancel_calls(self, reason: str) -> list:
        """The calls it still owes, answered with an error (the job regrouped)."""
        return []

    def shutdown(self) -> None:
        pass

