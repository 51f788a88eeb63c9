"""Paged KV block allocator with reference counts and a prefix cache. Pure Python: integer block ids.

A block holds `block_size` consecutive tokens of one sequence. A *full* block is identified by a
hash of its tokens chained with the hash of every block before it, so equal hashes mean equal
prefixes. Full blocks are registered in the prefix cache and can be shared by any number of
requests (ref count); a block whose ref count drops to 0 keeps its contents and stays in the cache
until it is reused for something else, least recently freed first.

Invariants (checked by the property tests):
  - every block is either referenced (ref > 0) or in the free queue, never both;
  - the free queue holds each free block once, in eviction order (front = evicted first);
  - the cache maps a hash to a block whose registered hash is that hash.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

_ROOT_HASH = b"moe-serve-prefix-root"


def hash_block(parent: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Chained 128-bit hash of a full block; a collision would silently reuse a wrong prefix."""
    h = hashlib.blake2b(parent or _ROOT_HASH, digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        # Net changes of `cached` since take_events (hash -> now findable), kept once track_events is
        # called: a data-parallel front end routes by them (moe_serve/engine/routing.py).
        self.events: dict[bytes, bool] | None = None
        # Called as on_evict(block_id, hash) when a findable cached block is about to be overwritten
        # (KV tiers: its bytes are saved before the step's forward); True when the prefix stays
        # findable elsewhere (a tier), so routing is not told it was lost (see note_lost).
        self.on_evict = None
        # Prefix-cache statistics, in tokens.
        self.lookup_tokens = 0
        self.hit_tokens = 0

    # --- capacity -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Share of blocks referenced by live requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- allocation -----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take n fresh blocks (ref 1), evicting cached contents as needed. Caller checks capacity."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            bid, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[bid]
            if h is not None:  # evict: the block's old contents are about to be overwritten
                if self.cached.get(h) == bid:
                    del self.cached[h]
                    kept = self.on_evict is not None and self.on_evict(bid, h)
                    if self.events is not None and not kept:
                        self.events[h] = False
                self.block_hash[bid] = None
            self.ref_cnt[bid] = 1
            out.append(bid)
        return out

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block. Tail blocks are queued first so that, among one
        request's blocks, the last ones (least likely to be shared) are evicted first."""
        for bid in reversed(block_ids):
            self.ref_cnt[bid] -= 1
            if self.ref_cnt[bid] < 0:
                raise RuntimeError(f"KV block {bid} freed more often than allocated")
            if self.ref_cnt[bid] == 0:
                self.free_queue[bid] = None

    # --- prefix cache ---------------------------------------------------------------------------
    def lookup_prefix(self, block_hashes: list[bytes], max_blocks: int) -> list[int]:
        """Longest run of cached blocks matching block_hashes[:max_blocks]; takes a reference on each."""
        hits: list[int] = []
        if self.enable_prefix_caching:
            for h in block_hashes[:max_blocks]:
                bid = self.cached.get(h)
                if bid is None:
                    break
                hits.append(bid)
        for bid in hits:
            if self.ref_cnt[bid] == 0:
                del self.free_queue[bid]
            self.ref_cnt[bid] += 1
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.lookup_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Mark a now-full block as holding the prefix `block_hash`."""
        if not self.enable_prefix_caching or self.block_hash[block_id] is not None:
            return
        self.block_hash[block_id] = block_hash
        # If another block already holds this prefix, keep that one: both stay valid, only one is findable.
        if self.cached.setdefault(block_hash, block_id) == block_id and self.events is not None:
            self.events[block_hash] = True

    def reset_prefix_cache(self, held: bool = False) -> None:
        """Forget the cached prefixes of free blocks; held: those of referenced blocks too (their
        contents were made by weights no longer served; they are simply freed later)."""
        for bid in range(self.num_blocks):
            if held or self.ref_cnt[bid] == 0:
                self.block_hash[bid] = None
        kept = {} if held else {h: b for h, b in self.cached.items() if self.ref_cnt[b] > 0}
        if self.events is not None:
            self.events.update((h, False) for h in self.cached if h not in kept)
        self.cached = kept

    def note_lost(self, block_hash: bytes) -> None:
        """A prefix kept outside this pool (a KV tier) is gone there too: routing hears it is lost,
        unless this pool holds it again."""
        if self.events is not None and block_hash not in self.cached:
            self.events[block_hash] = False

    def track_events(self) -> None:
        if self.events is None:
            self.events = {}

    def take_events(self) -> tuple[list[bytes], list[bytes]]:
        """The hashes that became findable and those that stopped being, since the last call."""
        ev, self.events = self.events or {}, ({} if self.events is not None else None)
        return [h for h, v in ev.items() if v], [h for h, v in ev.items() if not v]

    def check_invariants(self) -> None:
        for bid in range(self.num_blocks):
            in_free = bid in self.free_queue
            assert self.ref_cnt[bid] >= 0, bid
            assert (self.ref_cnt[bid] == 0) == in_free, (bid, self.ref_cnt[bid], in_free)
        for h, bid in self.cached.items():
            assert self.block_hash[bid] == h
