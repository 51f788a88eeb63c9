"""OpenAI's Responses API and Anthropic's Messages API against live servers, through the official
`openai` and `anthropic` clients, on copies of the tiny Qwen3-MoE whose chat template renders tools,
tool calls, tool results and enable_thinking (tests/e2e/test_openai_tools.py):

- greedy text through /v1/responses and /v1/messages equals chat completions' for the same
  conversation, streamed or not;
- a function tool forced by tool_choice (the grammar makes the model write the call), its output
  fed back (function_call_output / tool_result), and the conversation continued by
  previous_response_id, which the next prompt shows; text.format json_schema validated by jsonschema;
- on a copy whose weights make its greedy token the FORCED reasoning + tool-call text (the residual
  stream carries a constant component the LM head reads for that one id), auto tool choice and
  reasoning come back as reasoning / function_call items and thinking / tool_use blocks, whole and
  streamed;
- stop_sequences, count_tokens (thinking on and off reach the template), the x-api-key header, and
  bad input answered in each API's own error shape with the server unaffected.
"""
from __future__ import annotations

import json
import os
import shutil

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch

from tests.e2e.server import ServerProcess
from tests.e2e.test_openai_tools import ckpt  # noqa: F401  (the tools checkpoint fixture)

KEY = "sk-agents"
# A bounded schema (an enum, no other key), so that a random model's forced call ends well within max tokens.
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}
CHAT_TOOLS = [{"type": "function", "function": WEATHER}]
RESP_TOOL = {"type": "function", **WEATHER}
CLAUDE_TOOL = {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}


@pytest.fixture(scope="module")
def forced_ckpt(ckpt, tmp_path_factory):  # noqa: F811
    """A copy whose greedy token is always FORCED: every embedding gets +100 in channel 0 (after the
    final RMSNorm that channel is about sqrt(D) times its norm weight, whatever the input), and the
    LM head reads channel 0 for the FORCED id only."""
    from safetensors.torch import load_file, save_file

    out = str(tmp_path_factory.mktemp("forced") / "qwen3-forced")
    shutil.copytree(ckpt[0], out)
    path = os.path.join(out, "model.safetensors")
    sd = load_file(path)
    sd["model.embed_tokens.weight"][:, 0] = 100.0
    sd["model.norm.weight"][0] = 1.0
    head = sd["lm_head.weight"]
    head[:, 0] = 0.0
    head[ckpt[1], 0] = 10.0
    save_file({k: v.contiguous() for k, v in sd.items()}, path, metadata={"format": "pt"})
    return out


def _serve(path: str) -> ServerProcess:
    return ServerProcess(["--model", path, "--dtype", "float32", "--served-model-name", "tiny", "--kv-cache-memory",
                          str(8 << 20), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                          "--reasoning-parser", "qwen3", "--api-key", KEY])


@pytest.fixture(scope="module")
def server(ckpt):  # noqa: F811
    s = _serve(ckpt[0])
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def forced_server(forced_ckpt):
    s = _serve(forced_ckpt)
    yield s
    assert s.stop() == 0


def _oai(s):
    return openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, timeout=60, max_retries=0)


def _claude(s):
    return anthropic.Anthropic(base_url=s.url, api_key=KEY, timeout=60, max_retries=0)


CONV = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY = {"extra_body": {"temperature": 0}}  # the current Messages API has no sampling fields; older clients send them


def _chat_text(s, messages, system=None, **kw) -> str:
    msgs = ([{"role": "system", "content": system}] if system else []) + messages
    r = _oai(s).chat.completions.create(model="tiny", messages=msgs, temperature=0, **kw)
    return r.choices[0].message.content


# --- greedy text equals chat completions' -----------------------------------------------------------

