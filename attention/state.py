"""The per-sequence state cache of linear-attention layers (cache kind `STATE`)."""
from __future__ import annotations

import math

import torch
from torch import nn

from attention.cache_kinds import STATE


class StateCache(nn.Module):
    """A layer's per-sequence state: one tensor per entry of `shapes`, each (slots + 1, *shape),
    the last slot a scratch slot that padded decode rows write. Bound by the model runner; the
    step's slot of each sequence is `AttentionMetadata.state_slots` (B,), and a sequence whose
    context before this step is empty (`meta.context_lens_cpu[b] == 0`) starts from zeros."""

    cache_kind = STATE
    cache_group = 0  # set by the model runner when it groups the layers

    def __init__(self, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]):
        super().__init__()
        if len(shapes) != len(dtypes):
            raise ValueError("one dtype per state shape")
        self.shapes, self.dtypes = [tuple(s) for s in shapes], list(dtypes)
        self.caches: list[torch.Tensor | None] = [None] * len(shapes)

    def slot_bytes(self) -> int:
        """Bytes of one sequence's state in this layer."""
        return sum(math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in zip(self.shapes, self.dtypes))

    def cache_shapes(self, num_slots: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [((num_slots, *s), d) for s, d in zip(self.shapes, self.dtypes)]

    def bind(self, caches: list[torch.Tensor | None]) -> None:
        self.caches = list(caches)
