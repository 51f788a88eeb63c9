"""Expert rebalancing while serving, under torchrun (gloo): frequent forced rebalances
(--eplb-step-interval 4) move expert weights between ranks while requests run, and greedy text
through HTTP stays the single-process engine's (itself checked against transformers in
tests/models/test_hf_parity.py) before, during and after them, with overlap on and off. A rank that
dies in the middle of a transfer stops the job with an error naming it.

The cases are combined into few jobs (each start costs seconds on a small machine): every
architecture, 2 and 4 ranks, overlap on and off, and both spellings of the settings appear
(DeepSeek-V3 at EP 2; EP 4 with rebalances runs Qwen3-MoE, GLM-5 and DeepSeek-V4)."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time

import httpx
import pytest

from tests.distributed.jobs import TorchrunJob
from tests.distributed.test_launcher import ARGS, PROMPTS, _complete_all, expected_texts

EPLB_FLAGS = ["--enable-eplb", "--eplb-step-interval", "4", "--eplb-window-size", "8"]


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


JOBS = [  # (architecture, ranks, overlap, how the settings are given)
    ("mixtral", 2, False, ["--num-redundant-experts", "2"]),
    ("qwen3_moe", 4, True, ["--eplb-config", '{"num_redundant_experts": 4}']),
    ("deepseek_v3", 2, True, ["--eplb-config", '{"num_redundant_experts": 0, "step_interval": 4}']),
    # sparse and compressed attention at EP 4: GLM-5's DSA (an indexer shared between layers) and
    # DeepSeek-V4 (its hash-routed layer's experts move like any other's)
    ("glm_moe_dsa", 4, True, ["--num-redundant-experts", "4"]),
    ("deepseek_v4", 4, True, ["--num-redundant-experts", "4"]),
]


@pytest.mark.parametrize("arch, nproc, overlap, settings", JOBS, ids=[f"{a}-ep{n}-{'overlap' if o else 'plain'}"
                                                                      for a, n, o, _ in JOBS])
def test_greedy_text_unchanged_through_rebalances(checkpoints, extra_checkpoints, arch, nproc, overlap, settings):
    path = checkpoints[arch] if arch in checkpoints else extra_checkpoints[arch]
    want = expected_texts(path, PROMPTS, 10)
    extra = ["--enable-overlap", "--overlap-min-tokens", "1"] if overlap else []
    job = TorchrunJob(nproc, ["--model", path, *ARGS, *EPLB_FLAGS, *settings, *extra, "--speed-of-light-window", "0"])
    try:
        assert _metric(job.url, "moe_serve:eplb_rebalances_total") == 0  # before any
        # One request alone (the other ranks run empty steps, rebalancing all the same), then all at
        # once, twice: rebalances start and finish while requests are in flight.
        assert asyncio.run(_complete_all(job.url, PROMPTS[:1], 10)) == want[:1]
        for _ in range(2):
            assert asyncio.run(_complete_all(job.url, PROMPTS, 10)) == want
        done = _metric(job.url, "moe_serve:eplb_rebalances_total")
        assert done >= 2
        assert _metric(job.url, "moe_serve:eplb_transfer_seconds_count") == done
        assert 0 < _metric(job.url, "moe_serve:expert_balancedness") <= 1
        # Weights really travelled between ranks (not only local copies).
        received = [float(m) for m in re.findall(r"moved, ([0-9.]+) MiB received here", job.log())]
        assert received and max(received) > 0, job.log()[-3000:]
        # The decode speed of light, one gauge per rank (a window closes after every decode step here):
        # each rank that decoded reports its share, whatever experts moved.
        text = httpx.get(job.url + "/metrics", timeout=10).text
        sol = dict(re.findall(r'^moe_serve:decode_speed_of_light_fraction\{[^}]*rank="(\d+)"\} (\S+)$', text, re.M))
        assert sorted(sol) == [str(r) for r in range(nproc)], text
        assert any(float(v) > 0 for v in sol.values()) and all(float(v) >= 0 for v in sol.values()), sol
        # After: the last placement serves the same text.
        assert asyncio.run(_complete_all(job.url, PROMPTS, 10)) == want
        os.kill(job.rank_pid(0), signal.SIGTERM)
        assert job.wait(60) == 0
    finally:
        job.kill()


def test_rank_killed_mid_transfer_stops_job_naming_it(checkpoints, monkeypatch):
    # Rank 1 SIGKILLs itself right after posting its sends and receives of MoE layer 0 in the
    # first rebalance (expert_parallel/rebalance/eplb.py's test hook), with its peers' receives pending.
    monkeypatch.setenv("MOE_SERVE_EPLB_KILL_DURING_TRANSFER", "1:0")
    timeout = 15
    job = TorchrunJob(2, ["--model", checkpoints["mixtral"], *ARGS, *EPLB_FLAGS, "--num-redundant-experts", "2",
                          "--dist-timeout", str(timeout)])
    try:
        def long_request():
            try:
                httpx.post(job.url + "/v1/completions", timeout=90,
                           json={"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True})
            except httpx.HTTPError:
                pass

        threading.Thread(target=long_request, daemon=True).start()
        deadline = time.monotonic() + 60
        while "killing itself during the transfer" not in job.log():
            assert time.monotonic() < deadline and job.proc.poll() is None, job.log()[-3000:]
            time.sleep(0.1)
        t0 = time.monotonic()
        rc = job.wait(timeout + 30)
        assert time.monotonic() - t0 < timeout  # within --dist-timeout of the death
        assert rc != 0
        log = job.log()
        assert "rank: 1" in log or "rank 1 " in log, log[-3000:]
    finally:
        job.kill()
