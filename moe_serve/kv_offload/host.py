"""The host tier: copies of evicted blocks in host memory, least recently used out first.

An entry is one block's bytes (a 1-D uint8 tensor on the CPU) under (pool, hash); `put` returns
what it pushed out so the store can move it to the disk tier below.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

Key = tuple[int, bytes]


class HostTier:
    name = "host"

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.used = 0
        self.entries: OrderedDict[Key, torch.Tensor] = OrderedDict()

    def __contains__(self, key: Key) -> bool:
        return key in self.entries

    def get(self, key: Key) -> torch.Tensor | None:
        t = self.entries.get(key)
        if t is not None:
            self.entries.move_to_end(key)
        return t

    def put(self, key: Key, data: torch.Tensor) -> list[tuple[Key, torch.Tensor]]:
        """Keep data under key (an entry larger than the whole tier is pushed out at once)."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return []
        self.entries[key] = data
        self.used += data.numel()
        out = []
        while self.used > self.capacity and self.entries:
            k, t = self.entries.popitem(last=False)
            self.used -= t.numel()
            out.append((k, t))
        return out

    def clear(self) -> list[Key]:
        keys = list(self.entries)
        self.entries.clear()
        self.used = 0
        return keys
