"""Decode padding under real expert parallelism (EP 2, gloo): both ranks pad every decode step to the
same ladder size (the ladder size of the most tokens any rank scheduled, from the core loop's
per-step all-reduce, an idle rank included), and the greedy text equals the unpadded single-process
engine's."""
from __future__ import annotations

import asyncio
import os
import re
import signal

from moe_serve.cuda_graph import capture_sizes
from tests.distributed.jobs import TorchrunJob
from tests.distributed.test_launcher import ARGS, PROMPTS, _complete_all, expected_texts

_PADDED = re.compile(r"\[rank (\d)\] moe_serve\.model_runner: decode step of (\d+) sequences padded to (\d+)")


def test_ep2_ranks_pad_to_a_common_size(checkpoints, monkeypatch):
    path = checkpoints["qwen3_moe"]
    want = expected_texts(path, PROMPTS, 6)
    monkeypatch.setenv("MOE_SERVE_LOG_LEVEL", "DEBUG")  # the runner logs each padded step at debug
    job = TorchrunJob(2, ["--model", path, *ARGS, "--pad-decode"])
    try:
        assert asyncio.run(_complete_all(job.url, PROMPTS, 6)) == want
        os.kill(job.rank_pid(0), signal.SIGTERM)
        assert job.wait(60) == 0
        steps: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
        for m in _PADDED.finditer(job.log()):
            steps[int(m[1])].append((int(m[2]), int(m[3])))
    finally:
        job.kill()
    assert steps[0] and steps[1], "no padded decode step logged"
    ladder = capture_sizes(64)
    # Step by step the two ranks ran the same padded size, a ladder size, whatever each scheduled.
    assert [p for _, p in steps[0]] == [p for _, p in steps[1]]
    assert all(p in ladder and n <= p for s in steps.values() for n, p in s)
    assert any(n < p for s in steps.values() for n, p in s)  # rows were really added
