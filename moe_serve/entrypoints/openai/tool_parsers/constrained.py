"""Tool calls from output that tool_choice forced into JSON (entrypoints/openai/structured.py):

- a named function: the whole output is that function's arguments;
- "required": a JSON array of {"name": ..., "parameters": {...}} objects, one per call.

Both whole and streamed outputs go through the same scanner, so the streamed argument fragments of a
call concatenate to exactly the `arguments` of the whole response: the raw text of the
`parameters` value (or, for a named function, the output without surrounding whitespace). A
call's first delta carries its index, id, type and name; its argument fragments follow. Content is
always null. An output cut short by max_tokens gives the calls seen so far with the arguments
written so far (finish_reason "length" says so); a call cut before its arguments began is not
returned at all (its arguments would be "", which no client can parse): a call is announced, whole
or streamed, with the first character of its arguments.
"""
from __future__ import annotations

import json

from ..protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from .base import ParsedOutput, StreamDelta, ToolParser, ToolStream, new_call_id


class ConstrainedToolParser(ToolParser):
    name = "constrained"

    def __init__(self, tokenizer, tools: list[dict] | None, tool_choice):
        super().__init__(tokenizer, tools)
        self.function = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None

    def calls_finish_reason(self, finish: str | None) -> str | None:
        """vLLM's (and OpenAI's) finish_reason: for an output the grammar ended, "stop" when the
        function was named, "tool_calls" for "required"; one cut short keeps "length"."""
        if finish != "stop":
            return finish
        return "stop" if self.function is not None else "tool_calls"

    def parse(self, text: str) -> ParsedOutput:
        s = self.stream()
        calls: dict[int, list] = {}
        for d in (s.feed(text), s.feed("", final=True)):
            for c in d.tool_calls:
                entry = calls.setdefault(c.index, [c.id, c.function.name if c.function else None, []])
                if c.function is not None and c.function.arguments:
                    entry[2].append(c.function.arguments)
        return ParsedOutput(None, [ToolCall(cid, FunctionCall(name, "".join(args)))
                                   for _, (cid, name, args) in sorted(calls.items())])

    def stream(self) -> ToolStream:
        return _NamedStream(self.function) if self.function is not None else _ArrayStream()


class _NamedStream(ToolStream):
    """The output is the arguments: whitespace before the first and after the last non-blank
    character is dropped (held back until more text shows whether it is inside)."""

    def __init__(self, name: str):
        self.name, self.id = name, new_call_id()
        self.started = False
        self.held = ""

    def feed(self, delta_text: str, final: bool = False) -> StreamDelta:
        text = self.held + delta_text
        if not self.started:
            text = text.lstrip()
        body = text.rstrip()
        self.held = text[len(body):]
        if not self.started:
            if not body and not final:
                return StreamDelta()
            self.started = True
            return StreamDelta(None, [DeltaToolCall(0, self.id, "function", DeltaFunctionCall(self.name, body))])
        return StreamDelta(None, [DeltaToolCall(0, function=DeltaFunctionCall(arguments=body))] if body else [])


class _Call:
    __slots__ = ("index", "id", "name", "announced", "args")

    def __init__(self, index: int):
        self.index, self.id, self.name, self.announced, self.args = index, new_call_id(), None, False, []


