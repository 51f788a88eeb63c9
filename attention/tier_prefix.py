"""Prefix hits that go on below the device pool: the KV tiers' part of `KVCacheManager.attach_prefix`.
Pure Python: block ids, hashes, and the tier index's answers.

A request's cached prefix on the device ends at block k. The tiers (moe_serve/kv_offload) may hold
the blocks after it: the longest prefix every pool can resume from, counting a block as present
when the device has it or a tier has its bytes in hand, is attached with fresh blocks for the
tier's ones, registered at once under their hashes (a later request finds them on the device) and
filled by "load" ops the tier feature runs before the step's forward. A block being read from disk
sets `tier_wait`: the request waits for it rather than recompute what is on its way.
"""
from __future__ import annotations


def _first_needed_block(kv, g: int, k: int) -> int:
    return kv.kinds[g].first_needed(k * kv.block_size) // kv.block_size if k else 0


def tier_prefix(kv, hashes: list[bytes], max_blocks: int, k: int) -> int:
    """The longest prefix (at least k blocks, at most max_blocks) that every group and the state
    pool can resume from with the device's blocks and the tiers'; sets kv.tier_wait when a block it
    would need is still being read."""
    seen: dict[tuple[int, bytes], bool] = {}

    def present(pool: int, h: bytes) -> bool:
        if h in kv.pools[pool].cached:
            return True
        if (pool, h) not in seen:
            found = kv.tiers.has(pool, h)
            if found is None:  # being read: go on, so that the reads of the whole prefix start now
                kv.tier_wait = True
            seen[pool, h] = found is not False
        return seen[pool, h]

    n = min(max_blocks, len(hashes))
    run = k
    while run < n and present(0, hashes[run]):
        run += 1
    state = len(kv.allocs) if kv.state is not None else None
    # A group that reads every block (full attention) can resume from j up to its first missing
    # block; found once, so that the candidates below cost a window each, not the whole prefix.
    reach = {g: next((i for i in range(run) if not present(g, hashes[i])), run)
             for g, kind in enumerate(kv.kinds) if kind.first_needed(1 << 62) == 0}

    def resumable(j: int) -> bool:
        if state is not None and not present(state, hashes[j - 1]):  # the cheap test first
            return False
        return all(j <= reach[g] if g in reach else
                   all(present(g, h) for h in hashes[_first_needed_block(kv, g, j):j])
                   for g in range(len(kv.allocs)))

    while run > k and not resumable(run):
        run -= 1
    return run


def attach_tiered(kv, req, hashes: list[bytes], k: int) -> bool:
    """Lend req the first k blocks of its prefix in every group: the device's cached ones (a
    reference each) and fresh blocks for the tiers' (registered, with a "load" op each), and its
    state snapshot likewise. False, with nothing taken, when a pool lacks free blocks for them."""
    plans = []
    for g, alloc in enumerate(kv.allocs):
        lo = _first_needed_block(kv, g, k)
        on_device = [h for h in hashes[lo:k] if h in alloc.cached]
        idle = sum(1 for h in on_device if alloc.ref_cnt[alloc.cached[h]] == 0)  # leave the free queue
        if (k - lo) - len(on_device) > alloc.num_free_blocks - idle:
            return False
        plans.append(lo)
    st = kv.state
    if st is not None and hashes[k - 1] not in st.cached and st.num_free_blocks < 1:
        return False
    tables = []
    for g, (alloc, lo) in enumerate(zip(kv.allocs, plans)):
        # References first, so that the fresh blocks' allocation cannot evict a block of this prefix.
        table = [alloc.lookup_prefix([h], 1)[0] if h in alloc.cached else None for h in hashes[lo:k]]
        fresh = iter(alloc.allocate(table.count(None)))
        for i, bid in enumerate(table):
            if bid is None:
                table[i] = bid = next(fresh)
                alloc.register(bid, hashes[lo + i])
                kv.tier_ops.append(("load", g, bid, hashes[lo + i]))
        tables.append([kv.null_block(g)] * lo + table)
    kv._set_tables(req, tables)
    if st is not None:
        h = hashes[k - 1]
        if h in st.cached:
            (req.restore_from,) = st.lookup_prefix([h], 1)
        else:
            (req.restore_from,) = st.allocate(1)
            st.register(req.restore_from, h)
            kv.tier_ops.append(("load", len(kv.allocs), req.restore_from, h))
    return True
