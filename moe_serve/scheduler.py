"""Token-level scheduler. Pure Python: it moves Request objects and integer block ids, never tensors.

Each step gets a token budget (max_num_batched_tokens). Running requests go first: every decoding
request (1 token each) before any chunk of a prefill, then the requests in the middle of a chunked
prefill in arrival order, each taking the rest of its prompt cut to what the budget allows.
Waiting requests are then admitted first come, first served, each taking its prompt (minus
prefix-cache hits) in chunks that fit the budget.
When KV blocks run out, the most recently arrived running request is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed later (its prefix blocks usually
come back from the prefix cache).
Blocks and state slots are taken and given back through the cache manager
(attention/kv_manager.py), for every cache group of a request at once: a request is admitted or
grown only when every group has room. For a model with per-sequence state (linear attention) and
prefix caching, a prefill chunk that would cross the prompt's last block boundary ends there, so
the state at that boundary can be kept for later prefix hits.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from attention.blocks import BlockAllocator
from attention.kv_manager import KVCacheManager
from moe_serve.request import Request, RequestStatus
from moe_serve.scheduling.kv_transfer import KVTransferBookkeeping
from moe_serve.scheduling.prefix_cache import PrefixCacheAdmission


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed for this request in this step (its draft tokens included)
    samples: bool  # whether this step reaches the end of the known tokens and so yields a new token
    # Speculative decoding: the draft tokens scheduled after the last known token (the last
    # len(draft_ids) of num_tokens); the step samples at each of their positions too.
    draft_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_preempted: int = 0
    # Requests that left the running set since the last output that scheduled anything: finished
    # (stop, length, abort, finish_request) and preempted. The model runner frees their rows with
    # these. An output that schedules nothing carries none: they wait for the next non-empty one, so
    # an engine that skips running empty steps loses nothing. An id may also appear in `scheduled`
    # (a preempted request re-admitted, or an id reused after its request finished): the runner
    # drops the old row first, then adds the scheduled request.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # State-slot copies (src, dst) the runner makes before the forward, in order: snapshots of
    # states that reached a block boundary in earlier steps, then prefix-hit restores. The slots
    # restored from are held until `Scheduler.update` of this output.
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    restored_slots: list[int] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler(PrefixCacheAdmission, KVTransferBookkeeping):
    """The step's scheduling: the queues, the token budget, preemption, and the update after a step.
    Its other phases are mixed in from moe_serve/scheduling/: prefix-cache admission
    (prefix_cache.py) and disaggregation bookkeeping (kv_transfer.py)."""

    def __init__(self, allocator: BlockAllocator | KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int):
        self.kv = allocator if isinstance(allocator, KVCacheManager) else KVCacheManager.single(allocator)
        self.alloc = self.kv.allocs[0]  # group 0's: the prefix-cache statistics and the usage figure
        self.block_size = self.alloc.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        # Cache slots a piece that samples reserves past its last token (MTP drafts' chained passes).
        self.lookahead_tokens = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: set[str] = set()  # pending for the next non-empty SchedulerOutput
        self._preempted_ids: set[str] = set()
        self._init_prefix_cache()
        self._init_kv_transfer()

    # --- queue ----------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self._hashes[req.request_id] = []
        self.waiting.append(req)

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request now (abort, or a stop string found by the detokenizer); frees its blocks."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if self._end_awaiting_kv(req, status):
            return req
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        req.status = status
        self._release(req)
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._restores: list[tuple[int, int]] = []
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        budget = self._admit_waiting(out, budget)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        if out.scheduled:
            out.finished_req_ids, self._finished_ids = self._finished_ids, set()
            out.preempted_req_ids, self._preempted_ids = self._preempted_ids, set()
            out.state_copies = self.kv.take_snapshot_copies() + self._restores
        self._restores = []
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running requests, decodes first: a long prompt's next chunk never delays the streams that
        need one token each. Then the unfinished prefill chunks, in arrival order. Returns the
        budget left."""
        scheduled: set[str] = set()
        for decodes in (True, False):
            for req in list(self.running):
                if budget <= 0:
                    break
                left = req.num_tokens - req.num_computed_tokens
                if (left == 1) != decodes or req.request_id in scheduled or req.status != RequestStatus.RUNNING:
                    continue
                drafts, req.spec_token_ids = (req.spec_token_ids, []) if decodes else ([], req.spec_token_ids)
                # Drafts are positions past the known tokens: within the budget and the context limit.
                n = self._chunk(req, min(left + len(drafts), budget, self.max_model_len - req.num_computed_tokens))
                drafts = drafts[:max(0, n - left)]
                while not self._grow(req, n + self._lookahead(req, n)):
                    # Free blocks by preempting the latest arrival that is not already in this step.
                    victim = next(r for r in reversed(self.running) if r.request_id not in scheduled)
                    self.running.remove(victim)
                    self._preempt(victim)
                    out.num_preempted += 1
                    if victim is req:
                        break
                else:
                    out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens + n >= req.num_tokens,
                                                          drafts))
                    scheduled.add(req.request_id)
                    budget -= n
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests in order; stop at the first that does not fit (FCFS). A request
        whose prefix is being read from a KV tier is passed over until it arrives (it keeps its
        place at the front). Returns the budget left."""
        reading: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) + len(self.awaiting_kv) < self.max_num_seqs \
                and not out.num_preempted:
            req = self.waiting[0]
            if not req.block_ids:
                if not self._attach_prefix(req):
                    reading.append(self.waiting.popleft())
                    continue
                if req.kv_role == "decode":
                    reserved = self._reserve_for_transfer(req)
                    if reserved is False:
                        break
                    if reserved:
                        continue
            n = self._chunk(req, min(req.num_tokens - req.num_computed_tokens, budget))
            if not self._grow(req, n + self._lookahead(req, n)):
                # Give back the prefix blocks it was lent: a waiting request that holds blocks it
                # cannot use could leave the running ones (or, once nothing runs, itself) without
                # any, for ever. They stay cached, so the next attempt finds them again.
                self._detach_prefix(req)
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens + n == req.num_tokens))
            budget -= n
            if req.restore_from is not None:  # a prefix hit on a state snapshot: restore it first
                out.restored_slots.append(req.restore_from)
                self._restores.append((req.restore_from, req.state_slot))
                req.restore_from = None
        self.waiting.extendleft(reversed(reading))
        return budget

    def update(self, out: SchedulerOutput, sampled: dict[str, int | list[int]],
               recompute: set[str] = frozenset()) -> list[Request]:
        """Advance the scheduled requests; append sampled tokens (one, or with draft tokens the
        verified ones: the accepted drafts and the token after them); return those that finished.
        A piece with drafts advances its computed tokens past the accepted drafts only: the cache
        slots of rejected ones are rewritten before they are read. recompute: requests whose
        per-sequence state was restored to before the step (a rejected draft in a model with
        linear attention): their piece counts as not computed, its tokens are computed again."""
        finished = []
        if out.restored_slots:  # the runner has copied them: the snapshots may be evicted again
            self.kv.state.free(out.restored_slots)
            out.restored_slots = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:  # aborted while the step ran
                continue
            new = sampled[req.request_id] if s.samples else []
            new = [new] if isinstance(new, int) else new
            start = req.num_computed_tokens
            req.num_computed_tokens += s.num_tokens - len(s.draft_ids)
            stopped = False
            for i, tok in enumerate(new):
                if i:  # an accepted draft: its K/V, written this step, is now the request's
                    req.num_computed_tokens += 1
                req.output_token_ids.append(tok)
                if req.grammar is not None:
                    req.grammar.accept(tok)
                if req.check_stop_token():
                    stopped = True
                    break
            if req.request_id in recompute:
                req.num_computed_tokens = start
            self._register_full_blocks(req)
            self._snapshot_state(req)
            if stopped:
                self.running.remove(req)
                self._release(req)
                finished.append(req)
        return finished

    # --- blocks ----------------------------------------------------------------------------------
    def _grow(self, req: Request, n: int) -> bool:
        """Make room for n more tokens of req in every cache group; False (and nothing allocated)
        when one runs out."""
        return self.kv.grow(req, n)

    def _lookahead(self, req: Request, n: int) -> int:
        """Slots to reserve past a piece of n tokens: lookahead_tokens when it samples, within
        the context limit."""
        if not self.lookahead_tokens or req.num_computed_tokens + n < req.num_tokens:
            return 0
        return max(0, min(self.lookahead_tokens, self.max_model_len - req.num_computed_tokens - n))

    def _preempt(self, req: Request) -> None:
        req.spec_token_ids = []
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self._registered[req.request_id] = 0
        self.num_preemptions += 1
        self._preempted_ids.add(req.request_id)
        # First to be admitted again, but behind the waiting requests that hold their cache already
        # (a decode side's received prompt, a prefix being read from a tier): they resume with a
        # token or two and then give blocks back. Ahead of them, a request recomputing from scratch
        # could take the budget every step and the blocks they hold would never come back: it would
        # be preempted again, for ever (seen with a one-token budget).
        ahead = 0
        while ahead < len(self.waiting) and self.waiting[ahead].block_ids:
            ahead += 1
        self.waiting.insert(ahead, req)

    def _release(self, req: Request) -> None:
        if not self._hold_for_transfer(req):  # held: its blocks are written to the decode side first
            self.kv.free(req)
        self._forget(req)

    def _forget(self, req: Request) -> None:
        self._finished_ids.add(req.request_id)
        self.requests.pop(req.request_id, None)
        self._hashes.pop(req.request_id, None)
        self._registered.pop(req.request_id, None)
        self._looked_up.discard(req.request_id)
