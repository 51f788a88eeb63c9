"""The front end's rank choice (moe_serve/engine/routing.py), driven by real block allocators: each
rank's cache is a BlockAllocator whose own events the router learns from, as over ZMQ."""
from __future__ import annotations

import pytest

from attention.blocks import BlockAllocator
from moe_serve.engine.routing import Router, prompt_block_hashes

BS = 4


def cache_prompt(alloc: BlockAllocator, tokens: list[int]) -> None:
    """What a rank's scheduler does with a prompt it computed and finished: full blocks registered, freed."""
    hashes = prompt_block_hashes(tokens, BS)
    blocks = alloc.allocate(len(hashes))
    for b, h in zip(blocks, hashes):
        alloc.register(b, h)
    alloc.free(blocks)


def test_cache_aware_follows_the_prefix_within_the_load_margin():
    allocs = [BlockAllocator(16, BS) for _ in range(3)]
    for a in allocs:
        a.track_events()
    router = Router(3, BS, "cache_aware", load_margin=100)
    turn1 = list(range(10, 30))  # 5 blocks
    cache_prompt(allocs[2], turn1)
    for r, a in enumerate(allocs):
        router.apply_events(r, *a.take_events())
    turn2 = turn1 + [7, 8, 9, 11, 12]
    assert router.pick("a", turn2, [0, 0, 50]) == (2, 5)  # busier, but within the margin
    router.release("a")
    assert router.pick("b", turn2, [0, 0, 101])[0] == 0  # beyond the margin: the least loaded
    router.release("b")
    assert router.pick("c", list(range(50, 70)), [9, 3, 0]) == (2, 0)  # no rank holds it: least loaded
    router.release("c")
    # The cache evicts the prefix (other prompts fill it): the router learns it and stops following it.
    for i in range(4):
        cache_prompt(allocs[2], list(range(100 * (i + 1), 100 * (i + 1) + 16)))
    router.apply_events(2, *allocs[2].take_events())
    assert set(router.cached[2]) == set(allocs[2].cached)
    assert router.pick("d", turn2, [5, 0, 0])[1] < 5


def test_requests_sharing_a_prefix_land_together_before_any_report():
    """Routed, a request's prompt counts as held by its rank until it ends, so a burst of turns of
    one conversation does not scatter over the ranks before the first has been computed."""
    router = Router(4, BS, "cache_aware", load_margin=1000)
    system = list(range(1, 33))
    loads = [0, 0, 0, 0]
    picks = []
    for i in range(6):
        rank, _ = router.pick(f"r{i}", system + [40 + i], loads)
        loads[rank] += 40
        picks.append(rank)
    assert len(set(picks)) == 1
    for i in range(6):
        router.release(f"r{i}")
    assert not any(router.promised)  # nothing promised once they ended, and no report came
    rank, hit = router.pick("x", system, [0, 1, 1, 1])
    assert (rank, hit) == (0, 0)


@pytest.mark.parametrize("policy", ["least_load", "round_robin"])
def test_the_other_policies_ignore_the_cache(policy):
    alloc = BlockAllocator(16, BS)
    alloc.track_events()
    router = Router(2, BS, policy)
    prompt = list(range(12))
    cache_prompt(alloc, prompt)
    router.apply_events(1, *alloc.take_events())
    picks = [router.pick(str(i), prompt, [0, 5])[0] for i in range(4)]
    assert picks == ([0, 0, 0, 0] if policy == "least_load" else [0, 1, 0, 1])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="fastest"):
        Router(2, BS, "fastest")
    with pytest.raises(ValueError, match="load margin"):
        Router(2, BS, "cache_aware", -1)


def test_a_short_shared_start_does_not_pull_every_prompt_onto_one_rank():
    """A prefix under the threshold share of the prompt (a chat template's first block) is not
    followed: the request goes to the least loaded rank, the one caching least among equals."""
    alloc = BlockAllocator(64, BS)
    alloc.track_events()
    router = Router(2, BS, "cache_aware", load_margin=100, threshold=0.5)
    preamble = [1, 2, 3, 4]
    cache_prompt(alloc, preamble + list(range(10, 30)))
    router.apply_events(0, *alloc.take_events())
    assert router.pick("a", preamble + list(range(40, 60)), [0, 0]) == (1, 0)  # 1 block of 6 held by rank 0
    assert router.pick("b", preamble + list(range(10, 22)) + [99] * 8, [0, 0]) == (0, 4)  # 4 of 6
