"""What each attention-like layer keeps per request. Pure Python (the scheduler imports it).

Every layer that keeps something across steps declares a `cache_kind`:

- `FULL`: K/V (or MLA's latent) of every token; its blocks grow with the context.
- `sliding(w)`: K/V of the last w tokens only (GPT-OSS's sliding layers): a query at position p
  reads keys p - w + 1 .. p, so blocks wholly before that are freed as the request advances.
- `chunked(c)`: K/V of the current chunk of c tokens (Llama-4's local layers): a query at p reads
  keys from (p // c) * c to p, so blocks before its chunk are freed.
- `STATE`: a fixed-size state per sequence (linear attention: a recurrent matrix and the short
  convolution's last inputs), one slot per running request, never growing (`attention/state.py`).

Layers of the same kind share one block table (or slot) per request: the engine's cache manager
(`attention/kv_manager.py`) keeps one allocator per kind and the step's metadata carries one block
table per kind (`AttentionMetadata.for_group`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheKind:
    kind: str  # "full" | "sliding" | "chunked" | "state"
    tokens: int = 0  # sliding: the window; chunked: the chunk length; else 0

    def __post_init__(self):
        if self.kind not in ("full", "sliding", "chunked", "state"):
            raise ValueError(f"cache kind {self.kind!r} is not one of full, sliding, chunked, state")
        if self.kind in ("sliding", "chunked") and self.tokens < 1:
            raise ValueError(f"a {self.kind} cache needs a positive length, got {self.tokens}")

    @property
    def is_state(self) -> bool:
        return self.kind == "state"

    def first_needed(self, start: int) -> int:
        """The first position whose K/V a query at position `start` (or any later one) reads."""
        if self.kind == "sliding":
            return max(0, start - self.tokens + 1)
        if self.kind == "chunked":
            return (start // self.tokens) * self.tokens
        return 0

    def __str__(self) -> str:
        return f"{self.kind}({self.tokens})" if self.tokens else self.kind


FULL = CacheKind("full")
STATE = CacheKind("state")


def sliding(window: int) -> CacheKind:
    return CacheKind("sliding", window)


def chunked(chunk: int) -> CacheKind:
    return CacheKind("chunked", chunk)
