"""Both tiers behind one index: what the cache manager asks (`has`) and the bytes of a block in and
out, with the counts the metrics report.

A block saved goes to the host tier; what the host tier pushes out goes to the disk tier (or is
lost without one); with no host tier a block goes straight to disk. A block is held by one tier at
a time. `has` pins the bytes it answers True for until `end_step`, so the load ops of the step
that found them cannot lose them to an eviction in between.
"""
from __future__ import annotations

import torch

from moe_serve.kv_offload.disk import DiskTier
from moe_serve.kv_offload.host import HostTier, Key


class TierStore:
    def __init__(self, host_bytes: int = 0, disk_path: str | None = None, disk_bytes: int = 0):
        self.host = HostTier(host_bytes) if host_bytes else None
        self.disk = DiskTier(disk_path, disk_bytes) if disk_path else None
        self.pinned: dict[Key, tuple[torch.Tensor, str]] = {}
        self.lost: list[Key] = []  # left every tier (the host's, with no disk below)
        self.hits = {"host": 0, "disk": 0}  # blocks restored from each tier
        self.restored_bytes = {"host": 0, "disk": 0}
        self.host_saved_bytes = 0

    # --- the index the cache manager asks -------------------------------------------------------
    def has(self, pool: int, block_hash: bytes) -> bool | None:
        """True: the block's bytes are in hand (pinned until end_step); None: being read from disk
        (a read is started if none is); False: no tier holds it."""
        key = (pool, block_hash)
        if key in self.pinned:
            return True
        if self.host is not None:
            data = self.host.get(key)
            if data is not None:
                self.pinned[key] = (data, "host")
                return True
        if self.disk is None:
            return False
        found = self.disk.find(key)
        if isinstance(found, torch.Tensor):
            self.pinned[key] = (found, "disk")
            return True
        return found

    def holds(self, key: Key) -> bool:
        """Whether a tier holds key (a save of it would change nothing)."""
        if self.host is not None and self.host.get(key) is not None:
            return True
        return self.disk is not None and key in self.disk

    # --- bytes in and out -----------------------------------------------------------------------
    def save(self, key: Key, data: torch.Tensor) -> None:
        """Keep a block's bytes (a 1-D uint8 CPU tensor the store may keep as it is)."""
        if self.host is None:
            self.disk.put(key, data)
            return
        self.host_saved_bytes += data.numel()
        for old, old_data in self.host.put(key, data):
            if self.disk is not None:
                self.disk.put(old, old_data)
            else:
                self.lost.append(old)

    def take(self, key: Key) -> torch.Tensor:
        """The bytes `has` answered True for in this step, counted as a hit of their tier."""
        data, tier = self.pinned[key]
        if tier == "disk":
            self.disk.take_staged(key)
        self.hits[tier] += 1
        self.restored_bytes[tier] += data.numel()
        return data

    def end_step(self) -> None:
        self.pinned.clear()

    def take_lost(self) -> list[Key]:
        out, self.lost = self.lost, []
        return out + (self.disk.take_lost() if self.disk is not None else [])

    def reading(self) -> list:
        return self.disk.reading() if self.disk is not None else []

    def clear(self) -> None:
        """Forget every block (the prefixes changed meaning: new weights); they are reported lost."""
        self.pinned.clear()
        self.lost += self.host.clear() if self.host is not None else []
        self.lost += self.disk.clear() if self.disk is not None else []

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def shutdown(self) -> None:
        if self.disk is not None:
            self.disk.shutdown()
