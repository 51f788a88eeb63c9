"""The cache manager: one block allocator per cache group, one state-slot pool, and a request's
admission, growth, prefix hits and release across all of them together. Pure Python: ids only.

Groups (attention/cache_kinds.py): layers of one kind share a block table per request. Every
group's table is indexed the same way (block i holds positions i*bs .. i*bs + bs - 1), so a
request's tables all have the same length; in a sliding or chunked group the entries before the
window (or chunk) of the request's next query are freed as it advances and replaced by the
group's null block (its scratch block, never read: the kernels start at the window). Group 0 is
the one `AttentionMetadata` carries directly (full attention when the model has any).

State slots (linear attention): a running request holds one live slot, allocated with its first
blocks and freed with them. With prefix caching on, the state at the last block boundary of the
prompt is also kept: the scheduler ends a prefill chunk exactly there, and after that step the
live state is copied into a snapshot slot registered under that block's chained hash (like a
full block; evicted least recently used first, never counted as in use). A later request whose
prefix reaches that boundary restores the snapshot instead of recomputing the prefix. The copies
are ids in the step's `state_copies`, run by the model runner before the forward, in order.

KV tiers (moe_serve/kv_offload, `enable_tiers`): a findable block or snapshot about to be reused
is saved below the device pool first, and a prefix lookup that ends on the device goes on in the
tiers; blocks found there are allocated, registered and filled from them. Both are ops in
`tier_ops` (("save" | "load", pool, id, hash), pool = group index, the state pool last), in the
order they happened, which the tier feature carries out before the step's forward (a block
evicted and refilled in one step is saved before it is loaded). With tiers, a state snapshot's copy
is an op in the same log (("copy", pool, live, snapshot)) rather than a runner's state copy, so
that it lands before a later save reads the snapshot or a load reuses the live slot.
attention/tier_prefix.py.

Invariants (checked by the property tests): in every pool each id is either referenced or free,
never both; a request's tables have equal lengths; nothing is referenced once every request has
finished, been aborted or preempted.
"""
from __future__ import annotations

import functools

from attention.blocks import BlockAllocator
from attention.cache_kinds import FULL, CacheKind
from attention.tier_prefix import attach_tiered, tier_prefix


