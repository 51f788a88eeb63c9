"""Property tests of the block allocator and the scheduler, driven without a model: a fake step
"samples" a token for every request that reached its end. Hypothesis picks the workload, the
capacities and when aborts happen."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from attention.blocks import BlockAllocator
from moe_serve.engine.routing import Router, prompt_block_hashes
from moe_serve.request import Request
from moe_serve.sampling_params import SamplingParams
from moe_serve.scheduler import Scheduler

requests_st = st.lists(
    st.tuples(st.lists(st.integers(3, 40), min_size=1, max_size=30),  # prompt
              st.integers(1, 12),  # max new tokens
              st.integers(0, 60)),  # step at which it is aborted (if < its lifetime)
    min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(reqs=requests_st, block_size=st.sampled_from([1, 2, 4, 8]), extra_blocks=st.integers(0, 20),
       budget=st.integers(1, 40), max_seqs=st.integers(1, 8), prefix=st.booleans(),
       eos=st.sampled_from([None, 7]))
def test_no_leaks_every_request_ends_budget_respected(reqs, block_size, extra_blocks, budget, max_seqs, prefix, eos):
    max_len = 30 + 12
    # Enough blocks for the longest single request, so progress is always possible.
    num_blocks = -(-max_len // block_size) + extra_blocks
    alloc = BlockAllocator(num_blocks, block_size, enable_prefix_caching=prefix)
    alloc.track_events()
    router = Router(2, block_size)  # rank 1 holds this cache as the front end learns it from the events
    sched = Scheduler(alloc, budget, max_seqs, max_len)
    abort_at = {}
    for i, (prompt, max_new, abort_step) in enumerate(reqs):
        r = Request(str(i), prompt, SamplingParams(max_tokens=max_new), max_new,
                    frozenset([eos]) if eos is not None else frozenset())
        sched.add_request(r)
        abort_at[str(i)] = abort_step
    finished, aborted = set(), set()
    all_reqs = dict(sched.requests)
    for step in range(2000):
        if not sched.has_work():
            break
        for rid, at in abort_at.items():
            if at == step and rid in sched.requests:
                sched.abort_request(rid)
                aborted.add(rid)
        left_before = {r.request_id: r.num_tokens - r.num_computed_tokens for r in sched.running}
        out = sched.schedule()
        assert out.num_batched_tokens <= budget
        # Decodes first: among requests that were running, every one needing a single token is
        # scheduled before any prefill chunk, and none is left out while a chunk runs.
        kinds = [left_before[s.request.request_id] == 1 for s in out.scheduled if s.request.request_id in left_before]
        assert kinds == sorted(kinds, reverse=True)
        if False in kinds:
            still = {r.request_id for r in sched.running}
            assert all(rid in {s.request.request_id for s in out.scheduled}
                       for rid, left in left_before.items() if left == 1 and rid in still)
        assert len(sched.running) <= max_seqs
        assert sum(s.num_tokens for s in out.scheduled) == out.num_batched_tokens
        for s in out.scheduled:  # the scheduled tokens fit in the request's blocks
            assert s.request.num_computed_tokens + s.num_tokens <= len(s.request.block_ids) * block_size
        # Fake model: the sampled token is a function of the sequence, hitting eos sometimes.
        sampled = {s.request.request_id: (sum(s.request.all_token_ids) % 11) + 3 for s in out.scheduled if s.samples}
        for r in sched.update(out, sampled):
            finished.add(r.request_id)
        alloc.check_invariants()
        router.apply_events(1, *alloc.take_events())
        assert router.cached[1] == set(alloc.cached)
        # The front end's hashes of a prompt are the scheduler's, so a routed prompt's match is what
        # the cache can serve.
        for rid, hashes in sched._hashes.items():
            prompt = all_reqs[rid].prompt_token_ids
            n = min(len(hashes), len(prompt) // block_size)
            assert prompt_block_hashes(prompt, block_size)[:n] == hashes[:n]
            assert router.matched_blocks(1, hashes) == next(
                (i for i, h in enumerate(hashes) if h not in alloc.cached), len(hashes))
    assert not sched.has_work(), "some request never ended"
    assert finished | aborted == set(all_reqs)
    for rid in finished:
        r = all_reqs[rid]
        assert 1 <= r.num_output_tokens <= r.max_new_tokens
        assert r.num_output_tokens == r.max_new_tokens or r.output_token_ids[-1] == eos
    assert alloc.num_free_blocks == num_blocks, "blocks leaked"
    assert all(c == 0 for c in alloc.ref_cnt)


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "register", "lookup"]), st.integers(0, 5)),
                    max_size=60))
def test_allocator_invariants(ops):
    alloc = BlockAllocator(8, 4)
    held: list[list[int]] = []
    n_hash = 0
    for op, k in ops:
        if op == "alloc" and k <= alloc.num_free_blocks:
            held.append(alloc.allocate(k))
        elif op == "free" and held:
            alloc.free(held.pop(k % len(held)))
        elif op == "register" and held and held[k % len(held)]:
            n_hash += 1
            alloc.register(held[k % len(held)][0], n_hash.to_bytes(4, "little"))
        elif op == "lookup" and n_hash:
            hits = alloc.lookup_prefix([(k % n_hash + 1).to_bytes(4, "little")], 1)
            if hits:
                held.append(hits)
        alloc.check_invariants()
    for h in held:
        alloc.free(h)
    alloc.check_invariants()
    assert alloc.num_free_blocks == 8


def test_prefix_cache_reuses_and_evicts_lru():
    alloc = BlockAllocator(4, 2)
    sched = Scheduler(alloc, 100, 4, 8)
    a = Request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=1), 1)
    sched.add_request(a)
    out = sched.schedule()
    sched.update(out, {"a": 10})
    assert a.is_finished and alloc.num_free_blocks == 4
    b = Request("b", [5, 6, 7, 8, 11], SamplingParams(max_tokens=1), 1)
    sched.add_request(b)
    out = sched.schedule()
    assert b.num_computed_tokens == 4 and out.scheduled[0].num_tokens == 1  # two blocks reused
    assert alloc.hit_rate == 4 / 10
    sched.update(out, {"b": 10})
    # Fill the cache with unrelated content: the old prefix blocks get evicted.
    c = Request("c", [20, 21, 22, 23, 24, 25, 26], SamplingParams(max_tokens=1), 1)
    sched.add_request(c)
    sched.update(sched.schedule(), {"c": 3})
    d = Request("d", [5, 6, 7, 8, 12], SamplingParams(max_tokens=1), 1)
    sched.add_request(d)
    sched.schedule()
    assert d.num_computed_tokens < 4


def test_waiting_requests_never_hold_blocks_they_cannot_use():
    """Two requests sharing a cached prefix, each needing the whole cache, with different outputs:
    a waiting request that was lent prefix blocks but cannot grow must give them back, or nothing
    ever runs again (this hung before)."""
    alloc = BlockAllocator(8, 16)
    sched = Scheduler(alloc, 256, 4, 128)
    reqs = [Request(str(i), [5, 6, 7, 8, 9], SamplingParams(max_tokens=123), 123) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(3000):
        if not sched.has_work():
            break
        out = sched.schedule()
        assert out.scheduled or not sched.running, "nothing scheduled while requests run"
        sampled = {s.request.request_id: 3 + (int(s.request.request_id) * 7 + s.request.num_tokens) % 11
                   for s in out.scheduled if s.samples}
        sched.update(out, sampled)
        alloc.check_invariants()
        assert sum(len(r.block_ids) for r in sched.waiting) == 0
    assert not sched.has_work() and all(r.num_output_tokens == 123 for r in reqs)
    assert sched.num_preemptions > 0 and alloc.num_free_blocks == 8
