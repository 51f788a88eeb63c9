"""Tool-call and reasoning parsers on canned model outputs: the whole-text parse against the calls
the text was built from, and streams split at every character boundary, one character at a time
and in token-sized chunks, against the whole-text parse."""
from __future__ import annotations

import json
import random

import pytest

from moe_serve.entrypoints.openai.reasoning import REASONING_PARSERS
from moe_serve.entrypoints.openai.tool_parsers import PARSERS

WEATHER = {"city": "Paris", "days": 3, "units": ["c", "f"], "note": "a \"quoted\" {brace} </tool_call>-free, café"}
SEARCH = {"q": "x < y", "n": -1.5e3, "deep": {"a": [True, None, {}]}}


def hermes(name, args, raw=None):
    return '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (name, raw or json.dumps(args))


def deepseek(calls):
    body = "".join("<｜tool▁call▁begin｜>function<｜tool▁sep｜>%s\n```json\n%s\n```<｜tool▁call▁end｜>"
                   % (n, json.dumps(a, ensure_ascii=False)) for n, a in calls)
    return "<｜tool▁calls▁begin｜>" + body + "<｜tool▁calls▁end｜>"


def mistral_array(calls):
    return "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def mistral_v11(calls):
    return "".join("[TOOL_CALLS]%s%s" % (n, json.dumps(a)) for n, a in calls)


# (parser, model output, expected content, expected [(name, arguments as objects)])
CASES = [
    ("hermes", "The weather, then a search.\n\n" + hermes("get_weather", WEATHER) + "\n" + hermes("search", SEARCH),
     "The weather, then a search.", [("get_weather", WEATHER), ("search", SEARCH)]),
    ("hermes", hermes("get_weather", WEATHER), None, [("get_weather", WEATHER)]),
    ("hermes", "Just text, no calls: a < b, <tool and tool_call>.", "Just text, no calls: a < b, <tool and tool_call>.",
     []),
    ("hermes", "Before " + hermes("f", {}) + " after.", "Beforeafter.", [("f", {})]),
    # A call left open at the end of the output still counts when its JSON is complete.
    ("hermes", 'Hi <tool_call>\n{"name": "f", "arguments": {"x": 1}}', "Hi", [("f", {"x": 1})]),
    # Not JSON: the text stays content, tags and all.
    ("hermes", "A <tool_call>\nnot json\n</tool_call>", "A <tool_call>\nnot json\n</tool_call>", []),
    ("hermes", '<tool_call>{"arguments": {"k": "v"}, "name": "late_name"}</tool_call>', None,
     [("late_name", {"k": "v"})]),
    ("hermes", '<tool_call>{"name": "noargs"}</tool_call>', None, [("noargs", {})]),
    # Cut off inside the call (max_tokens): no call, the text as written.
    ("hermes", 'Hm <tool_call>{"name": "f", "arguments": {"x": ', 'Hm <tool_call>{"name": "f", "arguments": {"x": ',
     []),
    ("deepseek_v3", "Let me look.\n" + deepseek([("get_weather", WEATHER), ("search", SEARCH)]), "Let me look.",
     [("get_weather", WEATHER), ("search", SEARCH)]),
    ("deepseek_v3", deepseek([("f", {"a": "```"})]) + "\nDone.", "Done.", [("f", {"a": "```"})]),
    ("deepseek_v3", "No tools <｜tool here.", "No tools <｜tool here.", []),
    ("mistral", "Sure. " + mistral_array([("get_weather", WEATHER), ("search", SEARCH)]), "Sure.",
     [("get_weather", WEATHER), ("search", SEARCH)]),
    ("mistral", mistral_v11([("get_weather", WEATHER), ("search", SEARCH)]), None,
     [("get_weather", WEATHER), ("search", SEARCH)]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": [1, 2]}', None, [("f", {"x": [1, 2]})]),
    ("mistral", "Plain [TOOL text.", "Plain [TOOL text.", []),
]


def _ids(cases):
    return [f"{c[0]}-{i}" for i, c in enumerate(cases)]


@pytest.mark.parametrize("parser, text, content, calls", CASES, ids=_ids(CASES))
def test_whole_output(parser, text, content, calls):
    out = PARSERS[parser](None, []).parse(text)
    assert out.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in out.tool_calls] == calls
    assert all(c.type == "function" and c.id for c in out.tool_calls)
    assert len({c.id for c in out.tool_calls}) == len(out.tool_calls)
    if parser == "mistral":  # Mistral's templates accept only 9-character alphanumeric ids back
        assert all(len(c.id) == 9 and c.id.isalnum() for c in out.tool_calls)


