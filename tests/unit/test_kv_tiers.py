"""KV tiers below the device pool (moe_serve/kv_offload, attention/tier_prefix.py), driven without a
model: the real scheduler, cache manager and tier feature over real cache tensors (FP8 and
bfloat16 and float32, copied as bytes), and a fake forward that, for every position a request
reads, checks the bytes its blocks hold against an independent oracle (a hash of the tokens up to
that position) before stamping the positions it computes. So a block restored from a tier with
one wrong byte, a block restored under the wrong hash or filled after the forward, a state
snapshot restored wrong, all fail here. Hypothesis picks multi-turn workloads under eviction
pressure, preemption and shared prefixes, the tiers and their sizes, and failing disks."""
from __future__ import annotations

import errno
import hashlib
import random
import struct

import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from attention.cache_kinds import FULL, STATE, sliding
from attention.kv_manager import KVCacheManager
from moe_serve.engine.features.kv_offload import KVOffload
from moe_serve.kv_offload import resolve_kv_offload
from moe_serve.kv_offload.disk import DiskTier
from moe_serve.kv_offload.store import TierStore
from moe_serve.request import Request
from moe_serve.sampling_params import SamplingParams
from moe_serve.scheduler import Scheduler

WINDOW = 5


def stamp(tokens: list[int], n: int, size: int, salt: bytes = b"") -> torch.Tensor:
    """The oracle: `size` bytes that only the tokens 0 .. n - 1 determine."""
    d = hashlib.blake2b(struct.pack(f"<{n}q", *tokens[:n]) + salt, digest_size=size).digest()
    return torch.frombuffer(bytearray(d), dtype=torch.uint8)


