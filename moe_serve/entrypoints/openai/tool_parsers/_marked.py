"""Shared machinery of the format parsers (hermes, deepseek_v3, deepseek_v31, deepseek_v32, mistral).

A parser describes one thing: `items(text, final)`, the text read as a list of Items (content
text and tool calls, in order). With final=False the text is a prefix of the output: content that
could be the start of a call marker, and whitespace that could be followed by one, are left out
(held back), and the last call may be incomplete (its name unknown yet, its arguments a prefix).
Content and arguments of a prefix are prefixes of those of any longer text, so streaming is a
diff: each feed re-reads the text so far and sends what is new. Whitespace right before or after
a call is not content.

Arguments are the JSON text exactly as the model wrote it (after checking that it is JSON), so
the streamed fragments concatenate to the whole response's `arguments`. A call whose JSON does
not parse stays in the content as text; a stream that already sent its name cannot take it back
(only for malformed or truncated calls).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from .base import ParsedOutput, StreamDelta, ToolParser, ToolStream, new_call_id

_DECODER = json.JSONDecoder()
_WS = " \t\n\r"
NAME = re.compile(r"[\w.:-]{1,128}")  # a function name written bare (OpenAI's are [a-zA-Z0-9_-]{1,64})


@dataclass
class Item:
    text: str | None = None  # content, or None for a call
    name: str | None = None  # a call's name once it is known
    args: str = ""  # the arguments' JSON text (a prefix while the call is incomplete)
    done: bool = False


def partial_suffix(text: str, *markers: str) -> int:
    """The longest suffix of text that is a proper prefix of one of the markers."""
    best = 0
    for marker in markers:
        i = text.find(marker[0], max(0, len(text) - len(marker) + 1))
        while i >= 0:
            if marker.startswith(text[i:]):
                best = max(best, len(text) - i)
                break
            i = text.find(marker[0], i + 1)
    return best


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


class Partial(Exception):
    """The JSON ends before it is complete."""


class Invalid(Exception):
    """The JSON cannot become valid however it continues."""


def json_value(s: str, i: int) -> tuple[object, int]:
    """Decode one JSON value at s[i:] (no leading whitespace); raise Partial when s ends first.
    A number at the very end is Partial: more digits may follow."""
    if i >= len(s):
        raise Partial
    try:
        value, end = _DECODER.raw_decode(s, i)
    except json.JSONDecodeError as e:
        if _could_continue(s, i):
            raise Partial from None
        raise Invalid(str(e)) from None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and \
            all(c in "0123456789.eE+-" for c in s[end:]):
        raise Partial  # a number at the very end: more of it may follow ("12" -> "12.5")
    return value, end


def _could_continue(s: str, i: int) -> bool:
    """Whether the failed JSON at s[i:] is a prefix of some valid JSON (checked loosely: brackets
    and strings still open, or a literal cut short)."""
    depth, in_str, esc = 0, False, False
    for c in s[i:]:
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth < 0:
                return False
    if in_str or depth > 0:
        return True
    tail = s[i:].strip()
    return any(lit.startswith(tail) for lit in ("true", "false", "null")) or tail in ("", "-")


@dataclass
class Member:
    start: int  # where the value's text starts
    end: int | None = None  # None: still being written
    value: object = None


def json_object(s: str, i: int) -> tuple[dict[str, Member], int | None]:
    """Read the JSON object at s[i:] member by member: (members so far, end or None if s ends
    first). Raises Invalid."""
    i = skip_ws(s, i)
    members: dict[str, Member] = {}
    if i >= len(s):
        return members, None
    if s[i] != "{":
        raise Invalid(f"expected an object at {i}")
    i += 1
    first = True
    while True:
        i = skip_ws(s, i)
        if i >= len(s):
            return members, None
        if s[i] == "}":
            return members, i + 1
        if not first:
            if s[i] != ",":
                raise Invalid(f"expected ',' at {i}")
            i = skip_ws(s, i + 1)
        first = False
        try:
            key, i = json_value(s, i)
        except Partial:
            return members, None
        if not isinstance(key, str):
            raise Invalid("object keys are strings")
        i = skip_ws(s, i)
        if i >= len(s):
            return members, None
        if s[i] != ":":
            raise Invalid(f"expected ':' at {i}")
        i = skip_ws(s, i + 1)
        m = members[key] = Member(i)
        try:
            m.value, m.end = json_value(s, i)
        except Partial:
            return members, None
        i = m.end


def call_from_object(s: str, start: int, arg_keys=("arguments", "parameters")) -> tuple[Item, int | None]:
    """A call written as {"name": ..., "arguments": {...}} at s[start:]: the Item (name None until
    known; args a prefix until complete) and the object's end. Raises Invalid."""
    members, end = json_object(s, start)
    item = Item()
    name = members.get("name")
    if name is not None and name.end is not None:
        if not isinstance(name.value, str):
            raise Invalid("name must be a string")
        item.name = name.value
    args = next((members[k] for k in arg_keys if k in members), None)
    if args is not None:
        item.args = s[args.start:args.end if args.end is not None else len(s)].rstrip(_WS)
    if end is not None:
        if item.name is None:
            raise Invalid("a call needs a name")
        if args is None:
            item.args = "{}"
        item.done = True
    return item, end