def _run_stream(parser, chunks):
    s = parser.stream()
    content, names, ids, args, pieces = "", {}, {}, {}, []
    for k, chunk in enumerate(chunks):
        d = s.feed(chunk, final=k == len(chunks) - 1)
        if d.content:
            content += d.content
            pieces.append(d.content)
        for c in d.tool_calls:
            if c.index not in names:  # a call's first fragment: id, type, name
                assert c.id and c.type == "function" and c.function.name, c
                assert c.index == len(names), "calls are numbered in order"
                names[c.index], ids[c.index] = c.function.name, c.id
            else:
                assert c.id is None and c.function.name is None
            args[c.index] = args.get(c.index, "") + (c.function.arguments or "")
    return content, [names[i] for i in sorted(names)], [args[i] for i in sorted(args)], pieces


def _splits(text: str):
    yield "chars", list(text) + [""]
    rng = random.Random(len(text))
    for trial in range(3):
        chunks, i = [], 0
        while i < len(text):
            n = rng.randint(1, 6)  # token-sized pieces
            chunks.append(text[i:i + n])
            i += n
        yield f"tokens{trial}", chunks + [""]
    for k in range(len(text) + 1):
        yield f"at{k}", [text[:k], text[k:]]


@pytest.mark.parametrize("parser, text, content, calls", CASES, ids=_ids(CASES))
def test_stream_at_every_boundary(parser, text, content, calls):
    p = PARSERS[parser](None, [])
    whole = p.parse(text)
    markers = [m for m in ("<tool_call>", "<｜tool▁call", "[TOOL_CALLS]") if m not in (whole.content or "")]
    for how, chunks in _splits(text):
        got, names, args, pieces = _run_stream(p, chunks)
        assert (got or None) == whole.content, how
        if text.startswith("Hm <tool_call>"):
            # Cut off inside a call: a stream that already sent the call's name cannot take it back;
            # what it sent of the arguments is what the model wrote.
            assert names in ([], ["f"]) and all(text.endswith(a) or a in text for a in args), how
            continue
        assert names == [c.function.name for c in whole.tool_calls], how
        assert args == [c.function.arguments for c in whole.tool_calls], how
        # Text that might start a call marker is held back, never sent and then contradicted.
        for piece in pieces:
            assert not any(m[:2] in piece for m in markers if m[:2] not in (whole.content or "")), how


def test_arguments_stream_before_the_call_ends():
    p = PARSERS["hermes"](None, [])
    s = p.stream()
    text = hermes("get_weather", {"city": "Paris", "long": "x" * 40})
    cut = text.index("x" * 20)
    d = s.feed(text[:cut])
    assert d.tool_calls and d.tool_calls[0].function.name == "get_weather"
    assert d.tool_calls[0].function.arguments.startswith('{"city": "Paris", "long": "')
    d = s.feed(text[cut:], final=True)
    assert d.tool_calls[0].function.arguments.endswith('x"}') and d.tool_calls[0].id is None


REASONING = [
    ("deepseek_r1", {}, "The user wants x.\nSo y.</think>\n\nThe answer is y.", "The user wants x.\nSo y.",
     "\n\nThe answer is y."),
    ("deepseek_r1", {}, "<think>explicit</think>answer", "explicit", "answer"),
    ("deepseek_r1", {}, "still thinking when cut off <", "still thinking when cut off <", ""),
    ("deepseek_r1", {"enable_thinking": False}, "no </think> here", None, "no </think> here"),
    ("deepseek_v4", {}, "plain answer, no </think> here", None, "plain answer, no </think> here"),
    ("deepseek_v4", {"thinking": True}, "weighing it</think>the answer", "weighing it", "the answer"),
    ("deepseek_v4", {"enable_thinking": True}, "cut off while thinking", "cut off while thinking", ""),
    ("qwen3", {}, "<think>\nplan\n</think>\n\nanswer", "\nplan\n", "\n\nanswer"),
    ("qwen3", {}, "answer without thinking, a <b> tag", None, "answer without thinking, a <b> tag"),
    ("qwen3", {}, "  <think>cut", "cut", ""),
]


@pytest.mark.parametrize("name, kwargs, text, reasoning, content", REASONING)
def test_reasoning_whole_and_streamed(name, kwargs, text, reasoning, content):
    p = REASONING_PARSERS[name](None, kwargs)
    r, c = p.split(text)
    assert (r or None, c) == (reasoning, content)
    for how, chunks in _splits(text):
        s = p.stream()
        rs, cs = "", ""
        for k, chunk in enumerate(chunks):
            a, b = s.feed(chunk, final=k == len(chunks) - 1)
            rs, cs = rs + a, cs + b
            assert "</think" not in cs or "</think>" in (content or ""), how
        assert (rs or None, cs) == (reasoning, content), how


