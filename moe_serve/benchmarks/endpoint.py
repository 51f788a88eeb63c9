"""The client side of `moe-serve bench serve`: one streamed request to an OpenAI-compatible
endpoint, timed token by token, and the few other routes the benchmark reads (/v1/models,
/tokenize)."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT)


class BenchError(RuntimeError):
    """The benchmark cannot run (server unreachable, no model listed): one line for the user."""


@dataclass
class RequestResult:
    """What one request did. Times are seconds; `start` is from the start of the level."""

    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    text: str = ""  # the generated text (multi_turn appends it to the next turn's prompt)
    usage: bool = False  # token counts came from the server's usage, not counted chunks
    conversation: int | None = None
    turn: int | None = None


def payload_for(endpoint: str, model: str, prompt, max_tokens: int, temperature: float,
                ignore_eos: bool) -> dict:
    """The request body. `prompt`: text or token ids for completions; for chat, text (one user
    message) or a messages list."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # a vLLM / SGLang / moe-serve extension: exact output lengths
    if endpoint == CHAT:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            body["messages"] = prompt
        else:
            text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
            body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = prompt
    return body


async def stream_request(client: httpx.AsyncClient, endpoint: str, body: dict, t_origin: float,
                         known_prompt_len: int | None = None) -> RequestResult:
    """POST `body` to `endpoint` and read its event stream: TTFT is the time to the first chunk
    carrying text, inter-token latencies the gaps between such chunks; token counts come from the
    final usage chunk (stream_options.include_usage), else one token per text chunk."""
    res = RequestResult()
    chunks = 0
    texts: list[str] = []
    t0 = time.perf_counter()
    res.start = t0 - t_origin
    last = t0
    try:
        async with client.stream("POST", endpoint, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                res.latency = time.perf_counter() - t0
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("error"):  # a stream that could not finish
                    err = msg["error"]
                    res.error = "stream error: " + (err.get("message", str(err)) if isinstance(err, dict) else str(err))
                    res.latency = time.perf_counter() - t0
                    return res
                usage = msg.get("usage")
                if usage:
                    res.prompt_len = int(usage.get("prompt_tokens") or 0)
                    res.output_len = int(usage.get("completion_tokens") or 0)
                    res.usage = True
                for ch in msg.get("choices") or ():
                    delta = ch.get("delta") or {}
                    text = ch.get("text") if "text" in ch else delta.get("content")
                    # reasoning deltas are tokens too (timed, not part of the answer resent by multi_turn)
                    if not (text or delta.get("reasoning_content") or delta.get("reasoning")):
                        continue  # role-only chunks, or tokens that decode to nothing yet
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
                    texts.append(text or "")
        res.latency = time.perf_counter() - t0
        if not res.usage:
            res.output_len = chunks
            res.prompt_len = known_prompt_len or 0
        if chunks == 0:
            res.ttft = res.latency
        res.text = "".join(texts)
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, asyncio.TimeoutError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        res.latency = time.perf_counter() - t0
    return res


def list_models(base_url: str, headers: dict, timeout: float = 10.0) -> list[dict]:
    """GET /v1/models: the served models' cards."""
    try:
        r = httpx.get(base_url + "/v1/models", headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {base_url}/v1/models ({type(e).__name__}: {e}): is the server up? "
                         "Check --base-url / --host / --port, or pass --model") from None
    if r.status_code != 200:
        raise BenchError(f"{base_url}/v1/models answered HTTP {r.status_code}: {r.text[:200]}"
                         + (" (pass --api-key or set OPENAI_API_KEY)" if r.status_code == 401 else ""))
    try:
        data = r.json()["data"]
        assert isinstance(data, list)
        return data
    except (ValueError, KeyError, AssertionError):
        raise BenchError(f"{base_url}/v1/models: not an OpenAI model list: {r.text[:200]}") from None


def server_tokenizer(base_url: str, headers: dict, model: str):
    """A token counter backed by the server's POST /tokenize (vLLM's and ours), or None where the
    server has none."""
    client = httpx.Client(base_url=base_url, headers=headers, timeout=30.0)

    def count(text: str) -> int:
        r = client.post("/tokenize", json={"model": model, "prompt": text})
        r.raise_for_status()
        return int(r.json()["count"])

    try:
        count("hello")
    except (httpx.HTTPError, ValueError, KeyError):
        client.close()
        return None
    return count
