"""--batch-invariant under expert parallelism (2 ranks over gloo, the all-to-all dispatcher): a
request's token ids and logprobs are bitwise the same alone and in company, whichever rank it runs
on and however its companions spread over the ranks, and the same as a single-process
--batch-invariant engine's. That engine runs as the ranks do: a fresh process with one thread (the
pytest process, with its history of built checkpoints and its two threads, is not what is compared).

In company the target's tokens meet other requests' tokens, its own rank's and the other rank's,
in the same expert groups after dispatch, and its prompt's chunks are cut elsewhere (a 24-token
budget); the prefix cache is off so every run recomputes the prompt. Requests are placed round
robin and the target is sent first, so its rank alternates between the batches (asserted from the
log). Logprobs are compared as the JSON floats the server answers (they round-trip exactly).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time

import httpx
import pytest

from moe_serve import LLM, SamplingParams
from tests.distributed.jobs import TorchrunJob

TARGET = [random.Random(7).randrange(10, 400) for _ in range(29)]
MAX_NEW, TOP = 12, 2
ARGS = ["--dtype", "float32", "--kv-cache-memory", str(16 << 20), "--max-num-batched-tokens", "24",
        "--batch-invariant", "--no-enable-prefix-caching", "--load-balance-method", "round_robin"]
ROUTED = re.compile(r"request (\S+) -> rank (\d) ")


def _body(prompt: list[int], max_tokens: int = MAX_NEW, logprobs: int | None = TOP) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if logprobs is not None:
        body.update(logprobs=logprobs, prompt_logprobs=logprobs)
    return body


def _result(choice: dict) -> tuple:
    """The generated tokens with their logprobs and top logprobs, and the prompt's logprobs by token
    id, as the server answered them (floats compared exactly)."""
    lp = choice["logprobs"]
    prompt = [None if d is None else sorted((int(t), e["logprob"], e["rank"]) for t, e in d.items())
              for d in choice["prompt_logprobs"]]
    return choice["text"], lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], prompt


def _offline_result(llm: LLM) -> tuple:
    """The same fields from the single-process engine, the tokens decoded as the server does."""
    out = llm.generate({"prompt_token_ids": TARGET},
                       SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=TOP,
                                      prompt_logprobs=TOP))[0]
    o, tok = out.outputs[0], llm.tokenizer
    tokens = [tok.decode([t], False) for t in o.token_ids]
    lps = [d[t].logprob for t, d in zip(o.token_ids, o.logprobs)]
    tops = []
    for d in o.logprobs:
        top: dict[str, float] = {}
        for t, e in sorted(d.items(), key=lambda kv: kv[1].rank):
            if e.rank <= TOP:
                top.setdefault(tok.decode([t], False), e.logprob)
        tops.append(top)
    prompt = [None if d is None else sorted((t, e.logprob, e.rank) for t, e in d.items()) for d in out.prompt_logprobs]
    return o.text, tokens, lps, tops, prompt


def _offline_in_fresh_process(path: str) -> list:
    """`_offline_result` of an `LLM(path, batch_invariant=True)` in a process of its own with one
    thread, as JSON (floats round-trip exactly)."""
    code = ("import json, sys; from moe_serve import LLM; "
            "from tests.distributed.test_batch_invariance_ep import _offline_result; "
            "llm = LLM(sys.argv[1], dtype='float32', batch_invariant=True, kv_cache_memory=16 << 20, "
            "show_progress=False); print('RESULT ' + json.dumps(_offline_result(llm)))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=600, cwd=root,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and len(lines) == 1, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(lines[0][len("RESULT "):])


async def _post(h: httpx.AsyncClient, url: str, body: dict) -> dict:
    r = await h.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def _in_company(job: TorchrunJob, companions: list[dict]) -> tuple[tuple, int, set[int]]:
    """The target sent first (its rank picked before any companion's), then the companions at once.
    Returns the target's result, its rank and the ranks the companions went to."""
    before = len(ROUTED.findall(job.log()))
    async with httpx.AsyncClient(timeout=180) as h:
        target = asyncio.create_task(_post(h, job.url, _body(TARGET)))
        deadline = time.monotonic() + 60
        while len(ROUTED.findall(job.log())) == before:
            assert time.monotonic() < deadline and not target.done(), "the target was never placed"
            await asyncio.sleep(0.05)
        others = await asyncio.gather(*[_post(h, job.url, b) for b in companions])
        got = await target
    assert [o["usage"]["completion_tokens"] for o in others] == [b["max_tokens"] for b in companions]
    placed = dict(ROUTED.findall(job.log())[before:])
    mine = int(placed.pop(f"{got['id']}-0-0"))
    return _result(got["choices"][0]), mine, {int(r) for r in placed.values()}


def _companions(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    return [_body([rng.randrange(10, 400) for _ in range(rng.randrange(1, 60))], rng.randrange(1, 16),
                  rng.choice([None, 1, 3])) for _ in range(n)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_ep2_bitwise_alone_in_company_and_single_process(checkpoints, arch):
    path = checkpoints[arch]
    offline = _offline_in_fresh_process(path)
    job = TorchrunJob(2, ["--model", path, *ARGS])
    try:
        with httpx.Client(timeout=180) as h:
            alone = _result(h.post(job.url + "/v1/completions", json=_body(TARGET)).json()["choices"][0])
        assert "batch_invariant=True" in job.log() and "all2all_backend=all_to_all" in job.log()
        ranks = set()
        # 7 requests a batch: round robin puts the target (sent first) on the other rank each time
        for seed, n in [(1, 6), (2, 6)]:
            got, mine, theirs = asyncio.run(_in_company(job, _companions(seed, n)))
            assert theirs == {0, 1}
            ranks.add(mine)
            assert got == alone
        assert ranks == {0, 1}
        assert json.loads(json.dumps(alone)) == offline
    finally:
        job.kill()
