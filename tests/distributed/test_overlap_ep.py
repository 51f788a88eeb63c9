"""Two-batch overlap under real expert parallelism (gloo, async all-to-all): greedy text identical
to the single-process engine without overlap, every architecture, EP 4. Prompt lengths are
odd and one phase runs a single request, so some ranks' micro-batches are empty."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.distributed.jobs import TorchrunJob
from tests.distributed.test_launcher import ARGS, PROMPTS, _complete_all, expected_texts


# EP 4 here (Mixtral's path is Qwen3-MoE's; the newer families in test_new_archs_ep.py); overlap at
# EP 2 runs in test_eplb_serving.py and test_spec_decode_ep.py (DeepSeek-V3) and in the two-host
# test (Qwen3-MoE).
@pytest.mark.parametrize("nproc", [4])
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_overlap_matches_without_overlap(checkpoints, arch, nproc):
    path = checkpoints[arch]
    want = expected_texts(path, PROMPTS, 6)
    job = TorchrunJob(nproc, ["--model", path, *ARGS, "--enable-overlap", "--overlap-min-tokens", "1"])
    try:
        assert asyncio.run(_complete_all(job.url, PROMPTS[:1], 6)) == want[:1]
        assert asyncio.run(_complete_all(job.url, PROMPTS, 6)) == want
        os.kill(job.rank_pid(0), signal.SIGTERM)
        assert job.wait(60) == 0
    finally:
        job.kill()
