"""Prefix-cache admission, a phase of `moe_serve.scheduler.Scheduler`: a waiting request takes the
cached blocks of its longest cached prefix, the blocks it fills are hashed and registered for later
requests, and (models with per-sequence state) the state at the prompt's last block boundary is
snapshotted so a later hit can resume from it. Pure Python: request objects and integer block ids.
"""
from __future__ import annotations

from attention.blocks import hash_block
from moe_serve.request import Request

_NEVER = 1 << 62  # a request's count of registered blocks that no block count reaches


class PrefixCacheAdmission:
    """Mixed into `Scheduler`, whose `kv` (the cache manager), `alloc` (group 0's allocator) and
    `block_size` it uses. It owns, per live request: `_hashes` (chained full-block hashes, in
    order), `_registered` (how many of its blocks are registered) and `_looked_up` (whether its
    lookup is counted in the hit rate); snapshot copies wait in the cache manager's `snapshot_copies`."""

    def _init_prefix_cache(self) -> None:
        self._hashes: dict[str, list[bytes]] = {}  # full-block hashes of each live request, in order
        self._registered: dict[str, int] = {}  # how many of a request's blocks are registered
        self._looked_up: set[str] = set()  # requests whose prefix lookup is counted in the hit rate
        # How many times every cached prefix was forgotten (flush_cache, a weight update): whatever
        # was kept beside the cache by block hash (a feature's per-block data) is stale past a change.
        self.prefix_resets = 0

    def _snapshot_boundary(self, req: Request) -> int:
        """The position whose state a model with per-sequence state keeps for prefix hits: the last
        block boundary a later request with this prompt can hit (0: none)."""
        if not (self.kv.has_state and self.kv.enable_prefix_caching):
            return 0
        return (req.num_prompt_tokens - 1) // self.block_size * self.block_size

    def _chunk(self, req: Request, n: int) -> int:
        """n, or fewer: what the windowed groups hold for one request (`fit_chunk`), and ending at
        the snapshot boundary when the chunk would cross it."""
        n = self.kv.fit_chunk(req, n)
        b = self._snapshot_boundary(req)
        return b - req.num_computed_tokens if req.num_computed_tokens < b < req.num_computed_tokens + n else n

    def _snapshot_state(self, req: Request) -> None:
        b = self._snapshot_boundary(req)
        if b and req.num_computed_tokens == b:
            self.kv.snapshot(req, self._hashes[req.request_id][b // self.block_size - 1])

    def _full_block_hashes(self, req: Request, nfull: int) -> list[bytes]:
        """req's chained block hashes, extended to its first nfull full blocks."""
        hashes = self._hashes[req.request_id]
        tokens = req.all_token_ids
        parent = hashes[-1] if hashes else None
        for b in range(len(hashes), nfull):
            parent = hash_block(parent, tokens[b * self.block_size:(b + 1) * self.block_size])
            hashes.append(parent)
        return hashes

    def _attach_prefix(self, req: Request) -> bool:
        """Reuse cached blocks for the longest cached prefix every cache group can resume from. At
        least one token is always left to compute, since the step that computes the last known
        token is the one that samples. A request that still needs prompt logprobs takes no hits:
        every prompt position it has no logprob for is computed (vLLM does the same). False, with
        nothing attached, while blocks of its prefix are being read from a KV tier (it waits)."""
        tokens = req.all_token_ids
        hashes = self._full_block_hashes(req, len(tokens) // self.block_size)
        lookup = not req.needs_prompt_logprobs
        max_blocks = (len(tokens) - 1) // self.block_size if lookup else 0
        if max_blocks and req.prefix_hit_limit is not None:
            max_blocks = min(max_blocks, req.prefix_hit_limit(hashes))
        hits = self.kv.attach_prefix(req, hashes, max_blocks)
        if self.kv.tier_wait:
            return False
        self._registered[req.request_id] = hits
        req.num_computed_tokens = hits * self.block_size
        if req.num_preemptions == 0 and lookup:
            req.num_cached_prompt_tokens = req.num_computed_tokens
            if req.request_id not in self._looked_up:  # the hit rate counts a prompt once, not per attempt
                self._looked_up.add(req.request_id)
                self.alloc.record_lookup(len(tokens), req.num_computed_tokens)
        return True

    def _detach_prefix(self, req: Request) -> None:
        """Undo _attach_prefix for a request that stays waiting."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        self._registered[req.request_id] = 0

    def forget_prefixes(self, live: bool = False) -> int:
        """Forget the cached prefixes (every block group's and the state snapshots); returns how
        many were forgotten. live: after the weights changed, also those of blocks live requests
        hold, and those requests register no more blocks: all their KV was written by, or attends
        over, the old weights (a preempted one recomputes, and registers again from its new KV)."""
        allocs = list(self.kv.allocs) + ([self.kv.state] if self.kv.state is not None else [])
        self.prefix_resets += 1
        self.kv.forget_tiers()  # what KV tiers keep (or are about to) is as stale
        n = 0
        for alloc in allocs:
            before = len(alloc.cached)
            alloc.reset_prefix_cache(held=live)
            n += before - len(alloc.cached)
        if live:
            for rid in self._registered:
                self._registered[rid] = _NEVER
        return n

    def _register_full_blocks(self, req: Request) -> None:
        """Hash and register the blocks that became full since the last call (once each)."""
        if not self.alloc.enable_prefix_caching:
            return
        nfull = req.num_computed_tokens // self.block_size
        done = self._registered.get(req.request_id, 0)
        if nfull <= done:
            return
        self.kv.register(req, self._full_block_hashes(req, nfull), done, nfull)
        self._registered[req.request_id] = nfull
