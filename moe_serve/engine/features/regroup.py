"""Elastic EP's regroup as a feature of the core loop: every rank agrees, at one turn, to leave the
generation it serves (a replacement waits to join, or a planned change of size) and the launcher
forms the next one (launcher/elastic.py).

Unlike the engine's own features this one outlives a generation's engine core: the launcher gives it
to the `CoreLoop` (`CoreLoop(..., features=[...])`), which serves one core after another through the
same sockets. A plain run has no such feature: nothing in the loop knows about regrouping.

The agreement carries one field, `size`, combined with MAX over the ranks: -1 nothing asked, 0 a
replacement waits (regroup at the same size), n a planned size of n ranks. An agreed size >= 0
raises `Regroup` on every rank at the same turn, before any engine feature acts on that turn (the
loop applies its own features first) and never on the turn the job shuts down.
"""
from __future__ import annotations

import msgspec

from moe_serve.engine.features.base import StepFeature


class Regroup(Exception):
    """Every rank agreed, at this turn, to regroup: a replacement waits to join (size None), or a
    planned change of size (`size` ranks)."""

    def __init__(self, reason: str, size: int | None = None):
        super().__init__(reason)
        self.reason, self.size = reason, size


class RegroupFields(msgspec.Struct):
    size: int = -1  # -1: none asked; 0: a replacement joins; n: a planned size of n ranks


class Regrouping(StepFeature):
    """Asks for a regroup on this rank (`ask`, from the membership watcher's thread or the front
    end's "scale" call) and raises `Regroup` once every rank has agreed to it."""

    name = "regroup"
    calls = ("scale",)

    def __init__(self):
        self._asked: int | None = None  # written by one thread, read and cleared by the loop

    def ask(self, size: int = 0) -> None:
        """Regroup at the next turn's agreement: 0 at the same size (a replacement waits), n at n
        ranks. Thread-safe (one attribute written); a planned size wins over a replacement."""
        if self._asked is None or size:
            self._asked = size

    def agreement(self) -> RegroupFields:
        asked, self._asked = self._asked, None
        return RegroupFields(-1 if asked is None else asked)

    def apply_agreement(self, agreed: RegroupFields, group=None) -> None:
        if agreed.size >= 0:
            raise Regroup("a planned change of size" if agreed.size else "a replacement joins", agreed.size or None)

    def on_call(self, call):
        from moe_serve.protocol import UtilityResult

        self.ask(int(call.arg))  # answered once the job serves at the new size (ElasticChange)
        return UtilityResult(call.call_id, b"true")
