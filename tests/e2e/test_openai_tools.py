"""Tool calls, reasoning, chat history with tools, /tokenize and /detokenize, and the field policy
against a live server (official `openai` client), on a copy of the tiny Qwen3-MoE checkpoint whose
chat template renders tools, tool calls, tool results and enable_thinking as Qwen3's does.

A random-weight model writes no tool call by itself. The copy's tokenizer therefore gives one
vocabulary id (the last BPE merge, which no other merge uses) a whole reasoning + tool-call text;
logit_bias +100 on that id with max_tokens=1 makes the model write exactly that text, and the
server has to find the reasoning and the call in it.
"""
from __future__ import annotations

import json
import os
import shutil

import httpx
import openai
import pytest

from tests.e2e.server import ServerProcess

FORCED = ('<think>check the weather</think>Let me look.<tool_call>\n'
          '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>')

TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content or '' }}
{%- for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
HISTORY = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "assistant", "content": "It is sunny.", "reasoning_content": "the tool said sunny"},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.fixture(scope="module")
def ckpt(checkpoints, tmp_path_factory):
    """The tiny Qwen3-MoE with the template above and id `forced` standing for FORCED."""
    src = checkpoints["qwen3_moe"]
    out = str(tmp_path_factory.mktemp("tools") / "qwen3-tools")
    shutil.copytree(src, out)
    with open(os.path.join(out, "tokenizer.json")) as f:
        tj = json.load(f)
    vocab, merges = tj["model"]["vocab"], tj["model"]["merges"]
    last = "".join(merges[-1]) if isinstance(merges[-1], list) else merges[-1].replace(" ", "")
    forced = vocab.pop(last)
    merges.pop()
    tj["added_tokens"].append({"id": forced, "content": FORCED, "single_word": False, "lstrip": False,
                               "rstrip": False, "normalized": False, "special": False})
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tj, f)
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg["chat_template"] = TEMPLATE
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return out, forced


@pytest.fixture(scope="module")
def server(ckpt):
    s = ServerProcess(["--model", ckpt[0], "--dtype", "float32", "--served-model-name", "tiny",
                       "--kv-cache-memory", str(8 << 20), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       "--reasoning-parser", "qwen3"])
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)


def _forced(ckpt, **kw):
    return dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                max_tokens=1, temperature=0, logit_bias={str(ckpt[1]): 100}, **kw)


def test_tool_call_and_reasoning_parsed(client, ckpt):
    r = client.chat.completions.create(**_forced(ckpt))
    ch = r.choices[0]
    assert r.usage.completion_tokens == 1
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == "Let me look."
    assert ch.message.model_extra["reasoning_content"] == "check the weather"
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    # parallel_tool_calls=false keeps the first call (there is only one); tool_choice none: text.
    r = client.chat.completions.create(**_forced(ckpt, parallel_tool_calls=False))
    assert len(r.choices[0].message.tool_calls) == 1
    r = client.chat.completions.create(**_forced(ckpt, tool_choice="none"))
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == "Let me look." + FORCED.split("Let me look.")[1]


