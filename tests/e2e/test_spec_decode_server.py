"""Speculative decoding through the OpenAI API (the official client): streamed completions, whose
chunks may now carry several tokens, give the plain server's text, token logprobs and finish
reasons, stop strings included; the metrics count drafts and acceptances per position."""
from __future__ import annotations

import openai
import pytest

from tests.e2e.server import ServerProcess

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
PROMPTS = ["one two three one two three one two three one two", "a b c d a b c d a b c d a b", "hello hello hello"]


@pytest.fixture(scope="module")
def servers(checkpoints):
    args = ["--model", checkpoints["qwen3_moe"], "--dtype", "float32", "--kv-cache-memory", str(16 << 20),
            "--served-model-name", "tiny"]
    plain = ServerProcess(args)
    try:
        spec = ServerProcess(args + ["--speculative-config", SPEC])
    except BaseException:
        plain.stop()
        raise
    yield plain, spec
    spec.stop()
    plain.stop()


def stream(url: str, prompt: str, **kw) -> tuple[str, list[str], str, int]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    text, tokens, reason, chunks = "", [], None, 0
    for ch in client.completions.create(model="tiny", prompt=prompt, stream=True, temperature=0, **kw):
        c = ch.choices[0]
        chunks += 1
        text += c.text
        if c.logprobs is not None:
            tokens += c.logprobs.tokens
        reason = c.finish_reason or reason
    return text, tokens, reason, chunks


def test_streams_match_the_plain_server(servers):
    plain, spec = servers
    for prompt in PROMPTS:
        want = stream(plain.url, prompt, max_tokens=40, logprobs=1)
        got = stream(spec.url, prompt, max_tokens=40, logprobs=1)
        assert got[:3] == want[:3]
        cut = want[0][len(want[0]) // 2:][:4]
        if cut.strip():  # a stop string from the middle of the text: both stop at its first occurrence
            assert stream(spec.url, prompt, max_tokens=40, stop=[cut])[:3] == \
                stream(plain.url, prompt, max_tokens=40, stop=[cut])[:3]
    m = spec.metrics()
    assert m["moe_serve:spec_decode_num_drafts_total"] > 0
    assert m["moe_serve:spec_decode_num_draft_tokens_total"] >= m["moe_serve:spec_decode_num_accepted_tokens_total"] > 0
    assert plain.metrics()["moe_serve:spec_decode_num_drafts_total"] == 0
