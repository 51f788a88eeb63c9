"""AsyncEngine: the bridge between asyncio request handlers and the engine's step loop.

The step loop runs in one background thread (the only thread that touches the EngineCore). Handlers
submit typed control messages through a thread-safe queue and read their request's outputs from a
per-request asyncio.Queue that the loop fills with `call_soon_threadsafe`. A handler that goes away
(client disconnect, cancellation) aborts its request, which frees its KV blocks on the next loop turn.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from typing import Protocol

from moe_serve.engine.llm import child_params
from moe_serve.metrics import EngineMetrics
from moe_serve.protocol import (AbortRequest, ControlMessage, EngineOutput, LoadRecordControl, NewRequest,
                                Shutdown)
from moe_serve.sampling_params import SamplingParams

log = logging.getLogger("moe_serve.async_engine")


class QueueFullError(RuntimeError):
    """More requests are waiting than --max-waiting-requests allows."""


class Stepper(Protocol):
    """One engine step given the control messages that arrived since the last one.

    Local: apply them to this process's EngineCore and step it. Data-parallel: send them to the
    ranks that own the requests, step every rank in lockstep, gather their outputs here.
    """

    def step(self, msgs: list[ControlMessage]) -> list[EngineOutput]: ...
    def has_work(self) -> bool: ...
    def stats(self) -> dict: ...
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int: ...
    def close(self) -> None: ...


def apply_control(core, msgs: list[ControlMessage]) -> list[EngineOutput]:
    """Apply new-request and abort messages to an EngineCore; a request that fails its checks here
    (limits can race with validation at the front end) ends at once with the reason."""
    outs: list[EngineOutput] = []
    for m in msgs:
        if isinstance(m, NewRequest):
            try:
                core.add_request(m.request_id, m.prompt_token_ids, m.params)
            except ValueError as e:
                outs.append(EngineOutput(m.request_id, [], "", True, "abort", str(e)))
        elif isinstance(m, AbortRequest):
            o = core.abort_request(m.request_id)
            if o is not None:
                outs.append(o)
        elif isinstance(m, LoadRecordControl) and core.load_recorder is not None:
            core.load_recorder.start() if m.action == "start" else core.load_recorder.stop()
    return outs


class LocalStepper:
    """Steps one in-process EngineCore."""

    def __init__(self, core):
        self.core = core

    def step(self, msgs: list[ControlMessage]) -> list[EngineOutput]:
        outs = apply_control(self.core, msgs)
        return outs + self.core.step()

    def has_work(self) -> bool:
        return self.core.has_unfinished()

    def stats(self) -> dict:
        return self.core.stats()

    def validate(self, prompt_token_ids, params) -> int:
        return self.core.validate(prompt_token_ids, params)

    def close(self) -> None:
        pass


class AsyncEngine:
    def __init__(self, stepper: Stepper, tokenizer, model_name: str, max_waiting_requests: int = 1024,
                 log_interval_s: float = 10.0):
        self.stepper = stepper
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_waiting_requests = max_waiting_requests
        self.metrics = EngineMetrics()
        self._inbox: queue.Queue[ControlMessage] = queue.Queue()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._pending = 0  # submitted, not yet seen by the loop
        self._ids = itertools.count()
        self._stop = False
        self._log_interval = log_interval_s
        self._stats: dict = {}
        self.dead: str | None = None
        self.on_fatal = lambda: None  # called (from the engine thread) if the loop dies
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # --- called from request handlers (event loop thread) ---------------------------------------
    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids)}"

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        return self.stepper.validate(prompt_token_ids, params)

    def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams) -> "RequestStream":
        """Queue the n samples of every prompt at once; returns the stream of their outputs.
        Raises ValueError for a bad request and QueueFullError when the waiting queue is full."""
        if self.dead:
            raise RuntimeError(f"the engine has stopped: {self.dead}")
        for ids in prompts:
            self.stepper.validate(ids, params)
        if self._stop:
            raise QueueFullError("the server is shutting down")
        count = params.n * len(prompts)
        if self._stats.get("num_waiting", 0) + self._pending + count > self.max_waiting_requests:
            raise QueueFullError(f"more than max_waiting_requests={self.max_waiting_requests} requests are waiting")
        stream = RequestStream(self, request_id, prompts, params)
        with self._lock:
            for cid in stream.child_ids:
                self._queues[cid] = (stream.loop, stream.queue)
            self._pending += count
        for pi, ids in enumerate(prompts):
            for i in range(params.n):
                self._inbox.put(NewRequest(stream.child_ids[pi * params.n + i], list(ids),
                                           child_params(params, i)))
        self._wake.set()
        return stream

    def control(self, msg: ControlMessage) -> None:
        """Queue a control message for the engine loop (applied on every rank at one turn)."""
        self._inbox.put(msg)
        self._wake.set()

    def _abort(self, child_ids) -> None:
        for cid in child_ids:
            self._inbox.put(AbortRequest(cid))
        self._wake.set()

    def _forget(self, child_ids) -> None:
        with self._lock:
            for cid in child_ids:
                self._queues.pop(cid, None)

    def stats(self) -> dict:
        return dict(self._stats)

    def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop taking requests; let running ones finish for up to grace_s; abort the rest; stop the loop."""
        self._stop = True
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (self._queues or self.stepper.has_work()):
            time.sleep(0.05)
        with self._lock:
            ids = list(self._queues)
        for cid in ids:
            self._inbox.put(AbortRequest(cid))
        self._inbox.put(Shutdown("server shutdown"))
        self._wake.set()
        self._thread.join(timeout=30)
        if not self.dead:
            self.stepper.close()

    # --- the loop (engine thread) ---------------------------------------------------------------
    def _loop(self) -> None:
        last_log = time.monotonic()
        tokens_since = 0
        self._stats = self.stepper.stats()
        try:
            while True:
                msgs: list[ControlMessage] = []
                while True:
                    try:
                        msgs.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                stopping = any(isinstance(m, Shutdown) for m in msgs)
                msgs = [m for m in msgs if not isinstance(m, Shutdown)]
                with self._lock:
                    self._pending -= sum(1 for m in msgs if isinstance(m, NewRequest))
                if stopping:
                    self._deliver(self.stepper.step(msgs))
                    return
                if not msgs and not self.stepper.has_work():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    idle = getattr(self.stepper, "idle", None)
                    if idle is not None:  # multi-rank: a heartbeat turn keeps every rank answering
                        self._deliver(idle())
                    self._stats = self.stepper.stats()
                    continue
                outs = self.stepper.step(msgs)
                self._deliver(outs)
                tokens_since += sum(len(o.new_token_ids) for o in outs)
                self._stats = s = self.stepper.stats()
                self.metrics.update_from(s)
                now = time.monotonic()
                if now - last_log >= self._log_interval:
                    log.info("throughput %.1f tokens/s; running %d, waiting %d; KV cache %.1f%%; prefix hit %.1f%%",
                             tokens_since / (now - last_log), s.get("num_running", 0), s.get("num_waiting", 0),
                             100 * s.get("kv_cache_usage", 0), 100 * s.get("prefix_cache_hit_rate", 0))
                    last_log, tokens_since = now, 0
        except Exception as e:  # a dead loop must not leave clients hanging
            log.exception("engine loop failed")
            self.dead = f"{type(e).__name__}: {e}"
            with self._lock:
                items = list(self._queues.items())
            for cid, (loop, q) in items:
                loop.call_soon_threadsafe(q.put_nowait, EngineOutput(cid, [], "", True, "abort", self.dead))
            self.on_fatal()

    def _deliver(self, outs: list[EngineOutput]) -> None:
        with self._lock:
            for o in outs:
                dest = self._queues.get(o.request_id)
                if dest is not None:
                    loop, q = dest
                    loop.call_soon_threadsafe(q.put_nowait, o)


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
        if out.finished:
            self.open_ids.discard(out.request_id)
        return self._index[out.request_id], out

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
