"""DeepSeek-V3.1 tool calls (also V3.1-Terminus and V3.2-Exp): DeepSeek-V3's tokens, without the
type and the fence; the name before <｜tool▁sep｜>, the arguments' JSON object right after it
(on one line, here cut in two):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Text before the block is content (and after it, if the model goes on). Malformed and cut-off calls
are read as deepseek_v3 reads them.
"""
from __future__ import annotations

import re

from ._marked import NAME, Invalid, Item, Partial, _WS, json_value, partial_suffix, skip_ws
from .base import PARSERS
from .deepseek_v3 import CALL_END, SEP, DeepSeekV3ToolParser

_NAME_START = re.compile(r"[\w.:-]{0,128}")  # what a name may be before it is all written


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    name = "deepseek_v31"

    @staticmethod
    def _call(text: str, i: int) -> tuple[Item, int | None]:
        """One call after <｜tool▁call▁begin｜>: (Item, index after <｜tool▁call▁end｜> or None)."""
        item = Item()
        sep = text.find(SEP, i)
        if sep < 0:
            head = text[i:len(text) - partial_suffix(text[i:], SEP)]
            if not _NAME_START.fullmatch(head.strip(_WS)):
                raise Invalid("not a function name")
            return item, None
        name = text[i:sep].strip(_WS)
        if not NAME.fullmatch(name):
            raise Invalid("not a function name")
        item.name = name
        k = skip_ws(text, sep + len(SEP))
        if k >= len(text):
            return item, None
        if text[k] != "{":
            raise Invalid("the arguments are an object")
        try:
            _, end = json_value(text, k)
        except Partial:
            item.args = text[k:].rstrip(_WS)
            return item, None
        item.args = text[k:end]
        m = skip_ws(text, end)
        if not text.startswith(CALL_END, m):
            if CALL_END.startswith(text[m:]):
                return item, None
            raise Invalid(f"expected {CALL_END}")
        item.done = True
        return item, m + len(CALL_END)


PARSERS["deepseek_v31"] = DeepSeekV31ToolParser
