"""Agent frameworks, unchanged, against the built-in default model (`moe-serve serve` with no
--model, --enable-auto-tool-choice --tool-call-parser hermes):

- an OpenAI Agents SDK agent with one function tool, forced on the first turn (ModelSettings
  tool_choice "required"), on both of the SDK's models (OpenAIResponsesModel and
  OpenAIChatCompletionsModel): the tool runs with arguments of its schema, and the second turn,
  whose history holds the assistant's call with null content and the tool's result, answers in text;
- an Anthropic client conversation whose tool_result content is a list of text blocks.

The default model's own chat template is written for plain chat (it concatenates content as a
string), so the history has to reach it as vLLM hands it over: null content as "", a list of text
parts as one string (texts on lines). The oracle for that is transformers' rendering of those
messages with the model's tokenizer: the prompt the server counted must have exactly its tokens.
"""
from __future__ import annotations

import asyncio
import json
from typing import Literal

import anthropic
import jsonschema
import pytest
from openai import AsyncOpenAI

import agents
from agents import Agent, ModelSettings, Runner, function_tool

agents.set_tracing_disabled(True)  # the SDK makes no network call of its own

INSTRUCTIONS = "You answer questions about the weather."
QUESTION = "What is the weather in Paris?"
GREEDY = {"extra_body": {"temperature": 0}}  # the current Messages API has no sampling fields


def _template_tokens(path: str, messages: list[dict]) -> int:
    """Prompt tokens of messages rendered by the model's own template, through transformers."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def _model_id(server) -> str:
    import httpx

    return httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.mark.parametrize("sdk_model", ["OpenAIResponsesModel", "OpenAIChatCompletionsModel"])
def test_openai_agents_sdk_calls_the_tool_then_answers(default_tool_server, default_build, sdk_model):
    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 C in {city}."

    client = AsyncOpenAI(base_url=default_tool_server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    model = getattr(agents, sdk_model)(model=_model_id(default_tool_server), openai_client=client)
    # tool_choice "required" on the first turn; the SDK resets it after the call (reset_tool_choice),
    # so the second turn is auto and the model answers in text.
    agent = Agent(name="weather", instructions=INSTRUCTIONS, tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=96))
    result = asyncio.run(Runner.run(agent, QUESTION, max_turns=4))

    assert isinstance(result.final_output, str) and result.final_output.strip(), result.final_output
    assert len(calls) == 1, calls
    call_items = [o for r in result.raw_responses for o in r.output if getattr(o, "type", None) == "function_call"]
    assert [c.name for c in call_items] == ["get_weather"]
    args = json.loads(call_items[0].arguments)
    jsonschema.validate(args, get_weather.params_json_schema)
    assert calls == [args["city"]]

    # The second turn's prompt: the assistant's call with null content and the tool's output reached
    # the template as vLLM hands them ("" and the output's text); this template shows no tool calls.
    assert len(result.raw_responses) == 2
    expected = _template_tokens(default_build["path"], [
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": ""}, {"role": "tool", "content": f"It is sunny and 21 C in {calls[0]}."}])
    assert result.raw_responses[1].usage.input_tokens == expected


def test_anthropic_tool_result_as_a_list_of_blocks(default_tool_server, default_build):
    client = anthropic.Anthropic(base_url=default_tool_server.url, api_key="none", max_retries=0, timeout=300)
    model = _model_id(default_tool_server)
    tool = {"name": "get_weather", "description": "The weather in a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                             "required": ["city"], "additionalProperties": False}}
    question = {"role": "user", "content": QUESTION}
    first = client.messages.create(model=model, max_tokens=96, messages=[question], tools=[tool], **GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather", first.content
    jsonschema.validate(uses[0].input, tool["input_schema"])

    result_blocks = [{"type": "text", "text": "Sunny."}, {"type": "text", "text": f"21 C in {uses[0].input['city']}."}]
    second = client.messages.create(model=model, max_tokens=48, tools=[tool], **GREEDY, messages=[
        question, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": result_blocks}]}])
    text = "".join(b.text for b in second.content if b.type == "text")
    assert second.stop_reason in ("end_turn", "max_tokens") and text.strip(), second.content
    # vLLM's shape: the tool_use turn's content "", the result's text blocks one string on lines.
    expected = _template_tokens(default_build["path"], [
        question, {"role": "assistant", "content": ""},
        {"role": "tool", "content": "\n".join(b["text"] for b in result_blocks)}])
    assert second.usage.input_tokens == expected
    # count_tokens renders the same conversation
    counted = client.messages.count_tokens(model=model, tools=[tool], messages=[
        question, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": result_blocks}]}])
    assert counted.input_tokens == expected