class MarkedToolParser(ToolParser):
    """A format parser: subclasses implement items()."""

    markers: tuple[str, ...] = ()  # strings that start a call (held back while they may be starting)

    def __init__(self, tokenizer, tools: list[dict] | None):
        super().__init__(tokenizer, tools)
        # A marker that is a special token (Mistral's [TOOL_CALLS]) is only in text decoded with
        # special tokens kept: the endpoint then decodes this request so (as vLLM does).
        special = getattr(tokenizer, "special_tokens", frozenset())
        self.needs_special_tokens = any(m in special for m in self.markers)

    def items(self, text: str, final: bool) -> list[Item]:
        raise NotImplementedError

    def call_id(self) -> str:
        return new_call_id()

    def parse(self, text: str) -> ParsedOutput:
        items = self.items(text, True)
        calls = [ToolCall(self.call_id(), FunctionCall(it.name, it.args)) for it in items
                 if it.text is None and it.name is not None]
        content = "".join(it.text for it in items if it.text is not None)
        return ParsedOutput(content or None, calls)

    def stream(self) -> ToolStream:
        return _DiffStream(self)

    # --- helpers for items() -----------------------------------------------------------------
    def content(self, items: list[Item], text: str, after_call: bool, before_call: bool) -> None:
        """Append a content segment, without the whitespace that touches a call."""
        if after_call:
            text = text.lstrip(_WS)
        if before_call:
            text = text.rstrip(_WS)
        if text:
            items.append(Item(text))

    def tail(self, items: list[Item], text: str, after_call: bool, final: bool) -> None:
        """The text after the last marker: all of it at the end, else without a possible marker
        start or trailing whitespace."""
        if not final:
            text = text[:len(text) - partial_suffix(text, *self.markers)].rstrip(_WS)
        self.content(items, text, after_call, False)


class _DiffStream(ToolStream):
    def __init__(self, parser: MarkedToolParser):
        self.parser = parser
        self.text = ""
        self.sent_content = 0  # characters of the content sent
        self.sent_calls: list[list] = []  # per call: [id, characters of arguments sent]

    def feed(self, delta_text: str, final: bool = False) -> StreamDelta:
        self.text += delta_text
        items = self.parser.items(self.text, final)
        content = "".join(it.text for it in items if it.text is not None)
        out = StreamDelta(content[self.sent_content:] or None)
        self.sent_content = max(self.sent_content, len(content))
        if not self.sent_calls and len(items) == 1 and items[0].text is not None:
            # Plain text so far, all sent: parsing can start after it next time (so a long answer
            # is not re-read at every token), unless it holds a marker (a call that did not parse).
            sent = items[0].text
            if self.text.startswith(sent) and not any(m in sent for m in self.parser.markers):
                self.text, self.sent_content = self.text[len(sent):], 0
            return out
        calls = [it for it in items if it.text is None]
        for k, it in enumerate(calls):
            if it.name is None:
                break
            if k == len(self.sent_calls):
                cid = self.parser.call_id()
                self.sent_calls.append([cid, len(it.args)])
                out.tool_calls.append(DeltaToolCall(k, cid, "function", DeltaFunctionCall(it.name, it.args)))
            elif k < len(self.sent_calls) and len(it.args) > self.sent_calls[k][1]:
                out.tool_calls.append(DeltaToolCall(k, function=DeltaFunctionCall(
                    arguments=it.args[self.sent_calls[k][1]:])))
                self.sent_calls[k][1] = len(it.args)
        return out
