"""Router replay through the OpenAI API, with the official client: `return_routed_experts` on
completions and chat (whole and streamed) gives `choices[i].routed_experts` of the documented shape
(checked with a JSON schema), equal to the offline LLM's rows (those are checked against
transformers in tests/models/test_routed_experts.py); the base64 form decodes to the same array;
bad values are refused with a 400 naming the field; without the field the key is absent."""
from __future__ import annotations

import base64

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from moe_serve import LLM, SamplingParams
from tests.e2e.server import ServerProcess

KEY = "sk-test-key"
PROMPT = [5, 77, 301, 42, 9, 8, 7, 6]
LAYERS, K, E = 2, 3, 8  # the tiny Qwen3-MoE: MoE layers 0 and 2 of 3, top-3 of 8 experts


def rows_schema(positions: int) -> dict:
    ids = {"type": "array", "minItems": K, "maxItems": K, "items": {"type": "integer", "minimum": 0, "maximum": E - 1}}
    per_layer = {"type": "array", "minItems": LAYERS, "maxItems": LAYERS, "items": ids}
    return {"type": "array", "minItems": positions, "maxItems": positions, "items": per_layer}


@pytest.fixture(scope="module")
def server(checkpoints):
    s = ServerProcess(["--model", checkpoints["qwen3_moe"], "--dtype", "float32", "--api-key", KEY,
                       "--served-model-name", "tiny-qwen", "--kv-cache-memory", str(8 << 20)])
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def offline(checkpoints):
    llm = LLM(checkpoints["qwen3_moe"], dtype="float32", kv_cache_memory=8 << 20, show_progress=False)
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, return_routed_experts=True))[0]
    return out.outputs[0]


def test_completions_list_form(client, offline):
    r = client.completions.create(model="tiny-qwen", prompt=PROMPT, max_tokens=6, temperature=0,
                                  extra_body={"return_routed_experts": True, "ignore_eos": True})
    rows = r.choices[0].model_extra["routed_experts"]
    jsonschema.validate(rows, rows_schema(r.usage.prompt_tokens + r.usage.completion_tokens - 1))
    assert np.array_equal(np.array(rows), offline.routed_experts)


def test_chat_base64_form_and_stream(client):
    messages = [{"role": "user", "content": "hello there"}]
    extra = {"return_routed_experts": True, "ignore_eos": True}
    whole = client.chat.completions.create(model="tiny-qwen", messages=messages, max_tokens=5, temperature=0,
                                           extra_body={**extra, "routed_experts_format": "base64"})
    packed = whole.choices[0].model_extra["routed_experts"]
    jsonschema.validate(packed, {"type": "string", "contentEncoding": "base64"})
    rows = np.frombuffer(base64.b64decode(packed), dtype="<i2").reshape(-1, LAYERS, K)
    assert len(rows) == whole.usage.prompt_tokens + whole.usage.completion_tokens - 1
    chunks = list(client.chat.completions.create(model="tiny-qwen", messages=messages, max_tokens=5, temperature=0,
                                                 stream=True, extra_body=extra))
    carried = [c.choices[0].model_extra.get("routed_experts") for c in chunks if c.choices]
    assert all(x is None for x in carried[:-1]) and chunks[-1].choices[0].finish_reason is not None
    jsonschema.validate(carried[-1], rows_schema(len(rows)))
    assert np.array_equal(np.array(carried[-1]), rows)


def test_streamed_completion_carries_them_in_its_last_chunk(client, offline):
    chunks = list(client.completions.create(model="tiny-qwen", prompt=PROMPT, max_tokens=6, temperature=0,
                                            stream=True, extra_body={"return_routed_experts": True,
                                                                     "ignore_eos": True}))
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert np.array_equal(np.array(last.choices[0].model_extra["routed_experts"]), offline.routed_experts)


def test_bad_values_are_refused_and_absent_field_is_absent(server, client):
    for body, field in (({"routed_experts_format": "xml", "return_routed_experts": True}, "routed_experts_format"),
                        ({"return_routed_experts": "yes"}, "return_routed_experts")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny-qwen", prompt=PROMPT, max_tokens=2, extra_body=body)
        assert field in str(e.value)
    r = httpx.post(server.url + "/v1/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200 and "routed_experts" not in r.json()["choices"][0]
