"""The registered step features of one engine core, and the calls the core and its loop make on
all of them at once: the hooks (only the features that override each), the turn's agreement, the
requests, inputs and outputs outside the step, the front end's utility calls, the stats."""
from __future__ import annotations

import msgspec

from moe_serve.engine.features.base import StepFeature


class Hooks:
    """Per hook, the bound methods of the features that override it, in registration order: the
    core calls only those (a step pays nothing for a hook no feature uses)."""

    NAMES = ("admit", "on_request_added", "after_schedule", "before_forward", "after_forward", "on_outputs",
             "on_idle", "take_outputs", "claims_abort", "busy")

    def __init__(self, features: list[StepFeature]):
        for n in self.NAMES:
            setattr(self, n, [getattr(f, n) for f in features if getattr(type(f), n) is not getattr(StepFeature, n)])


class FeatureSet:
    """An ordered list of features with distinct names (registration order is hook order)."""

    def __init__(self, features: list[StepFeature] = ()):
        self._list: list[StepFeature] = []
        for f in features:
            self.add(f)

    def add(self, feature: StepFeature) -> None:
        if any(f.name == feature.name for f in self._list):
            raise ValueError(f"a step feature named {feature.name!r} is registered already")
        self._list.append(feature)
        self.hooks = Hooks(self._list)

    def __iter__(self):
        return iter(self._list)

    def __len__(self) -> int:
        return len(self._list)

    def get(self, name: str) -> StepFeature | None:
        return next((f for f in self._list if f.name == name), None)

    # --- the per-turn agreement (agreement.py) --------------------------------------------------
    def agreement(self) -> list[tuple[str, msgspec.Struct]]:
        """This rank's fields for the turn's agreement, one struct per feature that has any."""
        return [(f.name, a) for f in self._list if (a := f.agreement()) is not None]

    def apply_agreement(self, agreed: dict[str, msgspec.Struct], group=None) -> None:
        """Between steps, at the same turn on every rank: each feature acts on its agreed fields
        (expert rebalancing advances, load recording starts or stops), in registration order."""
        for f in self._list:
            if f.name in agreed:
                f.apply_agreement(agreed[f.name], group)

    def agree_alone(self) -> None:
        """One process: every feature's own fields are the agreed ones."""
        self.apply_agreement(dict(self.agreement()))

    # --- requests, inputs and outputs outside the step ------------------------------------------
    def admit(self, req, new) -> None:
        """Every feature's admission of a new request; a ValueError refuses it."""
        for hook in self.hooks.admit:
            hook(req, new)

    def deliver(self, msg) -> bool:
        """Hand each feature the CoreInput fields it takes (`inputs`) that this message carries;
        True when any was delivered (its state changed, the front end's figures may too)."""
        delivered = False
        for f in self._list:
            for name in f.inputs:
                items = getattr(msg, name, None)
                if items:
                    f.on_input(name, items)
                    delivered = True
        return delivered

    def take_outputs(self) -> list:
        """The outputs features made outside a step's own since the last call."""
        return [o for hook in self.hooks.take_outputs for o in hook()]

    def claims_abort(self, request_id: str) -> bool:
        """Whether a feature answers this abort later (the scheduler no longer holds the request)."""
        return any([hook(request_id) for hook in self.hooks.claims_abort])  # every feature hears it

    def busy(self) -> bool:
        """Work in flight outside the step (the idle loop polls sooner)."""
        return any(hook() for hook in self.hooks.busy)

    # --- between steps --------------------------------------------------------------------------
    def idle(self) -> bool:
        """A turn with no step anywhere; True when a feature has news for the front end."""
        changed = False
        for hook in self.hooks.on_idle:
            changed |= bool(hook())
        return changed

    def call(self, call) -> tuple[bool, object]:
        """A front-end utility call: (whether a feature takes it, its answer now or None)."""
        for f in self._list:
            if call.method in f.calls:
                return True, f.on_call(call)
        return False, None

    def holds_steps(self) -> bool:
        """Whether a feature holds the steps this turn (its `holds_steps()`: generation paused, or
        the engine asleep): the loop schedules nothing, and the requests wait with their KV."""
        return any(f.holds_steps() for f in self._list if hasattr(f, "holds_steps"))

    def take_results(self) -> list:
        return [r for f in self._list for r in f.take_results()]

    def cancel_calls(self, reason: str) -> list:
        return [r for f in self._list for r in f.cancel_calls(reason)]

    def shutdown(self) -> None:
        """Every rank at the same turn, the last one."""
        for f in self._list:
            f.shutdown()

    def stats(self, parts: tuple[str, ...]) -> tuple[dict, dict]:
        """Each feature's stats by name: those named in `parts` (EngineStats' own fields) and the others."""
        named, others = {}, {}
        for f in self._list:
            if (fs := f.stats()) is not None:
                (named if f.name in parts else others)[f.name] = fs
        return named, others
