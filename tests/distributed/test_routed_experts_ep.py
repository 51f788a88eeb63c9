"""Router replay under expert parallelism: two ranks, each routing its own requests' tokens before
dispatch, return the same routed experts as the single-process engine (itself checked against
transformers in tests/models/test_routed_experts.py). Decode steps are padded where nobody asks
(--pad-decode), and the ranks agree to leave them unpadded while any rank has a request that asks:
one request alone (the other rank idles, padded or not as agreed), then a batch over both ranks, in
overlapped micro-batches."""
from __future__ import annotations

import asyncio

import httpx
import numpy as np

from moe_serve import LLM, SamplingParams
from tests.distributed.jobs import TorchrunJob
from tests.distributed.test_launcher import ARGS, PROMPTS

MAX_NEW = 10


def expected_rows(path: str) -> list[np.ndarray]:
    llm = LLM(path, dtype="float32", kv_cache_memory=4 << 20, show_progress=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, return_routed_experts=True))
    return [o.outputs[0].routed_experts for o in outs]


async def routed_all(url: str, prompts) -> list[np.ndarray]:
    async with httpx.AsyncClient(timeout=120) as h:
        async def one(p):
            r = await h.post(url + "/v1/completions", json={
                "prompt": p, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
                "return_routed_experts": True})
            assert r.status_code == 200, r.text
            return np.array(r.json()["choices"][0]["routed_experts"], dtype=np.int16)
        return await asyncio.gather(*[one(p) for p in prompts])


def test_ep2_routed_experts_equal_single_process(checkpoints):
    path = checkpoints["qwen3_moe"]
    want = expected_rows(path)
    job = TorchrunJob(2, ["--model", path, *ARGS, "--pad-decode", "--enable-overlap", "--overlap-min-tokens", "1"])
    try:
        got = asyncio.run(routed_all(job.url, PROMPTS[:1]))
        assert np.array_equal(got[0], want[0])
        for g, w in zip(asyncio.run(routed_all(job.url, PROMPTS)), want):
            assert np.array_equal(g, w)
    finally:
        job.kill()


def test_ep2_routed_experts_through_replicas_and_rebalances(checkpoints):
    """EPLB at EP 2 with two redundant slots (replicas on both ranks) rebalancing every 4 steps: the
    rows stay the logical experts, equal to the single-process engine's, before and after a rebalance."""
    from tests.distributed.test_eplb_serving import EPLB_FLAGS, _metric

    path = checkpoints["qwen3_moe"]
    want = expected_rows(path)
    job = TorchrunJob(2, ["--model", path, *ARGS, *EPLB_FLAGS, "--num-redundant-experts", "2"])
    try:
        for g, w in zip(asyncio.run(routed_all(job.url, PROMPTS)), want):
            assert np.array_equal(g, w)
        done = _metric(job.url, "moe_serve:eplb_rebalances_total")
        assert done > 0, "no rebalance happened while the first requests ran"
        for g, w in zip(asyncio.run(routed_all(job.url, PROMPTS)), want):  # served by the new placement
            assert np.array_equal(g, w)
        assert _metric(job.url, "moe_serve:eplb_rebalances_total") > done
    finally:
        job.kill()
