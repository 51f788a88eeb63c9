"""The interface of a reasoning parser.

Whole text: `parser.split(text)` -> (reasoning or None, content).
Streaming: `s = parser.stream()` once per choice, then `s.feed(delta_text)` per engine output and
`s.feed("", final=True)` at the end; each returns (reasoning piece, content piece). The pieces
concatenate to what `split` gives for the whole text.
"""
from __future__ import annotations


class ReasoningStream:
    def feed(self, delta_text: str, final: bool = False) -> tuple[str, str]:
        raise NotImplementedError


class ReasoningParser:
    name: str = ""

    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.chat_template_kwargs = chat_template_kwargs or {}

    def split(self, text: str) -> tuple[str | None, str]:
        raise NotImplementedError

    def stream(self) -> ReasoningStream:
        raise NotImplementedError


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {}  # --reasoning-parser NAME -> class


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of marker (text that
    must be held back because the marker may be starting)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
