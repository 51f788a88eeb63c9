"""Server hardening: no single client can stall the others, and every refusal is fast and in
OpenAI's error shape. One real server (a small KV cache: 8 blocks of 16 tokens, so max_model_len is
128), /health latency measured while each case runs."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.hardening_util import (HealthProbe, assert_openai_error, from_json_schema, raw_socket, read_response,
                                      timed)
from tests.e2e.server import ServerProcess

BODY_LIMIT = 8_000_000
HEADER_TIMEOUT, BODY_TIMEOUT, MAX_CONNECTIONS = 2.0, 3.0, 100


@pytest.fixture(scope="module")
def server(checkpoints):
    s = ServerProcess(["--model", checkpoints["qwen3_moe"], "--dtype", "float32", "--num-kv-blocks", "8",
                       "--max-request-body-bytes", str(BODY_LIMIT), "--http-header-timeout", str(HEADER_TIMEOUT),
                       "--http-body-timeout", str(BODY_TIMEOUT), "--max-connections", str(MAX_CONNECTIONS),
                       "--request-timeout", "20"])
    yield s
    assert s.stop() == 0


def post(server, route: str, body, timeout: float = 30.0) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}/v1/{route}", content=data, timeout=timeout,
                      headers={"Content-Type": "application/json"})


def test_huge_bodies_are_refused_before_they_are_read(server):
    with HealthProbe(server.url) as hp:
        with timed() as t:  # Content-Length says it all: 413 without reading the 60 MB
            r = httpx.post(server.url + "/v1/completions", content=b" " * 60_000_000, timeout=30,
                           headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.text
        assert assert_openai_error(r.content, None)["code"] == "request_too_large"
        assert t() < 3.0, t()
        # Chunked (no Content-Length): refused once the bytes counted pass the limit, while the
        # upload is still unfinished.
        s = raw_socket(server.url)
        with timed() as t2:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n")
            chunk = b"%x\r\n" % (1 << 16) + b" " * (1 << 16) + b"\r\n"
            for _ in range(BODY_LIMIT // (1 << 16) + 8):
                s.sendall(chunk)
            status, body = read_response(s)
        s.close()
        assert status == 413 and assert_openai_error(body, None)["code"] == "request_too_large", (status, body[:300])
        assert t2() < 3.0
        # The server is still fine.
        assert post(server, "completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert hp.max_s < 1.0, hp.max_s
    print(f"\n60 MB body: 413 in {1000 * t():.0f} ms; chunked {BODY_LIMIT + (8 << 16)} bytes: 413 in "
          f"{1000 * t2():.0f} ms; /health max {1000 * hp.max_s:.0f} ms")


def test_too_long_prompts_are_refused_without_tokenizing(server):
    cases = [("completions", {"prompt": "word " * 800_000, "max_tokens": 4}, "prompt"),  # 4 MB
             ("completions", {"prompt": ["short", "word " * 400_000]}, "prompt"),
             ("chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 200_000}, "messages"),
             ("chat/completions", {"messages": [{"role": "user", "content": "word " * 800_000}]}, "messages"),
             ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "ab" * 10**6}]}]},
              "messages")]
    times = []
    with HealthProbe(server.url) as hp:
        for route, body, param in cases:
            with timed() as t:
                r = post(server, route, body)
            assert r.status_code == 400, r.text[:500]
            assert_openai_error(r.content, param)
            times.append(t())
    assert max(times) < 2.0, times
    assert hp.max_s < 1.0, hp.max_s
    print(f"\nlong prompts refused in {[round(1000 * x) for x in times]} ms; /health max {1000 * hp.max_s:.0f} ms")
    r = post(server, "completions", {"prompt": "word " * 800_000})
    assert "at least" in r.json()["error"]["message"] and "max_model_len=128" in r.json()["error"]["message"]


MSG = [{"role": "user", "content": "hi"}]
REFUSED = [
    # parse errors: OpenAI's shape, the field named where there is one
    ("completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "prompt"),  # deep nesting
    ("completions", b"[" * 100_000 + b"]" * 100_000, None),
    ("chat/completions", b'{"messages": [{"role": "user", "content": [' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000
     + b"]}]}", None),
    ("completions", b'{"prompt": "\xff\xfe\xfd"}', None),  # invalid UTF-8
    ("completions", b'{"prompt": "x", "temperature": NaN}', None),
    ("completions", b'{"prompt": "x", ', None),
    ("completions", b"", None),
    ("completions", b"[1, 2]", None),
    ("completions", {"prompt": "x", "temperature": "nan"}, "temperature"),
    ("completions", {"prompt": "x", "n": "two"}, "n"),
    ("chat/completions", {"messages": [{"role": 5, "content": "x"}]}, "messages"),
    ("chat/completions", {"messages": MSG, "tools": "all"}, "tools"),
    # sizes and ranges
    ("completions", {"prompt": "x", "n": 100_000}, "n"),
    ("completions", {"prompt": "x", "max_tokens": 10**12}, "max_tokens"),
    ("completions", {"prompt": "x", "logprobs": 10**6}, "logprobs"),
    ("chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 10**6}, "top_logprobs"),
    ("completions", {"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, "stop"),
    ("completions", {"prompt": "x", "stop": "z" * 2000}, "stop"),
    ("completions", {"prompt": "x", "stop_token_ids": [1] * 2000}, "stop_token_ids"),
    ("completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(2000)}}, "logit_bias"),
    ("chat/completions", {"messages": MSG, "tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                                      for i in range(129)]}, "tools"),
    ("chat/completions", {"messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "description": "d" * 100_000}}}]}, "tools"),
    ("chat/completions", {"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}] * 5000}, "messages"),
    ("completions", {"prompt": "x", "seed": 2**70}, "seed"),
    ("completions", {"prompt": "x", "top_k": 2**64}, "top_k"),
    ("completions", {"prompt": ["a"] * 600, "n": 2}, "n"),
    # could never fit the KV cache (8 blocks of 16 tokens)
    ("completions", {"prompt": [5] * 10, "max_tokens": 200}, "max_tokens"),
    ("completions", {"prompt": [5] * 200}, "prompt"),
    ("chat/completions", {"messages": MSG, "max_tokens": 500}, "max_tokens"),
]
KV_REFUSED = [body for _, body, _ in REFUSED[-3:]]


def test_refusals_are_fast_and_openai_shaped(server):
    times = {}
    with HealthProbe(server.url) as hp:
        for route, body, param in REFUSED:
            with timed() as t:
                r = post(server, route, body)
            assert 400 <= r.status_code < 500, (body if isinstance(body, bytes) else str(body))[:200]
            assert "detail" not in r.json() and "Traceback" not in r.text
            err = assert_openai_error(r.content, param)
            times[(route, str(body)[:40])] = t()
            if body in KV_REFUSED:
                assert "KV cache" in err["message"] and "could never run" in err["message"], err
    assert max(times.values()) < 1.0, sorted(times.items(), key=lambda kv: -kv[1])[:3]
    assert hp.max_s < 1.0, hp.max_s
    # Routes and methods that do not exist, and malformed HTTP, are OpenAI-shaped too.
    r = httpx.get(server.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and assert_openai_error(r.content)
    r = httpx.get(server.url + "/v1/nope", timeout=10)
    assert r.status_code == 404 and assert_openai_error(r.content)
    for raw in (b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n"):
        s = raw_socket(server.url)
        s.sendall(raw)
        status, body = read_response(s)
        s.close()
        assert status == 400 and assert_openai_error(body, None), (raw, status, body)


def _stalled_upload(server) -> socket.socket:
    s = raw_socket(server.url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"prompt\": \"")
    return s


def test_slow_clients_are_cut_off_and_do_not_block_others(server):
    with HealthProbe(server.url) as hp:
        uploads = [_stalled_upload(server) for _ in range(64)]
        slowloris = raw_socket(server.url)
        slowloris.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finish
        idle = raw_socket(server.url)  # sends nothing at all
        t0 = time.monotonic()
        with timed() as t:
            r = post(server, "completions", {"prompt": "hi", "max_tokens": 4}, timeout=10)
        assert r.status_code == 200 and t() < 5.0, t()
        results = [read_response(s, 15) for s in uploads]
        uploads_s = time.monotonic() - t0
        assert all(st == 408 and assert_openai_error(b, None)["code"] == "request_timeout" for st, b in results), \
            results[:2]
        assert BODY_TIMEOUT - 0.5 < uploads_s < BODY_TIMEOUT + 5, uploads_s
        status, body = read_response(slowloris, 15)
        assert status == 408 and "header" in assert_openai_error(body, None)["message"]
        idle.settimeout(15)
        assert idle.recv(100) == b""  # closed without an answer: it asked nothing
        assert time.monotonic() - t0 < HEADER_TIMEOUT + 5
        for s in uploads + [slowloris, idle]:
            s.close()
    assert hp.max_s < 1.0, hp.max_s
    print(f"\n64 stalled uploads: a normal request took {1000 * t():.0f} ms; uploads got 408 after {uploads_s:.1f}s; "
          f"/health max {1000 * hp.max_s:.0f} ms")


def test_connection_cap_answers_503_at_once(server):
    socks = [raw_socket(server.url) for _ in range(MAX_CONNECTIONS + 5)]
    try:
        time.sleep(0.3)
        with timed() as t:
            r = httpx.get(server.url + "/v1/models", timeout=10)
        assert r.status_code == 503 and t() < 1.0
        assert assert_openai_error(r.content, None)["code"] == "too_many_connections"
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if httpx.get(server.url + "/v1/models", timeout=10).status_code == 200:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the server did not take requests again after the connections closed")


def test_server_flags_out_of_range_are_refused(checkpoints):
    flags = (("--http-body-timeout", "0"), ("--request-timeout", "-1"), ("--max-connections", "-2"))
    procs = [subprocess.Popen([sys.executable, "-m", "moe_serve.entrypoints.cli", "serve", "--model", checkpoints["mixtral"],
                               flag, value], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for flag, value in flags]
    for (flag, _), p in zip(flags, procs):
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2 and flag in err, (flag, p.returncode, err[-500:])


def _inline(schema, components: dict):
    """The schema with every local $ref replaced by what it names (the request structs are not
    recursive)."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            return _inline(components[schema["$ref"].rsplit("/", 1)[1]], components)
        return {k: _inline(v, components) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_inline(x, components) for x in schema]
    return schema


