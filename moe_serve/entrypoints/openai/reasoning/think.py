"""`<think>...</think>` reasoning, in DeepSeek-R1's and Qwen3's conventions.

deepseek_r1: the chat template opens `<think>` itself, so the output starts inside the reasoning:
everything up to `</think>` is reasoning (a leading `<think>` the model writes anyway is dropped);
with no `</think>` at all the whole output is reasoning. Requests whose chat_template_kwargs turn
thinking off (`enable_thinking` or `thinking` false) are passed through as content.

deepseek_v4: deepseek_r1's reading, but only when the request turns thinking on (V4's default is off).

qwen3: reasoning only where the output opens `<think>` itself (at its start, after whitespace);
with enable_thinking=False the template closes an empty think block and the output is content.
"""
from __future__ import annotations

from .base import REASONING_PARSERS, ReasoningParser, ReasoningStream, partial_suffix

START, END = "<think>", "</think>"


class _ThinkParser(ReasoningParser):
    starts_inside = False  # the output begins within the reasoning without writing START

    def _active(self) -> bool:
        kw = self.chat_template_kwargs
        return kw.get("enable_thinking", True) is not False and kw.get("thinking", True) is not False

    def split(self, text: str) -> tuple[str | None, str]:
        if not self._active():
            return None, text
        body = text.lstrip()
        if body.startswith(START):
            body = body[len(START):]
        elif self.starts_inside:
            body = text
        else:
            return None, text
        end = body.find(END)
        if end < 0:
            return body, ""
        return body[:end], body[end + len(END):]

    def stream(self) -> ReasoningStream:
        return _ThinkStream(self)


class _ThinkStream(ReasoningStream):
    # phases: "start" (deciding whether reasoning opens), "think", "content"
    def __init__(self, parser: _ThinkParser):
        self.parser = parser
        self.phase = "start" if parser._active() else "content"
        self.buf = ""  # text not yet handed out

    def feed(self, delta_text: str, final: bool = False) -> tuple[str, str]:
        self.buf += delta_text
        reasoning, content = "", ""
        if self.phase == "start":
            body = self.buf.lstrip()
            if body.startswith(START):
                self.buf = body[len(START):]
                self.phase = "think"
            elif START.startswith(body) and not final:  # (empty or whitespace included) undecided
                return "", ""
            elif self.parser.starts_inside:
                self.phase = "think"
            else:
                self.phase = "content"
        if self.phase == "think":
            end = self.buf.find(END)
            if end >= 0:
                reasoning, self.buf = self.buf[:end], self.buf[end + len(END):]
                self.phase = "content"
            else:
                keep = 0 if final else partial_suffix(self.buf, END)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
        content, self.buf = self.buf, ""
        return reasoning, content


class DeepSeekR1ReasoningParser(_ThinkParser):
    name = "deepseek_r1"
    starts_inside = True


class Qwen3ReasoningParser(_ThinkParser):
    name = "qwen3"


class DeepSeekV4ReasoningParser(_ThinkParser):
    """DeepSeek-V4: its encoder ends a thinking-mode prompt with `<think>` and a chat-mode one with
    `</think>`, chat mode unless asked (chat_template_kwargs `thinking` or `enable_thinking` true):
    reasoning only then, starting inside it, as deepseek_r1."""

    name = "deepseek_v4"
    starts_inside = True

    def _active(self) -> bool:
        kw = self.chat_template_kwargs
        return kw.get("thinking") is True or kw.get("enable_thinking") is True


REASONING_PARSERS["deepseek_r1"] = DeepSeekR1ReasoningParser
REASONING_PARSERS["deepseek_v4"] = DeepSeekV4ReasoningParser
REASONING_PARSERS["qwen3"] = Qwen3ReasoningParser
