"""The interface between the chat endpoint and anything that turns model text into tool calls.

Two kinds implement it: the format parsers chosen by `--tool-call-parser` (hermes, deepseek_v3,
deepseek_v31, deepseek_v32, mistral), used for tool_choice="auto", and the parser of constrained
output, used when tool_choice is "required" or names a function (the output is then JSON forced by
the grammar).

Whole text: `parser.parse(text)` -> ParsedOutput(content, tool_calls).
Streaming: `s = parser.stream()` once per choice, then `s.feed(delta_text)` per engine output and
`s.feed("", final=True)` at the end; each returns a StreamDelta whose pieces the endpoint sends as
`delta.content` / `delta.tool_calls`. Concatenating every content piece gives ParsedOutput.content,
and per call index the argument fragments concatenate to the call's full `arguments`.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from ..protocol import DeltaToolCall, ToolCall


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class StreamDelta:
    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def empty(self) -> bool:
        return not self.content and not self.tool_calls


class ToolStream:
    """One choice's streaming state."""

    def feed(self, delta_text: str, final: bool = False) -> StreamDelta:
        raise NotImplementedError


class ToolParser:
    """Stateless per request; `stream()` makes the per-choice state."""

    name: str = ""

    def __init__(self, tokenizer, tools: list[dict] | None):
        self.tokenizer = tokenizer
        self.tools = tools or []

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def stream(self) -> ToolStream:
        raise NotImplementedError


PARSERS: dict[str, type[ToolParser]] = {}  # --tool-call-parser NAME -> class
