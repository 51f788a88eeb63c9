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
from types import SimpleNamespace

from attention.blocks import BlockAllocator, hash_block
from attention.kv_manager import KVCacheManager
from moe_serve.request import Request, RequestStatus


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


class Scheduler:
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
        self._hashes: dict[str, list[bytes]] = {}  # full-block hashes of each live request, in order
        self._registered: dict[str, int] = {}  # how many of a request's blocks are registered
        self._looked_up: set[str] = set()  # requests whose prefix lookup is counted in the hit rate
        self.num_preemptions = 0
        self._finished_ids: set[str] = set()  # pending for the next non-empty SchedulerOutput
        self._preempted_ids: set[str] = set()
        self._state_copies: list[tuple[int, int]] = []  # snapshots pending for the next non-empty output
        # Disaggregation (moe_serve/disagg). Decode side: requests whose blocks are reserved while a
        # prefill instance fills them (out of the queues until `kv_done`), reservations not yet
        # reported, and aborted ones whose blocks stay held until the writer is known to be done.
        # Prefill side: finished requests whose blocks are held until their write completes.
        self.awaiting_kv: dict[str, Request] = {}
        self._kv_reserved: list[Request] = []
        self._kv_quarantine: dict[str, Request] = {}
        self._kv_outbox: list[Request] = []
        self.kv_received = 0
        self.kv_fallbacks = 0

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
        if self.awaiting_kv.pop(request_id, None) is not None:
            # A prefill instance may still be writing into its blocks: held until kv_done says it is not.
            req.status = status
            self._kv_quarantine[request_id] = req
            self._forget(req)
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
        budget = self.max_num_batched_tokens
        # 1) running requests, decodes first: a long prompt's next chunk never delays the streams
        #    that need one token each. Then the unfinished prefill chunks, in arrival order.
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
        # 2) admit waiting requests in order; stop at the first that does not fit (FCFS).
        while self.waiting and budget > 0 and len(self.running) + len(self.awaiting_kv) < self.max_num_seqs \
                and not out.num_preempted:
            req = self.waiting[0]
            if not req.block_ids:
                self._attach_prefix(req)
                if req.kv_role == "decode":
                    if req.num_computed_tokens >= req.kv_end:  # cached here already: nothing to fetch
                        req.kv_role = None
                    elif not self.kv.reserve(req, req.kv_end):
                        self._detach_prefix(req)
                        break
                    else:
                        self.waiting.popleft()
                        self.awaiting_kv[req.request_id] = req
                        self._kv_reserved.append(req)
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
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        if out.scheduled:
            out.finished_req_ids, self._finished_ids = self._finished_ids, set()
            out.preempted_req_ids, self._preempted_ids = self._preempted_ids, set()
            out.state_copies, self._state_copies = self._state_copies + self._restores, []
        self._restores = []
        return out

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

    # --- disaggregation --------------------------------------------------------------------------
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

    @property
    def num_kv_held(self) -> int:
        """Requests whose blocks are held outside the queues (awaiting a prefill, or aborted meanwhile)."""
        return len(self.awaiting_kv) + len(self._kv_quarantine)

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
            copy = self.kv.snapshot(req, self._hashes[req.request_id][b // self.block_size - 1])
            if copy is not None:
                self._state_copies.append(copy)

    def _full_block_hashes(self, req: Request, nfull: int) -> list[bytes]:
        """req's chained block hashes, extended to its first nfull full blocks."""
        hashes = self._hashes[req.request_id]
        tokens = req.all_token_ids
        parent = hashes[-1] if hashes else None
        for b in range(len(hashes), nfull):
            parent = hash_block(parent, tokens[b * self.block_size:(b + 1) * self.block_size])
            hashes.append(parent)
        return hashes

    def _attach_prefix(self, req: Request) -> None:
        """Reuse cached blocks for the longest cached prefix every cache group can resume from. At
        least one token is always left to compute, since the step that computes the last known
        token is the one that samples. A request that still needs prompt logprobs takes no hits:
        every prompt position it has no logprob for is computed (vLLM does the same)."""
        tokens = req.all_token_ids
        hashes = self._full_block_hashes(req, len(tokens) // self.block_size)
        lookup = not req.needs_prompt_logprobs
        hits = self.kv.attach_prefix(req, hashes, (len(tokens) - 1) // self.block_size if lookup else 0)
        self._registered[req.request_id] = hits
        req.num_computed_tokens = hits * self.block_size
        if req.num_preemptions == 0 and lookup:
            req.num_cached_prompt_tokens = req.num_computed_tokens
            if req.request_id not in self._looked_up:  # the hit rate counts a prompt once, not per attempt
                self._looked_up.add(req.request_id)
                self.alloc.record_lookup(len(tokens), req.num_computed_tokens)

    def _detach_prefix(self, req: Request) -> None:
        """Undo _attach_prefix for a request that stays waiting."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        self._registered[req.request_id] = 0

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

    def _preempt(self, req: Request) -> None:
        req.spec_token_ids = []
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self._registered[req.request_id] = 0
        self.num_preemptions += 1
        self._preempted_ids.add(req.request_id)
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        if req.kv_role == "prefill" and req.status != RequestStatus.FINISHED_ABORTED:
            self._kv_outbox.append(req)  # its blocks are written to the decode side before they are freed
        else:
            self.kv.free(req)
        self._forget(req)

    def _forget(self, req: Request) -> None:
        self._finished_ids.add(req.request_id)
        self.requests.pop(req.request_id, None)
        self._hashes.pop(req.request_id, None)
        self._registered.pop(req.request_id, None)
        self._looked_up.discard(req.request_id)
