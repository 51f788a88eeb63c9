"""AsyncEngine: the front end's view of its engine cores, for asyncio request handlers.

It runs in the front-end process, which never steps a model. Handlers `submit` requests; each goes
to the rank the `Router` picks (moe_serve/engine/routing.py: by default the rank that holds the
longest cached prefix of its prompt, within a load margin of the rank with the fewest outstanding
tokens) through a sender thread that batches whatever arrived into one `CoreInput` per rank. A receiver thread reads every core's
`CoreOutputs` (one per engine step), turns tokens into text in the `OutputProcessor` and hands the
results to each request's asyncio.Queue with `call_soon_threadsafe`. A handler that goes away
(client disconnect) aborts its request, which frees its KV blocks in the core.

A core that dies (its process gone, or a `CoreFatal`) makes the engine `dead`: every open request
ends with the reason, /health answers 503 and `on_fatal` stops the server. Under elastic EP
(launcher/elastic.py) only rank 0's loss does: when rank 0's core says the ranks have regrouped
(`ElasticChange`), every open request is resubmitted to a member, with the tokens it has already
streamed, and inputs and outputs of an earlier generation are dropped on both sides.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import signal
import threading
import time
from typing import Callable

from moe_serve.engine.core_client import CoreClient
from moe_serve.disagg.prefill_fetch import PrefillFetch
from moe_serve.engine.core_channel import CoreChannel
from moe_serve.engine.elastic_members import ElasticMembers
from moe_serve.engine.output_processor import OutputProcessor
from moe_serve.engine.routing import Router
from moe_serve.limits import check_request
from moe_serve.metrics import EngineMetrics
from moe_serve.protocol import (CoreOutputs, CoreReady, EngineOutput, EngineStats, combine_rank_stats, KVParams,
                                NewRequest, RankInfo, UtilityCall, UtilityResult)
from moe_serve.sampling_params import SamplingParams, child_params

log = logging.getLogger("moe_serve.async_engine")


class QueueFullError(RuntimeError):
    """More requests are waiting than --max-waiting-requests allows."""


class AsyncEngine(CoreChannel, ElasticMembers, PrefillFetch):
    """Handlers' calls (submit, abort, utility calls, shutdown) and the cores' outputs; the threads
    to the cores (engine/core_channel.py), regrouping (engine/elastic_members.py) and the decode
    side's prefill requests (disagg/prefill_fetch.py) are its parts in their own modules."""

    def __init__(self, client: CoreClient, ready: list[CoreReady], tokenizer, model_name: str,
                 max_waiting_requests: int = 1024, log_interval_s: float = 10.0,
                 check_alive: Callable[[], str | None] = lambda: None, load_balance_method: str = "cache_aware",
                 load_margin: int = 4096, cache_threshold: float = 0.5, kv_timeout_s: float = 60.0,
                 elastic: bool = False):
        self.client = client
        self.world_size = client.world_size
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_waiting_requests = max_waiting_requests
        self.max_model_len = min(r.max_model_len for r in ready)
        self.vocab_size = min(r.vocab_size for r in ready)
        self.metrics = EngineMetrics()
        self.processor = OutputProcessor(tokenizer)
        self.check_alive = check_alive
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (rank or None, NewRequest | abort id | call | None)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        # Routing: tokens each rank may still add (prompt + tokens still to generate) and which rank
        # owns each live request with how many of its tokens are still counted there.
        self._rank_load = [0] * self.world_size
        self._owner: dict[str, tuple[int, int]] = {}
        caching = all(r.prefix_caching for r in ready)
        if load_balance_method == "cache_aware" and not caching:
            log.info("load balance: cache_aware needs the prefix cache, which is off: least_load instead")
            load_balance_method = "least_load"
        self.router = Router(self.world_size, ready[0].block_size, load_balance_method, load_margin, cache_threshold)
        self._ids = itertools.count()
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future, Callable | None]] = {}
        self._call_ids = itertools.count()
        self.rank_stats = [EngineStats() for _ in range(self.world_size)]
        self._stop = False
        self._closed = threading.Event()
        self._shutdown_asked = False
        self._log_interval = log_interval_s
        self.dead: str | None = None
        self.weight_version = "0"  # names the weights served (set by weight updates: weights_routes.py)
        self.stopping: str | None = None  # set by end_all: why every open request was ended
        self.on_fatal = lambda: None  # called (from the receiver thread) if a core dies
        self._cores_done = [False] * self.world_size
        # Disaggregation (moe_serve/disagg): this instance's side, and on the decode side the
        # prefill instance each request's prompt goes to, until its KV has arrived.
        self.disaggregation_mode = ready[0].disaggregation_mode
        self.kv_timeout_s = kv_timeout_s
        self._kv_prefill: dict[str, tuple[str, dict, list[int], bool]] = {}  # (url, headers, ids, routed experts?)
        self._http = None  # httpx.AsyncClient for the prefill instances, made in the event loop
        # Elastic EP: the members' generation, who they are, and what each open request needs to be
        # resubmitted (its prompt and params, the tokens it has generated).
        self.elastic = elastic
        self.generation = 0
        self.live = list(range(self.world_size))
        self.rank_info = {r.rank: RankInfo(r.rank, r.host, r.pid, r.expert_slots) for r in ready}
        self.elastic_state = "serving"
        self.lost_ranks: list[int] = []
        self._requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self._generated: dict[str, list[int]] = {}
        self.metrics.ep_world_size = self.world_size
        self._sender = threading.Thread(target=self._send_loop, name="core-sender", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name="core-receiver", daemon=True)
        self._sender.start()
        self._receiver.start()

    # --- called from request handlers (event loop thread) ---------------------------------------
    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids)}"

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        return check_request(prompt_token_ids, params, self.max_model_len, self.vocab_size)

    def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
               prefill: tuple[str, dict] | None = None, kv: KVParams | None = None,
               validated: bool = False) -> "RequestStream":
        """Queue the n samples of every prompt at once; returns the stream of their outputs.
        Raises ValueError for a bad request and QueueFullError when the waiting queue is full.
        prefill: (URL, headers) of the prefill instance that computes the prompts (a decode
        instance); kv: the request's part of a disaggregated request as it is (a prefill instance);
        validated: the caller has run `validate` on each prompt (the HTTP front end's runner)."""
        if self.dead:
            raise RuntimeError(f"the engine has stopped: {self.dead}")
        if not validated:
            for ids in prompts:
                self.validate(ids, params)
        if self._stop:
            raise QueueFullError("the server is shutting down")
        count = params.n * len(prompts)
        if sum(s.scheduler.num_waiting for s in self.rank_stats) + self._inbox.qsize() + count > self.max_waiting_requests:
            raise QueueFullError(f"more than max_waiting_requests={self.max_waiting_requests} requests are waiting")
        stream = RequestStream(self, request_id, prompts, params)
        with self._lock:
            for pi, ids in enumerate(prompts):
                for i in range(params.n):
                    cid = stream.child_ids[pi * params.n + i]
                    cp = child_params(params, i)
                    self._queues[cid] = (stream.loop, stream.queue)
                    self.processor.add_request(cid, ids, cp)
                    cost = len(ids) + (cp.max_tokens or self.max_model_len - len(ids))
                    rank, hit = self.router.pick(cid, ids, self._rank_load)
                    self._rank_load[rank] += cost
                    self._owner[cid] = (rank, cost)
                    if self.elastic:
                        self._requests[cid], self._generated[cid] = (list(ids), cp), []
                    if self.world_size > 1:
                        log.info("request %s -> rank %d (%d prompt tokens cached there)", cid, rank,
                                 hit * self.router.block_size)
                    if prefill is not None:
                        self._kv_prefill[cid] = (*prefill, list(ids), cp.return_routed_experts)
                        kv = KVParams("decode")
                    self._inbox.put((rank, NewRequest(cid, list(ids), cp, kv), self.generation))
        return stream

    async def call(self, method: str, arg: int = 0, data: bytes = b"", timeout_s: float = 60.0,
                   on_success: Callable[[], None] | None = None) -> bytes:
        """A utility call answered by rank 0's core (expert-load recording start/stop/dump, scale,
        weight updates: `data` its JSON arguments); TimeoutError after timeout_s. on_success runs
        in the receiver thread as a successful answer arrives, before any later output is handed
        out (a weight update's new weight_version stamps exactly the tokens made after it)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        cid = next(self._call_ids)
        with self._lock:
            self._calls[cid] = (loop, fut, on_success)
        self._inbox.put((0, UtilityCall(cid, method, arg, data)))
        return await asyncio.wait_for(fut, timeout=timeout_s)

    def _abort(self, child_ids) -> None:
        for cid in child_ids:
            self._kv_prefill.pop(cid, None)
            owner = self._release(cid)
            if owner is not None:
                self._inbox.put((owner, cid))
            self.processor.forget(cid)

    def cancel(self, child_ids) -> None:
        """Ask the cores to abort these requests but keep their streams: each still ends with its
        core's last output (a prefill instance's request: only once its KV write has ended)."""
        with self._lock:
            owners = [(self._owner[cid][0], cid) for cid in child_ids if cid in self._owner]
        for rank, cid in owners:
            self._inbox.put((rank, cid))

    def _release(self, cid: str) -> int | None:
        """Stop counting a request's tokens against its rank; returns the rank (None if unknown)."""
        with self._lock:
            o = self._owner.pop(cid, None)
            if o is None:
                return None
            self._rank_load[o[0]] -= o[1]
            self.router.release(cid)
            self._requests.pop(cid, None)
            self._generated.pop(cid, None)
            return o[0]

    def _forget(self, child_ids) -> None:
        with self._lock:
            for cid in child_ids:
                self._queues.pop(cid, None)

    def stats(self) -> EngineStats:
        """Every rank's stats combined (protocol.combine_rank_stats)."""
        return combine_rank_stats([self.rank_stats[r] for r in self.live])

    def has_work(self) -> bool:
        return bool(self._owner)

    def end_all(self, reason: str) -> int:
        """Stop taking requests and end every open one now (its stream ends with `reason`, its
        blocks are freed in the core); returns how many were open. Thread-safe."""
        self._stop = True
        self.stopping = reason
        with self._lock:
            items = list(self._queues.items())
        self._abort([cid for cid, _ in items])
        for cid, (loop, q) in items:
            loop.call_soon_threadsafe(q.put_nowait, EngineOutput(cid, [], "", True, "abort", reason))
        return len(items)

    def shutdown(self, grace_s: float = 0.0, timeout_s: float = 30.0) -> None:
        """Stop taking requests; let running ones finish for up to grace_s; abort the rest; tell
        every core to exit and wait (up to timeout_s) until each has said it did."""
        self._stop = True
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self._queues and not self.dead:
            time.sleep(0.05)
        with self._lock:
            ids = list(self._queues)
        self._abort(ids)
        for r in list(self.live):
            self._inbox.put((r, None))  # None: shut down
        if not self._closed.wait(timeout_s):
            log.warning("engine cores did not confirm shutdown within %.0fs", timeout_s)
        self._inbox.put(("stop", None))
        self._sender.join(timeout=5)
        self._receiver.join(timeout=5)
        self.client.close()

    def _on_outputs(self, msg: CoreOutputs) -> int:
        if msg.generation != self.generation:  # a core of another generation: its requests were resubmitted
            return 0
        if self.elastic:
            for o in msg.outputs:
                done = self._generated.get(o.request_id)
                if done is not None:
                    done += o.new_token_ids
        # Reservations first: a figure that shows the blocks held comes after the fetch is under way.
        if any(o.kv_target is not None for o in msg.outputs):
            for o in msg.outputs:
                if o.kv_target is not None:
                    self._fetch_kv(msg.rank, o)
            msg.outputs = [o for o in msg.outputs if o.kv_target is None]
        self.rank_stats[msg.rank] = msg.stats
        if msg.cache_events is not None:
            with self._lock:
                self.router.apply_events(msg.rank, msg.cache_events.added, msg.cache_events.removed)
        self.metrics.update_from(self.stats())
        if msg.shutdown_asked_by >= 0 and not self._shutdown_asked:
            self._shutdown_asked = True
            log.info("rank %d asked to shut down (SIGTERM); stopping the job", msg.shutdown_asked_by)
            signal.raise_signal(signal.SIGTERM)  # the server drains, then shutdown() stops every core
        outs, stopped = self.processor.process(msg.outputs)
        for cid in stopped:  # stop strings: the core frees their blocks
            owner = self._release(cid)
            if owner is not None:
                self._inbox.put((owner, cid))
        ntok = 0
        with self._lock:
            for o in outs:
                ntok += len(o.new_token_ids)
                own = self._owner.get(o.request_id)
                if own is not None:
                    if o.finished:
                        self._kv_prefill.pop(o.request_id, None)
                        self._owner.pop(o.request_id)
                        self._rank_load[own[0]] -= own[1]
                        self.router.release(o.request_id)
                    elif o.new_token_ids:
                        self._owner[o.request_id] = (own[0], own[1] - len(o.new_token_ids))
                        self._rank_load[own[0]] -= len(o.new_token_ids)
                o.weight_version = self.weight_version
                dest = self._queues.get(o.request_id)
                if dest is not None:
                    dest[0].call_soon_threadsafe(dest[1].put_nowait, o)
        if msg.finished_shutdown:
            self._cores_done[msg.rank] = True
            if all(self._cores_done):
                self._closed.set()
        return ntok

    def _on_result(self, msg: UtilityResult) -> None:
        with self._lock:
            dest = self._calls.pop(msg.call_id, None)
        if dest is None:
            return
        loop, fut, on_success = dest
        if on_success is not None and not msg.error:
            on_success()

        def resolve():
            if fut.done():
                return
            if msg.error:
                fut.set_exception(RuntimeError(msg.error))
            else:
                fut.set_result(msg.result)

        loop.call_soon_threadsafe(resolve)