def test_responses_text_equals_chat(server):
    want = _chat_text(server, CONV, system="Be brief.", max_tokens=12)
    c = _oai(server)
    r = c.responses.create(model="tiny", input="Weather in Paris?", instructions="Be brief.", max_output_tokens=12,
                           temperature=0)
    assert r.output_text == want and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 0
    events = list(c.responses.create(model="tiny", input=[{"role": "user", "content": "Weather in Paris?"}],
                                      instructions="Be brief.", max_output_tokens=12, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output[0].content[0].text == want
    assert c.responses.retrieve(events[-1].response.id).output[0].content[0].text == want


def test_messages_text_equals_chat(server):
    want = _chat_text(server, CONV, system="Be brief.", max_tokens=12)
    m = _claude(server).messages.create(model="tiny", max_tokens=12, system="Be brief.", messages=CONV,
                                        **GREEDY)
    assert m.content[0].type == "text" and m.content[0].text == want
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 12
    with _claude(server).messages.stream(model="tiny", max_tokens=12, system="Be brief.", messages=CONV,
                                         **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want and final.content[0].text == want and final.stop_reason == "max_tokens"
    assert final.usage.input_tokens == m.usage.input_tokens > 0


def test_stop_sequences(server):
    full = _chat_text(server, CONV, max_tokens=12)
    cut = full[3:6]
    m = _claude(server).messages.create(model="tiny", max_tokens=12, messages=CONV, **GREEDY,
                                        stop_sequences=[cut])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == cut
    assert m.content[0].text == full[:full.index(cut)]


# --- tools: forced calls, their results fed back, conversations continued -------------------------

def test_responses_function_call_round_trip(server):
    c = _oai(server)
    r = c.responses.create(model="tiny", input="Weather in Paris?", tools=[RESP_TOOL], max_output_tokens=300,
                           tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    # The call's output fed back as the next input, the conversation continued by id.
    r2 = c.responses.create(model="tiny", previous_response_id=r.id, max_output_tokens=3, temperature=0,
                            tools=[RESP_TOOL], tool_choice="none",
                            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.call_id, "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"}]
    prompt = httpx.post(server.url + "/tokenize", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                        json={"messages": history, "tools": CHAT_TOOLS}).json()["count"]
    assert r2.usage.input_tokens == prompt  # the stored turn and the tool output made the prompt
    assert r2.output_text == _chat_text(server, history, max_tokens=3, tools=CHAT_TOOLS, tool_choice="none")
    # Streamed: the call's events, its arguments in fragments.
    events = list(c.responses.create(model="tiny", input="Weather in Paris?", tools=[RESP_TOOL], stream=True,
                                     tool_choice="required", max_output_tokens=300, temperature=0))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done[-1].item.type == "function_call" and done[-1].item.arguments == args and json.loads(args)


def test_messages_tool_use_round_trip(server):
    c = _claude(server)
    m = c.messages.create(model="tiny", max_tokens=300, messages=CONV, tools=[CLAUDE_TOOL], **GREEDY,
                          tool_choice={"type": "tool", "name": "get_weather"})
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and "city" in use.input and m.stop_reason == "end_turn"
    m = c.messages.create(model="tiny", max_tokens=300, messages=CONV, tools=[CLAUDE_TOOL], **GREEDY,
                          tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use" and [b.type for b in m.content][-1] == "tool_use"
    turn = [*CONV, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                      "input": use.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]}]
    m2 = c.messages.create(model="tiny", max_tokens=3, messages=turn, tools=[CLAUDE_TOOL], **GREEDY,
                           tool_choice={"type": "none"})
    history = [CONV[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
               {"role": "tool", "tool_call_id": use.id, "content": "18 C"}]
    assert m2.content[0].text == _chat_text(server, history, max_tokens=3, tools=CHAT_TOOLS, tool_choice="none")
    with c.messages.stream(model="tiny", max_tokens=300, messages=CONV, tools=[CLAUDE_TOOL], **GREEDY,
                           tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    assert final.content[-1].type == "tool_use" and final.content[-1].input == m.content[-1].input


def test_responses_json_schema(server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}
    r = _oai(server).responses.create(model="tiny", input="A city as JSON.", max_output_tokens=300, temperature=0,
                                      text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                       "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


# --- what the model writes itself: auto tool choice, reasoning ---------------------------------------

def test_auto_tool_call_and_reasoning(forced_server):
    r = _oai(forced_server).responses.create(model="tiny", input="Weather in Paris?", tools=[RESP_TOOL],
                                             max_output_tokens=1, temperature=0)
    kinds = [o.type for o in r.output]
    assert kinds == ["reasoning", "message", "function_call"], kinds
    assert r.output[0].content[0].text == "check the weather" and r.output[1].content[0].text == "Let me look."
    assert json.loads(r.output[2].arguments) == {"city": "Paris", "days": 2}
    events = list(_oai(forced_server).responses.create(model="tiny", input="Weather in Paris?", tools=[RESP_TOOL],
                                                       max_output_tokens=1, temperature=0, stream=True))
    final = events[-1].response
    assert [o.type for o in final.output] == kinds and json.loads(final.output[2].arguments) == {"city": "Paris",
                                                                                                 "days": 2}
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "check the weather"
    m = _claude(forced_server).messages.create(model="tiny", max_tokens=1, messages=CONV, tools=[CLAUDE_TOOL],
                                               **GREEDY, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"] and m.stop_reason == "tool_use"
    assert m.content[0].thinking == "check the weather" and m.content[2].input == {"city": "Paris", "days": 2}
    with _claude(forced_server).messages.stream(model="tiny", max_tokens=1, messages=CONV, tools=[CLAUDE_TOOL],
                                                **GREEDY) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"city": "Paris", "days": 2}


def test_count_tokens_and_thinking_reach_the_template(server, ckpt):  # noqa: F811
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ckpt[0])
    c = _claude(server)
    for thinking, kwargs in (({"type": "enabled", "budget_tokens": 1024}, {}),
                             ({"type": "disabled"}, {"enable_thinking": False})):
        want = hf.apply_chat_template(CONV, tools=CHAT_TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False,
                                      **kwargs)
        n = c.messages.count_tokens(model="tiny", messages=CONV, tools=[CLAUDE_TOOL], thinking=thinking)
        assert n.input_tokens == len(want)


# --- errors ------------------------------------------------------------------------------------------

def test_errors_in_each_apis_shape(server):
    c, o = _claude(server), _oai(server)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=5, messages=CONV)
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=30,
                   json={"model": "tiny", "messages": CONV})  # no max_tokens
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        o.responses.create(model="tiny", input="hi", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.NotFoundError):
        o.responses.create(model="tiny", input="hi", previous_response_id="resp_unknown")
    with pytest.raises(openai.NotFoundError):
        o.responses.retrieve("resp_unknown")
    with pytest.raises(openai.BadRequestError) as e:
        o.responses.create(model="tiny", input="hi", reasoning={"effort": "high"})
    assert e.value.body["param"] == "reasoning"  # this template has no reasoning_effort to set
    r = o.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        o.responses.retrieve(r.id)
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert len(_claude(server).messages.create(model="tiny", max_tokens=2, messages=CONV).content) == 1