def test_fuzz_the_api_from_its_openapi_schema(server):
    """Bodies generated from the request schemas in /openapi.json, plain
    JSON values, random bytes, and mostly-valid requests: never a 5xx, never a hang, every error in
    OpenAI's shape, every stream ends with [DONE]; /health stays fast. About a minute at most."""
    from collections import Counter

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    spec = httpx.get(server.url + "/openapi.json", timeout=10).json()
    comps = spec["components"]["schemas"]
    schemas = {path: _inline(spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"], comps)
               for path in ("/v1/completions", "/v1/chat/completions")}
    assert {"prompt", "max_tokens", "n"} <= set(schemas["/v1/completions"]["properties"])
    assert "messages" in schemas["/v1/chat/completions"]["properties"]
    paths = st.sampled_from(sorted(schemas))
    encode = lambda b: json.dumps(b).encode()  # noqa: E731
    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                               lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4),
                               max_leaves=12)
    common = {"max_tokens": st.integers(-2, 12), "n": st.integers(0, 3), "temperature": st.floats(-0.5, 2.5),
              "top_p": st.floats(0, 1.2), "top_k": st.integers(-2, 600), "seed": st.integers(-2**63, 2**63 - 1),
              "stream": st.booleans(), "stop": st.lists(st.text(max_size=4), max_size=3),
              "ignore_eos": st.booleans(), "logit_bias": st.dictionaries(st.integers(-1, 600).map(str),
                                                                         st.floats(-101, 101), max_size=3),
              "min_tokens": st.integers(0, 4), "frequency_penalty": st.floats(-2.5, 2.5)}
    valid_completion = st.fixed_dictionaries(
        {"prompt": st.one_of(st.text(min_size=1, max_size=60), st.lists(st.integers(-1, 600), min_size=1, max_size=40),
                             st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=3))},
        optional={**common, "echo": st.booleans(), "logprobs": st.integers(-1, 21)})
    role = st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard"])
    valid_chat = st.fixed_dictionaries(
        {"messages": st.lists(st.fixed_dictionaries({"role": role, "content": st.text(max_size=40)}), max_size=4)},
        optional={**common, "logprobs": st.booleans(), "top_logprobs": st.integers(-1, 21),
                  "max_completion_tokens": st.integers(-1, 12)})
    cases = st.one_of(
        st.tuples(st.just("/v1/completions"), from_json_schema(schemas["/v1/completions"]).map(encode)),
        st.tuples(st.just("/v1/chat/completions"), from_json_schema(schemas["/v1/chat/completions"]).map(encode)),
        st.tuples(st.just("/v1/completions"), valid_completion.map(encode)),
        st.tuples(st.just("/v1/chat/completions"), valid_chat.map(encode)),
        st.tuples(paths, json_values.map(encode)),
        st.tuples(paths, st.binary(max_size=300)))
    codes: Counter = Counter()
    # Bounded by a count, not a clock: the same derandomized cases run however busy the machine is.
    # At least `budget` requests, and on until 10 have reached the model (a new request field shifts
    # which cases the schema generators draw), but never more than `cap`.
    budget, cap = 60, 200

    @settings(max_examples=600, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def one(case):
        sent = sum(codes.values())
        if sent >= cap or (sent >= budget and codes[200] >= 10):
            return
        path, data = case
        with httpx.Client(timeout=30) as h:
            with h.stream("POST", server.url + path, content=data, headers={"Content-Type": "application/json"}) as r:
                text = b"".join(r.iter_bytes())
        codes[r.status_code] += 1
        assert r.status_code < 500, (data[:300], r.status_code, text[:500])
        if r.status_code >= 400:
            assert_openai_error(text)
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert text.rstrip().endswith(b"data: [DONE]"), text[-300:]
        else:
            assert json.loads(text)["choices"]

    with HealthProbe(server.url) as hp:
        with timed() as t:
            one()
    print(f"\nfuzz: {sum(codes.values())} requests in {t():.0f}s, status codes {dict(sorted(codes.items()))}; "
          f"/health max {1000 * hp.max_s:.0f} ms")
    assert codes[200] >= 10, codes  # the generators reach the model, not only the validators
    assert hp.max_s < 1.0, hp.max_s
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_kv_cache_empty_and_server_alive_at_the_end(server):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["moe_serve:kv_cache_usage_perc"] == 0 and m["moe_serve:num_requests_running"] == 0:
            break
        time.sleep(0.3)
    assert m["moe_serve:kv_cache_usage_perc"] == 0.0 and m["moe_serve:num_requests_running"] == 0, m
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
