"""Cache-aware routing across data-parallel ranks (moe_serve/engine/routing.py), through torchrun
with 4 ranks over gloo: a multi-turn workload, where each turn's prompt is the previous prompt, the
model's answer and a new user message, gets a prefix-hit rate close to a single rank's, and well
above routing by fewest outstanding tokens, with the single-process engine's greedy text."""
from __future__ import annotations

import asyncio
import re

import httpx

from moe_serve import LLM, SamplingParams
from tests.distributed.jobs import TorchrunJob

CONVERSATIONS, TURNS, ANSWER = 8, 4, 4
BLOCK = 4
ARGS = ["--dtype", "float32", "--kv-cache-memory", str(4 << 20), "--max-num-batched-tokens", "32",
        "--block-size", str(BLOCK)]


def user_message(c: int, t: int) -> list[int]:
    return [50 + 37 * c + 11 * t + i for i in range(10 if t == 0 else 6)]


def single_rank_turns(path: str):
    """Every conversation's prompts and greedy answers, and the prefix-hit rate, from one
    in-process engine that runs each turn of all conversations together."""
    llm = LLM(path, dtype="float32", kv_cache_memory=4 << 20, block_size=BLOCK, show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=ANSWER, ignore_eos=True)
    prompts = [user_message(c, 0) for c in range(CONVERSATIONS)]
    turns, cached, total = [], 0, 0
    for t in range(TURNS):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        turns.append([(p, o.outputs[0].text) for p, o in zip(prompts, outs)])
        cached += sum(o.num_cached_tokens for o in outs)
        total += sum(len(p) for p in prompts)
        prompts = [p + list(o.outputs[0].token_ids) + user_message(c, t + 1)
                   for c, (p, o) in enumerate(zip(prompts, outs))]
    return turns, cached / total


async def _serve_conversations(url: str, turns) -> list[list[str]]:
    """Each conversation's turns in order, the conversations concurrently."""
    async with httpx.AsyncClient(timeout=120) as h:
        async def conversation(c):
            texts = []
            for t in range(TURNS):
                prompt = turns[t][c][0]
                r = await h.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": ANSWER,
                                                                "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                texts.append(r.json()["choices"][0]["text"])
            return texts
        return await asyncio.gather(*[conversation(c) for c in range(CONVERSATIONS)])


def _hit_rate(metrics: str, world: int) -> float:
    def per_rank(name):
        vals = {int(m.group(1)): float(m.group(2))
                for m in re.finditer(rf'^moe_serve:{name}_total{{[^}}]*rank="(\d+)"}} (\S+)$', metrics, re.M)}
        assert sorted(vals) == list(range(world)), vals
        return vals
    queries, hits = per_rank("prefix_cache_queries"), per_rank("prefix_cache_hits")
    return sum(hits.values()) / sum(queries.values())


def test_multi_turn_hit_rate_follows_the_prefix(checkpoints):
    path = checkpoints["qwen3_moe"]
    turns, single = single_rank_turns(path)
    want = [[turns[t][c][1] for t in range(TURNS)] for c in range(CONVERSATIONS)]
    assert single > 0.5  # the workload is mostly prefix
    rates = {}
    for method in ("cache_aware", "least_load"):
        job = TorchrunJob(4, ["--model", path, *ARGS, "--load-balance-method", method])
        try:
            assert asyncio.run(_serve_conversations(job.url, turns)) == want
            rates[method] = _hit_rate(httpx.get(job.url + "/metrics").text, 4)
            routed = [int(r) for r in re.findall(r" -> rank (\d) ", job.log())]
            assert len(routed) == CONVERSATIONS * TURNS and len(set(routed)) > 1, routed
        finally:
            job.kill()
    assert rates["cache_aware"] >= 0.9 * single, (rates, single)
    assert rates["cache_aware"] >= rates["least_load"] + 0.2, (rates, single)
