"""Which expert weights move where when one layer's placement changes (pure Python, no torch).

Shape legend: S physical slots, P ranks, s = S / P slots per rank (slot g lives on rank g // s, as
local slot g % s).

For rank r, each new local slot j holding expert e is filled
  - from r's own old weights when r already holds e (a local copy: nothing travels), else
  - by one receive of e from a rank that held e before; when r needs e in several new slots it is
    received once and copied to the others after it arrived ("dups").
Sources are picked so that every rank computes the same plan for every rank: ranks in order, each
one's missing experts in slot order, from the old holder that has been asked for the fewest sends
so far (ties: the lowest rank). So every send posted has exactly one matching receive.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LayerPlan:
    layer: int
    new_row: list[int]                                   # S logical ids after the switch
    copies: list[tuple[int, int]] = field(default_factory=list)       # (new local j, old local i)
    recvs: list[tuple[int, int, int]] = field(default_factory=list)   # (new local j, src rank, expert)
    dups: list[tuple[int, int]] = field(default_factory=list)         # (new local j, new local j0)
    sends: list[tuple[int, int, int]] = field(default_factory=list)   # (old local i, dst rank, expert)

    @property
    def moves_weights(self) -> bool:
        return bool(self.recvs or self.sends)


def plan_layer(layer: int, old_row: list[int], new_row: list[int], world: int, rank: int) -> LayerPlan:
    """This rank's part of moving one layer from old_row to new_row (both length S)."""
    S = len(old_row)
    if len(new_row) != S or S % world:
        raise ValueError(f"layer {layer}: old and new placements need the same slot count, divisible by {world}")
    s = S // world
    old_local = [old_row[q * s:(q + 1) * s] for q in range(world)]
    holders: dict[int, list[int]] = {}
    for q in range(world):
        for e in dict.fromkeys(old_local[q]):
            holders.setdefault(e, []).append(q)
    sent = [0] * world
    plan = LayerPlan(layer, list(new_row))
    for r in range(world):
        first: dict[int, int] = {}  # expert -> the new local slot that receives or copies it first
        for j, e in enumerate(new_row[r * s:(r + 1) * s]):
            if e in first:
                if r == rank:
                    plan.dups.append((j, first[e]))
                continue
            first[e] = j
            if e in old_local[r]:
                if r == rank:
                    plan.copies.append((j, old_local[r].index(e)))
                continue
            if e not in holders:
                raise ValueError(f"layer {layer}: expert {e} has no slot in the old placement")
            q = min(holders[e], key=lambda h: (sent[h], h))
            sent[q] += 1
            if r == rank:
                plan.recvs.append((j, q, e))
            if q == rank:
                plan.sends.append((old_local[q].index(e), r, e))
    return plan
