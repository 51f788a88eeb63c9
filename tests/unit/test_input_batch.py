"""The persistent input batch against a from-scratch build of every step.

A real Scheduler and BlockAllocator (few blocks, so preemption happens) are driven by hypothesis
through random adds, steps, aborts and finishes; a fake step "samples" random tokens. After every
step the rows must hold exactly the requests' tokens and blocks, and the step tensors (ids,
positions, slot mapping, block tables, sequence lengths, query start locations, sampled rows and
their sampling parameters) must equal the plainest possible build from the Request objects.
"""
from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention.blocks import BlockAllocator
from expert_parallel.runtime.overlap import split_pieces, split_point
from moe_serve.input_batch import InputBatch, split_point_T
from moe_serve.request import Request, RequestStatus
from moe_serve.sampling_params import SamplingParams
from moe_serve.scheduler import Scheduler

VOCAB = 50
MAX_LEN = 24
EOS = 3


def random_params(rng: random.Random) -> SamplingParams:
    kw = {}
    if rng.random() < 0.5:
        kw.update(temperature=rng.choice([0.5, 1.0]), seed=rng.choice([None, rng.randrange(1 << 40)]))
    else:
        kw.update(temperature=0.0)
    if rng.random() < 0.3:
        kw.update(frequency_penalty=0.5, presence_penalty=-0.25, repetition_penalty=rng.choice([1.0, 1.5]))
    if rng.random() < 0.3:
        kw.update(logit_bias={rng.randrange(VOCAB): rng.uniform(-5, 5) for _ in range(rng.randint(1, 3))})
    if rng.random() < 0.3:
        kw.update(min_tokens=rng.randint(1, 4), stop_token_ids=[rng.randrange(VOCAB)], max_tokens=8)
    return SamplingParams(**kw)