class RequestStream:
    """Outputs of one API request (every prompt x n samples) as (choice index, EngineOutput) pairs.
    Closing it early (client gone) aborts whatever is still running."""

    def __init__(self, engine: AsyncEngine, request_id: str, prompts: list[list[int]], params: SamplingParams):
        self.engine, self.request_id, self.params = engine, request_id, params
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.child_ids = [f"{request_id}-{pi}-{i}" for pi in range(len(prompts)) for i in range(params.n)]
        self._index = {cid: k for k, cid in enumerate(self.child_ids)}
        self.open_ids = set(self.child_ids)
        self.num_prompt_tokens = sum(len(p) for p in prompts)
        self.num_output_tokens = 0
        self._cached: dict[int, int] = {}  # per prompt: its tokens served from the prefix cache
        # Per choice: its prompt's logprob entries (protocol.TokenLogprob), when params.prompt_logprobs is set.
        self.prompt_logprobs: list[list | None] = [None] * len(self.child_ids)
        # Per choice, with params.return_routed_experts: its rows so far (moe_serve/routed_experts.py).
        self.routed_experts: list = [None] * len(self.child_ids)
        self.weight_version = engine.weight_version  # that of the latest output (every chunk carries it)
        self.t0 = time.monotonic()
        self.first: float | None = None
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, EngineOutput]:
        if not self.open_ids:
            self._finish()
            raise StopAsyncIteration
        out: EngineOutput = await self.queue.get()
        if self.first is None and out.new_token_ids:
            self.first = time.monotonic()
            self.engine.metrics.ttft.observe(self.first - self.t0)
        self.num_output_tokens += len(out.new_token_ids)
        k = self._index[out.request_id] // self.params.n
        self._cached[k] = max(self._cached.get(k, 0), out.num_cached_tokens)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[self._index[out.request_id]] = out.prompt_logprobs
        if out.routed_experts is not None:
            self._add_routed_experts(self._index[out.request_id], out.routed_experts)
        if out.weight_version is not None:
            self.weight_version = out.weight_version
        if out.finished:
            self.open_ids.discard(out.request_id)
        return self._index[out.request_id], out

    def _add_routed_experts(self, choice: int, chunk) -> None:
        from moe_serve.routed_experts import RoutedExperts

        if self.routed_experts[choice] is None:
            self.routed_experts[choice] = RoutedExperts()
        self.routed_experts[choice].add(chunk)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (each prompt once, whatever n)."""
        return sum(self._cached.values())

    async def aclose(self) -> None:
        self._finish()

    def _finish(self) -> None:
        if self.closed:
            return
        self.closed = True
        m, end = self.engine.metrics, time.monotonic()
        if self.open_ids:  # the consumer left early: abort what is still running
            self.engine._abort(self.open_ids)
            log.info("request %s aborted after %d generated tokens", self.request_id, self.num_output_tokens)
        else:
            m.e2e.observe(end - self.t0)
            k = len(self.child_ids)
            if self.first is not None and self.num_output_tokens > k:
                m.tpot.observe((end - self.first) / (self.num_output_tokens - k))
            log.info("request %s done: prompt %d tokens, generated %d, TTFT %.3fs, total %.3fs", self.request_id,
                     self.num_prompt_tokens, self.num_output_tokens, (self.first or end) - self.t0, end - self.t0)
        self.engine._forget(self.child_ids)
