"""DeepSeek-V3 / R1 tool calls, written with the model's tool-call tokens:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Text before the block is content (and after it, if the model goes on). The type before
<｜tool▁sep｜> is "function"; the arguments are the JSON inside the fence.
"""
from __future__ import annotations

from ._marked import NAME, Invalid, Item, MarkedToolParser, Partial, _WS, json_value, skip_ws
from .base import PARSERS

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```"


class DeepSeekV3ToolParser(MarkedToolParser):
    name = "deepseek_v3"
    calls_begin, calls_end, call_begin = CALLS_BEGIN, CALLS_END, CALL_BEGIN  # the block and each call
    markers = (CALLS_BEGIN, CALL_BEGIN)

    def items(self, text: str, final: bool) -> list[Item]:
        calls_begin, calls_end, call_begin = self.calls_begin, self.calls_end, self.call_begin
        items: list[Item] = []
        pos, after_call = 0, False
        while True:
            starts = [k for k in (text.find(calls_begin, pos), text.find(call_begin, pos)) if k >= 0]
            if not starts:
                self.tail(items, text[pos:], after_call, final)
                return items
            i = min(starts)
            self.content(items, text[pos:i], after_call, True)
            j = i + len(calls_begin) if text.startswith(calls_begin, i) else i
            while True:  # the calls of one block
                j = skip_ws(text, j)
                if text.startswith(calls_end, j):
                    pos, after_call = j + len(calls_end), True
                    break
                if not text.startswith(call_begin, j):
                    if j >= len(text) or calls_end.startswith(text[j:]) or call_begin.startswith(text[j:]):
                        if not final:
                            return items  # the block goes on
                        pos, after_call = j, True  # the output ended inside the block
                        break
                    pos, after_call = j, True  # the block ends without its closing token
                    break
                try:
                    call, end = self._call(text, j + len(call_begin))
                except Invalid:
                    # Not a call: the rest is content, as written.
                    self.content(items, text[j:], True, False)
                    return items
                if end is None:  # still being written
                    if not final:
                        items.append(call)
                    elif call.done:
                        items.append(call)
                    else:
                        self.content(items, text[j:], True, False)
                    return items
                items.append(call)
                j = end

    @staticmethod
    def _call(text: str, i: int) -> tuple[Item, int | None]:
        """One call after <｜tool▁call▁begin｜>: (Item, index after <｜tool▁call▁end｜> or None)."""
        item = Item()
        sep = text.find(SEP, i)
        if sep < 0:
            if CALL_END in text[i:]:
                raise Invalid("no tool separator")
            return item, None
        nl = text.find("\n", sep)
        if nl < 0:
            return item, None
        item.name = text[sep + len(SEP):nl].strip()
        if not NAME.fullmatch(item.name):
            raise Invalid("not a function name")
        k = skip_ws(text, nl)
        rest = text[k:]
        if not rest.startswith(FENCE):
            if FENCE.startswith(rest) or "```json".startswith(rest):
                return item, None
            raise Invalid("no ```json fence")
        k += len(FENCE)
        line = text.find("\n", k)
        if line < 0:
            return item, None
        k = skip_ws(text, line)
        try:
            _, end = json_value(text, k)
        except Partial:
            item.args = text[k:].rstrip(_WS)
            return item, None
        item.args = text[k:end]
        m = skip_ws(text, end)
        for token in (FENCE, CALL_END):
            if not text.startswith(token, m):
                if token.startswith(text[m:]):
                    return item, None
                raise Invalid(f"expected {token}")
            m = skip_ws(text, m + len(token)) if token == FENCE else m + len(token)
        item.done = True
        return item, m


PARSERS["deepseek_v3"] = DeepSeekV3ToolParser
