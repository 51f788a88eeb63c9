"""Prompt logprobs through a live server, against transformers' own float32 forward on the same
tiny checkpoint: completions' `echo` with `logprobs` in OpenAI's legacy format (what scoring
clients such as lm-evaluation-harness read: a logprob for every prompt token, the first null),
`max_tokens: 0` with echo (the prompt alone), vLLM's `prompt_logprobs` on completions and chat,
and the refusals. Steps of 16 tokens split the 45-token prompt into chunks, and the prompt is
cached before it is scored (a would-be prefix-cache hit)."""
from __future__ import annotations

import random

import httpx
import openai
import pytest
import torch

from tests.e2e.server import ServerProcess

MODEL = "tiny"
TOL = 1e-4


@pytest.fixture(scope="module")
def path(checkpoints):
    return checkpoints["mixtral"]


@pytest.fixture(scope="module")
def prompt(path) -> list[int]:
    """45 token ids that each decode to printable ASCII, so the echoed text is their strings joined."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ok = [i for i in range(tok.vocab_size) if (t := tok.decode([i])).isascii() and t.isprintable() and t
          and i not in tok.all_special_ids]
    rng = random.Random(21)
    return [rng.choice(ok) for _ in range(45)]


@pytest.fixture(scope="module")
def hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(path):
    s = ServerProcess(["--model", path, "--dtype", "float32", "--served-model-name", MODEL, "--block-size", "4",
                       "--max-num-batched-tokens", "16", "--kv-cache-memory", str(8 << 20)])
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)


def reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def decode(path: str, ids: list[int]) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [tok.decode([i]) for i in ids]


def check_legacy(lp, ids: list[int], ref: torch.Tensor, strings: list[str], n_top: int) -> None:
    """OpenAI's legacy logprobs of the echoed prompt ids (the first null)."""
    assert lp.tokens[:len(ids)] == strings
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(ids)):
        assert abs(lp.token_logprobs[j] - ref[j - 1, ids[j]].item()) < TOL, j
        top_v = torch.topk(ref[j - 1], n_top).values.tolist()
        got = sorted(lp.top_logprobs[j].values(), reverse=True)
        # Keys are token strings: two tokens that read the same share one.
        assert 1 <= len(got) <= n_top and abs(got[0] - top_v[0]) < TOL
        assert all(min(abs(v - r) for r in top_v) < TOL for v in got), (j, got, top_v)
    assert lp.text_offset[0] == 0
    for j in range(len(ids) - 1):
        assert lp.text_offset[j + 1] - lp.text_offset[j] == len(lp.tokens[j])


def test_echo_logprobs_score_every_prompt_token(server, client, hf, path, prompt):
    PROMPT = prompt
    ref, strings = reference(hf, PROMPT), decode(path, PROMPT)
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
    cached = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
    assert cached.usage.prompt_tokens_details.cached_tokens == 44, "the prompt should be in the prefix cache"

    # lm-evaluation-harness's request: temperature 0, max_tokens 1, logprobs 1, echo.
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=2, echo=True)
    c = r.choices[0]
    assert r.usage.prompt_tokens == 45 and r.usage.completion_tokens == 1
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # computed, not taken from the cache
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 46
    check_legacy(lp, PROMPT, ref, strings, 2)
    # The generated token (greedy): the most likely at the last prompt position.
    assert abs(lp.token_logprobs[45] - ref[44].max().item()) < TOL
    assert c.text == "".join(strings) + lp.tokens[45] and lp.text_offset[45] == len("".join(strings))
    # What a scoring client sums for a continuation after a 30-token context.
    assert abs(sum(lp.token_logprobs[30:-1]) - sum(ref[j - 1, PROMPT[j]].item() for j in range(30, 45))) < 1e-3

    # The same as a stream: the echoed prompt and its logprobs first, then the generated token.
    chunks = [ch.choices[0] for ch in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=2, echo=True, stream=True) if ch.choices]
    assert chunks[0].text == "".join(strings) and chunks[0].logprobs.token_logprobs == lp.token_logprobs[:45]
    assert "".join(ch.text for ch in chunks) == c.text and chunks[-1].finish_reason == "length"


