"""The engine core's side of prefill/decode disaggregation: its cache memory registered with a
transfer engine, the layout a peer needs to write into it, and the prefill side's writes.

Both instances run the same model with the same block size and dtype, so a block of a cache group
is, in every cache tensor of the group's layers, one contiguous run of `stride` bytes at `base +
block * stride` (the caches are block-first: `layer.cache_shape(n, block_size)`), and a state slot
likewise. A request's cache moves as one write of (address, length) pairs: for each cache tensor,
the prefill side's blocks of the positions the decode side lacks into the decode side's blocks of
the same positions (consecutive blocks on both sides merge into one pair); state layers' live
slots likewise. Windowed groups move only the blocks the decode side's next query reads.

`transfer_ranges` is pure Python (tests check it against a copy made block by block); `KVConnector`
holds the transfer engine (moe_serve/disagg/transfer.py) and the writes in flight.
"""
from __future__ import annotations

import logging
import time

from moe_serve.protocol import CacheLayout, KVTarget

log = logging.getLogger("moe_serve.disagg")


class LayoutMismatch(ValueError):
    """The two instances' caches are not laid out alike (another model, dtype, block size or layer set)."""


def transfer_ranges(src: CacheLayout, src_tables: list[list[int]], src_null: list[int], src_slot: int | None,
                    target: KVTarget, block_size: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int]:
    """The (local, remote) byte ranges that copy target.start .. target.end - 1 of a request from
    this side's tables into the target's, and their total bytes. src_null: each group's null block
    (a windowed entry this side no longer holds)."""
    dst = target.layout
    if src.signature != dst.signature:
        raise LayoutMismatch(f"the decode instance's cache layout ({dst.signature}) differs from this prefill "
                             f"instance's ({src.signature}): both must serve the same model, dtype, block size "
                             "and speculative layers")
    first = target.start // block_size
    local, remote = [], []

    def add(la: int, ra: int, n: int) -> None:
        if local and local[-1][0] + local[-1][1] == la and remote[-1][0] + remote[-1][1] == ra:
            local[-1] = (local[-1][0], local[-1][1] + n)
            remote[-1] = (remote[-1][0], remote[-1][1] + n)
        else:
            local.append((la, n))
            remote.append((ra, n))

    for g, (stensors, dtensors) in enumerate(zip(src.groups, dst.groups)):
        pairs = []
        for i, d in enumerate(target.tables[g]):
            if d < 0:
                continue
            s = src_tables[g][first + i] if first + i < len(src_tables[g]) else src_null[g]
            if s == src_null[g]:
                raise ValueError(f"block {first + i} of cache group {g} is not held here: it cannot be sent")
            pairs.append((s, d))
        for (sb, sn), (db, dn) in zip(stensors, dtensors):
            for s, d in pairs:
                add(sb + s * sn, db + d * dn, sn)
    if target.state_slot >= 0:
        if src_slot is None:
            raise ValueError("the request holds no state slot here: its linear-attention state cannot be sent")
        for (sb, sn), (db, dn) in zip(src.state, dst.state):
            add(sb + src_slot * sn, db + target.state_slot * dn, sn)
    return local, remote, sum(n for _, n in local)


def _region(t) -> tuple[int, int, int]:
    """A cache tensor's base address, bytes per block (or slot) and total bytes."""
    per = t.stride(0) * t.element_size()
    return t.data_ptr(), per, t.shape[0] * per


def layout_signature(model: str, dtype, block_size: int, groups: list[list], state: list) -> str:
    shapes = ";".join(",".join("x".join(map(str, t.shape[1:])) + f":{t.dtype}" for t in ts) for ts in groups)
    st = ",".join("x".join(map(str, t.shape[1:])) + f":{t.dtype}" for t in state)
    return f"{model}|{dtype}|block_size={block_size}|{shapes}|state={st}"


class Send:
    """One write in flight: the request it belongs to (its blocks held until done) and its output."""

    def __init__(self, req, handle, nbytes: int, output):
        self.req, self.handle, self.nbytes, self.output = req, handle, nbytes, output
        self.t0 = time.monotonic()


class KVConnector:
    """A core's cache registered with a transfer engine; writes into peers' caches and their state."""

    def __init__(self, engine: str, groups: list[list], state: list, signature: str, device: str,
                 timeout_s: float = 60.0):
        from moe_serve.disagg.transfer import make_transfer

        self.transfer = make_transfer(engine)
        tensors = [t for ts in groups for t in ts] + list(state)
        regions = [_region(t) for t in tensors]
        self.transfer.register([(a, n) for a, _, n in regions], device)
        self.layout = CacheLayout(engine, self.transfer.metadata(), signature,
                                  [[_region(t)[:2] for t in ts] for ts in groups], [_region(t)[:2] for t in state])
        self.timeout_s = timeout_s
        self._peers: dict[bytes, str] = {}
        self.sending: list[Send] = []
        log.info("disaggregation: %d cache tensors (%.1f MiB) registered with %s", len(regions),
                 sum(n for _, _, n in regions) / 2**20, engine)

    def peer(self, layout: CacheLayout) -> str:
        name = self._peers.get(layout.agent)
        if name is None:
            if layout.engine != self.layout.engine:
                raise LayoutMismatch(f"the decode instance moves KV with {layout.engine}, this one with "
                                     f"{self.layout.engine} (--disaggregation-transfer-backend)")
            name = self._peers[layout.agent] = self.transfer.connect(layout.agent)
        return name

    def post(self, req, target: KVTarget, tables, nulls, slot, block_size: int, output) -> Send:
        local, remote, nbytes = transfer_ranges(self.layout, tables, nulls, slot, target, block_size)
        handle = self.transfer.write(self.peer(target.layout), local, remote) if local else None
        send = Send(req, handle, nbytes, output)
        self.sending.append(send)
        return send

    def poll(self) -> list[tuple[Send, str]]:
        """Writes that ended since the last call, each with "DONE", or an error message."""
        ended, still = [], []
        now = time.monotonic()
        for s in self.sending:
            st = "DONE" if s.handle is None else self.transfer.poll(s.handle)
            if st == "PROC" and now - s.t0 > self.timeout_s:
                st = f"the KV write did not finish within {self.timeout_s:g}s"
            elif st not in ("DONE", "PROC"):
                st = f"the KV write failed ({self.layout.engine}: {st})"
            if st == "PROC":
                still.append(s)
                continue
            if s.handle is not None:
                self.transfer.release(s.handle)
            ended.append((s, st))
        self.sending = still
        return ended

    def close(self) -> None:
        self.transfer.close()
