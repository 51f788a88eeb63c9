"""KV tiers through the offline `LLM` on tiny checkpoints: a multi-turn workload whose working set is
ten times the device pool gives the same greedy tokens with no tier, a host tier and a disk tier;
with tiers the prompt tokens computed fall to exactly the tiers' misses (one request at a time, so
no preemption blurs the count); a disk tier that is tiny, that fills up (ENOSPC) or that fails its
reads (EIO) never fails a request. Full attention (Mixtral), sliding windows (GPT-OSS) and
linear-attention state (Qwen3-Next) each restore from the tiers. The engine without tiers is the
oracle here; it is checked against transformers' own forward in tests/models/test_hf_parity.py."""
from __future__ import annotations

import errno
import random

import pytest

from moe_serve import LLM, SamplingParams
from moe_serve.kv_offload.disk import DiskTier

BS, POOL, TURNS, NEW_TOKENS, MAX_NEW = 4, 12, 2, 6, 3


def conversations(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(14, 22))] for _ in range(n)]


def run(path: str, convs: list[list[int]], seqs: int = 1, ratio: int = 10, **kw) -> tuple:
    """Every turn's greedy tokens, the prompt tokens computed, the tokens a perfect cache of every
    earlier turn leaves to compute, the tier stats and the scheduler's."""
    llm = LLM(path, dtype="float32", block_size=BS, num_kv_blocks=POOL, max_num_batched_tokens=32,
              max_num_seqs=seqs, show_progress=False, **kw)
    rng = random.Random(7)
    hist, prev = [list(c) for c in convs], [0] * len(convs)
    outs, misses = [], 0
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    for _ in range(TURNS):
        res = llm.generate([{"prompt_token_ids": h} for h in hist], params)
        for i, (h, r) in enumerate(zip(hist, res)):
            toks = list(r.outputs[0].token_ids)
            outs.append(toks)
            misses += len(h) - BS * min(prev[i] // BS, (len(h) - 1) // BS)
            prev[i] = len(h) + len(toks) - 1  # computed: the prompt and all but the last token
            h += toks + [rng.randrange(3, 500) for _ in range(NEW_TOKENS)]
        tiers = llm.engine.features.get("kv_offload")
        if tiers is not None:  # every write done: the next turn's disk hits are read in the background
            tiers.store.flush()
    core = llm.engine
    assert core.scheduler.kv.in_use == 0
    working_set = sum(-(-p // BS) for p in prev)
    assert working_set >= ratio * POOL, working_set  # the working set over the device pool
    stats = core.stats()
    return outs, core.num_prompt_tokens, misses, stats.features.get("kv_offload"), stats.scheduler


@pytest.fixture(scope="module")
def mixtral_plain(checkpoints):
    convs = conversations(16, 3)
    return convs, run(checkpoints["mixtral"], convs)


@pytest.mark.parametrize("tiers", ["host", "disk", "host+disk"])
def test_multi_turn_outputs_same_prompt_tokens_fall_to_the_misses(checkpoints, mixtral_plain, tmp_path, tiers):
    convs, (plain, plain_computed, misses, _, _) = mixtral_plain
    kw = {"kv_offloading_size": 0.01} if "host" in tiers else {}
    if "disk" in tiers:
        kw.update(kv_offloading_disk=str(tmp_path), kv_offloading_disk_size=0.01)
    outs, computed, misses_now, stats, sched = run(checkpoints["mixtral"], convs, **kw)
    assert outs == plain
    assert misses_now == misses and computed == misses < plain_computed * 0.6, (computed, misses, plain_computed)
    # No preemption: each prompt is looked up once, and what it found (on the device or in a
    # tier) is what it did not compute; a tier's blocks are among those.
    prompts = sum(len(c) for c in convs) * TURNS + len(convs) * (MAX_NEW + NEW_TOKENS) * TURNS * (TURNS - 1) // 2
    assert sched.prefix_cache_hits == prompts - computed >= (stats.host_hits + stats.disk_hits) * BS > 0
    assert (stats.disk_hits > 0) == (tiers == "disk") and (stats.host_hits > 0) == ("host" in tiers)
    assert (stats.read_waits > 0) == (tiers == "disk")  # requests waited for their blocks' disk reads


@pytest.mark.parametrize("failure", ["tiny", "enospc", "eio"])
def test_a_full_or_failing_disk_never_fails_a_request(checkpoints, mixtral_plain, tmp_path, monkeypatch, failure):
    """tiny: a disk tier of 12 KiB (six blocks), its budget kept for real; enospc: every write fails
    as on a full disk; eio: every read fails. Same tokens, no error to any request."""
    convs, (plain, plain_computed, _, _, _) = mixtral_plain
    size = 12 / 2**20 if failure == "tiny" else 0.01

    def failing_open(path, mode="r"):
        if (failure == "enospc" and "w" in mode) or (failure == "eio" and "r" in mode):
            raise OSError(errno.ENOSPC if "w" in mode else errno.EIO, "injected", path)
        return open(path, mode)

    if failure != "tiny":
        monkeypatch.setattr(DiskTier, "open", staticmethod(failing_open))
    outs, computed, _, stats, _ = run(checkpoints["mixtral"], convs, kv_offloading_disk=str(tmp_path),
                                   kv_offloading_disk_size=size)
    assert outs == plain
    if failure == "tiny":
        # It filled up and dropped its least recently used blocks: a turn comes back after all
        # the other conversations, so under LRU a tier this small keeps none of them (no hits).
        assert 0 < stats.disk_used_bytes <= 12 << 10 < stats.disk_saved_bytes and stats.disk_errors == 0
    elif failure == "enospc":  # nothing was ever kept, so no request waited for the disk
        assert stats.disk_errors > 0 and stats.disk_saved_bytes == stats.disk_used_bytes == 0
        assert stats.read_waits == 0
    else:  # blocks were kept; the requests that waited for them found the reads failed, and recomputed
        assert stats.disk_errors > 0 and stats.disk_hits == 0 and stats.read_waits > 0


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_next"])
def test_sliding_window_and_linear_attention_state_restore_from_the_tiers(extra_checkpoints, tmp_path, arch):
    """GPT-OSS's sliding layers keep their own group; Qwen3-Next's linear-attention layers keep a
    state snapshot per prompt: both are saved and restored with the full layers' blocks. Several
    requests at once, so preemption mixes in."""
    path = extra_checkpoints[arch]
    convs = conversations(12, 4)
    plain = run(path, convs, seqs=3, ratio=7)
    tiered = run(path, convs, seqs=3, ratio=7, kv_offloading_disk=str(tmp_path), kv_offloading_disk_size=0.01)
    assert tiered[0] == plain[0]
    assert tiered[3].disk_hits > 0 and tiered[1] < plain[1]


def test_speculative_decoding_and_preemption_with_tiers(checkpoints, tmp_path):
    """N-gram drafts (verify steps, rejected drafts' slots rewritten) and several requests at once
    (preemption by recompute) over a host tier: the same tokens as without it, fewer computed."""
    convs = conversations(12, 5)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    plain = run(checkpoints["mixtral"], convs, seqs=3, ratio=7, speculative_config=spec)
    tiered = run(checkpoints["mixtral"], convs, seqs=3, ratio=7, speculative_config=spec, kv_offloading_size=0.01)
    assert tiered[0] == plain[0]
    assert tiered[3].host_hits > 0 and tiered[1] < plain[1]
