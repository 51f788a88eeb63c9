"""The per-turn agreement of the ranks: named int fields, one MAX all-reduce.

Each contributor (the core loop itself, every feature with an `agreement()`) gives a msgspec Struct of
int fields. `Layout` lays them out in one flat list: contributors in their given order, fields in
declaration order, each slot named `contributor.field`. Fields annotated `MinInt` are stored negated,
so that the one MAX reduction gives their minimum. Nothing here imports torch: the caller turns the
list into a tensor (moe_serve/engine/core_proc.py).
"""
from __future__ import annotations

import typing
from functools import lru_cache

import msgspec

from moe_serve.engine.features.base import MIN


@lru_cache(maxsize=None)
def struct_signs(cls: type) -> tuple[int, ...]:
    """Per field of an agreement struct, +1 (MAX) or -1 (MIN, stored negated); TypeError for a
    field that is not an int."""
    hints = typing.get_type_hints(cls, include_extras=True)
    signs = []
    for f in cls.__struct_fields__:
        t = hints[f]
        is_min = typing.get_origin(t) is typing.Annotated and MIN in t.__metadata__
        base = typing.get_args(t)[0] if typing.get_origin(t) is typing.Annotated else t
        if base is not int:
            raise TypeError(f"agreement field {cls.__name__}.{f} is {t!r}: agreement fields must be ints")
        signs.append(-1 if is_min else 1)
    return tuple(signs)


class Layout:
    """Where each contributor's fields sit in the flat vector. Made from (name, struct) pairs; the
    same contributors (names and struct types) give the same layout on every rank."""

    def __init__(self, parts: list[tuple[str, msgspec.Struct]]):
        names = [n for n, _ in parts]
        if len(set(names)) != len(names):
            raise ValueError(f"agreement contributors must have distinct names: {names}")
        self.types = tuple(type(s) for _, s in parts)
        self.names = tuple(names)
        self.slots: list[str] = [f"{n}.{f}" for n, s in parts for f in type(s).__struct_fields__]
        self._signs = [struct_signs(t) for t in self.types]

    def pack(self, parts: list[tuple[str, msgspec.Struct]]) -> list[int]:
        """The flat values to reduce with MAX (MIN fields negated)."""
        out: list[int] = []
        for (_, s), signs in zip(parts, self._signs):
            out += [v if sign > 0 else -v for v, sign in zip(msgspec.structs.astuple(s), signs)]
        return out

    def unpack(self, values: list[int]) -> dict[str, msgspec.Struct]:
        """The reduced values back as one struct per contributor, by name."""
        agreed, i = {}, 0
        for name, cls, signs in zip(self.names, self.types, self._signs):
            n = len(signs)
            agreed[name] = cls(*(int(v) if sign > 0 else -int(v) for v, sign in zip(values[i:i + n], signs)))
            i += n
        return agreed


def combine(contributions: list[list[int]]) -> list[int]:
    """The MAX over ranks of packed vectors (what the all-reduce computes; for tests and one host)."""
    return [max(col) for col in zip(*contributions)]
