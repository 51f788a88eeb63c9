"""A live server driven by the official `openai` client (and raw HTTP for malformed bodies)."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from moe_serve import LLM, SamplingParams
from tests.e2e.server import ServerProcess

KEY = "sk-test-key"
PROMPTS = [[5, 77, 301, 42], [9, 8, 7, 6, 5, 4, 3, 200, 100], [450, 12]]


@pytest.fixture(scope="module")
def server(checkpoints):
    s = ServerProcess(["--model", checkpoints["qwen3_moe"], "--dtype", "float32", "--api-key", KEY,
                       "--served-model-name", "tiny-qwen", "--kv-cache-memory", str(8 << 20), "--log-interval", "1"])
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(checkpoints["qwen3_moe"], dtype="float32", kv_cache_memory=8 << 20, show_progress=False)


def test_models_health_version_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-qwen"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    m = server.metrics()
    for name in ("moe_serve:num_requests_running", "moe_serve:kv_cache_usage_perc", "moe_serve:prompt_tokens_total",
                 "moe_serve:generation_tokens_total", "moe_serve:num_preemptions_total",
                 "moe_serve:time_to_first_token_seconds_count", "moe_serve:e2e_request_latency_seconds_count"):
        assert name in m


def test_usage_counts_prompt_tokens_served_from_the_prefix_cache(client):
    """usage.prompt_tokens_details.cached_tokens, as OpenAI reports it: 0 for a fresh prompt, then
    the whole 16-token blocks a repeat finds (one token is always computed), streamed or not."""
    prompt = [(7 * i) % 400 + 20 for i in range(45)]
    first = client.completions.create(model="tiny-qwen", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == 45 and first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model="tiny-qwen", prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    chunks = list(client.completions.create(model="tiny-qwen", prompt=prompt + [5], max_tokens=2, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32


def test_greedy_http_equals_offline_llm(client, llm):
    expected = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=10))
    r = client.completions.create(model="tiny-qwen", prompt=PROMPTS, max_tokens=10, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.outputs[0].text for o in expected]
    assert r.usage.prompt_tokens == sum(map(len, PROMPTS))
    assert r.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in expected)
    # The same through a stream: the deltas add up to the same text, then finish_reason and usage.
    for p, o in zip(PROMPTS, expected):
        chunks = list(client.completions.create(model="tiny-qwen", prompt=p, max_tokens=10, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == o.outputs[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == o.outputs[0].finish_reason
        assert chunks[-1].usage.completion_tokens == len(o.outputs[0].token_ids)


def test_prompt_forms_n_echo_stop_logprobs(client, llm):
    text_prompt = "The capital of France"
    r = client.completions.create(model="tiny-qwen", prompt=[text_prompt, "Hello"], max_tokens=4, temperature=0,
                                  n=2, echo=True)
    assert len(r.choices) == 4 and sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert all(c.text.startswith(text_prompt) for c in r.choices if c.index < 2)
    base = client.completions.create(model="tiny-qwen", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[4:7]
    r = client.completions.create(model="tiny-qwen", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == base[: base.find(stop)] and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny-qwen", prompt=PROMPTS[1], max_tokens=3, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(len(t) <= 3 for t in lp.top_logprobs)
    off = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(temperature=0, max_tokens=3, logprobs=3))
    ours = off[0].outputs[0]
    for got, tok, d in zip(lp.token_logprobs, ours.token_ids, ours.logprobs):
        assert abs(got - d[tok].logprob) < 1e-5


def test_seeded_sampling_same_text_twice(client):
    kw = dict(model="tiny-qwen", prompt=PROMPTS[2], max_tokens=12, temperature=1.0, top_p=0.9, seed=42,
              extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    c = client.completions.create(**{**kw, "seed": 43}).choices[0].text
    assert a == b and a != c


def test_chat_template_and_chat_features(client, llm, checkpoints):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoints["qwen3_moe"])
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again, café?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    r = client.chat.completions.create(model="tiny-qwen", messages=msgs, max_completion_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == expected.text
    stream = client.chat.completions.create(model="tiny-qwen", messages=msgs, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, n=2)
    chunks = list(stream)
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts[0] == texts[1] == expected.text
    assert chunks[-1].usage.completion_tokens == 2 * len(expected.token_ids)
    r = client.chat.completions.create(model="tiny-qwen", messages=msgs, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    off = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=3, logprobs=2))[0].outputs[0]
    for c, tok, d in zip(content, off.token_ids, off.logprobs):
        assert abs(c.logprob - d[tok].logprob) < 1e-5
        assert bytes(c.bytes).decode("utf-8", "replace") == c.token


BAD = [
    ("completions", b'{"prompt": "x", ', 400, None),
    ("completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("completions", {"prompt": "x", "model": "gpt-5"}, 404, "model"),
    ("completions", {"prompt": [5] * 2000}, 400, "prompt"),
    ("completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("completions", {"prompt": "x", "logit_bias": {"999999": 5}}, 400, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"abc": 5}}, 400, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("completions", {"prompt": "x", "frequency_penalty": 3}, 400, "frequency_penalty"),
    ("completions", {"prompt": "x", "presence_penalty": -2.5}, 400, "presence_penalty"),
    ("completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens"),
    ("completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto",
                          "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("chat/completions", {"messages": "hello"}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this image?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}, 400, "messages"),
]


@pytest.mark.parametrize("route, body, status, param", BAD)
def test_bad_input_gets_openai_error_and_server_survives(server, route, body, status, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}/v1/{route}", content=data, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    if param:
        assert err["param"] == param, err
    if b"image_url" in data:  # the refusal names the part
        assert "messages[0].content[1]" in err["message"] and "'image_url'" in err["message"], err
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                    headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert ok.status_code == 200


def test_logit_bias_and_penalties_reach_the_sampler(client, llm):
    greedy = SamplingParams(temperature=0, max_tokens=6)
    first = llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy)[0].outputs[0].token_ids[0]
    cases = [({"logit_bias": {"77": 100}}, {"logit_bias": {77: 100}}),
             ({"logit_bias": {str(first): -100}}, {"logit_bias": {first: -100}}),
             ({"frequency_penalty": 1.5, "presence_penalty": 0.5, "logit_bias": {"77": 4}},
              {"frequency_penalty": 1.5, "presence_penalty": 0.5, "logit_bias": {77: 4}}),
             ({"extra_body": {"repetition_penalty": 1.8}}, {"repetition_penalty": 1.8})]
    for http_kw, llm_kw in cases:
        r = client.completions.create(model="tiny-qwen", prompt=PROMPTS[0], max_tokens=6, temperature=0, **http_kw)
        o = llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy.replace(**llm_kw))[0].outputs[0]
        assert r.choices[0].text == o.text, http_kw
        if "logit_bias" in llm_kw and llm_kw["logit_bias"].get(77) == 100:
            assert o.token_ids == [77] * 6
        if "logit_bias" in llm_kw and first in llm_kw["logit_bias"]:
            assert first not in o.token_ids


def test_api_key_required(server):
    r = httpx.get(server.url + "/v1/models", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
        assert httpx.post(server.url + path, json=body, timeout=10).status_code == 401
        assert httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=10).status_code == 200
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_64_concurrent_streams_then_32_dropped_leave_no_kv(server):
    async def one(client, i):
        n = 0
        usage = None
        stream = await client.completions.create(model="tiny-qwen", prompt=[3 + i, 4, 5 + i], max_tokens=6 + i % 5,
                                                 temperature=0.7, seed=i, stream=True,
                                                 stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for c in stream:
            if c.usage:
                usage = c.usage
            n += 1
        return usage.completion_tokens

    async def drop(i):
        async with httpx.AsyncClient(timeout=60) as h:
            async with h.stream("POST", f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                                json={"prompt": [7, 8, 9 + i], "max_tokens": 1000, "stream": True,
                                      "extra_body": None, "ignore_eos": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        return True  # leave after the first chunk: the connection closes
        return False

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        counts = await asyncio.gather(*[one(client, i) for i in range(64)])
        dropped = await asyncio.gather(*[drop(i) for i in range(32)])
        return counts, dropped

    counts, dropped = asyncio.run(main())
    assert counts == [6 + i % 5 for i in range(64)]
    assert all(dropped)
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["moe_serve:kv_cache_usage_perc"] == 0 and m["moe_serve:num_requests_running"] == 0:
            break
        time.sleep(0.5)
    assert m["moe_serve:kv_cache_usage_perc"] == 0.0, m
    assert m["moe_serve:num_requests_running"] == 0 and m["moe_serve:num_requests_waiting"] == 0
    assert "aborted" in server.log()


def test_queue_limit_503_and_sigterm_exits_cleanly(checkpoints):
    s = ServerProcess(["--model", checkpoints["mixtral"], "--dtype", "float32", "--max-num-seqs", "1",
                       "--max-waiting-requests", "2", "--kv-cache-memory", str(4 << 20), "--shutdown-grace", "3"])
    try:
        async def go():
            async with httpx.AsyncClient(timeout=120) as h:
                async def req(i):
                    r = await h.post(f"{s.url}/v1/completions",
                                     json={"prompt": [5, 6, 7 + i], "max_tokens": 40, "ignore_eos": True})
                    return r.status_code, r.json()
                return await asyncio.gather(*[req(i) for i in range(12)])

        results = asyncio.run(go())
        codes = [c for c, _ in results]
        assert 503 in codes and 200 in codes, codes
        for c, body in results:
            if c == 503:
                assert body["error"]["type"] == "ServiceUnavailableError"
            else:
                assert c == 200 and body["usage"]["completion_tokens"] == 40
        # SIGTERM with a request in flight: the process finishes or aborts it and exits 0 in time.
        import threading
        import time

        got = {}

        def long_request():
            try:
                got["r"] = httpx.post(f"{s.url}/v1/completions", timeout=60,
                                      json={"prompt": [5, 6], "max_tokens": 900, "ignore_eos": True})
            except httpx.HTTPError as e:
                got["e"] = e

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        assert s.stop() == 0
        assert time.monotonic() - t0 < 20
        t.join(30)
        assert "server stopped" in s.log()
    finally:
        s.stop()
