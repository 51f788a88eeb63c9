"""A stream's first bytes go out only once the first token exists, on chat completions, the
Responses API and the Messages API, against the built-in default model: benchmark clients (vLLM's
and SGLang's `bench serve`) and agents time the first chunk or event as the first token.

The oracle is the engine's own first-token time: the front end observes each request's time to
first token, from the request's submission to the engine to its first token, in the Prometheus
histogram `moe_serve:time_to_first_token_seconds` (one observation per request here, so the sum's
increase is this request's). The client and the server share the host's monotonic clock, and the
client sends before the server submits, so a first chunk that left after the first token was
computed arrived at least that long after the client sent the request: a causal ordering, whatever
the machine's speed. A long prompt (a prefill of a second or more on a CPU) makes a first chunk sent
before the prefill arrive well before it. The first chunk's text is checked against the first
token's, from a non-streamed request for one token (greedy).
"""
from __future__ import annotations

import json
import time

import httpx
import jsonschema

TTFT = "moe_serve:time_to_first_token_seconds"
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}


def _prompt(tag: str) -> str:
    # A distinct start per test: no prefix-cache hit shortens the prefill being timed.
    return f"{tag}. Summarize this list in one sentence: " + ", ".join(f"item {i}" for i in range(120))


def _stream(server, path: str, body: dict) -> tuple[float, float, bytes, list[tuple[str | None, dict]]]:
    """(seconds from sending to the first body bytes, the engine's TTFT for the request, those first
    bytes, every SSE event as (event name, data)), for one streamed request."""
    before = server.metrics()
    with httpx.Client(timeout=300) as client:
        sent = time.monotonic()
        with client.stream("POST", server.url + path, json=body) as r:
            assert r.status_code == 200, r.read()
            first_at, first, raw = None, b"", b""
            for b in r.iter_raw():
                if first_at is None and b:
                    first_at, first = time.monotonic(), b
                raw += b
    after = server.metrics()
    assert after[TTFT + "_count"] - before[TTFT + "_count"] == 1  # this request's observation alone
    ttft = after[TTFT + "_sum"] - before[TTFT + "_sum"]
    events = []
    for block in raw.decode().split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
        if data is not None:
            events.append((name, data))
    return first_at - sent, ttft, first, events


def _model(server) -> str:
    return httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]


def _first_token_text(server, messages: list[dict]) -> str:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
        "model": _model(server), "messages": messages, "max_tokens": 1, "temperature": 0})
    text = r.json()["choices"][0]["message"]["content"]
    assert text, r.json()  # a whole token of plain text: the check below means something
    return text


def test_chat_stream_first_chunk_is_role_and_first_token(default_tool_server):
    s = default_tool_server
    messages = [{"role": "user", "content": _prompt("Chat")}]
    waited, ttft, _, events = _stream(s, "/v1/chat/completions", {
        "model": _model(s), "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True})
    assert waited >= ttft > 0, (waited, ttft)
    first = events[0][1]["choices"][0]
    assert first["index"] == 0
    assert first["delta"] == {"role": "assistant", "content": _first_token_text(s, messages)}
    assert all("role" not in e["choices"][0]["delta"] for _, e in events[1:] if e["choices"])


def test_chat_tool_call_stream_first_chunk_waits_for_the_first_token(default_tool_server):
    """A forced call: its first tokens are held back until the call's name is known, so the first
    chunk has the role alone (empty content); it still leaves only after the first token."""
    s = default_tool_server
    waited, ttft, _, events = _stream(s, "/v1/chat/completions", {
        "model": _model(s), "messages": [{"role": "user", "content": _prompt("Tools")}], "max_tokens": 96,
        "temperature": 0, "stream": True, "tools": [TOOL], "tool_choice": "required"})
    assert waited >= ttft > 0, (waited, ttft)
    chunks = [e for _, e in events if e["choices"]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert not chunks[0]["choices"][0]["delta"].get("content")
    args = "".join(tc["function"].get("arguments") or "" for c in chunks
                   for tc in c["choices"][0]["delta"].get("tool_calls") or [])
    jsonschema.validate(json.loads(args), TOOL["function"]["parameters"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_responses_stream_opens_with_the_first_token(default_tool_server):
    s = default_tool_server
    text = _prompt("Responses")
    waited, ttft, first_bytes, events = _stream(s, "/v1/responses", {
        "model": _model(s), "input": text, "max_output_tokens": 4, "temperature": 0, "stream": True})
    assert waited >= ttft > 0, (waited, ttft)
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    delta = next(d for n, d in events if n == "response.output_text.delta")
    assert delta["delta"] == _first_token_text(s, [{"role": "user", "content": text}])
    # the opening events and the first text delta are one write
    assert b"response.created" in first_bytes and b"response.output_text.delta" in first_bytes


def test_messages_stream_opens_with_the_first_token(default_tool_server):
    s = default_tool_server
    messages = [{"role": "user", "content": _prompt("Messages")}]
    waited, ttft, first_bytes, events = _stream(s, "/v1/messages", {
        "model": _model(s), "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True})
    assert waited >= ttft > 0, (waited, ttft)
    assert [n for n, _ in events][:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert events[2][1]["delta"] == {"type": "text_delta", "text": _first_token_text(s, messages)}
    assert b"message_start" in first_bytes and b"text_delta" in first_bytes
