"""The front end's two threads to its engine cores, a part of `AsyncEngine` (engine/async_engine.py,
its one user): the sender batches whatever handlers queued into one `CoreInput` per rank and
generation; the receiver reads every core's messages and hands each to the engine's handler, and
turns a dead core into every open request's end."""
from __future__ import annotations

import logging
import queue
import time

from moe_serve.protocol import (CoreFatal, CoreInput, CoreOutputs, ElasticChange, EngineOutput, KVDone, NewRequest,
                                UtilityCall, UtilityResult)

log = logging.getLogger("moe_serve.async_engine")


class CoreChannel:
    """AsyncEngine's sender and receiver loops (mixed into AsyncEngine, whose state they use:
    `_inbox`, `client`, `generation`, the handlers `_on_outputs`, `_on_result`, `_on_elastic`)."""

    # --- sender thread ----------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            items = [self._inbox.get()]
            while True:
                try:
                    items.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            per_rank: dict[tuple[int, int], CoreInput] = {}
            quit_ = False
            gen = self.generation
            for rank, item, *stamp in items:
                if rank == "stop":
                    quit_ = True
                    continue
                g = stamp[0] if stamp else gen
                if g < gen:  # a request queued before a regroup: it has been resubmitted since
                    continue
                ci = per_rank.setdefault((rank, g), CoreInput([], [], [], False, generation=g))
                if isinstance(item, NewRequest):
                    ci.new.append(item)
                elif isinstance(item, str):
                    ci.aborts.append(item)
                elif isinstance(item, UtilityCall):
                    ci.calls.append(item)
                elif isinstance(item, KVDone):
                    ci.kv_done.append(item)
                elif item is None:
                    ci.shutdown = True
            for (rank, _), ci in per_rank.items():
                try:
                    if not self.client.send(rank, ci, block=not self.elastic):
                        log.warning("rank %d takes no input (lost, or regrouping): %d new request(s) wait for the "
                                    "next generation", rank, len(ci.new))
                except Exception:  # sockets closed under us at exit
                    return
            if quit_:
                return

    # --- receiver thread --------------------------------------------------------------------------
    def _recv_loop(self) -> None:
        last_log, tokens_since = time.monotonic(), 0
        try:
            while not self._closed.is_set():
                msg = self.client.recv(250)
                if msg is None:
                    dead = self.check_alive()
                    if dead:
                        raise RuntimeError(dead)
                    continue
                if isinstance(msg, CoreOutputs):
                    tokens_since += self._on_outputs(msg)
                elif isinstance(msg, UtilityResult):
                    self._on_result(msg)
                elif isinstance(msg, ElasticChange):
                    self._on_elastic(msg)
                elif isinstance(msg, CoreFatal):
                    if self.elastic and msg.rank != 0:
                        log.warning("engine core (rank %d) failed: %s; the others regroup without it", msg.rank,
                                    msg.error)
                        continue
                    raise RuntimeError(f"engine core (rank {msg.rank}) failed: {msg.error}")
                now = time.monotonic()
                if now - last_log >= self._log_interval and tokens_since:
                    s = self.stats()
                    sc, sd = s.scheduler, s.spec_decode
                    sol = [r.speed_of_light.fraction for r in self.rank_stats if r.speed_of_light.fraction > 0]
                    log.info("throughput %.1f tokens/s; running %d, waiting %d; KV cache %.1f%%; prefix hit %.1f%%%s",
                             tokens_since / (now - last_log), sc.num_running, sc.num_waiting,
                             100 * sc.kv_cache_usage, 100 * sc.prefix_cache_hit_rate,
                             (f"; decode at {100 * sum(sol) / len(sol):.1f}% of speed of light" if sol else "")
                             + (f"; speculative: mean acceptance length {1 + sd.num_accepted_tokens / sd.num_drafts:.2f}"
                                f" ({sd.num_accepted_tokens} of {sd.num_draft_tokens} draft tokens accepted)"
                                if sd.num_drafts else ""))
                    last_log, tokens_since = now, 0
        except Exception as e:  # a dead core must not leave clients hanging
            if self._stop and self._closed.is_set():
                return
            log.error("engine failed: %s", e)
            self.dead = str(e)
            with self._lock:
                items = list(self._queues.items())
            for cid, (loop, q) in items:
                loop.call_soon_threadsafe(q.put_nowait, EngineOutput(cid, [], "", True, "abort", self.dead))
            self._closed.set()
            self.on_fatal()
