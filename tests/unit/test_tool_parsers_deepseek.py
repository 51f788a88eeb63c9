"""The DeepSeek-V3.1, DeepSeek-V3.2 and DeepSeek-V4 (DSML) tool-call parsers on canned model outputs: the
whole-text parse against the calls the text was built from (arguments compared as objects), and
streams split at every character boundary, one character at a time and in token-sized chunks,
against the whole-text parse."""
from __future__ import annotations

import json

import pytest

from moe_serve.entrypoints.openai.tool_parsers import PARSERS
from tests.unit.test_tool_parsers import _is_subsequence, _run_stream, _splits

D = "｜DSML｜"
WEATHER = {"city": "Paris", "days": 3, "units": ["c", "f"], "note": 'a "quoted" {brace}, café, 中文'}
TYPES = {"q": "x < y && a > b", "n": -1.5e3, "k": 7, "yes": True, "no": False, "none": None,
         "obj": {"a": [1, {"b": f"</{D}invoke> <｜tool▁call▁end｜>"}]}, "list": ["a", 2.5, []],
         "lines": "line 1\nline 2\n", "markup": f'<{D}parameter name="x" string="true">, <b>, "q", \\'}


def v31(calls):
    """As DeepSeek-V3.1's chat template writes an assistant turn's calls."""
    body = "".join("<｜tool▁call▁begin｜>%s<｜tool▁sep｜>%s<｜tool▁call▁end｜>" % (n, json.dumps(a, ensure_ascii=False))
                   for n, a in calls)
    return "<｜tool▁calls▁begin｜>" + body + "<｜tool▁calls▁end｜>"


def dsml_param(key, value):
    if isinstance(value, str):
        return f'<{D}parameter name="{key}" string="true">{value}</{D}parameter>'
    return f'<{D}parameter name="{key}" string="false">{json.dumps(value, ensure_ascii=False)}</{D}parameter>'


def dsml(calls):
    """As DeepSeek-V3.2's encoding_dsv32.py writes an assistant turn's calls."""
    invokes = [f'<{D}invoke name="{n}">\n' + "\n".join(dsml_param(k, v) for k, v in a.items()) + f"\n</{D}invoke>"
               for n, a in calls]
    return f"\n\n<{D}function_calls>\n" + "\n".join(invokes) + f"\n</{D}function_calls>"


def dsml_v4(calls):
    """As DeepSeek-V4's encoding_dsv4.py writes an assistant turn's calls: V3.2's invokes in a
    tool_calls block."""
    return dsml(calls).replace(f"{D}function_calls>", f"{D}tool_calls>")


V31_CALL = "<｜tool▁call▁begin｜>f<｜tool▁sep｜>"
INVOKE = f'<{D}invoke name="f">\n'

