"""Which data-parallel rank a new request goes to (the front end's choice; AsyncEngine.submit).

Every rank has its own prefix cache, so a request that extends an earlier conversation is only
cheap on the rank that served the earlier turn. `cache_aware` (the default) sends a request to the
rank holding the longest cached prefix of its prompt when that prefix is at least `threshold` of
the prompt and that rank's outstanding tokens exceed the least loaded rank's by no more than
`load_margin`; otherwise to the least loaded rank, the one caching least among equals (SGLang's
policy shape: `cache_aware_choice`, which `moe-serve router` uses too). The threshold keeps a
short shared start (a chat template's preamble) from pulling every conversation onto one rank.
`least_load` always takes the least loaded rank; `round_robin` takes the next in turn.

What a rank holds is known from its own reports: each engine step's `CoreOutputs` carries the
block hashes its prefix cache gained and lost in that step (`CacheEvents`, only the net change;
no rank ever sends its whole cache). Hashes are the cache's own chained block hashes
(attention/blocks.hash_block over `block_size` tokens), computed here from the prompt token ids. A
request routed to a rank counts as a promise of its prompt's blocks there until it ends, so
requests sharing a prefix that arrive together land together before the first has reported.

The events follow the first cache group (on hybrid models the full-attention or first windowed
layers); a hit there can still be cut shorter in the core where another group cannot resume from it
(linear-attention states, sliding windows): routing is a placement heuristic, never a correctness
matter.
"""
from __future__ import annotations

import itertools
from collections import Counter

from attention.blocks import hash_block

POLICIES = ("cache_aware", "least_load", "round_robin")


def cache_aware_choice(candidates: list[int], matched: dict[int, int] | list[int], total: int, loads, sizes,
                       threshold: float, margin: int) -> tuple[int, bool]:
    """The candidate to send a request to, and whether it was chosen for its prefix. matched[c]:
    how much of the request's `total` (blocks, chunks) candidate c holds; loads, sizes: its load
    and how much it caches (the tie-break among the least loaded)."""
    least = min(candidates, key=lambda c: (loads[c], sizes[c], c))
    best = max(candidates, key=lambda c: (matched[c], -loads[c], -c))
    if matched[best] and matched[best] >= threshold * total and loads[best] - loads[least] <= margin:
        return best, best != least
    return least, False


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """The chained hashes of the prompt's full blocks, as the core's prefix cache computes them."""
    out, parent = [], None
    for b in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[b * block_size:(b + 1) * block_size])
        out.append(parent)
    return out


class Router:
    """Not thread-safe: AsyncEngine calls it under its lock."""

    def __init__(self, world_size: int, block_size: int, policy: str = "cache_aware", load_margin: int = 4096,
                 threshold: float = 0.5):
        if policy not in POLICIES:
            raise ValueError(f"load balance method {policy!r} is not one of {', '.join(POLICIES)}")
        if load_margin < 0:
            raise ValueError(f"cache-aware load margin must be >= 0, got {load_margin}")
        if not 0 <= threshold <= 1:
            raise ValueError(f"cache-aware threshold must be within [0, 1], got {threshold}")
        self.world_size, self.block_size, self.policy = world_size, block_size, policy
        self.load_margin, self.threshold = load_margin, threshold
        self.cached: list[set[bytes]] = [set() for _ in range(world_size)]  # what each rank reported
        self.promised: list[Counter] = [Counter() for _ in range(world_size)]  # blocks of requests routed there
        self._held: dict[str, tuple[int, list[bytes]]] = {}  # request id -> (rank, hashes it promised)
        self._turn = itertools.count()
        self.routed_by_prefix = 0  # requests sent to a rank for its cached prefix (not the least loaded)
        self.live = list(range(world_size))  # the ranks requests may go to (elastic EP: the members)

    def reset(self, live: list[int]) -> None:
        """Route to `live` only, every cache empty (elastic EP: the members rebuilt their cores)."""
        self.live = list(live)
        self.cached = [set() for _ in range(self.world_size)]
        self.promised = [Counter() for _ in range(self.world_size)]
        self._held.clear()

    def apply_events(self, rank: int, added: list[bytes], removed: list[bytes]) -> None:
        s = self.cached[rank]
        s.difference_update(removed)
        s.update(added)

    def matched_blocks(self, rank: int, hashes: list[bytes]) -> int:
        cached, promised = self.cached[rank], self.promised[rank]
        n = 0
        for h in hashes:
            if h not in cached and h not in promised:
                break
            n += 1
        return n

    def pick(self, request_id: str, token_ids: list[int], loads: list[int]) -> tuple[int, int]:
        """The rank for a new request and how many of its prompt's blocks that rank holds."""
        ranks = self.live
        if len(ranks) == 1:
            return ranks[0], 0
        if self.policy == "round_robin":
            return ranks[next(self._turn) % len(ranks)], 0
        sizes = {r: len(self.cached[r]) + len(self.promised[r]) for r in ranks}
        if self.policy == "least_load":
            return min(ranks, key=lambda r: (loads[r], sizes[r], r)), 0
        hashes = prompt_block_hashes(token_ids, self.block_size)
        matched = {r: self.matched_blocks(r, hashes) for r in ranks}
        rank, by_prefix = cache_aware_choice(ranks, matched, len(token_ids) // self.block_size, loads, sizes,
                                             self.threshold, self.load_margin)
        self.routed_by_prefix += by_prefix
        if hashes:
            self.promised[rank].update(hashes)
            self._held[request_id] = (rank, hashes)
        return rank, matched[rank]

    def release(self, request_id: str) -> None:
        """The request ended: its blocks are now what its rank reports, no longer promised."""
        held = self._held.pop(request_id, None)
        if held is not None:
            promised = self.promised[held[0]]
            promised.subtract(held[1])
            for h in held[1]:
                if promised[h] <= 0:
                    del promised[h]