class FakeModel:
    """Cache tensors per group (and a state pool), written and checked like a forward would."""

    def __init__(self, kv: KVCacheManager, bs: int, device: str = "cpu"):
        self.kv, self.bs = kv, bs
        n = [a.num_blocks + 1 for a in kv.allocs]
        self.groups = [[torch.zeros(n[0], bs, 4, dtype=torch.float8_e4m3fn, device=device),
                        torch.zeros(n[0], bs, 2, dtype=torch.bfloat16, device=device)]]
        if len(kv.allocs) > 1:
            self.groups.append([torch.zeros(n[1], bs, 1, dtype=torch.float32, device=device)])
        self.state = [torch.zeros(kv.state.num_blocks + 1, 2, dtype=torch.float32, device=device)] if kv.state else []

    def pools(self):
        return self.groups + ([self.state] if self.state else [])

    @staticmethod
    def _u8(t):
        return t.view(t.shape[0], -1).view(torch.uint8)

    def step(self, out) -> None:
        for src, dst in out.state_copies:
            self.state[0][dst] = self.state[0][src]
        for s in out.scheduled:
            self._piece(s.request, s.num_tokens)

    def _piece(self, req, n: int) -> None:
        tokens, c, bs = req.all_token_ids, req.num_computed_tokens, self.bs
        tables = self.kv.tables(req)
        for g, tensors in enumerate(self.groups):
            lo = self.kv.kinds[g].first_needed(c)
            for j, t in enumerate(tensors):
                u8 = self._u8(t)
                for p in range(lo, c):  # what attention reads: restored or computed, it must be right
                    got = u8[tables[g][p // bs], (p % bs) * 4:(p % bs + 1) * 4].cpu()
                    assert torch.equal(got, stamp(tokens, p + 1, 4, bytes([g, j]))), (req.request_id, g, j, p)
                for p in range(c, c + n):
                    u8[tables[g][p // bs], (p % bs) * 4:(p % bs + 1) * 4] = stamp(tokens, p + 1, 4, bytes([g, j]))
        if self.state:
            u8 = self._u8(self.state[0])
            if c:  # the state after c tokens: restored from a snapshot (device or tier) or computed
                assert torch.equal(u8[req.state_slot].cpu(), stamp(tokens, c, 8)), (req.request_id, c)
            u8[req.state_slot] = stamp(tokens, c + n, 8)


def make(bs: int, blocks: int, kinds: str, store: TierStore | None, budget: int, seqs: int, max_len: int,
         device: str = "cpu"):
    groups = [(FULL, blocks)] + ([(sliding(WINDOW), blocks)] if "sliding" in kinds else [])
    kv = KVCacheManager(bs, groups, state_slots=max(seqs + 1, 3) if "state" in kinds else 0)
    sched = Scheduler(kv, budget, seqs, max_len)
    model = FakeModel(kv, bs, device)
    feature = KVOffload(sched, model.pools(), store) if store is not None else None
    return sched, model, feature


def run_turns(sched, model, feature, convs: list[list[int]], turns: int, new_tokens: int, max_new: int,
              seed: int) -> tuple[list[list[int]], int]:
    """Each conversation's outputs per turn, and the prompt tokens computed (the misses)."""
    rng = random.Random(seed)
    outs, computed = [], 0
    for turn in range(turns):
        for i, c in enumerate(convs):
            sched.add_request(Request(f"{turn}-{i}", list(c), SamplingParams(max_tokens=max_new), max_new,
                                      frozenset()))
        done = {}
        for _ in range(20000):
            if not sched.has_work():
                break
            out = sched.schedule()
            if feature is not None:
                feature.after_schedule(out)
            for s in out.scheduled:
                r = s.request
                computed += max(0, min(s.num_tokens, r.num_prompt_tokens - r.num_computed_tokens))
            model.step(out)
            sampled = {s.request.request_id: 3 + len(s.request.all_token_ids) * 7 % 31
                       for s in out.scheduled if s.samples}
            for r in sched.update(out, sampled):
                done[r.request_id] = r
        assert not sched.has_work(), "the workload did not finish"
        if feature is not None:  # every write done: the next turn's disk hits are read in the background
            feature.store.flush()
        for i, c in enumerate(convs):
            r = done[f"{turn}-{i}"]
            outs.append(list(r.output_token_ids))
            c += r.output_token_ids + [rng.randrange(3, 40) for _ in range(new_tokens)]
    assert sched.kv.in_use == 0
    sched.kv.check_invariants()
    return outs, computed


class FlakyOpen:
    """The disk tier's open, failing every `every`-th call: ENOSPC on writes, EIO on reads."""

    def __init__(self, every: int):
        self.every, self.calls = every, 0

    def __call__(self, path, mode="r"):
        self.calls += 1
        if self.every and self.calls % self.every == 0:
            raise OSError(errno.ENOSPC if "w" in mode else errno.EIO, "injected", path)
        return open(path, mode)


tiers_st = st.sampled_from(["host", "disk", "host+disk"])


@settings(max_examples=60, deadline=None, derandomize=True)
# A snapshot taken in one step and copied before the next forward, whose slot or live slot a tier
# restore in between takes: the copy must land first.
@example(convs=[[3, 3, 3, 3], [3, 3, 3, 3], [3, 3, 3, 3, 3]], turns=3, new_tokens=2, max_new=5, bs=4, extra=1,
         budget=24, seqs=3, kinds="full+state", tiers="host", tier_blocks=3, flaky=0, seed=0)
@given(convs=st.lists(st.lists(st.integers(3, 40), min_size=4, max_size=14), min_size=2, max_size=6),
       turns=st.integers(2, 3), new_tokens=st.integers(0, 6), max_new=st.integers(1, 5),
       bs=st.sampled_from([2, 4]), extra=st.integers(0, 4), budget=st.integers(2, 24), seqs=st.integers(1, 4),
       kinds=st.sampled_from(["full", "full+sliding", "full+state", "full+sliding+state"]), tiers=tiers_st,
       tier_blocks=st.integers(1, 40), flaky=st.sampled_from([0, 0, 2, 3]), seed=st.integers(0, 9))
def test_restored_blocks_are_byte_exact_and_outputs_unchanged(tmp_path_factory, convs, turns, new_tokens, max_new, bs,
                                                              extra, budget, seqs, kinds, tiers, tier_blocks, flaky,
                                                              seed):
    max_len = 14 + turns * (max_new + new_tokens) + 1
    blocks = -(-max_len // bs) + 1 + extra  # one request always fits: the pool is what forces evictions
    block_bytes = bs * 8
    store = TierStore(tier_blocks * block_bytes if "host" in tiers else 0,
                      str(tmp_path_factory.mktemp("tier")) if "disk" in tiers else None, tier_blocks * block_bytes)
    if store.disk is not None and flaky:
        store.disk.open = FlakyOpen(flaky)
    try:
        plain = run_turns(*make(bs, blocks, kinds, None, budget, seqs, max_len), [list(c) for c in convs], turns,
                          new_tokens, max_new, seed)
        tiered = run_turns(*make(bs, blocks, kinds, store, budget, seqs, max_len), [list(c) for c in convs],
                           turns, new_tokens, max_new, seed)
    finally:
        store.shutdown()
    event(f"tier hits: {bool(store.hits['host'] + store.hits['disk'])}")
    assert tiered[0] == plain[0]
    # Fewer prompt tokens computed with a tier, one sequence at a time. With several at once,
    # preemptions may differ either way; with state snapshots, a restored snapshot takes one of the
    # few state slots and can push out another prompt's snapshot that plain recomputation would
    # have kept (a host tier of one block, 3 slots: 30 tokens against 28), a replacement effect.
    assert tiered[1] <= plain[1] or seqs > 1 or "state" in kinds


def expected_misses(convs: list[list[int]], turns: int, new_tokens: int, max_new: int, bs: int) -> int:
    """Prompt tokens a run computes when every full block of every earlier turn is found again: a
    turn's prompt extends the last one's context, whose full blocks (of its computed tokens: the
    prompt and all but the last output token) were registered."""
    total = 0
    for c in convs:
        n, prev = len(c), 0
        for _ in range(turns):
            hit = min(prev // bs, (n - 1) // bs)
            total += n - hit * bs
            prev = n + max_new - 1
            n += max_new + new_tokens
    return total


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
@pytest.mark.parametrize("tiers", ["host", "disk", "host+disk"])
@pytest.mark.parametrize("kinds", ["full", "full+sliding"])
def test_prompt_tokens_computed_fall_to_the_misses(tmp_path, tiers, kinds, device):
    """A working set ten times the device pool, one request at a time: with tiers that hold it all
    every earlier turn's blocks come back, and only the rest is computed; without, nearly all is.
    On a GPU the device -> host gathers and host -> device scatters are the CUDA ones."""
    bs, turns, new_tokens, max_new = 4, 3, 6, 4
    rng = random.Random(5)
    convs = [[rng.randrange(3, 40) for _ in range(rng.randrange(10, 20))] for _ in range(10)]
    max_len = 20 + turns * (max_new + new_tokens)
    blocks = -(-max_len // bs) + 1  # one conversation's context: a tenth of the working set
    store = TierStore(1 << 20 if "host" in tiers else 0, str(tmp_path) if "disk" in tiers else None, 1 << 20)
    try:
        plain = run_turns(*make(bs, blocks, kinds, None, 16, 1, max_len, device), [list(c) for c in convs], turns,
                          new_tokens, max_new, 0)
        sched, model, feature = make(bs, blocks, kinds, store, 16, 1, max_len, device)
        tiered = run_turns(sched, model, feature, [list(c) for c in convs], turns, new_tokens, max_new, 0)
    finally:
        store.shutdown()
    assert tiered[0] == plain[0]
    assert tiered[1] == expected_misses(convs, turns, new_tokens, max_new, bs) < plain[1] * 0.6
    stats = feature.stats()
    # The host tier (1 MiB) holds the whole working set: with it, the disk below is never read.
    assert (stats.host_hits > 0) == ("host" in tiers) and (stats.disk_hits > 0) == (tiers == "disk")
    assert (stats.read_waits > 0) == (tiers == "disk")  # a disk hit is read in the background first
    if kinds == "full":  # 8 bytes a position: FP8 (4 values) and bfloat16 (2)
        assert stats.host_restored_bytes + stats.disk_restored_bytes == (stats.host_hits + stats.disk_hits) * bs * 8


@pytest.mark.parametrize("fail_every", [1, 2])
def test_a_disk_that_fails_loses_blocks_not_requests(tmp_path, caplog, fail_every):
    """Every (or every other) write fails with ENOSPC and read with EIO: the outputs are those of a
    run without tiers, the failures are counted and logged once per kind."""
    bs, turns = 4, 3
    rng = random.Random(2)
    convs = [[rng.randrange(3, 40) for _ in range(12)] for _ in range(6)]
    store = TierStore(0, str(tmp_path), 1 << 20)
    store.disk.open = FlakyOpen(fail_every)
    try:
        plain = run_turns(*make(bs, 12, "full", None, 16, 2, 60), [list(c) for c in convs], turns, 4, 4, 1)
        sched, model, feature = make(bs, 12, "full", store, 16, 2, 60)
        with caplog.at_level("WARNING", logger="moe_serve.kv_offload"):
            tiered = run_turns(sched, model, feature, [list(c) for c in convs], turns, 4, 4, 1)
    finally:
        store.shutdown()
    assert tiered[0] == plain[0]
    stats = feature.stats()
    assert stats.disk_errors > 0
    if fail_every == 1:  # no file was ever written, so none was read (a write's bytes may serve a hit)
        assert stats.read_waits == 0 and stats.disk_used_bytes == 0
    warnings = [r.getMessage() for r in caplog.records if "KV disk tier" in r.getMessage()]
    assert 1 <= len(warnings) <= 2  # one per kind: a write's ENOSPC, a read's EIO


def test_a_small_disk_keeps_its_budget_least_recently_used_out(tmp_path):
    block = torch.arange(64, dtype=torch.uint8)
    disk = DiskTier(str(tmp_path), 64 * 3)
    try:
        for i in range(5):
            disk.put((0, bytes([i])), block + i)
        disk.flush()  # the writes are done
        assert disk.used == 64 * 3 and sorted(k[1][0] for k in disk.index) == [2, 3, 4]
        assert {k[1][0] for k in disk.take_lost()} == {0, 1}
        assert disk.find((0, bytes([0]))) is False
        assert disk.find((0, bytes([3]))) is None  # a read is under way
        disk.reading()[0].result()
        assert torch.equal(disk.find((0, bytes([3]))), block + 3)
        import os
        assert len(os.listdir(disk.dir)) == 3
    finally:
        disk.shutdown()
    assert not (tmp_path / disk.dir).exists()


def test_flags_are_checked_naming_them(tmp_path):
    assert resolve_kv_offload(None, None, None, True) is None
    cfg = resolve_kv_offload(0.5, str(tmp_path), 2, True)
    assert cfg.host_bytes == 1 << 29 and cfg.disk_bytes == 2 << 30 and cfg.disk_path == str(tmp_path)
    for args, flag in [((-1, None, None, True), "--kv-offloading-size"),
                       ((None, None, 1.0, True), "--kv-offloading-disk-size"),
                       ((None, str(tmp_path), None, True), "--kv-offloading-disk"),
                       ((None, str(tmp_path), 0, True), "--kv-offloading-disk-size"),
                       ((None, str(tmp_path / "nope"), 1, True), "--kv-offloading-disk"),
                       ((1.0, None, None, False), "--no-enable-prefix-caching")]:
        with pytest.raises(ValueError, match=flag):
            resolve_kv_offload(*args)


def test_routing_keeps_a_tiered_prefix_held_until_it_leaves_every_tier():
    """An evicted block kept in a tier is still reported as held (cache-aware routing counts it);
    once the tier drops it too, the loss is reported."""
    bs = 2
    store = TierStore(2 * bs * 8, None, 0)  # room for two blocks
    sched, model, feature = make(bs, 6, "full", store, 16, 1, 12)
    sched.alloc.track_events()
    run_turns(sched, model, feature, [[5, 6, 7, 8, 9]], 1, 0, 1, 0)
    first, removed = sched.alloc.take_events()
    assert len(first) == 2 and not removed
    # Evicts the first request's two blocks into the host tier: still held.
    run_turns(sched, model, feature, [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]], 1, 0, 1, 0)
    second, removed = sched.alloc.take_events()
    assert len(second) == 5 and not removed
    # Evicts the second's five: the tier keeps two of them and drops the first's and three others.
    run_turns(sched, model, feature, [[22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]], 1, 0, 1, 0)
    third, removed = sched.alloc.take_events()
    assert len(third) == 5 and len(removed) == 5 and set(first) <= set(removed)
    assert len(set(second) - set(removed)) == 2


def test_metrics_report_each_tier_per_rank_from_the_decoded_stats():
    """The front end gets the feature's stats as a plain dict (msgpack): /metrics shows them per tier."""
    import msgspec

    from moe_serve.engine.features.kv_offload import KVOffloadStats
    from moe_serve.metrics import EngineMetrics
    from moe_serve.protocol import EngineStats

    sent = EngineStats(features={"kv_offload": KVOffloadStats(host_hits=3, disk_hits=5, disk_restored_bytes=7,
                                                              restore_seconds=0.5, disk_errors=2)})
    got = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=EngineStats)
    text = EngineMetrics().render("m", got, [EngineStats(), got])
    for line in ['moe_serve:kv_offload_hits_total{model_name="m",rank="1",tier="host"} 3',
                 'moe_serve:kv_offload_hits_total{model_name="m",rank="1",tier="disk"} 5',
                 'moe_serve:kv_offload_hits_total{model_name="m",rank="0",tier="disk"} 0',
                 'moe_serve:kv_offload_restored_bytes_total{model_name="m",rank="1",tier="disk"} 7',
                 'moe_serve:kv_offload_restore_seconds_total{model_name="m",rank="1"} 0.5',
                 'moe_serve:kv_offload_disk_errors_total{model_name="m",rank="1"} 2']:
        assert line in text.splitlines(), line


@pytest.mark.parametrize("tiers", ["host", "disk"])
def test_forgetting_the_prefixes_empties_the_tiers(tmp_path, tiers):
    """New weights (forget_prefixes): nothing the tiers kept is restored afterwards, and routing
    hears every tiered prefix is gone."""
    bs = 4
    rng = random.Random(3)
    convs = [[rng.randrange(3, 40) for _ in range(12)] for _ in range(6)]
    store = TierStore(1 << 20 if tiers == "host" else 0, str(tmp_path) if tiers == "disk" else None, 1 << 20)
    try:
        sched, model, feature = make(bs, 8, "full", store, 16, 1, 40)
        sched.alloc.track_events()
        run_turns(sched, model, feature, [list(c) for c in convs], 1, 0, 2, 0)
        added, _ = sched.alloc.take_events()
        sched.forget_prefixes(live=False)
        feature.after_schedule(sched.schedule())  # a turn with nothing to run: the losses are reported
        _, removed = sched.alloc.take_events()
        before = store.hits["host"] + store.hits["disk"]
        _, computed = run_turns(sched, model, feature, [list(c) for c in convs], 1, 0, 2, 0)
    finally:
        store.shutdown()
    assert set(added) == set(removed) and len(added) > 8  # more than the device held: tiers held the rest
    assert store.hits["host"] + store.hits["disk"] == before
    assert computed == sum(len(c) for c in convs)  # all recomputed: nothing stale came back


def test_a_decode_instance_counts_tier_blocks_as_cached():
    """Disaggregated decode side: a prompt whose prefix was evicted to the host tier reserves
    blocks only past it (the prefill instance writes the rest), and the restored blocks hold the
    prefix's bytes before anything reads them."""
    bs = 4
    store = TierStore(1 << 20, None, 0)
    sched, model, feature = make(bs, 8, "full", store, 16, 1, 32)
    prompt = list(range(3, 23))  # five full blocks
    run_turns(sched, model, feature, [list(prompt)], 1, 0, 1, 0)
    run_turns(sched, model, feature, [list(range(100, 128))], 1, 0, 1, 0)  # seven blocks: evicts the first's
    assert store.host.used > 0
    r = Request("d", prompt + [50, 51], SamplingParams(max_tokens=2), 2, frozenset())
    r.kv_role, r.kv_end = "decode", len(r.prompt_token_ids) - 1
    sched.add_request(r)
    feature.after_schedule(sched.schedule())
    assert sched.take_kv_reserved() == [r] and r.num_computed_tokens == 20
    assert store.hits["host"] >= 1
    model._piece(r, 1)  # the prefill instance's write of position 20; checks positions 0 .. 19 first
    assert sched.kv_done("d", True) is r and r.num_computed_tokens == r.kv_end
    for _ in range(10):  # the last prompt token and the decode, reading everything restored or written
        out = sched.schedule()
        feature.after_schedule(out)
        model.step(out)
        if sched.update(out, {s.request.request_id: 7 for s in out.scheduled if s.samples}):
            break
    assert r.is_finished and len(r.output_token_ids) == 2 and sched.kv.in_use == 0


def test_cli_flags_are_the_llm_keywords(tmp_path):
    import argparse

    from moe_serve.engine.args import EngineArgs

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    ns = p.parse_args(["--kv-offloading-size", "0.5", "--kv-offloading-disk", str(tmp_path),
                       "--kv-offloading-disk-size", "2"])
    args = EngineArgs.from_cli(ns, "m")
    assert (args.kv_offloading_size, args.kv_offloading_disk, args.kv_offloading_disk_size) == (0.5, str(tmp_path), 2.0)
    assert EngineArgs("m").kv_offloading_size is None and EngineArgs("m").kv_offloading_disk is None