# (parser, model output, expected content, expected [(name, arguments as objects)], names a stream
# may announce that the whole parse does not return: malformed or cut-off calls)
CASES = [
    ("deepseek_v31", "Let me look.\n" + v31([("get_weather", WEATHER), ("search", TYPES)]), "Let me look.",
     [("get_weather", WEATHER), ("search", TYPES)], []),
    ("deepseek_v31", v31([("f", {"a": "```", "b": "<｜tool▁calls▁end｜>"})]) + "\nDone.", "Done.",
     [("f", {"a": "```", "b": "<｜tool▁calls▁end｜>"})], []),
    ("deepseek_v31", "No tools <｜tool here, a < b.", "No tools <｜tool here, a < b.", [], []),
    ("deepseek_v31", v31([("f", {})]) + " and " + v31([("g.h:i-j", {"x": None})]), "and",
     [("f", {}), ("g.h:i-j", {"x": None})], []),
    # Whitespace around the parts, and a call without the block's tokens.
    ("deepseek_v31", '<｜tool▁calls▁begin｜>\n<｜tool▁call▁begin｜> f <｜tool▁sep｜> {"x": [1, 2]} <｜tool▁call▁end｜>\n'
     "<｜tool▁calls▁end｜>", None, [("f", {"x": [1, 2]})], []),
    ("deepseek_v31", V31_CALL + "{}<｜tool▁call▁end｜>", None, [("f", {})], []),
    # The block left open: the text after the last call is content.
    ("deepseek_v31", "<｜tool▁calls▁begin｜>" + V31_CALL + '{"k": "v"}<｜tool▁call▁end｜>The end.', "The end.",
     [("f", {"k": "v"})], []),
    ("deepseek_v31", "<｜tool▁calls▁begin｜>" + V31_CALL + "{}<｜tool▁call▁end｜>", None, [("f", {})], []),
    # Not calls: the text from the call token on stays content, as written.
    ("deepseek_v31", "A <｜tool▁calls▁begin｜>" + V31_CALL + '{"x": nope}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "A" + V31_CALL + '{"x": nope}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', [], ["f"]),
    ("deepseek_v31", "<｜tool▁calls▁begin｜>" + V31_CALL + "[1]<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     V31_CALL + "[1]<｜tool▁call▁end｜><｜tool▁calls▁end｜>", [], ["f"]),
    ("deepseek_v31", "<｜tool▁call▁begin｜>get weather<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
     "<｜tool▁call▁begin｜>get weather<｜tool▁sep｜>{}<｜tool▁call▁end｜>", [], []),
    ("deepseek_v31", V31_CALL + '{"x": 1} oops<｜tool▁call▁end｜>', V31_CALL + '{"x": 1} oops<｜tool▁call▁end｜>',
     [], ["f"]),
    # Cut off (max_tokens): the complete calls count, the rest is content as written.
    ("deepseek_v31", "Hm <｜tool▁calls▁begin｜>" + V31_CALL + '{"x": ', "Hm" + V31_CALL + '{"x": ', [], ["f"]),
    ("deepseek_v31", v31([("f", {"a": 1})])[:-len("<｜tool▁calls▁end｜>")] + '<｜tool▁call▁begin｜>g<｜tool▁sep｜>{"y": 1}',
     '<｜tool▁call▁begin｜>g<｜tool▁sep｜>{"y": 1}', [("f", {"a": 1})], ["g"]),

    ("deepseek_v32", "Checking.\n\n" + dsml([("get_weather", {"location": "Hangzhou", "days": 3}), ("search", TYPES)]),
     "Checking.", [("get_weather", {"location": "Hangzhou", "days": 3}), ("search", TYPES)], []),
    ("deepseek_v32", dsml([("get_weather", WEATHER)]) + "\n\nAnything else?", "Anything else?",
     [("get_weather", WEATHER)], []),
    ("deepseek_v32", f"Plain text: <b>tags</b>, a < b, <{D} words.", f"Plain text: <b>tags</b>, a < b, <{D} words.", [],
     []),
    # String values as written (whitespace, empty); no parameters; two blocks with text between.
    ("deepseek_v32", dsml([("f", {"s": "  padded \n", "e": ""}), ("g", {})]) + "\nthen" + dsml([("h", {"n": 0})]),
     "then", [("f", {"s": "  padded \n", "e": ""}), ("g", {}), ("h", {"n": 0})], []),
    # Spacing the template never writes, and an invoke without the block's tags.
    ("deepseek_v32", f'<{D}function_calls><{D}invoke  name="f" ><{D}parameter name="a"  string="false" > [1, 2] '
     f'</{D}parameter><{D}parameter name="b" string="true">x</{D}parameter></{D}invoke></{D}function_calls>',
     None, [("f", {"a": [1, 2], "b": "x"})], []),
    ("deepseek_v32", INVOKE + f"</{D}invoke>", None, [("f", {})], []),
    # The block left open: the text after the last call is content; at the end, the calls count.
    ("deepseek_v32", f"<{D}function_calls>\n" + INVOKE + f"</{D}invoke>\nDone.", "Done.", [("f", {})], []),
    ("deepseek_v32", dsml([("f", {"k": True})])[:-len(f"\n</{D}function_calls>")], None, [("f", {"k": True})], []),
    # Not calls: the text from the invoke on stays content, as written.
    ("deepseek_v32", f"A\n\n<{D}function_calls>\n" + INVOKE
     + f'<{D}parameter name="n" string="false">three</{D}parameter>\n</{D}invoke>\n</{D}function_calls>',
     "A" + INVOKE + f'<{D}parameter name="n" string="false">three</{D}parameter>\n</{D}invoke>\n</{D}function_calls>',
     [], ["f"]),
    ("deepseek_v32", INVOKE + f'<{D}parameter name="n" string="false">1 2</{D}parameter>\n</{D}invoke>',
     INVOKE + f'<{D}parameter name="n" string="false">1 2</{D}parameter>\n</{D}invoke>', [], ["f"]),
    ("deepseek_v32", INVOKE + f'<{D}parameter name="n">1</{D}parameter>\n</{D}invoke>',
     INVOKE + f'<{D}parameter name="n">1</{D}parameter>\n</{D}invoke>', [], ["f"]),
    ("deepseek_v32", INVOKE + f'<{D}parameter name="n" string="maybe">1</{D}parameter>\n</{D}invoke>',
     INVOKE + f'<{D}parameter name="n" string="maybe">1</{D}parameter>\n</{D}invoke>', [], ["f"]),
    ("deepseek_v32", INVOKE + dsml_param("n", 1) + dsml_param("n", 2) + f"</{D}invoke>",
     INVOKE + dsml_param("n", 1) + dsml_param("n", 2) + f"</{D}invoke>", [], ["f"]),
    ("deepseek_v32", INVOKE + dsml_param("n", 1) + "junk" + f"</{D}invoke>",
     INVOKE + dsml_param("n", 1) + "junk" + f"</{D}invoke>", [], ["f"]),
    ("deepseek_v32", f'<{D}invoke name="get weather">\n</{D}invoke>', f'<{D}invoke name="get weather">\n</{D}invoke>',
     [], []),
    # Cut off (max_tokens): the complete calls count, the rest is content as written.
    ("deepseek_v32", f"Hm\n\n<{D}function_calls>\n" + INVOKE + f'<{D}parameter name="q" string="true">half a val',
     "Hm" + INVOKE + f'<{D}parameter name="q" string="true">half a val', [], ["f"]),
    ("deepseek_v32", f"<{D}function_calls>\n" + INVOKE + dsml_param("a", [1]) + f"\n</{D}invoke>\n"
     f'<{D}invoke name="g">\n<{D}parameter name="o" string="false">{{"k": [1, ',
     f'<{D}invoke name="g">\n<{D}parameter name="o" string="false">{{"k": [1, ', [("f", {"a": [1]})], ["g"]),
]

# DeepSeek-V4: V3.2's cases with its block's name (its invokes and parameters are V3.2's).
CASES += [("deepseek_v4", *(None if x is None else x.replace(f"{D}function_calls>", f"{D}tool_calls>")
                            if isinstance(x, str) else x for x in case[1:]))
          for case in CASES if case[0] == "deepseek_v32"]
# V3.2's block in V4's output is text (with the invokes inside it still read as calls).
CASES.append(("deepseek_v4", "See: " + dsml([("f", {"a": 1})]), f"See: \n\n<{D}function_calls></{D}function_calls>",
              [("f", {"a": 1})], []))

MARKERS = {"deepseek_v31": ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"],
           "deepseek_v32": [f"<{D}function_calls>", f"<{D}invoke"],
           "deepseek_v4": [f"<{D}tool_calls>", f"<{D}invoke"]}


def _ids(cases):
    return [f"{c[0]}-{i}" for i, c in enumerate(cases)]


@pytest.mark.parametrize("parser, text, content, calls, dropped", CASES, ids=_ids(CASES))
def test_whole_output(parser, text, content, calls, dropped):
    out = PARSERS[parser](None, []).parse(text)
    assert out.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in out.tool_calls] == calls
    assert all(c.type == "function" and c.id for c in out.tool_calls)
    assert len({c.id for c in out.tool_calls}) == len(out.tool_calls)


@pytest.mark.parametrize("parser, text, content, calls, dropped", CASES, ids=_ids(CASES))
def test_stream_at_every_boundary(parser, text, content, calls, dropped):
    p = PARSERS[parser](None, [])
    whole = p.parse(text)
    expected = [(c.function.name, c.function.arguments) for c in whole.tool_calls]
    for how, chunks in _splits(text):
        got, names, args, pieces = _run_stream(p, chunks)
        assert (got or None) == whole.content, how
        streamed, k = list(zip(names, args)), 0
        for call in streamed:  # the whole parse's calls, in order, fragments and all; others only if dropped
            if k < len(expected) and call == expected[k]:
                k += 1
            else:
                assert call[0] in dropped and call not in expected[k:], (how, call)
        assert k == len(expected), (how, streamed)
        # Text that might start a call marker is held back, never sent and then contradicted.
        for piece in pieces:
            assert not any(m[:2] in piece for m in MARKERS[parser] if m[:2] not in (whole.content or "")), how


def test_arguments_stream_before_the_call_ends():
    for parser, text in (("deepseek_v31", v31([("get_weather", {"city": "Paris", "long": "x" * 40})])),
                         ("deepseek_v32", dsml([("get_weather", {"city": "Paris", "long": "x" * 40})])),
                         ("deepseek_v4", dsml_v4([("get_weather", {"city": "Paris", "long": "x" * 40})]))):
        s = PARSERS[parser](None, []).stream()
        cut = text.index("x" * 20)
        d = s.feed(text[:cut])
        assert d.content is None and d.tool_calls and d.tool_calls[0].function.name == "get_weather", parser
        assert d.tool_calls[0].function.arguments.startswith('{"city": "Paris", "long": "'), parser
        d = s.feed(text[cut:], final=True)
        assert d.tool_calls[0].function.arguments.endswith('x"}') and d.tool_calls[0].id is None, parser


def test_dsml_arguments_are_the_parameters_in_order():
    """String values JSON-encoded, the others as the model wrote them, in the order written."""
    text = (INVOKE + f'<{D}parameter name="b" string="false">{{"z":1,  "a":2}}</{D}parameter>\n'
            f'<{D}parameter name="a" string="true">say "hi"\\n</{D}parameter>\n'
            f'<{D}parameter name="c" string="false">\n1.50\n</{D}parameter>\n</{D}invoke>')
    [call] = PARSERS["deepseek_v32"](None, []).parse(text).tool_calls
    assert call.function.arguments == '{"b": {"z":1,  "a":2}, "a": "say \\"hi\\"\\\\n", "c": 1.50}'
    assert list(json.loads(call.function.arguments)) == ["b", "a", "c"]
    assert json.loads(call.function.arguments)["a"] == 'say "hi"\\n'


FRAGMENTS = {
    "deepseek_v31": ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "f<｜tool▁sep｜>", "<｜tool▁sep｜>", "g",
                     '{"x": [1, "}"]}', "{}", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "{", "}", "12", '"', " ",
                     "\n", "text", "<", "<｜tool", v31([("d", {"k": 1})]), v31([("e", {})])],
    "deepseek_v32": [f"<{D}function_calls>", f"</{D}function_calls>", f'<{D}invoke name="f">', f"</{D}invoke>",
                     f'<{D}parameter name="a" string="true">', f'<{D}parameter name="b" string="false">',
                     f"</{D}parameter>", '{"x": [1, "}"]}', "12", "true", '"', "\n", " ", "text", "<", f"<{D}",
                     "<b>", dsml([("d", {"k": 1, "s": "v"})]), dsml([("e", {})])],
    "deepseek_v4": [f"<{D}tool_calls>", f"</{D}tool_calls>", f'<{D}invoke name="f">', f"</{D}invoke>",
                    f'<{D}parameter name="a" string="true">', f"</{D}parameter>", "12", '"', "\n", "text", "<",
                    f"<{D}", dsml_v4([("d", {"k": 1, "s": "v"})]), dsml_v4([("e", {})])],
}


@pytest.mark.parametrize("parser", sorted(FRAGMENTS))
def test_fragment_soup_never_raises_and_streams_agree(parser):
    """Random mixes of marker and value fragments: parsing never raises, a stream's content equals
    the whole parse's, and the whole parse's calls are among the streamed ones (equal unless the
    stream announced a call that did not parse in the end); the arguments are JSON objects."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    p = PARSERS[parser](None, [])
    seen = {"calls": 0}

    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(parts=st.lists(st.sampled_from(FRAGMENTS[parser]), max_size=14),
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
        if len(streamed) == len(calls):
            assert streamed == calls
        for _, a in calls:
            assert isinstance(json.loads(a), dict)
        seen["calls"] += len(calls)

    check()
    assert seen["calls"] >= 20, seen
