"""Two-batch overlap: same greedy tokens as the plain path, and a schedule that really overlaps."""
from __future__ import annotations

import pytest

from expert_parallel.runtime.dispatch.base import Pending
from expert_parallel.runtime.dispatch.local import LocalDispatcher
from expert_parallel.runtime.overlap import split_pieces, split_point
from moe_serve import LLM, SamplingParams

PROMPTS = [[5, 77, 301, 42, 9], [9, 8, 7, 6, 5, 4, 3, 200, 100], [450], [33] * 23, [7, 8, 9]]


def test_split_balances_cost_and_cuts_sequences():
    assert split_point([0] * 10) == 5
    assert split_point([0] * 7) in (3, 4)
    assert split_point([]) == 0
    # Late positions cost more: the cut moves towards them.
    s = split_point(list(range(0, 8000, 100)))
    assert s > 40
    pieces = [("a", 0, 5, True), ("b", 10, 4, True), ("c", 3, 1, True)]
    a, b = split_pieces(pieces, 7)
    assert a == [("a", 0, 5, True), ("b", 10, 2, False)]
    assert b == [("b", 12, 2, True), ("c", 3, 1, True)]
    assert split_pieces(pieces, 0) == ([], pieces)
    assert split_pieces(pieces, 10) == (pieces, [])


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_overlap_gives_identical_tokens(checkpoints, arch):
    kw = dict(dtype="float32", kv_cache_memory=2 << 20, max_num_batched_tokens=13, show_progress=False)
    sp = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    plain = LLM(checkpoints[arch], **kw).generate([{"prompt_token_ids": p} for p in PROMPTS], sp)
    llm = LLM(checkpoints[arch], enable_overlap=True, overlap_min_tokens=1, **kw)
    splits = []
    orig = llm.engine.runner.model.forward_microbatches
    llm.engine.runner.model.forward_microbatches = lambda b, s: splits.append([x[0].numel() for x in b]) or orig(b, s)
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert any(min(s) > 0 for s in splits)
    single = llm.generate([{"prompt_token_ids": PROMPTS[3]}], sp)  # one sequence cut across A and B
    assert single[0].outputs[0].token_ids == plain[3].outputs[0].token_ids
    assert any(0 in s for s in splits)  # a one-token decode step leaves one micro-batch empty


class RecordingDispatcher(LocalDispatcher):
    """Logs when each communication starts and when its result is waited for."""

    def __init__(self, num_slots, events):
        super().__init__(num_slots)
        self.events = events

    def dispatch_async(self, x, ids, w, step):
        assert step.microbatch == self.current_mb and step.split  # the step tells the layer which half it is
        mb = self.current_mb
        self.events.append(("comm_start", mb))
        out = super().dispatch(x, ids, w, step)
        return Pending(lambda: self.events.append(("comm_end", mb)) or out)

    def combine_async(self, y, handle):
        mb = self.current_mb
        self.events.append(("comm_start", mb))
        out = super().combine(y, handle)
        return Pending(lambda: self.events.append(("comm_end", mb)) or out)


def test_schedule_overlaps_compute_with_the_other_micro_batch_communication(checkpoints):
    llm = LLM(checkpoints["qwen3_moe"], dtype="float32", kv_cache_memory=2 << 20, enable_overlap=True,
              overlap_min_tokens=1, show_progress=False)
    events: list[tuple[str, int]] = []
    ctx = llm.engine.moe_ctx
    rec = RecordingDispatcher(ctx.dispatcher.num_slots, events)

    def trace(event, mb, layer):
        rec.current_mb = mb
        if event == "experts":
            events.append(("compute", mb))

    ctx.dispatcher, ctx.trace = rec, trace
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=3))
    outstanding = {0: 0, 1: 0}
    overlapped = 0
    for kind, mb in events:
        if kind == "comm_start":
            outstanding[mb] += 1
        elif kind == "comm_end":
            outstanding[mb] -= 1
        elif outstanding[1 - mb] > 0:
            overlapped += 1  # this micro-batch's experts ran while the other's transfer was in flight
    computes = sum(1 for k, _ in events if k == "compute")
    assert computes > 0 and overlapped == computes, (overlapped, computes)
