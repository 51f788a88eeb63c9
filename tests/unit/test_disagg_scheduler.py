"""The decode side's reservations under the scheduler, without a model, and the byte ranges a
prefill side writes: hypothesis picks the workload, the cache groups (full, sliding, state), and
whether each prompt's KV arrives, fails, is aborted while on its way, or is given up on while the
write may still land ("late": computed here in other blocks, the reserved ones out of use until the
write is said to have ended). Invariants hold at every step and nothing stays held at the end; a
reserved request resumes exactly at its prompt's last token; the ranges copy exactly the blocks
asked for."""
from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from attention.cache_kinds import FULL, sliding
from attention.kv_manager import KVCacheManager
from moe_serve.disagg.connector import LayoutMismatch, transfer_ranges
from moe_serve.protocol import CacheLayout, KVTarget
from moe_serve.request import Request
from moe_serve.sampling_params import SamplingParams
from moe_serve.scheduler import Scheduler

reqs_st = st.lists(st.tuples(st.lists(st.integers(3, 40), min_size=1, max_size=40),  # prompt
                             st.integers(1, 6),  # max new tokens
                             st.sampled_from(["ok", "fail", "abort", "local", "late"]),  # what happens to its KV
                             st.integers(0, 3),  # steps until the answer comes
                             st.integers(0, 6)),  # "late": steps after that until its write has ended
                   min_size=1, max_size=10)


@settings(max_examples=120, deadline=None)
@given(reqs=reqs_st, block_size=st.sampled_from([2, 4, 8]), window=st.sampled_from([None, 5, 9]),
       state=st.booleans(), prefix=st.booleans(), budget=st.integers(1, 24), max_seqs=st.integers(1, 6),
       extra=st.integers(0, 12))
# Found by a random run: with a one-token budget, a request preempted for blocks went back ahead of
# one that held its received prompt, took the budget, ran out of blocks again, and so on for ever.
@example(reqs=[([3] * 25, 1, "ok", 0, 0), ([3] * 21, 5, "ok", 0, 0)], block_size=2, window=None, state=False,
         prefix=False, budget=1, max_seqs=2, extra=0)
