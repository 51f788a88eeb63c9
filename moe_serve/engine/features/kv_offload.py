"""KV tiers as a step feature: moves block bytes between the device cache and the tiers below it
(the tiers: moe_serve/kv_offload; the scheduler's part: attention/tier_prefix.py).

Offload on eviction: the allocator reports a findable block (or state snapshot) it is about to hand
out again, and right after scheduling, before any forward can write into it, its bytes are copied
out (device -> host: one gather per run of blocks; host -> disk: in the disk tier's thread, from
the host copy). Saving on eviction rather than on registration costs nothing for a prefix that is
hit again while it is on the device, which with a working set near the pool's size is most of them.
Restore: blocks a prefix lookup found in a tier were allocated and registered by the scheduler; they
are filled here, after that step's evictions were saved (the ops run in the order they happened),
and before its forward. Disk reads run in the disk thread while other requests step; the request
whose prefix is being read waits, passed over by admission (attention/tier_prefix.py), and a failed
read is a miss. State snapshots' copies (live -> snapshot slot) run here too, in the same ordered
log, rather than in the runner: a save must see a snapshot filled, and a load may reuse a live slot
a pending copy still reads.
"""
from __future__ import annotations

import time
from concurrent.futures import wait

import msgspec
import torch

from moe_serve.engine.features.base import StepFeature
from moe_serve.kv_offload.store import TierStore


class KVOffloadStats(msgspec.Struct):
    """Since start. hits: blocks (and state snapshots) restored from a tier; saved: bytes written to
    it; restored: bytes copied back from it; restore_seconds: time in the copies back to the device
    and the disk reads they waited for."""

    host_hits: int = 0
    disk_hits: int = 0
    host_saved_bytes: int = 0
    disk_saved_bytes: int = 0
    host_restored_bytes: int = 0
    disk_restored_bytes: int = 0
    restore_seconds: float = 0.0
    read_waits: int = 0  # admissions put off while a prompt's blocks were read from disk
    host_used_bytes: int = 0
    disk_used_bytes: int = 0
    disk_errors: int = 0


def _byte_views(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each cache tensor as (blocks, bytes per block) uint8, sharing its memory (any dtype: FP8 too)."""
    out = []
    for t in tensors:
        u8 = t.view(t.shape[0], -1).view(torch.uint8)
        if u8.data_ptr() != t.data_ptr():
            raise ValueError("a KV cache tensor is not contiguous: its blocks cannot be offloaded")
        out.append(u8)
    return out


class KVOffload(StepFeature):
    name = "kv_offload"

    def __init__(self, scheduler, pools: list[list[torch.Tensor]], store: TierStore):
        """pools: the cache tensors of every block group, then the state pool's (the cache
        manager's pool numbering)."""
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.pools = [_byte_views(p) for p in pools]
        self.store = store
        self.restore_seconds = 0.0
        self.kv.enable_tiers(store)

    @classmethod
    def build(cls, ctx) -> "KVOffload | None":
        cfg = getattr(ctx.cfg, "kv_offload", None)
        if cfg is None or ctx.scheduler is None or ctx.cache is None:
            return None
        groups, state = ctx.cache
        store = TierStore(cfg.host_bytes, cfg.disk_path, cfg.disk_bytes)
        return cls(ctx.scheduler, list(groups) + ([state] if state else []), store)

    # --- the step -------------------------------------------------------------------------------
    def after_schedule(self, sched) -> None:
        ops = self.kv.take_tier_ops()
        start = 0
        for i in range(1, len(ops) + 1):  # runs of one kind and pool, in order
            if i == len(ops) or ops[i][:2] != ops[start][:2]:
                kind, pool = ops[start][:2]
                run = [(a, b) for _, _, a, b in ops[start:i]]
                if kind == "copy":  # a state snapshot (attention/kv_manager.py): live -> snapshot slot
                    for src, dst in run:
                        for v in self.pools[pool]:
                            v[dst] = v[src]
                else:
                    self._save(pool, run) if kind == "save" else self._load(pool, run)
                start = i
        self.store.end_step()
        self._lost(self.store.take_lost())
        if sched.is_empty and not self.scheduler.running:
            reads = self.store.reading()
            if reads:  # nothing to step until a read lands: wait for one rather than spin
                t0 = time.perf_counter()
                wait(reads, timeout=0.01, return_when="FIRST_COMPLETED")
                self.restore_seconds += time.perf_counter() - t0

    def _save(self, pool: int, run: list[tuple[int, bytes]]) -> None:
        run = [(bid, h) for bid, h in run if not self.store.holds((pool, h))]
        if not run:
            return
        views = self.pools[pool]
        idx = torch.tensor([bid for bid, _ in run], device=views[0].device)
        rows = torch.cat([v.index_select(0, idx) for v in views], dim=1).cpu()
        for (_, h), row in zip(run, rows):
            self.store.save((pool, h), row.clone())  # its own memory: the batch is not kept whole

    def _load(self, pool: int, run: list[tuple[int, bytes]]) -> None:
        t0 = time.perf_counter()
        views = self.pools[pool]
        rows = torch.stack([self.store.take((pool, h)) for _, h in run])
        width = sum(v.shape[1] for v in views)
        if rows.shape[1] != width:
            raise RuntimeError(f"a KV tier block of {rows.shape[1]} bytes does not fit pool {pool}'s {width}")
        rows = rows.to(views[0].device)
        idx = torch.tensor([bid for bid, _ in run], device=views[0].device)
        off = 0
        for v in views:
            v.index_copy_(0, idx, rows[:, off:off + v.shape[1]])
            off += v.shape[1]
        self.restore_seconds += time.perf_counter() - t0

    def _lost(self, keys) -> None:
        """Blocks that left every tier: routing hears group 0's are gone (unless back on the device)."""
        for pool, h in keys:
            if pool == 0:
                self.kv.allocs[0].note_lost(h)

    # --- the rest of the contract ---------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self.store.reading())

    def stats(self) -> KVOffloadStats:
        s, disk, host = self.store, self.store.disk, self.store.host
        return KVOffloadStats(
            host_hits=s.hits["host"], disk_hits=s.hits["disk"], host_saved_bytes=s.host_saved_bytes,
            disk_saved_bytes=disk.saved_bytes if disk else 0, host_restored_bytes=s.restored_bytes["host"],
            disk_restored_bytes=s.restored_bytes["disk"],
            restore_seconds=self.restore_seconds + (disk.read_seconds if disk else 0.0), read_waits=self.kv.tier_waits,
            host_used_bytes=host.used if host else 0, disk_used_bytes=disk.used if disk else 0,
            disk_errors=sum(disk.errors.values()) if disk else 0)

    def shutdown(self) -> None:
        self.store.shutdown()
