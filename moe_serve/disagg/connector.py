"""A disaggregated core's cache memory registered with a transfer engine, the layout a peer needs to
write into it, and the prefill side's writes (`KVWriter`, held by the connector: pd_connector.py).

Both instances run the same model with the same block size and dtype, so a block of a cache group
is, in every cache tensor of the group's layers, one contiguous run of `stride` bytes at `base +
block * stride` (the caches are block-first: `layer.cache_shape(n, block_size)`), and a state slot
likewise. A request's cache moves as one write of (address, length) pairs: for each cache tensor,
the prefill side's blocks of the positions the decode side lacks into the decode side's blocks of
the same positions (consecutive blocks on both sides merge into one pair); state layers' live
slots likewise. Windowed groups move only the blocks the decode side's next query reads.

`transfer_ranges` is pure Python (tests check it against a copy made block by block); `KVWriter`
holds the transfer engine (moe_serve/disagg/transfer.py) and the writes in flight.

A posted write cannot be recalled: an aborted request's write is left to end (done, failed, or
released at the timeout) and only then reported, so that the decode side hears "ended" only when
no byte of it can still land (docs/architecture.md, "Disaggregated prefill and decode").

Test only: MOE_SERVE_TEST_KV_WRITE_PACE="PIECES:SECONDS[:HOLD]" splits every write into PIECES
writes of about equal bytes, each posted SECONDS after the previous one completed and, with HOLD (a
file path), only while that file does not exist; it logs each piece as it completes ("KV write pace
(test only): request R: piece i of n written"). It stands for a slow transfer, so that tests can
order events against one in flight (tests/e2e/test_disagg_late_writes.py); never set it when serving.
"""
from __future__ import annotations

import logging
import os
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
                             f"instance's ({src.signature}): both must serve the same model, dtype, "
                             "--kv-cache-dtype, block size and speculative layers")
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


def _test_pace() -> tuple[int, float, str | None] | None:
    """MOE_SERVE_TEST_KV_WRITE_PACE (test only, see the module's docstring) as (pieces, seconds, hold)."""
    v = os.environ.get("MOE_SERVE_TEST_KV_WRITE_PACE")
    if not v:
        return None
    pieces, seconds, *hold = v.split(":", 2)
    return max(1, int(pieces)), float(seconds), (hold[0] if hold else None)


def split_ranges(local: list[tuple[int, int]], remote: list[tuple[int, int]], pieces: int):
    """(local, remote) range pairs cut into `pieces` runs of about equal bytes (test pacing)."""
    total = sum(n for _, n in local)
    size = max(1, -(-total // pieces))
    out, cur_l, cur_r, room = [], [], [], size
    for (la, n), (ra, _) in zip(local, remote):
        off = 0
        while off < n:
            k = min(room, n - off)
            cur_l.append((la + off, k))
            cur_r.append((ra + off, k))
            off += k
            room -= k
            if room == 0:
                out.append((cur_l, cur_r))
                cur_l, cur_r, room = [], [], size
    if cur_l:
        out.append((cur_l, cur_r))
    return out


class Send:
    """One write in flight: the request it belongs to (its blocks held until done) and its output.
    aborted: the request was aborted while the write was posted; it still ends before it is reported.
    pending: the pieces not yet posted (test pacing only)."""

    def __init__(self, req, handle, nbytes: int, output):
        self.req, self.handle, self.nbytes, self.output = req, handle, nbytes, output
        self.t0 = time.monotonic()
        self.aborted = False
        self.pending: list = []
        self.peer, self.pieces, self.wait_until = "", 1, None


class KVWriter:
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
        self.pace = _test_pace()
        if self.pace is not None:
            log.warning("MOE_SERVE_TEST_KV_WRITE_PACE=%s: every KV write is slowed down (a test setting)",
                        os.environ["MOE_SERVE_TEST_KV_WRITE_PACE"])
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
        pieces = split_ranges(local, remote, self.pace[0]) if self.pace is not None and local else [(local, remote)]
        peer = self.peer(target.layout) if local else ""
        handle = self.transfer.write(peer, *pieces[0]) if local else None
        send = Send(req, handle, nbytes, output)
        send.peer, send.pending, send.pieces = peer, pieces[1:], len(pieces)
        self.sending.append(send)
        return send

    def abort(self, request_id: str) -> bool:
        """The request was aborted while its write is posted: True if one is. The write goes on
        until it ends (a posted write cannot be recalled); poll reports it then, as aborted."""
        hit = False
        for s in self.sending:
            if s.req.request_id == request_id:
                s.aborted = hit = True
        return hit

    def _paced(self, s: Send, now: float) -> str:
        """Test pacing: a piece that completed is logged and the next one posted SECONDS later;
        the write is in flight ("PROC") until its last piece has completed."""
        if s.wait_until is None:  # a piece in flight
            st = self.transfer.poll(s.handle)
            if st != "DONE":
                return st
            log.info("KV write pace (test only): request %s: piece %d of %d written", s.req.request_id,
                     s.pieces - len(s.pending), s.pieces)
            if not s.pending:
                return "DONE"
            self.transfer.release(s.handle)
            s.handle, s.wait_until = None, now + self.pace[1]
            return "PROC"
        if now < s.wait_until or (self.pace[2] is not None and os.path.exists(self.pace[2])):
            return "PROC"
        s.handle, s.wait_until = self.transfer.write(s.peer, *s.pending.pop(0)), None
        return "PROC"

    def poll(self) -> list[tuple[Send, str]]:
        """Writes that ended since the last call, each with "DONE", or an error message."""
        ended, still = [], []
        now = time.monotonic()
        for s in self.sending:
            if self.pace is not None and (s.handle is not None or s.wait_until is not None):
                try:
                    st = self._paced(s, now)
                except Exception as e:  # a piece refused: the write failed
                    st = f"ERR ({e})"
            else:
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