def test_tool_call_and_reasoning_streamed(client, ckpt):
    chunks = list(client.chat.completions.create(**_forced(ckpt, n=2), stream=True))
    for i in range(2):
        deltas = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        content = "".join(d.delta.content or "" for d in deltas)
        reasoning = "".join((d.delta.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        calls = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
        assert content == "Let me look." and reasoning == "check the weather"
        assert calls[0].id and calls[0].type == "function" and calls[0].function.name == "get_weather"
        assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Paris", "days": 2}
        assert deltas[-1].finish_reason == "tool_calls"


def test_history_with_tool_calls_reaches_the_template(server, ckpt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ckpt[0])
    # HF's shape: the arguments as an object (the template writes them with tojson).
    hf_msgs = json.loads(json.dumps(HISTORY))
    hf_msgs[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    for kwargs in ({}, {"enable_thinking": False}):
        expected = hf.apply_chat_template(hf_msgs, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                          return_dict=False, **kwargs)
        r = httpx.post(server.url + "/tokenize", json={"messages": HISTORY, "tools": TOOLS,
                                                       "chat_template_kwargs": kwargs}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == expected
    text = hf.decode(expected)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert '<tool_response id="call_1">\n18 C, sunny' in text and "the tool said sunny" in text
    assert text.endswith("<think>\n\n</think>\n\n")  # enable_thinking=False reached the template
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": HISTORY, "tools": TOOLS, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(expected)
    bad = [dict(HISTORY[2], tool_calls=[{"function": {"name": "f", "arguments": "{not json"}}])]
    r = httpx.post(server.url + "/tokenize", json={"messages": [HISTORY[1], *bad]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_tokenize_detokenize_round_trip(server, ckpt):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(ckpt[0], "tokenizer.json"))
    text = "Hello, café! 東京は日本の首都です。 <|im_end|> done"
    r = httpx.post(server.url + "/tokenize", json={"prompt": text, "return_token_strs": True}, timeout=30).json()
    enc = tok.encode(text)
    assert r["tokens"] == enc.ids and r["count"] == len(enc.ids) and r["token_strs"] == enc.tokens
    models = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    assert r["max_model_len"] == models["max_model_len"] > 0
    d = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, timeout=30)
    assert d.json() == {"prompt": tok.decode(enc.ids, skip_special_tokens=False)} and "<|im_end|>" in d.json()["prompt"]
    vocab = tok.get_vocab_size(with_added_tokens=True)
    d = httpx.post(server.url + "/detokenize", json={"tokens": [5, vocab, -1]}, timeout=30)
    assert d.status_code == 400 and d.json()["error"]["param"] == "tokens"
    assert str(vocab) in d.json()["error"]["message"] and "-1" in d.json()["error"]["message"]
    r = httpx.post(server.url + "/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
                   timeout=30)
    assert r.status_code == 400


def test_unknown_field_is_logged_and_ignored(server, client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"frobnicate": 7, "zz_unknown": "x"}, user="someone")
    assert r.choices[0].message.role == "assistant"
    log = server.log()
    line = next(ln for ln in log.splitlines() if "frobnicate" in ln)
    assert "ignored unknown field(s) frobnicate, user, zz_unknown" in line and r.id in line


def test_continuous_usage_in_every_chunk(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True, temperature=0,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    used = [c.usage.completion_tokens for c in chunks if c.choices]
    assert all(c.usage is not None for c in chunks) and used == sorted(used) and used[-1] == 4
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.prompt_tokens > 0


@pytest.mark.parametrize("flags, message", [
    (["--enable-auto-tool-choice"], "--tool-call-parser"),
    (["--tool-call-parser", "nope"], "--tool-call-parser=nope"),
    (["--reasoning-parser", "nope"], "--reasoning-parser=nope"),
])
def test_bad_parser_flags_exit_2(checkpoints, flags, message, capsys):
    from moe_serve.entrypoints.cli import main

    assert main(["serve", "--model", checkpoints["qwen3_moe"], *flags]) == 2
    assert message in capsys.readouterr().err


BAD = [
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"logit_bias": {"5": -101}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"min_p": 1.5}, "min_p"),
    ({"top_k": -2}, "top_k"),
    ({"seed": 1 << 64}, "seed"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"echo": True}, "echo"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"tool_choice": "auto", "tools": [{"type": "function", "function": {"name": "f"}}],
      "messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages"),
]


@pytest.mark.parametrize("extra, param", BAD)
def test_out_of_range_fields_are_refused(server, extra, param):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    if param not in ("echo", "messages", "stream_options", "max_completion_tokens", "top_logprobs"):
        c = {k: v for k, v in body.items() if k != "messages"}
        r = httpx.post(server.url + "/v1/completions", json={**c, "prompt": "x"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
