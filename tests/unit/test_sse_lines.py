"""Server-sent events' data lines survive line readers built on str.splitlines (httpx's iter_lines,
which many Python clients read streams with): a token's text can hold U+0085, U+2028 or U+2029, which
JSON lets stand raw inside a string and splitlines takes for line ends. The server escapes them; the
JSON decodes to the same text."""
from __future__ import annotations

import json

import httpx
import pytest

from moe_serve.entrypoints.openai import protocol as P
from moe_serve.entrypoints.openai.outputs import _sse, sse_json

TEXTS = ["a\u2028b", "x\u0085y", "p\u2029q", "\u2028\u2029\u0085", "plain", "caf\u00e9 \u4e2d\u6587 \U0001f600",
         "tab\tnew\nline\rcr"]


def _lines(body: bytes) -> list[str]:
    """The stream as httpx's client reads it."""
    return list(httpx.Response(200, content=body).iter_lines())


@pytest.mark.parametrize("text", TEXTS)
def test_a_data_line_is_one_line_to_httpx_and_decodes_to_the_same_text(text):
    chunk = P.CompletionResponse("cmpl-1", 0, "m", [P.CompletionChoice(0, text, None, None)])
    body = _sse(chunk) + b"data: [DONE]\n\n"
    data = [line for line in _lines(body) if line.startswith("data: ")]
    assert len(data) == 2 and data[1] == "data: [DONE]", data
    assert json.loads(data[0][6:])["choices"][0]["text"] == text
    # the same bytes as the plain encoder where nothing needed escaping
    raw = json.dumps({"t": text}, ensure_ascii=False, separators=(",", ":")).encode()
    if not any(c in text for c in "\u0085\u2028\u2029"):
        assert sse_json({"t": text}) == raw

