"""Disaggregation bookkeeping, a phase of `moe_serve.scheduler.Scheduler`; the connector that drives
it is moe_serve/disagg/pd_connector.py (a step feature).

Decode side: a request whose prompt a prefill instance computes has its blocks reserved at
admission and stays out of the queues (`awaiting_kv`) until `kv_done` says the write landed, or
will not; reservations are reported once (`take_kv_reserved`); blocks a write may still land in
are set aside (`_kv_quarantine`) until the prefill side says its write is over. Prefill side: a
finished request holds its blocks (`take_kv_outbox`) until its write completes (`free_held`).
"""
from __future__ import annotations

from types import SimpleNamespace

from moe_serve.request import Request, RequestStatus


class KVTransferBookkeeping:
    """Mixed into `Scheduler`, whose `kv` (the cache manager), `waiting` queue, `_registered`
    counts, `_detach_prefix` and `_forget` it uses."""

    def _init_kv_transfer(self) -> None:
        # Decode side: requests whose blocks are reserved while a prefill instance fills them (out
        # of the queues until `kv_done`), reservations not yet reported, and aborted ones whose
        # blocks stay held until the writer is known to be done. Prefill side: finished requests
        # whose blocks are held until their write completes.
        self.awaiting_kv: dict[str, Request] = {}
        self._kv_reserved: list[Request] = []
        self._kv_quarantine: dict[str, Request] = {}
        self._kv_outbox: list[Request] = []
        self.kv_received = 0
        self.kv_fallbacks = 0

    def take_kv_reserved(self) -> list[Request]:
        """Decode side: requests whose blocks were reserved since the last call (to be filled)."""
        out, self._kv_reserved = [r for r in self._kv_reserved if r.request_id in self.awaiting_kv], []
        return out

    def take_kv_outbox(self) -> list[Request]:
        """Prefill side: requests that finished computing and hold their blocks for the write."""
        out, self._kv_outbox = self._kv_outbox, []
        return out

    def free_held(self, req: Request) -> None:
        """Prefill side: give back a request's blocks once its write is over (they stay cached)."""
        self.kv.free(req)

    def kv_done(self, request_id: str, ok: bool, ended: bool = True) -> Request | None:
        """Decode side: the prefill instance wrote a request's blocks (ok) or will not. Written: the
        request resumes after its first kv_end tokens, ahead of the queue (one token to compute).
        Not written: it is computed here from its prefix-cache hits, like a preempted request.
        Blocks a write may still land in (not ended: the prefill side has not said its write is
        over) are set aside, out of use, and given back by a later kv_done with ended; meanwhile
        the request is computed in others. An aborted request's held blocks likewise."""
        if ended:
            held = self._kv_quarantine.pop(request_id, None)
            if held is not None:
                self.kv.free(held)
                return None
        req = self.awaiting_kv.pop(request_id, None)
        if req is None:
            return None
        req.kv_role = None
        if ok:
            req.num_computed_tokens = req.kv_end
            self.kv_received += 1
        else:
            if ended:
                self.kv.free(req)
            else:
                self._kv_quarantine[request_id] = self._take_blocks(req)
            req.num_computed_tokens = 0
            self._registered[req.request_id] = 0
            self.kv_fallbacks += 1
        self.waiting.appendleft(req)
        return req

    def _take_blocks(self, req: Request):
        """What req holds (blocks of every group, its state slot), moved to a holder that
        `self.kv.free` takes later; req is left holding nothing."""
        tables = self.kv.tables(req)
        held = SimpleNamespace(block_ids=tables[0], group_block_ids=tables[1:], state_slot=req.state_slot,
                               restore_from=req.restore_from)
        req.block_ids, req.group_block_ids = [], [[] for _ in tables[1:]]
        req.state_slot = req.restore_from = None
        return held

    def kv_transfer_counts(self) -> tuple[int, int]:
        """Decode side, since start: requests whose prompt cache arrived, and those computed here
        after their transfer failed."""
        return self.kv_received, self.kv_fallbacks

    @property
    def num_kv_held(self) -> int:
        """Requests whose blocks are held outside the queues (awaiting a prefill, or aborted meanwhile)."""
        return len(self.awaiting_kv) + len(self._kv_quarantine)

    def _reserve_for_transfer(self, req: Request) -> bool | None:
        """Admission of a decode-side request (prefix attached): None when it computes here after
        all (its prompt is cached here already), True when its blocks are now reserved for the
        write (it leaves the queue), False when they do not fit (it stays waiting, detached)."""
        if req.num_computed_tokens >= req.kv_end:  # cached here already: nothing to fetch
            req.kv_role = None
            return None
        if not self.kv.reserve(req, req.kv_end):
            self._detach_prefix(req)
            return False
        self.waiting.popleft()
        self.awaiting_kv[req.request_id] = req
        self._kv_reserved.append(req)
        return True

    def _end_awaiting_kv(self, req: Request, status: RequestStatus) -> bool:
        """End a request that awaits its KV (decode side); False if it does not. A prefill instance
        may still be writing into its blocks: they are held until kv_done says it is not."""
        if self.awaiting_kv.pop(req.request_id, None) is None:
            return False
        req.status = status
        self._kv_quarantine[req.request_id] = req
        self._forget(req)
        return True

    def _hold_for_transfer(self, req: Request) -> bool:
        """Prefill side: a request that finished (not aborted) keeps its blocks for the write to
        the decode side; True when it was put in the outbox instead of being freed."""
        if req.kv_role == "prefill" and req.status != RequestStatus.FINISHED_ABORTED:
            self._kv_outbox.append(req)
            return True
        return False