class _ArrayStream(ToolStream):
    """Scans `[{"name": "f", "parameters": {...}}, ...]` character by character: the call objects
    sit at depth 2; the string after "name" is the call's name; the raw text of the value after
    "parameters" is its arguments."""

    def __init__(self):
        self.stack: list[str] = []
        self.in_str = self.esc = False
        self.calls: list[_Call] = []
        self.key: str | None = None  # the last key read in the current call object
        self.expect = "key"  # in a call object: key | colon | value | comma
        self.str_buf: list[str] | None = None  # a key or name string being read
        self.str_role = ""  # "key" | "name"
        self.capture_depth: int | None = None  # depth of the parameters value being captured
        self.scalar = False  # the captured value is a number or literal (ends before , } or blank)

    def feed(self, delta_text: str, final: bool = False) -> StreamDelta:
        out: dict[int, list] = {}
        for ch in delta_text:
            self._char(ch, out)
        deltas = []
        for call in self.calls:
            frag = "".join(out.get(call.index, []))
            if call.name is not None and not call.announced and (call.args or frag):
                call.announced = True  # with its first argument character: never a call with ""
                frag = "".join(call.args) + frag
                deltas.append(DeltaToolCall(call.index, call.id, "function", DeltaFunctionCall(call.name, frag)))
            elif call.announced and frag:
                deltas.append(DeltaToolCall(call.index, function=DeltaFunctionCall(arguments=frag)))
            elif not call.announced and frag:
                call.args.append(frag)  # arguments before the name: sent with the name
        return StreamDelta(None, deltas)

    def _emit(self, ch: str, out: dict) -> None:
        out.setdefault(self.calls[-1].index, []).append(ch)

    def _char(self, ch: str, out: dict) -> None:
        depth = len(self.stack)
        capturing = self.capture_depth is not None
        if capturing and self.scalar and not self.in_str and (ch in ",}]" or ch.isspace()):
            self.capture_depth, self.scalar, capturing = None, False, False
            self.expect = "comma"
        if self.in_str:
            if capturing:
                self._emit(ch, out)
            if self.esc:
                self.esc = False
                if self.str_buf is not None:
                    self.str_buf.append("\\" + ch)
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                if self.str_buf is not None:
                    self._end_string()
                elif capturing and len(self.stack) == self.capture_depth:  # a string value ended
                    self.capture_depth = None
                    self.expect = "comma"
            elif self.str_buf is not None:
                self.str_buf.append(ch)
            return
        if capturing:
            self._emit(ch, out)
            if ch == '"':
                self.in_str = True
            elif ch in "[{":
                self.stack.append(ch)
            elif ch in "]}":
                if self.stack:
                    self.stack.pop()
                if len(self.stack) == self.capture_depth:
                    self.capture_depth = None
                    self.expect = "comma"
            return
        if ch.isspace():
            return
        if depth == 0:
            if ch == "[":
                self.stack.append(ch)
            return
        if depth == 1:  # in the array: call objects and commas
            if ch == "{":
                self.stack.append(ch)
                self.calls.append(_Call(len(self.calls)))
                self.expect, self.key = "key", None
            elif ch == "]":
                self.stack.pop()
            return
        # depth 2: inside a call object
        if self.expect == "key" and ch == '"':
            self.in_str, self.str_buf, self.str_role = True, [], "key"
        elif self.expect == "colon" and ch == ":":
            self.expect = "value"
        elif self.expect == "value":
            if self.key == "name" and ch == '"':
                self.in_str, self.str_buf, self.str_role = True, [], "name"
            elif self.key == "parameters":
                self.capture_depth = depth
                self._emit(ch, out)
                if ch == '"':
                    self.in_str = True
                elif ch in "[{":
                    self.stack.append(ch)
                else:
                    self.scalar = True
            else:  # any other value: skipped (the grammar allows none)
                self._skip_value(ch)
        elif ch == ",":
            self.expect = "key"
        elif ch == "}":
            self.stack.pop()

    def _skip_value(self, ch: str) -> None:
        if ch == '"':
            self.in_str, self.str_buf, self.str_role = True, [], "skip"
        self.expect = "comma"

    def _end_string(self) -> None:
        raw = "".join(self.str_buf)
        self.str_buf = None
        try:
            text = json.loads('"' + raw + '"')
        except ValueError:
            text = raw
        if self.str_role == "key":
            self.key, self.expect = text, "colon"
        elif self.str_role == "name":
            self.calls[-1].name = text
            self.expect = "comma"
        else:
            self.expect = "comma"
