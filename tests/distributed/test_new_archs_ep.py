"""The architectures added for checkpoint breadth under real expert parallelism (torchrun, gloo,
EP 2): greedy text through HTTP equals the single-process engine's. Qwen2-MoE carries the gated
shared expert, OLMoE the full-width q/k norm and clip_qkv, GLM-4.5 group-limited routing with one
of two groups kept (so each rank's experts see uneven loads) and partial rotary; GPT-OSS its
MXFP4 experts (each rank reads and keeps only its experts' blocks), sliding-window layers and
sinks; MiniMax-M2 sigmoid routing with a correction bias, full-width q/k norm and partial rotary;
Llama-4 its routing weights on the experts' inputs (scaled before dispatch), chunked and NoPE
layers, dense layers between the MoE ones; DeepSeek-V3.2 and GLM-5 their indexers' sparse selection
(GLM-5's shared between layers); DeepSeek-V4 its hash-routed first layer (by token id, on each rank's own tokens), compressed caches and hyper-connections. Kimi-K2 is the DeepSeek-V3 model, covered by test_launcher.py."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.distributed.jobs import TorchrunJob
from tests.distributed.test_launcher import ARGS, PROMPTS, _complete_all, expected_texts


# MiniMax-M2, Llama-4 and Qwen3-Next run at EP 4 with overlap below (the same paths, split or not);
# OLMoE's and Qwen2-MoE's routing is Qwen3-MoE's (test_launcher.py; a shared expert is local to every
# rank), GLM-4-MoE's grouped sigmoid routing DeepSeek-V3's. GLM-5 and DeepSeek-V4 are served at EP 4
# with overlap and rebalances in test_eplb_serving.py (text equal to the single-process engine's), V4's
# MTP at EP 2 in test_spec_decode_ep.py.
@pytest.mark.parametrize("arch", ["gpt_oss_mxfp4", "qwen3_5_moe", "deepseek_v32"])
def test_ep2_serving_matches_single_process(extra_checkpoints, arch):
    path = extra_checkpoints[arch]
    want = expected_texts(path, PROMPTS, 8)
    job = TorchrunJob(2, ["--model", path, *ARGS])
    try:
        assert asyncio.run(_complete_all(job.url, PROMPTS[:1], 8)) == want[:1]  # rank 1 runs empty steps
        assert asyncio.run(_complete_all(job.url, PROMPTS, 8)) == want
        assert "[rank 1] moe_serve.model_runner: model" in job.log()
        os.kill(job.rank_pid(0), signal.SIGTERM)
        assert job.wait(60) == 0
    finally:
        job.kill()


@pytest.mark.parametrize("arch", ["qwen3_next", "llama4", "minimax_m2"])
def test_ep4_overlap_serving_matches_single_process(extra_checkpoints, arch):
    """The hybrid and newest families at EP 4 with two overlapped micro-batches (some ranks' micro-
    batches empty; a sequence cut across them carries its linear-attention state or chunk's K/V)."""
    path = extra_checkpoints[arch]
    want = expected_texts(path, PROMPTS, 6)
    job = TorchrunJob(4, ["--model", path, *ARGS, "--enable-overlap", "--overlap-min-tokens", "1"])
    try:
        assert asyncio.run(_complete_all(job.url, PROMPTS[:1], 6)) == want[:1]
        assert asyncio.run(_complete_all(job.url, PROMPTS, 6)) == want
        os.kill(job.rank_pid(0), signal.SIGTERM)
        assert job.wait(60) == 0
    finally:
        job.kill()
