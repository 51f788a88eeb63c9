"""Hermes-style tool calls (Qwen2.5, Qwen3, Hermes): each call is a JSON object between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

anywhere in the output, any number of times. A last call left open at the end of the output
(no `</tool_call>`) still counts if its JSON is complete.
"""
from __future__ import annotations

from ._marked import Invalid, Item, MarkedToolParser, call_from_object, skip_ws
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
            try:  # the JSON decides where the call ends (a string in it may contain the end tag)
                call, obj_end = call_from_object(text, i + len(START))
            except Invalid:
                call, obj_end = None, None
            if call is not None and obj_end is not None:
                k = skip_ws(text, obj_end)
                if text.startswith(END, k):
                    self.content(items, text[pos:i], after_call, True)
                    items.append(call)
                    pos, after_call = k + len(END), True
                    continue
                if k >= len(text) or END.startswith(text[k:]):  # the end tag may be coming, or never will
                    self.content(items, text[pos:i], after_call, True)
                    items.append(call)
                    if final:
                        self.content(items, text[obj_end:], True, False)
                    return items
                call = None  # more after the object: not a call
            if call is not None:  # still being written (or cut off)
                if final:
                    self.content(items, text[pos:], after_call, False)
                else:
                    self.content(items, text[pos:i], after_call, True)
                    items.append(call)
                return items
            j = text.find(END, i + len(START))
            if j < 0:
                self.content(items, text[pos:] if final else text[pos:i], after_call, not final)
                return items
            # Not a call: the tags and all stay in the content.
            self.content(items, text[pos:j + len(END)], after_call, False)
            pos, after_call = j + len(END), False


PARSERS["hermes"] = HermesToolParser
