"""tool_choice "required" / a named function: the parser of the grammar-forced JSON. An output cut
short by max_tokens gives the complete calls and the cut call's arguments as written, never a call
with empty arguments (whole and streamed at every split alike); the required array's grammar lets
the model close the array after every call (xgrammar, on the test tokenizer)."""
from __future__ import annotations

import json

import pytest

from moe_serve.entrypoints.openai import protocol as P
from moe_serve.entrypoints.openai.structured import tool_choice_schema
from moe_serve.entrypoints.openai.tool_parsers.constrained import ConstrainedToolParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]
DONE = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "noop", "parameters": {}}]'


def _streamed(parser, text, cut):
    s = parser.stream()
    calls = {}
    for d in (s.feed(text[:cut]), s.feed(text[cut:]), s.feed("", final=True)):
        for c in d.tool_calls:
            if c.id is not None:
                assert c.index not in calls and c.function.name
                calls[c.index] = [c.function.name, ""]
            calls[c.index][1] += c.function.arguments or ""
    return [tuple(v) for _, v in sorted(calls.items())]


@pytest.mark.parametrize("end, want", [
    (len(DONE), [("get_weather", '{"city": "Paris"}'), ("noop", "{}")]),
    (DONE.index(', {"name": "noop"'), [("get_weather", '{"city": "Paris"}')]),
    (DONE.index('"noop"') + 7, [("get_weather", '{"city": "Paris"}')]),  # cut after the name: no empty call
    (DONE.index('"parameters": {}') + 15, [("get_weather", '{"city": "Paris"}'), ("noop", "{")]),
    (DONE.index('"Paris"') + 3, [("get_weather", '{"city": "Pa')]),
    (DONE.index('"parameters"'), []),
], ids=["whole", "after-a-call", "after-a-name", "inside-arguments", "inside-a-string", "before-arguments"])
def test_cut_output_never_gives_empty_arguments(end, want):
    parser = ConstrainedToolParser(None, TOOLS, "required")
    text = DONE[:end]
    got = [(c.function.name, c.function.arguments) for c in parser.parse(text).tool_calls]
    assert got == want
    assert all(args for _, args in got)
    for cut in range(len(text) + 1):
        assert _streamed(parser, text, cut) == want, cut
    if end == len(DONE):
        assert [json.loads(a) for _, a in got] == [{"city": "Paris"}, {}]


def test_required_array_can_close_after_every_call(checkpoints):
    import xgrammar as xgr

    from moe_serve.structured_output.grammar import build_grammar, tokenizer_info
    from moe_serve.structured_output import StructuredOutputsParams
    from moe_serve.tokenizer import Tokenizer

    path = checkpoints["qwen3_moe"]
    tok = Tokenizer(path)
    req = P.ChatCompletionRequest(messages=[P.ChatMessage("user", "x")], tools=TOOLS, tool_choice="required")
    so = StructuredOutputsParams(json=tool_choice_schema(req))
    compiler = xgr.GrammarCompiler(tokenizer_info(path, tok.vocab_size, [tok.eos_token_id]), max_threads=1)
    grammar = compiler.compile_grammar(build_grammar(*so.key))
    one = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    for text, complete in ((one, True), (DONE, True), (one[:-1], False)):
        m = xgr.GrammarMatcher(grammar)
        assert m.accept_string(text)
        assert m.is_completed() == complete, text
