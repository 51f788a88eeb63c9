"""Disaggregated serving with expert parallelism on each side: a prefill job and a decode job of 2
ranks each under torchrun (every rank's cache registered with its own NIXL agent; the decode front
end asks the prefill job to write into the blocks of whichever rank took the request, and the
prefill rank that computed the prompt writes them), and the router in front. Greedy text equals the
single-process engine's; every rank on both sides moved prompts' KV; every block comes back."""
from __future__ import annotations

import asyncio
import re
import signal

import httpx
import openai

from moe_serve import LLM, SamplingParams
from tests.distributed.jobs import TorchrunJob
from tests.e2e.server import ServerProcess

ARGS = ["--dtype", "float32", "--kv-cache-memory", str(8 << 20), "--served-model-name", "tiny"]
PROMPTS = [[40 + i, 7, 300 - i] * (6 + 3 * i) for i in range(8)]


async def _ask(url: str) -> list[str]:
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    outs = await asyncio.gather(*(c.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0)
                                  for p in PROMPTS))
    return [o.choices[0].text for o in outs]


def per_rank(metrics: str, name: str) -> dict[int, float]:
    return {int(r): float(v) for r, v in re.findall(rf'^moe_serve:{name}{{[^}}]*rank="(\d+)"}} (\S+)$', metrics, re.M)}


def test_two_decode_ranks_under_ep(checkpoints):
    path = checkpoints["qwen3_moe"]
    want = [o.outputs[0].text for o in LLM(path, dtype="float32", kv_cache_memory=8 << 20, show_progress=False)
            .generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=6))]
    p = TorchrunJob(2, ["--model", path, *ARGS, "--disaggregation-mode", "prefill", "--load-balance-method",
                        "least_load"])
    d = TorchrunJob(2, ["--model", path, *ARGS, "--disaggregation-mode", "decode", "--load-balance-method",
                        "least_load"])
    r = None
    try:
        r = ServerProcess(["--prefill", p.url, "--decode", d.url], command="router", timeout_s=60)
        assert asyncio.run(_ask(r.url)) == want
        m = httpx.get(d.url + "/metrics").text
        received = per_rank(m, "kv_transfer_received_requests_total")
        assert sorted(received) == [0, 1] and all(v > 0 for v in received.values()), received
        assert sum(received.values()) == len(PROMPTS)
        pm = httpx.get(p.url + "/metrics").text
        sent = per_rank(pm, "kv_transfer_sent_requests_total")
        assert sorted(sent) == [0, 1] and all(v > 0 for v in sent.values()), sent
        assert sum(sent.values()) == len(PROMPTS)
        assert set(per_rank(m, "kv_blocks_in_use").values()) == set(per_rank(pm, "kv_blocks_in_use").values()) == {0}
    finally:
        if r is not None:
            r.stop(signal.SIGKILL)
        p.kill()
        d.kill()