def test_chat_message_assembly():
    """The endpoint's whole-response assembly: reasoning first, calls from the rest, finish_reason,
    parallel_tool_calls=false keeping the first call."""
    from moe_serve.entrypoints.openai.serving import OpenAIServing

    text = "<think>two lookups</think>On it." + hermes("a", {"x": 1}) + hermes("b", {})
    tools, think = PARSERS["hermes"](None, []), REASONING_PARSERS["qwen3"](None, {})
    msg, finish = OpenAIServing._chat_message(text, "stop", tools, think)
    assert (msg.reasoning_content, msg.content, finish) == ("two lookups", "On it.", "tool_calls")
    assert [c.function.name for c in msg.tool_calls] == ["a", "b"]
    msg, _ = OpenAIServing._chat_message(text, "stop", tools, think, parallel=False)
    assert [c.function.name for c in msg.tool_calls] == ["a"]
    msg, finish = OpenAIServing._chat_message("plain", "length", tools, think)
    assert (msg.content, msg.tool_calls, finish, msg.reasoning_content) == ("plain", [], "length", None)
    msg, _ = OpenAIServing._chat_message("still thinking", "length", None, REASONING_PARSERS["deepseek_r1"](None, {}))
    assert (msg.reasoning_content, msg.content) == ("still thinking", None)


FRAGMENTS = ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": ', '{"name": "g"}', '{"x": [1, "}"]}', "}", " ",
             "\n", "text", '"', "\\", "12", "[TOOL_CALLS]", "[ARGS]", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
             "function<｜tool▁sep｜>f\n", "```json\n", "\n```", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "{", "[",
             "]", ",", "<", "<tool", "<｜tool", "[TOOL", "<think>", "</think>",
             # whole calls of each format, so that many examples hold some
             hermes("h", {"k": "v"}), deepseek([("d", {"k": 1})]), mistral_v11([("m", {})]), mistral_array([("a", {})])]
FRAGMENTS_OF = {  # the formats whose calls the fragments above do not make
    "deepseek_v31": ["f<｜tool▁sep｜>", "<｜tool▁call▁begin｜>e<｜tool▁sep｜>{}<｜tool▁call▁end｜>"],
    "deepseek_v32": ['<｜DSML｜invoke name="f">', '<｜DSML｜parameter name="p" string="false">', "</｜DSML｜parameter>",
                     "</｜DSML｜invoke>", "</｜DSML｜function_calls>", '<｜DSML｜invoke name="t"></｜DSML｜invoke>',
                     '<｜DSML｜function_calls>\n<｜DSML｜invoke name="s">\n<｜DSML｜parameter name="k" string="true">v'
                     "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>"],
    "deepseek_v4": ['<｜DSML｜invoke name="f">', '<｜DSML｜parameter name="p" string="false">', "</｜DSML｜parameter>",
                    "</｜DSML｜invoke>", "</｜DSML｜tool_calls>", '<｜DSML｜invoke name="t"></｜DSML｜invoke>',
                    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="s">\n<｜DSML｜parameter name="k" string="true">v'
                    "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"],
}


def _is_subsequence(small, big):
    it = iter(big)
    return all(x in it for x in small)


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_fragment_soup_never_raises_and_streams_agree(parser):
    """Random mixes of marker and JSON fragments: parsing never raises, a stream's content equals the
    whole parse's, and the whole parse's calls are among the streamed ones (equal unless the stream
    announced a call that did not parse in the end)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    p = PARSERS[parser](None, [])
    seen = {"calls": 0}

    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(parts=st.lists(st.sampled_from(FRAGMENTS + FRAGMENTS_OF.get(parser, [])), max_size=14),
           cuts=st.lists(st.integers(1, 7), max_size=40))
    def check(parts, cuts):
        text = "".join(parts)
        whole = p.parse(text)
        chunks, i = [], 0
        for n in cuts:
            chunks.append(text[i:i + n])
            i += n
        chunks += [text[i:], ""]
        got, names, args, _ = _run_stream(p, chunks)
        assert (got or None) == whole.content
        calls = [(c.function.name, c.function.arguments) for c in whole.tool_calls]
        streamed = list(zip(names, args))
        assert _is_subsequence(calls, streamed) or _is_subsequence([n for n, _ in calls], names), (calls, streamed)
        if len(streamed) == len(calls):  # nothing announced and dropped: the same calls, fragments and all
            assert streamed == calls
        for _, a in calls:
            json.loads(a)
        seen["calls"] += len(calls)

    check()
    assert seen["calls"] >= 20, seen  # the mixes do hold calls
