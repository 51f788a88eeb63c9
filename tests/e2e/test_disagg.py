"""Disaggregated serving with real processes: `moe-serve router --prefill P --decode D` in front of
a `--disaggregation-mode prefill` and a `--disaggregation-mode decode` instance, KV moved over
NIXL, driven by the official `openai` client. Greedy output equals one colocated instance and
transformers; the prompt is computed on the prefill side (its counters say so); faults (the
prefill instance killed while prompts are on their way, the decode instance killed mid-stream, a
client leaving during the transfer) give a named error or complete elsewhere, and every KV block on
both sides comes back (the instances' /metrics)."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest
import torch

from moe_serve import LLM, SamplingParams
from tests.e2e.server import ServerProcess
from tests.models.test_hf_parity import hf_greedy

KEY = "sk-disagg"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}


def instance(path: str, mode: str, *extra) -> ServerProcess:
    return ServerProcess(["--model", path, "--dtype", "float32", "--api-key", KEY, "--served-model-name", MODEL,
                          "--kv-cache-memory", str(8 << 20), "--disaggregation-mode", mode, *extra])


def router(prefill: list[ServerProcess], decode: list[ServerProcess]) -> ServerProcess:
    return ServerProcess(["--prefill", *(p.url for p in prefill), "--decode", *(d.url for d in decode), "--api-key",
                          KEY, "--health-check-interval", "0.3"], command="router", timeout_s=60)


def blocks_back(*servers, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(s.metrics().get("moe_serve:kv_blocks_in_use") == 0 for s in servers):
            return
        time.sleep(0.2)
    raise AssertionError([s.metrics().get("moe_serve:kv_blocks_in_use") for s in servers])


@pytest.fixture(scope="module")
def mla(checkpoints):
    path = checkpoints["deepseek_v3"]
    p, d = instance(path, "prefill"), instance(path, "decode")
    r = router([p], [d])
    yield path, p, d, r
    for s in (r, p, d):
        s.stop(signal.SIGKILL)


PROMPTS = [[5, 77, 301, 42] * 9, [9, 8, 7, 6, 5, 4, 3, 200, 100] * 3, [450, 12, 13], [33] * 50]


def test_greedy_through_a_disaggregated_pair_equals_one_instance_and_transformers(mla):
    path, p, d, r = mla
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20, show_progress=False)
    want = llm.generate([{"prompt_token_ids": q} for q in PROMPTS], SamplingParams(temperature=0, max_tokens=8))
    for q, o in zip(PROMPTS, want):
        assert list(o.outputs[0].token_ids) == hf_greedy(model, q, 8)
    c = openai.OpenAI(base_url=r.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    got = [c.completions.create(model=MODEL, prompt=q, max_tokens=8, temperature=0).choices[0].text for q in PROMPTS]
    assert got == [o.outputs[0].text for o in want]
    streamed = ["".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt=q, max_tokens=8, temperature=0, stream=True)) for q in PROMPTS[:2]]
    assert streamed == got[:2]
    pm, dm = p.metrics(), d.metrics()
    # The prompts were computed on the prefill side (the decode side computed one token of each
    # first request; the repeats hit its prefix cache) and their KV moved.
    assert pm["moe_serve:kv_transfer_sent_requests_total"] == dm["moe_serve:kv_transfer_received_requests_total"] >= 4
    assert pm["moe_serve:kv_transfer_sent_bytes_total"] > 0
    assert dm["moe_serve:prompt_tokens_total"] < sum(map(len, PROMPTS)) / 4
    assert dm["moe_serve:kv_transfer_fallbacks_total"] == 0
    # A chat conversation, n > 1 and logprobs through the same path.
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there, how are you?"}],
                                     max_tokens=6, temperature=0, n=2, logprobs=True, top_logprobs=2)
    one = openai.OpenAI(base_url=d.url + "/v1", api_key=KEY, max_retries=0, timeout=60)  # decode alone: local
    alone = one.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there, how are you?"}],
                                        max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    assert [ch.message.content for ch in chat.choices] == [alone.choices[0].message.content] * 2
    assert [t.token for t in chat.choices[0].logprobs.content] == [t.token for t in alone.choices[0].logprobs.content]
    # Structured output: the decode side's grammar constrains the tokens after the moved prompt.
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    out = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A number as JSON, please."}],
                                    max_tokens=40, temperature=0, response_format={
                                        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    # A forced tool call: the grammar makes the decode side write the call, the parser returns it.
    params = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
              "additionalProperties": False}
    call = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                     max_tokens=60, temperature=0, tools=[{"type": "function", "function": {
                                         "name": "get_weather", "parameters": params}}],
                                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (tc,) = call.choices[0].message.tool_calls
    assert tc.function.name == "get_weather"
    jsonschema.validate(json.loads(tc.function.arguments), params)
    blocks_back(p, d)


def test_routed_experts_through_the_pair(mla):
    """return_routed_experts through the router: the prompt's rows the prefill instance computed
    (sent back with its answer) and the decode side's own, base64, equal one instance's and
    transformers' routing."""
    import base64

    import numpy as np

    from tests.models.test_hf_parity import hf_model
    from tests.models.test_routed_experts import assert_same_routing

    path, p, d, r = mla
    q = [7, 300, 12, 44, 5] * 7
    llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20, show_progress=False)
    want = llm.generate({"prompt_token_ids": q}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                                 return_routed_experts=True))[0].outputs[0]
    sent = p.metrics()["moe_serve:kv_transfer_sent_requests_total"]
    c = openai.OpenAI(base_url=r.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    out = c.completions.create(model=MODEL, prompt=q, max_tokens=6, temperature=0, extra_body={
        "return_routed_experts": True, "ignore_eos": True, "routed_experts_format": "base64"})
    rows = np.frombuffer(base64.b64decode(out.choices[0].model_extra["routed_experts"]), "<i2").astype(np.int16)
    rows = rows.reshape(want.routed_experts.shape)
    assert np.array_equal(rows, want.routed_experts)
    assert_same_routing(hf_model(path), q, list(want.token_ids), rows)
    assert p.metrics()["moe_serve:kv_transfer_sent_requests_total"] == sent + 1  # the prompt did move
    assert d.metrics()["moe_serve:kv_transfer_fallbacks_total"] == 0
    blocks_back(p, d)


def test_fields_and_modes_are_checked(mla):
    path, p, d, r = mla
    bad = httpx.post(r.url + "/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "x", "max_tokens": 1,
                                                                    "kv_transfer_params": {"prefill_url": p.url}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer_params"
    bad = httpx.post(p.url + "/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "x", "max_tokens": 1,
                                                                    "kv_transfer_params": {"prefill_url": p.url}})
    assert bad.status_code == 400 and "--disaggregation-mode prefill" in bad.json()["error"]["message"]
    bad = httpx.post(d.url + "/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "x", "max_tokens": 1,
                                                                    "kv_transfer_params": {"url": p.url}})
    assert bad.status_code == 400 and "unknown key(s) url" in bad.json()["error"]["message"]
    assert httpx.post(p.url + "/v1/disagg/prefill", json={}).status_code == 401
    workers = httpx.get(r.url + "/workers").json()
    assert sorted(w["role"] for w in workers) == ["decode", "prefill"]


