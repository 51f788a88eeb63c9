"""Mistral tool calls: the [TOOL_CALLS] token, then the calls, in either of Mistral's forms:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (tokenizers before v11)
    [TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]other[ARGS]{...}          (v11 and later)

Text before [TOOL_CALLS] is content. Call ids are 9 letters and digits, the only form Mistral's
chat templates accept back in the history.

[TOOL_CALLS] is a special (control) token in Mistral's tokenizers: it reaches the text only when
the request keeps special tokens (skip_special_tokens=false).
"""
from __future__ import annotations

import random
import string

from ._marked import NAME, Invalid, Item, MarkedToolParser, Partial, _WS, call_from_object, json_value, skip_ws
from .base import PARSERS

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ALNUM = string.ascii_letters + string.digits


class MistralToolParser(MarkedToolParser):
    name = "mistral"
    markers = (BOT,)

    def call_id(self) -> str:
        return "".join(random.choices(_ALNUM, k=9))

    def items(self, text: str, final: bool) -> list[Item]:
        items: list[Item] = []
        i = text.find(BOT)
        if i < 0:
            self.tail(items, text, False, final)
            return items
        self.content(items, text[:i], False, True)
        j = skip_ws(text, i + len(BOT))
        before = len(items)
        try:
            if j < len(text) and text[j] == "[":
                end = self._array(text, j + 1, items)
            else:
                end = self._named(text, i, items, final)
        except Invalid:
            del items[before:]
            self.content(items, text[i:], False, False)  # not calls: the text as written
            return items
        if end is None:
            if final:  # cut off: only complete calls count
                while items and items[-1].text is None and not items[-1].done:
                    items.pop()
            return items
        self.tail(items, text[end:], True, final)
        return items

    @staticmethod
    def _array(text: str, j: int, items: list[Item]) -> int | None:
        first = True
        while True:
            j = skip_ws(text, j)
            if j >= len(text):
                return None
            if text[j] == "]":
                return j + 1
            if not first:
                if text[j] != ",":
                    raise Invalid("expected ',' between calls")
                j = skip_ws(text, j + 1)
            first = False
            call, end = call_from_object(text, j)
            items.append(call)
            if end is None:
                return None
            j = end

    @staticmethod
    def _named(text: str, i: int, items: list[Item], final: bool) -> int | None:
        """[TOOL_CALLS]name{...} (or name[ARGS]{...}), repeated."""
        while True:
            j = i + len(BOT)
            brace = text.find("{", j)
            name_end = brace
            k = text.find(ARGS, j)
            if k >= 0 and (brace < 0 or k < brace):
                name_end, brace = k, skip_ws(text, k + len(ARGS))
            if brace < 0 or brace >= len(text):
                if len(text) - j > 256 or "\n" in text[j:]:
                    raise Invalid("no arguments after the name")
                return None
            item = Item(name=text[j:name_end].strip())
            if not NAME.fullmatch(item.name):
                raise Invalid("bad function name")
            if text[brace] != "{":
                raise Invalid("the arguments are an object")
            items.append(item)
            try:
                _, end = json_value(text, brace)
            except Partial:
                item.args = text[brace:].rstrip(_WS)
                return None
            item.args, item.done = text[brace:end], True
            i = skip_ws(text, end)
            if text.startswith(BOT, i):
                continue
            if not final and (i >= len(text) or BOT.startswith(text[i:])):
                return None  # another call may follow
            return end


PARSERS["mistral"] = MistralToolParser
