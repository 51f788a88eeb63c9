"""DeepSeek-V3.2 tool calls, in its DSML markup:

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="location" string="true">Hangzhou</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    <｜DSML｜invoke name="...">...</｜DSML｜invoke>
    </｜DSML｜function_calls>

A parameter's value is the text up to its closing tag, as written: a string when string="true",
else JSON (a number, boolean, null, array or object). The arguments are the JSON object of the
parameters in order, string values encoded, the others as the model wrote them. Text before the
block is content (and after it, if the model goes on); malformed and cut-off calls are read as
deepseek_v3 reads them.
"""
from __future__ import annotations

import json
import re

from ._marked import NAME, Invalid, Item, Partial, _WS, json_value, partial_suffix, skip_ws
from .base import PARSERS
from .deepseek_v3 import DeepSeekV3ToolParser
from .deepseek_v31 import _NAME_START

DSML = "｜DSML｜"
CALLS_BEGIN, CALLS_END = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
INVOKE_BEGIN, INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke>"
PARAM_BEGIN, PARAM_END = f"<{DSML}parameter", f"</{DSML}parameter>"

_DECODER = json.JSONDecoder()
_ATTR_VALUE = re.compile(r'[^"<>\n]*')  # an attribute value: one line, no markup
_BOOL_START = re.compile("t(r(ue?)?)?|f(a(l(se?)?)?)?|")  # "true" or "false", or the start of one


def _attr(text: str, i: int, key: str, value_re: re.Pattern) -> tuple[str, int] | None:
    """Whitespace, then key="value" at text[i:]: (value, index after it), None while it is being
    written. Raises Invalid."""
    j = skip_ws(text, i)
    if j == i and j < len(text):
        raise Invalid(f"expected a space before {key}")
    head = f'{key}="'
    if not text.startswith(head, j):
        if head.startswith(text[j:]):
            return None
        raise Invalid(f"expected {head}")
    j += len(head)
    q = text.find('"', j)
    value = text[j:q if q >= 0 else len(text)]
    if not value_re.fullmatch(value):
        raise Invalid(f"bad {key}")
    return (value, q + 1) if q >= 0 else None


def _tag_end(text: str, i: int) -> int | None:
    """Whitespace, then the '>' that closes a tag: the index after it, None while being written."""
    k = skip_ws(text, i)
    if k >= len(text):
        return None
    if text[k] != ">":
        raise Invalid("expected '>'")
    return k + 1


class DeepSeekV32ToolParser(DeepSeekV3ToolParser):
    name = "deepseek_v32"
    calls_begin, calls_end, call_begin = CALLS_BEGIN, CALLS_END, INVOKE_BEGIN
    markers = (CALLS_BEGIN, INVOKE_BEGIN)

    @staticmethod
    def _call(text: str, i: int) -> tuple[Item, int | None]:
        """One call after <｜DSML｜invoke: (Item, index after </｜DSML｜invoke> or None)."""
        item = Item()
        attr = _attr(text, i, "name", _NAME_START)
        if attr is None:
            return item, None
        name, k = attr
        if not NAME.fullmatch(name):
            raise Invalid("not a function name")
        k = _tag_end(text, k)
        if k is None:
            return item, None
        item.name, item.args = name, "{"
        seen: set[str] = set()
        while True:
            k = skip_ws(text, k)
            if text.startswith(INVOKE_END, k):
                item.args += "}"
                item.done = True
                return item, k + len(INVOKE_END)
            if not text.startswith(PARAM_BEGIN, k):
                if INVOKE_END.startswith(text[k:]) or PARAM_BEGIN.startswith(text[k:]):
                    return item, None
                raise Invalid(f"expected {PARAM_BEGIN} or {INVOKE_END}")
            attr = _attr(text, k + len(PARAM_BEGIN), "name", _ATTR_VALUE)
            if attr is None:
                return item, None
            key, k = attr
            if key in seen:
                raise Invalid(f"parameter {key!r} given twice")
            attr = _attr(text, k, "string", _BOOL_START)
            if attr is None:
                return item, None
            if attr[0] not in ("true", "false"):
                raise Invalid('string is "true" or "false"')
            is_str, k = attr[0] == "true", _tag_end(text, attr[1])
            if k is None:
                return item, None
            item.args += (", " if seen else "") + json.dumps(key, ensure_ascii=False) + ": "
            seen.add(key)
            close = text.find(PARAM_END, k)
            raw = text[k:close] if close >= 0 else text[k:len(text) - partial_suffix(text[k:], PARAM_END)]
            if is_str:
                value = json.dumps(raw, ensure_ascii=False)
                item.args += value if close >= 0 else value[:-1]
            else:
                item.args += _json_text(raw, close >= 0)
            if close < 0:
                return item, None
            k = close + len(PARAM_END)


def _json_text(raw: str, whole: bool) -> str:
    """The JSON value in raw without the whitespace around it (a prefix while not whole). Raises
    Invalid."""
    a = skip_ws(raw, 0)
    try:
        if whole:
            _, end = _DECODER.raw_decode(raw, a)
        else:
            _, end = json_value(raw, a)
    except json.JSONDecodeError as e:
        raise Invalid(str(e)) from None
    except Partial:
        return raw[a:].rstrip(_WS)
    if skip_ws(raw, end) < len(raw):
        raise Invalid("more after the value")
    return raw[a:end]


PARSERS["deepseek_v32"] = DeepSeekV32ToolParser


V4_CALLS_BEGIN, V4_CALLS_END = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"


class DeepSeekV4ToolParser(DeepSeekV32ToolParser):
    """DeepSeek-V4: V3.2's invokes and parameters inside a `<｜DSML｜tool_calls>` block (its
    encoding_dsv4.py), instead of `function_calls`."""

    name = "deepseek_v4"
    calls_begin, calls_end = V4_CALLS_BEGIN, V4_CALLS_END
    markers = (V4_CALLS_BEGIN, INVOKE_BEGIN)


PARSERS["deepseek_v4"] = DeepSeekV4ToolParser
