"""Property tests of the scheduler over several cache kinds (attention/kv_manager.py), without a
model: full, sliding and chunked block groups and a state-slot pool, driven by a fake step.
Hypothesis picks the workload, capacities and aborts; after every step no group is over-committed,
every request holds exactly what its window needs, and at the end every block and slot is back."""
from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from attention.cache_kinds import FULL, chunked, sliding
from attention.kv_manager import KVCacheManager
from moe_serve.request import Request
from moe_serve.sampling_params import SamplingParams
from moe_serve.scheduler import Scheduler

requests_st = st.lists(
    st.tuples(st.lists(st.integers(3, 6), min_size=1, max_size=30),  # prompt (few ids: shared prefixes)
              st.integers(1, 12),  # max new tokens
              st.integers(0, 60)),  # step at which it is aborted (if < its lifetime)
    min_size=1, max_size=10)


def _held(manager: KVCacheManager, g: int, table: list[int]) -> list[int]:
    return [b for b in table if b != manager.null_block(g)]


@settings(max_examples=120, deadline=None)
@given(reqs=requests_st, block_size=st.sampled_from([1, 2, 4]), window=st.integers(1, 9), chunk=st.integers(1, 9),
       extra=st.integers(0, 12), budget=st.integers(1, 24), max_seqs=st.integers(1, 6), prefix=st.booleans(),
       with_state=st.booleans())
def test_groups_never_overcommitted_and_everything_returned(reqs, block_size, window, chunk, extra, budget,
                                                            max_seqs, prefix, with_state):
    max_len = 30 + 12
    full_blocks = -(-max_len // block_size) + extra
    kinds = [FULL, sliding(window), chunked(chunk)]
    # The windowed groups hold a request's window and a step's tokens at least (what sizing gives).
    groups = [(FULL, full_blocks)] + [(k, k.tokens // block_size + 2 + extra) for k in kinds[1:]]
    slots = max_seqs * (2 if prefix else 1) if with_state else 0
    manager = KVCacheManager(block_size, groups, slots, enable_prefix_caching=prefix)
    sched = Scheduler(manager, budget, max_seqs, max_len)
    abort_at, all_reqs = {}, {}
    for i, (prompt, max_new, abort_step) in enumerate(reqs):
        r = Request(str(i), prompt, SamplingParams(max_tokens=max_new), max_new)
        sched.add_request(r)
        abort_at[str(i)], all_reqs[str(i)] = abort_step, r
    finished, aborted = set(), set()
    for step in range(3000):
        if not sched.has_work():
            break
        for rid, at in abort_at.items():
            if at == step and rid in sched.requests:
                sched.abort_request(rid)
                aborted.add(rid)
        out = sched.schedule()
        assert out.num_batched_tokens <= budget
        for s in out.scheduled:
            r = s.request
            tables = manager.tables(r)
            assert len({len(t) for t in tables}) == 1, "a request's tables have different lengths"
            end = r.num_computed_tokens + s.num_tokens
            assert end <= len(r.block_ids) * block_size
            for g, kind in enumerate(kinds):
                # Every block a query of this step reads is held; nothing before the window is.
                lo = kind.first_needed(r.num_computed_tokens) // block_size
                assert all(b != manager.null_block(g) for b in tables[g][lo:])
                assert all(b == manager.null_block(g) for b in tables[g][:lo])
            if with_state:
                assert r.state_slot is not None
        # Each pool's references are exactly its holders' (prefix hits share full blocks), so no
        # group hands out more than it has; live state slots are never shared.
        live = [r for r in all_reqs.values() if not r.is_finished]
        for g, alloc in enumerate(manager.allocs):
            held = Counter(b for r in live for b in _held(manager, g, manager.tables(r)[g]))
            assert held == {b: c for b, c in enumerate(alloc.ref_cnt) if c}
        if with_state:
            mine = [r.state_slot for r in live if r.state_slot is not None]
            assert len(mine) == len(set(mine)) <= slots
        for src, dst in out.state_copies:  # copies go between distinct slots of the pool
            assert src != dst and 0 <= src < slots and 0 <= dst < slots
        sampled = {s.request.request_id: (sum(s.request.all_token_ids) % 4) + 3 for s in out.scheduled if s.samples}
        for r in sched.update(out, sampled):
            finished.add(r.request_id)
        manager.check_invariants()
    assert not sched.has_work(), "some request never ended"
    assert finished | aborted == set(all_reqs)
    assert manager.in_use == 0, "blocks or state slots leaked"


def test_sliding_group_holds_only_the_window():
    """A long request keeps about window / block_size blocks in its sliding group, while the full
    group grows with the context; the freed blocks go back to the pool (still cached)."""
    bs, w = 4, 8
    manager = KVCacheManager(bs, [(FULL, 64), (sliding(w), 8)], enable_prefix_caching=True)
    sched = Scheduler(manager, 16, 4, 256)
    r = Request("a", list(range(100)), SamplingParams(max_tokens=20), 20)
    sched.add_request(r)
    peak = 0
    while sched.has_work():
        out = sched.schedule()
        peak = max(peak, len(_held(manager, 1, r.group_block_ids[0])))
        sched.update(out, {s.request.request_id: 1 for s in out.scheduled if s.samples})
    assert len(r.output_token_ids) == 20
    # 120 tokens: the full group needed 30 blocks, the sliding one never more than the window
    # plus a 16-token chunk (two partial blocks).
    assert peak <= (w + 16) // bs + 2
    assert manager.in_use == 0


def test_state_prefix_hit_restores_the_snapshot():
    """The prompt's last block boundary ends a prefill chunk; its state is snapshotted; a second
    request with the same prompt starts there, restoring the snapshot into its own live slot."""
    bs = 4
    manager = KVCacheManager(bs, [(FULL, 32)], state_slots=4, enable_prefix_caching=True)
    sched = Scheduler(manager, 64, 2, 128)
    prompt = list(range(3, 21))  # 18 tokens: the boundary is 16
    a = Request("a", prompt, SamplingParams(max_tokens=2), 2)
    sched.add_request(a)
    out = sched.schedule()
    assert [s.num_tokens for s in out.scheduled] == [16]  # cut at the boundary
    sched.update(out, {})
    out = sched.schedule()
    assert out.state_copies and out.state_copies[0][0] == a.state_slot  # the snapshot, before the forward
    snap = out.state_copies[0][1]
    sched.update(out, {"a": 5})
    b = Request("b", prompt, SamplingParams(max_tokens=1), 1)
    sched.add_request(b)
    out = sched.schedule()
    (sb,) = [s for s in out.scheduled if s.request is b]
    assert b.num_cached_prompt_tokens == 16 and sb.num_tokens == 2
    assert (snap, b.state_slot) in out.state_copies and b.state_slot != a.state_slot
    assert manager.state.ref_cnt[snap] == 1  # held until the step that restores it has run
    sched.update(out, {"a": 5, "b": 6})
    assert manager.state.ref_cnt[snap] == 0 and snap in manager.state.free_queue
