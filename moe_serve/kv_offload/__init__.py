"""KV tiers below the device pool: prefix-cache blocks evicted from the device are kept in host
memory (`--kv-offloading-size GB`) and, below it, on disk (`--kv-offloading-disk PATH`,
`--kv-offloading-disk-size GB`), and copied back when a prompt's prefix is found there instead of
being recomputed (vLLM's offloading connector, SGLang's HiCache, LMCache).

- `host.py` the host tier: an LRU of block copies within a byte budget.
- `disk.py` the disk tier: one file per block under a directory of its own, an LRU within a byte
  budget, written and read by one background thread; a full disk or an I/O error loses the block
  (logged once per kind), never a request.
- `store.py` both tiers behind one index (`TierStore.has`, what the cache manager asks) and the
  bytes of one block in and out.
- the step feature that moves bytes between the device cache and the store:
  moe_serve/engine/features/kv_offload.py. The scheduler's part: attention/tier_prefix.py.

What is saved is whatever the cache tensors hold, as bytes (float, bfloat16 or FP8 alike): every
layer's slice of one block of one cache group, or one state snapshot of the linear-attention layers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

GB = 1 << 30


@dataclass(frozen=True)
class KVOffloadConfig:
    host_bytes: int = 0  # 0: no host tier
    disk_path: str | None = None  # None: no disk tier
    disk_bytes: int = 0

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes or self.disk_path)


def resolve_kv_offload(size_gb: float | None, disk: str | None, disk_size_gb: float | None,
                       enable_prefix_caching: bool) -> KVOffloadConfig | None:
    """The tiers the three flags ask for (None: none), or a ValueError naming the flag."""
    if size_gb is not None and not size_gb >= 0:
        raise ValueError(f"kv_offloading_size={size_gb} (--kv-offloading-size, GB) must be >= 0")
    if disk_size_gb is not None and not disk_size_gb > 0:
        raise ValueError(f"kv_offloading_disk_size={disk_size_gb} (--kv-offloading-disk-size, GB) must be > 0")
    if disk_size_gb is not None and not disk:
        raise ValueError("kv_offloading_disk_size (--kv-offloading-disk-size) needs a directory: "
                         "--kv-offloading-disk PATH")
    if disk:
        if disk_size_gb is None:
            raise ValueError(f"kv_offloading_disk={disk!r} (--kv-offloading-disk) needs a size: "
                             "--kv-offloading-disk-size GB")
        if not os.path.isdir(disk):
            raise ValueError(f"kv_offloading_disk={disk!r} (--kv-offloading-disk) is not a directory")
        if not os.access(disk, os.W_OK | os.X_OK):
            raise ValueError(f"kv_offloading_disk={disk!r} (--kv-offloading-disk) is not writable")
    cfg = KVOffloadConfig(int((size_gb or 0) * GB), disk or None, int((disk_size_gb or 0) * GB))
    if not cfg.enabled:
        return None
    if not enable_prefix_caching:
        raise ValueError("--kv-offloading-size / --kv-offloading-disk keep prefix-cache blocks: they need "
                         "prefix caching (drop --no-enable-prefix-caching)")
    return cfg