def test_reservations_never_leak(reqs, block_size, window, state, prefix, budget, max_seqs, extra):
    max_len = 48
    full = -(-max_len // block_size) + 1 + extra
    groups = [(FULL, full)] + ([(sliding(window), -(-(window + budget) // block_size) + 2 + extra)] if window else [])
    kv = KVCacheManager(block_size, groups, state_slots=(max_seqs + 2) if state else 0, enable_prefix_caching=prefix)
    sched = Scheduler(kv, budget, max_seqs, max_len)
    fate, answer_in, end_in = {}, {}, {}
    for i, (prompt, max_new, what, delay, end) in enumerate(reqs):
        r = Request(str(i), prompt, SamplingParams(max_tokens=max_new), max_new)
        if what != "local":
            r.kv_role, r.kv_end = "decode", len(prompt) - 1
        sched.add_request(r)
        fate[str(i)], answer_in[str(i)], end_in[str(i)] = what, delay, end
    pending: dict[str, int] = {}  # reserved: steps until the prefill side answers
    landing: dict[str, tuple[int, list[set[int]]]] = {}  # "late": steps until the write ends; its blocks
    for _ in range(3000):
        if not (sched.has_work() or pending or landing):
            break
        for rid in list(landing):
            steps, held = landing[rid]
            if steps > 0:
                landing[rid] = (steps - 1, held)
                continue
            del landing[rid]
            assert sched.kv_done(rid, False, ended=True) is None
        for rid in list(pending):
            if pending[rid] > 0:
                pending[rid] -= 1
                continue
            del pending[rid]
            if fate[rid] == "abort":
                assert sched.abort_request(rid) is not None
                assert kv.in_use > 0  # held for the writer
            if fate[rid] == "late":  # this side stops waiting: the write may still land in its blocks
                r = sched.requests[rid]  # the blocks the write targets (not its prefix hits, which stay shared)
                held = [set(t[r.num_computed_tokens // block_size:]) - {kv.null_block(g)}
                        for g, t in enumerate(kv.tables(r))]
                req = sched.kv_done(rid, False, ended=False)
                assert req is not None and req.num_computed_tokens == 0 and not req.block_ids
                landing[rid] = (end_in[rid], held)
                continue
            req = sched.kv_done(rid, fate[rid] == "ok")
            if req is not None and fate[rid] == "ok":
                assert req.num_computed_tokens == req.num_prompt_tokens - 1
        out = sched.schedule()
        for req in sched.take_kv_reserved():
            tables = kv.tables(req)
            assert len({len(t) for t in tables}) == 1
            assert len(tables[0]) * block_size >= req.num_prompt_tokens  # room for the last prompt token
            assert req.num_computed_tokens < req.kv_end and req.num_computed_tokens % block_size == 0
            pending[req.request_id] = answer_in[req.request_id]
        assert out.num_batched_tokens <= budget
        assert len(sched.running) + len(sched.awaiting_kv) <= max_seqs
        for s in out.scheduled:
            assert s.request.kv_role is None  # never computed while its KV is on its way
        for _, held in landing.values():  # blocks a write may still land in: nobody else's
            for r in list(sched.running) + list(sched.waiting) + list(sched.awaiting_kv.values()):
                for g, t in enumerate(kv.tables(r)):
                    assert not held[g] & set(t), (r.request_id, held[g] & set(t))
        sampled = {s.request.request_id: 1 for s in out.scheduled if s.samples}
        sched.update(out, sampled)
        kv.check_invariants()
    assert not sched.has_work() and not pending and not landing and sched.num_kv_held == 0
    assert kv.in_use == 0
    kv.check_invariants()


def _layout(bases, strides, state=()):
    return CacheLayout("nixl", b"", "sig", [list(zip(b, s)) for b, s in zip(bases, strides)], list(state))


def test_ranges_copy_the_asked_blocks_and_merge_runs():
    src = _layout([[1000, 5000]], [[10, 20]], [(90000, 7)])
    dst = _layout([[200000, 300000]], [[10, 20]], [(400000, 7)])
    # The decode side lacks logical blocks 2..5 (start = 2 blocks of 4); its block ids 7, 8, 9, 3.
    target = KVTarget(dst, 8, 23, [[7, 8, 9, 3]], state_slot=2)
    src_tables = [[0, 1, 4, 5, 6, 11]]
    local, remote, n = transfer_ranges(src, src_tables, [99], 3, target, 4)
    # tensor 0: src blocks 4,5,6 -> dst 7,8,9 merge into one run; 11 -> 3 alone; same for tensor 1; the state slot.
    assert local == [(1040, 30), (1110, 10), (5080, 60), (5220, 20), (90021, 7)]
    assert remote == [(200070, 30), (200030, 10), (300140, 60), (300060, 20), (400014, 7)]
    assert n == sum(k for _, k in local)


def test_ranges_refuse_what_cannot_be_sent():
    import pytest

    src = _layout([[0]], [[8]])
    with pytest.raises(LayoutMismatch):
        transfer_ranges(src, [[0, 1]], [9], None, KVTarget(CacheLayout("nixl", b"", "other", [[(0, 8)]]), 0, 3,
                                                               [[0]]), 4)
    with pytest.raises(ValueError, match="not held here"):  # a windowed block this side gave back
        transfer_ranges(src, [[9, 1]], [9], None, KVTarget(_layout([[0]], [[8]]), 0, 7, [[4, 5]]), 4)


def test_paced_pieces_cover_the_write_in_order():
    """The test pacing's pieces (MOE_SERVE_TEST_KV_WRITE_PACE) move exactly the write's bytes."""
    from moe_serve.disagg.connector import split_ranges

    local, remote = [(1000, 7), (2000, 5), (3000, 1)], [(9000, 7), (8000, 5), (7000, 1)]
    for pieces in (1, 2, 3, 5, 13, 40):
        got = split_ranges(local, remote, pieces)
        assert 1 <= len(got) <= pieces
        flat_l = [a + k for ls, _ in got for a, n in ls for k in range(n)]
        flat_r = [a + k for _, rs in got for a, n in rs for k in range(n)]
        assert flat_l == [a + k for a, n in local for k in range(n)]
        assert flat_r == [a + k for a, n in remote for k in range(n)]
        assert max(sum(n for _, n in ls) for ls, _ in got) - min(sum(n for _, n in ls) for ls, _ in got) <= \
            -(-13 // pieces)