def test_echo_with_max_tokens_0_is_the_prompt_alone(server, client, hf, path, prompt):
    PROMPT = prompt
    ref, strings = reference(hf, PROMPT[:20]), decode(path, PROMPT[:20])
    r = client.completions.create(model=MODEL, prompt=PROMPT[:20], max_tokens=0, logprobs=1, echo=True)
    c = r.choices[0]
    assert c.text == "".join(strings) and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == 20
    assert len(c.logprobs.tokens) == 20
    check_legacy(c.logprobs, PROMPT[:20], ref, strings, 1)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT[:20], max_tokens=0, logprobs=1, echo=True,
                                            stream=True, stream_options={"include_usage": True}))
    texts = [ch.choices[0] for ch in chunks if ch.choices]
    assert len(texts) == 1 and texts[0].text == c.text and texts[0].finish_reason == "length"
    assert texts[0].logprobs.token_logprobs == c.logprobs.token_logprobs
    assert chunks[-1].usage.completion_tokens == 0
    # Without logprobs: the text alone; several prompts and n.
    r = client.completions.create(model=MODEL, prompt=[PROMPT[:5], PROMPT[5:9]], max_tokens=0, echo=True, n=2)
    assert sorted((ch.index, ch.text) for ch in r.choices) == [
        (0, "".join(strings[:5])), (1, "".join(strings[:5])), (2, "".join(strings[5:9])), (3, "".join(strings[5:9]))]


def check_vllm_field(field, ids: list[int], ref: torch.Tensor, n_top: int) -> None:
    assert field[0] is None and len(field) == len(ids)
    for j in range(1, len(ids)):
        row, tok, d = ref[j - 1], ids[j], field[j]
        e = d[str(tok)]
        assert abs(e["logprob"] - row[tok].item()) < TOL
        assert int((row > row[tok] + TOL).sum()) + 1 <= e["rank"] <= int((row > row[tok] - TOL).sum()) + 1
        top = torch.topk(row, n_top)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            if str(t) in d:
                assert abs(d[str(t)]["logprob"] - v) < TOL
        assert len(d) <= n_top + 1 and sum(str(t) in d for t in top.indices.tolist()) >= n_top - 1


def test_vllm_prompt_logprobs_on_completions_and_chat(server, hf, prompt):
    PROMPT = prompt
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["logprobs"] is None  # not asked for
    check_vllm_field(c["prompt_logprobs"], PROMPT, reference(hf, PROMPT), 3)

    messages = [{"role": "user", "content": "How many legs does a spider have? " * 3}]
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    assert len(ids) > 16  # chunked
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    check_vllm_field(r.json()["prompt_logprobs"], ids, reference(hf, ids), 0)
    plain = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}).json()
    assert plain["prompt_logprobs"] is None


@pytest.mark.parametrize("route, body, param", [
    ("completions", {"prompt": [5, 6], "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": [5, 6], "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ("completions", {"prompt": [5, 6], "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("completions", {"prompt": [5, 6], "prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {"prompt": [5, 6], "prompt_logprobs": -1}, "prompt_logprobs"),
    ("completions", {"prompt": [5, 6], "echo": True, "logprobs": 21}, "logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
])
def test_refused_naming_the_field(server, route, body, param):
    r = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_disaggregated_request_with_prompt_logprobs_is_refused(path):
    """On a decode instance the prompt is computed by a prefill instance: its logprobs are not
    here, so the request is refused before anything is reserved."""
    s = ServerProcess(["--model", path, "--dtype", "float32", "--served-model-name", MODEL, "--kv-cache-memory",
                       str(8 << 20), "--disaggregation-mode", "decode"])
    try:
        kv = {"prefill_url": "http://127.0.0.1:9"}
        for body in ({"prompt": [5, 6, 7], "echo": True, "logprobs": 1, "max_tokens": 1},
                     {"prompt": [5, 6, 7], "prompt_logprobs": 0, "max_tokens": 1}):
            r = httpx.post(s.url + "/v1/completions", json={**body, "kv_transfer_params": kv}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)  # computed here: served
            assert r.status_code == 200, r.text
    finally:
        assert s.stop() == 0
