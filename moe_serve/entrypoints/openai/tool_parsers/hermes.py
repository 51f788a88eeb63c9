"""Hermes-style tool calls (Qwen2.5, Qwen3, Hermes): each call is a JSON object between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

anywhere in the output, any number of times. A last call left open at the end of the output
(no `</tool_call>`) still counts if its JSON is complete.
"""
from __future__ import annotations

from ._marked import Invalid, Item, MarkedToolParser, call_from_object
from .base import PARSERS

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(MarkedToolParser):
    name = "hermes"
    markers = (START,)

    def items(self, text: str, final: bool) -> list[Item]:
        items: list[Item] = []
        pos, after_call = 0, False
        while True:
            i = text.find(START, pos)
            if i < 0:
                self.tail(items, text[pos:], after_call, final)
                return items
            body = i + len(START)
            j = text.find(END, body)
            try:
                call, obj_end = call_from_object(text[:j] if j >= 0 else text, body)
            except Invalid:
                call, obj_end = None, None
            if j < 0:  # the call is still being written (or was cut off)
                if not final:
                    self.content(items, text[pos:i], after_call, True)
                    if call is not None:
                        items.append(call)
                elif call is not None and call.done:
                    self.content(items, text[pos:i], after_call, True)
                    items.append(call)
                    self.content(items, text[obj_end:], True, False)
                else:
                    self.content(items, text[pos:], after_call, False)
                return items
            if call is not None and call.done and not text[obj_end:j].strip():
                self.content(items, text[pos:i], after_call, True)
                items.append(call)
                after_call = True
            else:  # not a call after all: the tags and all stay in the content
                self.content(items, text[pos:j + len(END)], after_call, False)
                after_call = False
            pos = j + len(END)


PARSERS["hermes"] = HermesToolParser
