"""`moe-serve router` in front of two real `moe-serve serve` instances, driven by the official
`openai` client: the same greedy output as one instance, a conversation's turns kept on the worker
that caches its prefix (more prefix hits than round robin), the server's limits and key at the
router, and workers that die before or during a request."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time

import httpx
import openai
import pytest

from moe_serve import LLM, SamplingParams
from tests.e2e.server import ServerProcess

KEY = "sk-router-key"
MODEL = "tiny-qwen"


@pytest.fixture(scope="module")
def long_qwen(checkpoints, tmp_path_factory) -> str:
    """The tiny Qwen3-MoE with 32768 positions, so that a stream of max_model_len tokens outlasts any
    client's disconnect on a busy machine (at 1024 it could run to its end first; at 8192 a fresh
    clone's suite once saw 4488 tokens run before the abort landed, the workers' HTTP side starved
    of CPU by the generating core, where a quiet machine sees about 200)."""
    path = str(tmp_path_factory.mktemp("router") / "qwen3_moe_32k")
    shutil.copytree(checkpoints["qwen3_moe"], path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = 32768
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


@pytest.fixture(scope="module")
def workers(long_qwen):
    args = ["--model", long_qwen, "--dtype", "float32", "--api-key", KEY, "--served-model-name", MODEL,
            "--kv-cache-memory", str(32 << 20)]
    ws = [ServerProcess(args), ServerProcess(args)]
    yield ws
    for w in ws:
        w.stop(signal.SIGKILL)


def router(workers, *extra) -> ServerProcess:
    return ServerProcess(["--worker", *(w.url for w in workers), "--api-key", KEY, "--health-check-interval", "0.3",
                          "--max-request-body-bytes", "200000", *extra], command="router", timeout_s=60)


@pytest.fixture(scope="module")
def cache_aware(workers):
    r = router(workers)
    yield r
    r.stop()


def long_stream(r: ServerProcess, prompt: list[int]) -> dict:
    """A streamed completion as long as the workers allow (so it is still running when acted on)."""
    card = httpx.get(r.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]
    return {"model": MODEL, "prompt": prompt, "max_tokens": card["max_model_len"] - len(prompt), "ignore_eos": True,
            "stream": True}


def served(r: ServerProcess) -> list[int]:
    return [w["requests"] for w in httpx.get(r.url + "/workers").json()]


def prefix_hits(workers) -> float:
    return sum(w.metrics().get("moe_serve:prefix_cache_hits_total", 0.0) for w in workers)


def test_greedy_through_the_router_equals_one_instance(long_qwen, cache_aware):
    llm = LLM(long_qwen, dtype="float32", kv_cache_memory=8 << 20, show_progress=False)
    prompts = [[5, 77, 301, 42], [9, 8, 7, 6, 5, 4, 3, 200, 100], [450, 12]]
    want = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                    SamplingParams(temperature=0, max_tokens=8))]
    c = openai.OpenAI(base_url=cache_aware.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in c.models.list().data] == [MODEL]
    got = [c.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text for p in prompts]
    assert got == want
    streamed = ["".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt=p, max_tokens=8, temperature=0, stream=True)) for p in prompts]
    assert streamed == want


def test_conversation_turns_stay_with_their_prefix(workers, cache_aware):
    """Four chat conversations of three turns, one after another: under cache_aware every turn of a
    conversation goes where its first went (and both workers get conversations); the workers find
    more of the prompts in their prefix caches than under round robin (other conversations: a
    repeat would hit what the first run cached)."""
    def converse(r: ServerProcess, run: str):
        c = openai.OpenAI(base_url=r.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        homes, texts, before = [], [], prefix_hits(workers)
        for k in range(4):
            msgs = [{"role": "system", "content": f"Run {run}. You are assistant number {k}. " + "Answer briefly. " * 12}]
            where = []
            for t in range(3):
                msgs.append({"role": "user", "content": f"Question {t} of conversation {k}: what is {k} + {t}?"})
                counts = served(r)
                out = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
                after = served(r)
                where.append([a - b for a, b in zip(after, counts)].index(1))
                texts.append(out.choices[0].message.content)
                msgs.append({"role": "assistant", "content": out.choices[0].message.content})
            homes.append(where)
        return homes, texts, prefix_hits(workers) - before

    homes, texts, hits = converse(cache_aware, "A")
    assert all(len(set(w)) == 1 for w in homes), homes
    assert {w[0] for w in homes} == {0, 1}, homes
    rr = router(workers, "--policy", "round_robin")
    try:
        rr_homes, rr_texts, rr_hits = converse(rr, "B")
    finally:
        rr.stop()
    assert any(len(set(w)) > 1 for w in rr_homes)
    assert hits > rr_hits, (hits, rr_hits)


def test_limits_and_key_hold_at_the_router(cache_aware):
    url = cache_aware.url + "/v1/completions"
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(url, content=b"x" * 300000, headers=auth)
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"]
    r = httpx.post(url, content=b"{not json", headers=auth)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    # A worker's own refusal reaches the client unchanged.
    r = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": -1}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = httpx.get(cache_aware.url + "/v1/responses/resp_unknown", headers=auth)
    assert r.status_code == 404


def test_a_stored_response_is_continued_where_it_lives(cache_aware):
    """previous_response_id goes to the worker that stored the response, whatever the policy says."""
    c = openai.OpenAI(base_url=cache_aware.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    first = c.responses.create(model=MODEL, input="Say one word.", max_output_tokens=4, temperature=0)
    counts = served(cache_aware)
    for i in range(3):
        c.responses.create(model=MODEL, input=f"And another, {i}.", previous_response_id=first.id,
                           max_output_tokens=4, temperature=0)
    delta = [a - b for a, b in zip(served(cache_aware), counts)]
    assert sorted(delta) == [0, 3]
    assert c.responses.retrieve(first.id).id == first.id


def test_client_leaving_mid_stream_frees_the_worker(workers, cache_aware):
    body = long_stream(cache_aware, [5, 6, 7])
    generated = sum(w.metrics()["moe_serve:generation_tokens_total"] for w in workers)
    with httpx.stream("POST", cache_aware.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    def idle() -> bool:  # the worker's request ends, then the router's stream (its in_flight count) after it
        return (all(w.metrics()["moe_serve:num_requests_running"] == 0 for w in workers)
                and all(w["in_flight"] == 0 for w in httpx.get(cache_aware.url + "/workers").json()))

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not idle():
        time.sleep(0.2)
    assert all(w.metrics()["moe_serve:num_requests_running"] == 0 for w in workers)
    assert all(w["in_flight"] == 0 for w in httpx.get(cache_aware.url + "/workers").json())
    # Aborted, not run to its end.
    assert sum(w.metrics()["moe_serve:generation_tokens_total"] for w in workers) - generated < body["max_tokens"] / 2


def test_dead_workers_before_and_during_a_request(workers, cache_aware):
    """Runs last: kills the workers. A worker killed mid-stream ends that stream with an error event
    naming it; requests then go to the survivor; with none left, 503 naming both."""
    auth = {"Authorization": f"Bearer {KEY}"}
    body = long_stream(cache_aware, [8, 9, 10])
    counts = served(cache_aware)
    events = []
    with httpx.stream("POST", cache_aware.url + "/v1/completions", headers=auth, json=body, timeout=60) as r:
        assert r.status_code == 200
        victim = None
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if victim is None:
                victim = [a - b for a, b in zip(served(cache_aware), counts)].index(1)
                workers[victim].proc.send_signal(signal.SIGKILL)
    assert len(events) >= 2 and events[-1] == "[DONE]", events
    err = json.loads(events[-2])["error"]
    assert err["code"] == "worker_failed" and workers[victim].url in err["message"]
    survivor = workers[1 - victim]
    # Before the health check notices, a request to the dead worker is retried on the survivor.
    c = openai.OpenAI(base_url=cache_aware.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    for i in range(4):
        assert c.completions.create(model=MODEL, prompt=[100 + i, 7], max_tokens=2, temperature=0).choices[0].text \
            is not None
    assert httpx.get(cache_aware.url + "/health").status_code == 200
    listed = httpx.get(cache_aware.url + "/workers").json()
    assert [w["healthy"] for w in listed] == [i != victim for i in range(2)]
    survivor.proc.send_signal(signal.SIGKILL)
    survivor.proc.wait(10)
    r = httpx.post(cache_aware.url + "/v1/completions", headers=auth, json={"model": MODEL, "prompt": "x",
                                                                           "max_tokens": 1})
    assert r.status_code == 503
    assert all(w.url in r.json()["error"]["message"] for w in workers)
    assert re.search(r'moe_serve_router:worker_failures_total\{worker="[^"]+",role="worker"\} [1-9]',
                     httpx.get(cache_aware.url + "/metrics").text)
