"""Structured outputs and tool_choice "required" / named through a live server and the official
`openai` client: outputs validate against their schemas (`jsonschema` as the oracle) at temperature
1 on random weights, streamed tool-call deltas assemble into the whole response's calls, requests
without constraints are token-identical beside constrained ones, and specs xgrammar cannot compile
are 400s naming the field."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.e2e.server import ServerProcess

KEY = "sk-test-key"
MODEL = "tiny"
MSG = [{"role": "user", "content": "Give me the data."}]
# Bounded schemas: every string a pattern or enum, numbers in ranges, arrays with maxItems, so a
# random model finishes well within max_tokens.
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "member": {"type": "boolean"},
                         "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3}},
          "required": ["name", "age", "member", "pets"], "additionalProperties": False}
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Berlin", "Tokyo"]},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
BOOK = {"type": "object",
        "properties": {"title": {"type": "string", "pattern": "^[a-z ]{1,12}$"}, "copies": {"type": "integer",
                                                                                          "minimum": 1, "maximum": 9}},
        "required": ["title", "copies"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "order_book", "parameters": BOOK}}]
SCHEMAS = {"get_weather": WEATHER, "order_book": BOOK}


@pytest.fixture(scope="module")
def server(checkpoints):
    # With a reasoning parser that takes a whole unconstrained output as reasoning (deepseek_r1
    # starts inside <think>): constrained outputs must still be the content.
    s = ServerProcess(["--model", checkpoints["qwen3_moe"], "--dtype", "float32", "--api-key", KEY,
                       "--served-model-name", MODEL, "--kv-cache-memory", str(8 << 20),
                       "--reasoning-parser", "deepseek_r1"])
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=120, max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=MSG, **kw)


def plain_text(choice) -> str:
    """An unconstrained chat output: all of it is reasoning under deepseek_r1 (no </think>)."""
    msg = choice.message
    assert not msg.content
    return (msg.model_extra or {}).get("reasoning_content") or ""


def test_json_schema_outputs_validate(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = chat(client, response_format=rf, temperature=1.0, seed=0, n=3, max_tokens=300)
    outs = [(c.message.content, c.finish_reason) for c in r.choices]
    for s in (10, 20):  # (n=3 with seed 0 is seeds 0, 1, 2)
        c = chat(client, response_format=rf, temperature=1.0, seed=s, max_tokens=300).choices[0]
        outs.append((c.message.content, c.finish_reason))
    for text, finish in outs:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert len({t for t, _ in outs}) == len(outs)
    # A cut-short JSON is finish_reason "length", as vLLM does.
    c = chat(client, response_format=rf, temperature=1.0, seed=0, max_tokens=3).choices[0]
    assert c.finish_reason == "length" and c.message.content.startswith("{")
    # The completions endpoint takes the same response_format, and vLLM's structured_outputs.
    r = client.completions.create(model=MODEL, prompt="Person:", temperature=1.0, seed=5, max_tokens=300,
                                  extra_body={"structured_outputs": {"json": PERSON}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = client.completions.create(model=MODEL, prompt="Person:", temperature=0, max_tokens=300,
                                  extra_body={"response_format": rf})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_json_object_regex_choice_text(client):
    finished = 0
    for s in range(4):
        c = chat(client, response_format={"type": "json_object"}, temperature=1.0, seed=s, max_tokens=120).choices[0]
        assert c.message.content.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
            finished += 1
    assert finished >= 1
    regex = r"(yes|no), [0-9]{2,4} (apples|pears)"
    for s in range(3):
        c = chat(client, temperature=1.0, seed=s, max_tokens=60,
                 extra_body={"structured_outputs": {"regex": regex}}).choices[0]
        assert re.fullmatch(regex, c.message.content) and c.finish_reason == "stop"
    choices = ["red", "green", "dark blue", 'say "hi"']
    seen = {chat(client, temperature=1.0, seed=s, max_tokens=20,
                 extra_body={"structured_outputs": {"choice": choices}}).choices[0].message.content for s in range(6)}
    assert seen <= set(choices) and seen
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'
    c = chat(client, temperature=1.0, seed=1, max_tokens=60,
             extra_body={"structured_outputs": {"grammar": grammar}}).choices[0]
    assert re.fullmatch(r"\([1-9](\+[1-9])*\)", c.message.content), c.message.content
    # "text" is unconstrained: the same tokens as no response_format at all.
    kw = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    text = plain_text(chat(client, **kw).choices[0])
    assert text and plain_text(chat(client, response_format={"type": "text"}, **kw).choices[0]) == text


def _assemble(chunks):
    calls, finish, content = {}, None, ""
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
            else:
                assert tc.id is None and not tc.function.name
                calls[tc.index][2] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return [v for _, v in sorted(calls.items())], finish, content


def test_named_tool_choice(client):
    tc = {"type": "function", "function": {"name": "get_weather"}}
    for s in range(3):
        kw = dict(tools=TOOLS, tool_choice=tc, temperature=1.0, seed=s, max_tokens=200)
        c = chat(client, **kw).choices[0]
        assert c.finish_reason == "stop" and c.message.content is None  # vLLM's finish_reason for a named function
        (call,) = c.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        calls, finish, content = _assemble(chat(client, stream=True, **kw))
        assert finish == "stop" and content == ""
        assert [(n, a) for _, n, a in calls] == [("get_weather", call.function.arguments)]


def test_required_tool_choice(client):
    for s, parallel in ((0, None), (1, None), (2, False), (3, None)):
        kw = dict(tools=TOOLS, tool_choice="required", temperature=1.0, seed=s, max_tokens=400)
        if parallel is not None:
            kw["parallel_tool_calls"] = parallel
        c = chat(client, **kw).choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c.message
        assert len(c.message.tool_calls) >= 1 and (parallel is not False or len(c.message.tool_calls) == 1)
        for call in c.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        calls, finish, _ = _assemble(chat(client, stream=True, **kw))
        assert finish == "tool_calls"
        assert [(n, a) for _, n, a in calls] == [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
        assert len({i for i, _, _ in calls}) == len(calls)


def test_unconstrained_requests_identical_beside_constrained(client):
    plain = [dict(temperature=0, max_tokens=24), dict(temperature=1.0, seed=11, max_tokens=24),
             dict(temperature=0.7, top_p=0.9, seed=5, max_tokens=24)]
    for kw in plain:
        kw["extra_body"] = {"ignore_eos": True}
    alone = [plain_text(chat(client, **kw).choices[0]) for kw in plain]
    assert all(alone)
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    constrained = [dict(response_format=rf, temperature=1.0, seed=s, max_tokens=300) for s in range(6)]
    jobs = [kw for pair in zip(constrained, plain + plain) for kw in pair]
    with ThreadPoolExecutor(len(jobs)) as ex:
        results = list(ex.map(lambda kw: chat(client, **kw).choices[0], jobs))
    results = [plain_text(c) if i % 2 else c.message.content for i, c in enumerate(results)]
    assert results[1::2] == alone + alone
    for text in results[0::2]:
        jsonschema.validate(json.loads(text), PERSON)


def test_refusals_name_the_field(client):
    def bad(param, **kw):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, max_tokens=5, **kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
        return e.value.body["message"]

    bad("response_format", response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}})
    bad("response_format", response_format={"type": "xml"})
    bad("response_format", response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert "position" in bad("structured_outputs", extra_body={"structured_outputs": {"regex": "(ab"}})
    bad("structured_outputs", extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}})
    bad("structured_outputs", extra_body={"structured_outputs": {"grammar": "root ::= missing"}})
    bad("structured_outputs", response_format={"type": "json_object"},
        extra_body={"structured_outputs": {"regex": "a"}})
    bad("min_tokens", response_format={"type": "json_object"}, extra_body={"min_tokens": 3})
    bad("tool_choice", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    bad("tool_choice", tool_choice="required")
    bad("tool_choice", tool_choice={"type": "function", "function": {"name": "get_weather"}})
    bad("tool_choice", tools=TOOLS, tool_choice="sometimes")
    bad("response_format", tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    broken = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(("}}}}}]
    bad("tools", tools=broken, tool_choice="required")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5,
                                  extra_body={"structured_outputs": {"json": "{not json"}})
    assert e.value.body["param"] == "structured_outputs"