class KVCacheManager:
    def __init__(self, block_size: int, groups: list[tuple[CacheKind, int]], state_slots: int = 0,
                 enable_prefix_caching: bool = True):
        """groups: (kind, blocks) per block group, group 0 first; state_slots: the state pool's size
        (0: the model keeps no per-sequence state)."""
        if not groups:
            raise ValueError("a cache manager needs at least one block group")
        self.block_size = block_size
        self.kinds = [k for k, _ in groups]
        self.allocs = [BlockAllocator(n, block_size, enable_prefix_caching) for _, n in groups]
        self.state = BlockAllocator(state_slots, 1, enable_prefix_caching) if state_slots else None
        self.enable_prefix_caching = enable_prefix_caching
        self._no_tiers()

    def _no_tiers(self) -> None:
        self.tiers = None  # the tier index (enable_tiers), or None
        self.tier_ops: list[tuple[str, int, int, bytes]] = []
        self.tier_wait = False  # the last attach_prefix found tier blocks still being read
        self.tier_waits = 0  # admissions put off for tier reads, since start
        # (live, snapshot) copies of snapshots taken since the last step that ran them: the next
        # step's first state copies (take_snapshot_copies).
        self.snapshot_copies: list[tuple[int, int]] = []

    @classmethod
    def single(cls, alloc: BlockAllocator) -> "KVCacheManager":
        """A manager over one existing full-attention allocator (one group, no state)."""
        m = cls.__new__(cls)
        m.block_size, m.kinds, m.allocs, m.state = alloc.block_size, [FULL], [alloc], None
        m.enable_prefix_caching = alloc.enable_prefix_caching
        m._no_tiers()
        return m

    @property
    def pools(self) -> list[BlockAllocator]:
        """Every block group's allocator, then the state pool's (the tiers' pool numbering)."""
        return self.allocs + ([self.state] if self.state is not None else [])

    # --- KV tiers -------------------------------------------------------------------------------
    def enable_tiers(self, index) -> None:
        """Keep evicted prefixes in tiers below the device: index.has(pool, hash) answers True (its
        bytes are in hand), None (being read: the request waits) or False (not held)."""
        self.tiers = index
        for p, alloc in enumerate(self.pools):
            alloc.on_evict = functools.partial(self._evicted, p)

    def _evicted(self, pool: int, block_id: int, block_hash: bytes) -> bool:
        self.tier_ops.append(("save", pool, block_id, block_hash))
        return True

    def forget_tiers(self) -> None:
        """Every prefix changed meaning (new weights, a flush): the saves not yet made and whatever
        the tiers keep are dropped; loads already lent to requests still run."""
        for kind, pool, _, h in self.tier_ops:
            if kind == "save" and pool == 0:  # never saved: routing hears it is gone
                self.allocs[0].note_lost(h)
        self.tier_ops = [op for op in self.tier_ops if op[0] != "save"]
        if self.tiers is not None:
            self.tiers.clear()

    def take_snapshot_copies(self) -> list[tuple[int, int]]:
        copies, self.snapshot_copies = self.snapshot_copies, []
        return copies

    def take_tier_ops(self) -> list[tuple[str, int, int, bytes]]:
        ops, self.tier_ops = self.tier_ops, []
        return ops


    @property
    def has_state(self) -> bool:
        return self.state is not None

    def null_block(self, g: int) -> int:
        """The id a freed windowed entry holds: the group's scratch block (one past its blocks)."""
        return self.allocs[g].num_blocks

    # --- a request's tables ---------------------------------------------------------------------
    def tables(self, req) -> list[list[int]]:
        """req's block table in every group (a request not yet given any has empty ones)."""
        while len(req.group_block_ids) < len(self.allocs) - 1:
            req.group_block_ids.append([])
        return [req.block_ids, *req.group_block_ids]

    def _set_tables(self, req, tables: list[list[int]]) -> None:
        req.block_ids, req.group_block_ids = tables[0], tables[1:]

    def _held(self, g: int, table: list[int]) -> list[int]:
        null = self.null_block(g)
        return [b for b in table if b != null]

    # --- growth ---------------------------------------------------------------------------------
    def release_out_of_window(self, req) -> None:
        """Free the blocks of sliding / chunked groups that no query from the request's next token
        on reads (they stay in the prefix cache while free)."""
        start = req.num_computed_tokens
        for g, kind in enumerate(self.kinds):
            if kind.kind not in ("sliding", "chunked"):
                continue
            table = self.tables(req)[g]
            lo = min(kind.first_needed(start) // self.block_size, len(table))
            null = self.null_block(g)
            gone = [b for b in table[:lo] if b != null]
            if gone:
                self.allocs[g].free(gone)
                table[:lo] = [null] * lo

    def fit_chunk(self, req, n: int) -> int:
        """n, or fewer so that the request's window plus the new tokens fits in every sliding or
        chunked group's whole pool (so a request alone always progresses)."""
        c = req.num_computed_tokens
        for g, kind in enumerate(self.kinds):
            if kind.kind in ("sliding", "chunked"):
                lo = kind.first_needed(c) // self.block_size
                n = min(n, (self.allocs[g].num_blocks + lo) * self.block_size - c)
        return max(n, 1)

    def grow(self, req, n: int) -> bool:
        """Make room for n more tokens of req in every group (and a live state slot); False, with
        nothing allocated, when any group runs out. Out-of-window blocks are freed first."""
        self.release_out_of_window(req)
        need = -(-(req.num_computed_tokens + n) // self.block_size)
        tables = self.tables(req)
        short = [need - len(t) for t in tables]
        if any(s > a.num_free_blocks for s, a in zip(short, self.allocs)):
            return False
        wants_slot = self.state is not None and req.state_slot is None
        if wants_slot and self.state.num_free_blocks < 1:
            return False
        for g, s in enumerate(short):
            if s > 0:
                tables[g].extend(self.allocs[g].allocate(s))
        if wants_slot:
            (req.state_slot,) = self.state.allocate(1)
        return True

    def reserve(self, req, end: int) -> bool:
        """Hold blocks for req as if its first `end` tokens were computed (they arrive from another
        instance) plus the next one: windowed groups only from the next query's window on (null
        entries before it), and a live state slot. A state snapshot lent by a prefix hit is given
        back (the arriving state supersedes it). False, with nothing new held, when a pool runs
        short. req.num_computed_tokens is left as it was (what is cached here)."""
        computed = req.num_computed_tokens
        req.num_computed_tokens = end
        self.release_out_of_window(req)
        req.num_computed_tokens = computed
        need = -(-(end + 1) // self.block_size)
        tables = self.tables(req)
        los = [kind.first_needed(end) // self.block_size if kind.kind in ("sliding", "chunked") else 0
               for kind in self.kinds]
        short = [sum(1 for i in range(len(t), need) if i >= lo) for t, lo in zip(tables, los)]
        if any(s > a.num_free_blocks for s, a in zip(short, self.allocs)):
            return False
        wants_slot = self.state is not None and req.state_slot is None
        if wants_slot and self.state.num_free_blocks < 1:
            return False
        for g, (t, lo) in enumerate(zip(tables, los)):
            fresh = iter(self.allocs[g].allocate(short[g]) if short[g] else ())
            t.extend(self.null_block(g) if i < lo else next(fresh) for i in range(len(t), need))
        if wants_slot:
            (req.state_slot,) = self.state.allocate(1)
        if req.restore_from is not None:
            self.state.free([req.restore_from])
            req.restore_from = None
        return True

    def free(self, req) -> None:
        """Give back everything req holds: blocks of every group, its live slot and a snapshot it
        was lent but not yet restored from."""
        for g, table in enumerate(self.tables(req)):
            self.allocs[g].free(self._held(g, table))
        self._set_tables(req, [[] for _ in self.allocs])
        if req.state_slot is not None:
            self.state.free([req.state_slot])
            req.state_slot = None
        if req.restore_from is not None:
            self.state.free([req.restore_from])
            req.restore_from = None

    # --- prefix cache ---------------------------------------------------------------------------
    def _hit_ok(self, g: int, hashes: list[bytes], k: int) -> bool:
        """Whether group g has cached every block a request resuming after k full blocks reads."""
        cached = self.allocs[g].cached
        lo = self.kinds[g].first_needed(k * self.block_size) // self.block_size
        return all(h in cached for h in hashes[lo:k])

    def attach_prefix(self, req, hashes: list[bytes], max_blocks: int) -> int:
        """Lend req the cached blocks (and state snapshot) of its longest cached prefix of at most
        max_blocks full blocks that every group can resume from; returns the blocks hit."""
        k = 0
        self.tier_wait = False
        if self.enable_prefix_caching:
            cached0 = self.allocs[0].cached
            while k < min(max_blocks, len(hashes)) and hashes[k] in cached0:
                k += 1
            while k > 0 and not (all(self._hit_ok(g, hashes, k) for g in range(len(self.allocs)))
                                 and (self.state is None or hashes[k - 1] in self.state.cached)):
                k -= 1
            if self.tiers is not None:
                deeper = tier_prefix(self, hashes, max_blocks, k)
                if self.tier_wait:  # some of its blocks are being read from a tier: attach nothing yet
                    self.tier_waits += 1
                    self._set_tables(req, [[] for _ in self.allocs])
                    return 0
                if deeper > k and attach_tiered(self, req, hashes, deeper):
                    return deeper
        tables = []
        for g, alloc in enumerate(self.allocs):
            lo = self.kinds[g].first_needed(k * self.block_size) // self.block_size if k else 0
            tables.append([self.null_block(g)] * lo + alloc.lookup_prefix(hashes[lo:k], k - lo))
        self._set_tables(req, tables)
        if k and self.state is not None:
            (req.restore_from,) = self.state.lookup_prefix([hashes[k - 1]], 1)
        return k

    def register(self, req, hashes: list[bytes], done: int, nfull: int) -> None:
        """Register req's blocks done .. nfull - 1 (now full) in every group under their hashes."""
        for g, table in enumerate(self.tables(req)):
            null = self.null_block(g)
            for b in range(done, nfull):
                if table[b] != null:
                    self.allocs[g].register(table[b], hashes[b])

    def snapshot(self, req, block_hash: bytes) -> None:
        """Keep req's live state (now at a block boundary) under block_hash: a (live, snapshot)
        copy for the runner in snapshot_copies (nothing when it is kept already or no slot is free)."""
        st = self.state
        if st is None or not st.enable_prefix_caching or block_hash in st.cached or st.num_free_blocks < 1:
            return
        (slot,) = st.allocate(1)
        st.register(slot, block_hash)
        st.free([slot])  # cached and evictable from now on, like a free full block
        if self.tiers is not None:
            self.tier_ops.append(("copy", len(self.allocs), req.state_slot, slot))
        else:
            self.snapshot_copies.append((req.state_slot, slot))

    # --- statistics and checks ------------------------------------------------------------------
    def check_invariants(self) -> None:
        for a in self.allocs:
            a.check_invariants()
        if self.state is not None:
            self.state.check_invariants()

    @property
    def in_use(self) -> int:
        """Referenced blocks and slots in all pools (0 once every request is gone)."""
        return sum(a.num_blocks - a.num_free_blocks for a in self.pools)