def test_faults_end_cleanly_and_give_every_block_back(checkpoints):
    """A client that leaves while its prompt's KV is on its way; the decode instance killed
    mid-stream (a named error; the prefill instance keeps serving another decode instance); the
    prefill instance killed while prompts are on their way (the decode instance computes them: the
    same text). Every block on the surviving instances comes back."""
    path = checkpoints["mixtral"]
    p, d1, d2 = instance(path, "prefill"), instance(path, "decode"), instance(path, "decode")
    r = router([p], [d1, d2])
    try:
        c = openai.OpenAI(base_url=r.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        long_prompt = [7 + i % 400 for i in range(400)]
        # 1) The client leaves while its prompt's KV is on its way (the prefill instance frozen until
        #    then): the decode side holds the reserved blocks until the prefill side has answered.
        p.proc.send_signal(signal.SIGSTOP)
        with httpx.stream("POST", d1.url + "/v1/completions", headers=AUTH, timeout=60, json={
                "model": MODEL, "prompt": long_prompt, "max_tokens": 4, "stream": True,
                "kv_transfer_params": {"prefill_url": p.url}}) as resp:
            assert resp.status_code == 200
            deadline = time.monotonic() + 30
            while d1.metrics()["moe_serve:kv_blocks_in_use"] == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
        time.sleep(0.5)
        assert d1.metrics()["moe_serve:kv_blocks_in_use"] > 0  # aborted, but held while the writer may write
        p.proc.send_signal(signal.SIGCONT)
        blocks_back(p, d1, d2)
        assert p.metrics()["moe_serve:kv_transfer_sent_requests_total"] == 1
        # 2) A decode instance killed mid-stream: its client gets an error event naming it.
        card = httpx.get(r.url + "/v1/models", headers=AUTH).json()["data"][0]
        events, victim = [], None
        with httpx.stream("POST", r.url + "/v1/completions", headers=AUTH, timeout=120, json={
                "model": MODEL, "prompt": [11, 12, 13], "max_tokens": card["max_model_len"] - 3, "temperature": 0,
                "stream": True, "ignore_eos": True}) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if victim is None:
                    busy = [w["url"] for w in httpx.get(r.url + "/workers").json()
                            if w["role"] == "decode" and w["in_flight"]]
                    victim = d1 if busy == [d1.url] else d2
                    assert busy == [victim.url]
                    victim.proc.send_signal(signal.SIGKILL)
        err = json.loads(events[-2])["error"]
        assert events[-1] == "[DONE]" and err["code"] == "worker_failed" and victim.url in err["message"]
        survivor = d2 if victim is d1 else d1
        time.sleep(1.0)  # the router's health check sees the dead one
        want = LLM(path, dtype="float32", kv_cache_memory=8 << 20, show_progress=False).generate(
            [{"prompt_token_ids": long_prompt[:120]}], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
        assert c.completions.create(model=MODEL, prompt=long_prompt[:120], max_tokens=6,
                                    temperature=0).choices[0].text == want
        blocks_back(p, survivor)
        # 3) The prefill instance killed while prompts wait on it (frozen first, so that the decode
        #    side has reserved their blocks and asked it): the decode side computes them.
        fallbacks = survivor.metrics()["moe_serve:kv_transfer_fallbacks_total"]
        results = [None] * 4
        direct = openai.OpenAI(base_url=survivor.url + "/v1", api_key=KEY, max_retries=0, timeout=60)

        def ask(i):
            results[i] = direct.completions.create(
                model=MODEL, prompt=long_prompt[i * 50:i * 50 + 300], max_tokens=6, temperature=0,
                extra_body={"kv_transfer_params": {"prefill_url": p.url}}).choices[0].text

        p.proc.send_signal(signal.SIGSTOP)
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        deadline = time.monotonic() + 30
        while survivor.metrics()["moe_serve:kv_blocks_in_use"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert survivor.metrics()["moe_serve:kv_blocks_in_use"] > 0  # reserved, waiting on the prefill side
        p.proc.send_signal(signal.SIGKILL)
        for th in threads:
            th.join(120)
        llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20, show_progress=False)
        want = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": long_prompt[i * 50:i * 50 + 300]}
                                                         for i in range(4)], SamplingParams(temperature=0, max_tokens=6))]
        assert results == want
        assert survivor.metrics()["moe_serve:kv_transfer_fallbacks_total"] > fallbacks
        blocks_back(survivor)
        # With the prefill instance gone for good, the decode instance serves alone.
        assert c.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2, temperature=0).choices[0].text
        blocks_back(survivor)
    finally:
        for s in (r, p, d1, d2):
            s.stop(signal.SIGKILL)