def fresh_forward(sched_pieces, bs):
    """(ids, positions, slots, query_start_loc, seq_lens, block_tables) written plainly; block
    tables are as wide as the longest context's blocks (blocks allocated ahead past it are not read)."""
    ids, pos, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
    for req, start, n, _ in sched_pieces:
        for p in range(start, start + n):
            ids.append(req.all_token_ids[p])
            pos.append(p)
            slots.append(req.block_ids[p // bs] * bs + p % bs)
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
        tables.append(list(req.block_ids))
    width = max([1] + [-(-s // bs) for s in seq_lens])  # the blocks the longest context spans
    tables = [(t + [0] * width)[:width] for t in tables]
    return ids, pos, slots, qsl, seq_lens, tables


def check_rows(batch: InputBatch, out) -> None:
    scheduled = {s.request.request_id for s in out.scheduled}
    assert scheduled <= set(batch.row_of)
    for rid, row in batch.row_of.items():
        req = batch.req_at_row[row]
        assert req.request_id == rid and req.status == RequestStatus.RUNNING
        n, nb = int(batch.num_tokens_R[row]), int(batch.num_blocks_R[row])
        if rid in scheduled:  # synced this step: exactly the request's state
            assert n == req.num_tokens and nb == len(req.block_ids)
        assert batch.token_ids_RL[row, :n].tolist() == req.all_token_ids[:n]
        assert int(batch.num_prompt_R[row]) == req.num_prompt_tokens
        assert batch.block_table_RM[row].tolist() == req.block_ids[:nb] + [0] * (batch.max_blocks - nb)
        assert float(batch.sampling.temperature_R[row]) == req.params.temperature
    free = [r for r in range(len(batch.req_at_row)) if batch.req_at_row[r] is None]
    assert len(free) + len(batch.row_of) == len(batch.req_at_row)
    for r in free:
        assert int(batch.num_tokens_R[r]) == 0 and not batch.block_table_RM[r].any()
        assert int(batch.sampling.logprobs_R[r]) == -1 and not batch.sampling.bias_ids_RK[r].ge(0).any()


def check_step(batch: InputBatch, step, out, split: bool) -> None:
    bs = batch.block_size
    pieces = [(s.request, s.request.num_computed_tokens, s.num_tokens, s.samples) for s in out.scheduled]
    groups = [pieces]
    if split:
        groups = list(split_pieces(pieces, split_point([p for _, st, n, _ in pieces for p in range(st, st + n)])))
    assert len(step.batches) == len(groups)
    for (ids, pos, meta), g in zip(step.batches, groups):
        f_ids, f_pos, f_slots, f_qsl, f_seq, f_tables = fresh_forward(g, bs)
        assert ids.tolist() == f_ids and ids.dtype == torch.int64
        assert pos.tolist() == f_pos
        assert meta.slot_mapping.tolist() == f_slots
        assert meta.query_start_loc.tolist() == f_qsl and meta.query_start_loc.dtype == torch.int32
        assert meta.seq_lens.tolist() == f_seq and meta.seq_lens_cpu == f_seq
        assert meta.query_lens_cpu == [n for _, _, n, _ in g]
        if g:
            assert meta.block_tables.tolist() == f_tables
    # Sampled rows: indices into the packed tokens and their parameters.
    ends, sampled = [], []
    total = 0
    for req, _, n, samples in pieces:
        total += n
        if samples:
            ends.append(total - 1)
            sampled.append(req)
    if not sampled:
        assert step.sampling is None
        return
    assert step.logits_indices_S.tolist() == ends
    md = step.sampling
    if md.temperature_S is not None:
        assert md.temperature_S.tolist() == [r.params.temperature for r in sampled]
    want_seeded = [i for i, r in enumerate(sampled) if r.params.temperature > 0 and r.params.seed is not None]
    assert (md.seeded_Q.tolist() if md.seeded_Q is not None else []) == want_seeded
    if want_seeded:
        assert md.out_pos_Q.tolist() == [sampled[i].num_output_tokens for i in want_seeded]
    want_bias = sorted((i * VOCAB + t, b) for i, r in enumerate(sampled) for t, b in (r.params.logit_bias or {}).items())
    got_bias = sorted(zip(md.bias_index_N.tolist(), md.bias_value_N.tolist())) if md.bias_index_N is not None else []
    assert [i for i, _ in got_bias] == [i for i, _ in want_bias]
    assert all(abs(a - b) < 1e-6 for (_, a), (_, b) in zip(got_bias, want_bias))
    want_ban = sorted(i * VOCAB + t for i, r in enumerate(sampled) if r.num_output_tokens < r.params.min_tokens
                      for t in set(r.params.stop_token_ids) | ({EOS} if not r.params.ignore_eos else set()))
    assert sorted(md.banned_index_M.tolist() if md.banned_index_M is not None else []) == want_ban
    want_pen = [i for i, r in enumerate(sampled) if r.params.has_penalties]
    assert (md.penalized_P.tolist() if md.penalized_P is not None else []) == want_pen
    for k, i in enumerate(want_pen):
        n = sampled[i].num_tokens
        assert md.tokens_PL[k, :n].tolist() == sampled[i].all_token_ids
        assert int(md.num_tokens_P[k]) == n and int(md.prompt_lens_P[k]) == sampled[i].num_prompt_tokens


ops_st = st.lists(st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "abort", "finish"]),
                            st.integers(0, 1 << 30)), min_size=1, max_size=80)


@settings(max_examples=120, deadline=None)
@given(ops=ops_st, block_size=st.sampled_from([1, 2, 4]), extra_blocks=st.integers(0, 6),
       budget=st.integers(1, 20), max_seqs=st.integers(1, 5), prefix=st.booleans(), seed=st.integers(0, 1 << 20))
def test_persistent_batch_matches_fresh_build(ops, block_size, extra_blocks, budget, max_seqs, prefix, seed):
    rng = random.Random(seed)
    alloc = BlockAllocator(-(-MAX_LEN // block_size) + extra_blocks, block_size, enable_prefix_caching=prefix)
    sched = Scheduler(alloc, budget, max_seqs, MAX_LEN)
    batch = InputBatch(max_seqs, MAX_LEN, block_size, VOCAB)
    next_id = 0
    for op, x in ops + [("step", i) for i in range(40)]:  # then drain
        live = sorted(sched.requests)
        if op == "add":
            # Reuse a finished id now and then: the batch must not mistake the new request for the old.
            rid = str(next_id if x % 5 else max(0, next_id - 1))
            if rid in sched.requests:
                rid = str(next_id)
            next_id += 1
            prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 16))]
            params = random_params(rng)
            max_new = min(params.max_tokens, MAX_LEN - len(prompt))
            sched.add_request(Request(rid, prompt, params, max_new, frozenset([EOS])))
        elif op in ("abort", "finish") and live:
            rid = live[x % len(live)]
            if op == "abort":
                sched.abort_request(rid)
            else:
                sched.finish_request(rid, RequestStatus.FINISHED_STOPPED)
        elif op == "step":
            out = sched.schedule()
            if out.is_empty:
                continue  # an engine runs nothing: what changed must reach the next step instead
            pieces = batch.update(out)
            check_rows(batch, out)
            split = x % 3 == 0
            step = batch.prepare(pieces, split=split)
            check_step(batch, step, out, split)
            sampled = {s.request.request_id: rng.choice([EOS, rng.randrange(VOCAB)]) for s in out.scheduled if s.samples}
            sched.update(out, sampled)


def test_preemption_happens_in_the_property_test_setting():
    """The capacities above do preempt (so the property test covers re-added rows)."""
    alloc = BlockAllocator(6, 4, enable_prefix_caching=False)
    sched = Scheduler(alloc, 20, 4, MAX_LEN)
    batch = InputBatch(4, MAX_LEN, 4, VOCAB)
    for i in range(3):
        sched.add_request(Request(str(i), [5 + i] * 7, SamplingParams(temperature=0, max_tokens=12), 12))
    seen_preempted = False
    for _ in range(60):
        out = sched.schedule()
        if out.is_empty:
            break
        seen_preempted |= bool(out.preempted_req_ids)
        step = batch.prepare(batch.update(out))
        check_rows(batch, out)
        check_step(batch, step, out, False)
        sched.update(out, {s.request.request_id: 9 for s in out.scheduled if s.samples})
    assert seen_preempted and not sched.has_work()
    # The last finishes reach the batch with the next step that schedules anything.
    assert all(batch.req_at_row[row].is_finished for row in batch.row_of.values())


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.tuples(st.integers(0, 9000), st.integers(1, 40)), max_size=12))
def test_tensor_split_point_equals_overlap_split_point(pieces):
    positions = [p for start, n in pieces for p in range(start, start + n)]
    assert split_point_T(torch.tensor(positions, dtype=torch.int64)) == split_point(positions)


def test_staging_packs_and_unpacks_every_dtype_and_shape():
    """The one-copy packing (forced on here: on the CPU it is normally skipped) returns the same
    values, dtypes and shapes, and grows its buffer when a step needs more."""
    from moe_serve.staging import HostToDevice

    h2d = HostToDevice("cpu", initial_numel=4)
    h2d.on_cpu, h2d._buf = False, h2d._alloc(4)
    tensors = [torch.arange(6, dtype=torch.int64).view(2, 3), None, torch.tensor([-1, 2**31 - 1], dtype=torch.int32),
               torch.tensor([0.5, -1e-8, 3.25], dtype=torch.float32), torch.zeros((0, 1), dtype=torch.int32),
               torch.tensor([True, False]), torch.tensor([-(2**40)], dtype=torch.int64)]
    for _ in range(2):  # the second round reuses the grown buffer
        out = h2d(tensors)
        assert out[1] is None
        for a, b in zip(tensors, out):
            if a is not None:
                assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
