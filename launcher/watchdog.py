"""Turn a dead or hung rank into a prompt, named error instead of a silent hang.

Every rank publishes, in the job's key-value store, the number of the engine turn it has started.
A watchdog thread on every rank checks the others: when this rank has been waiting in turn n for
longer than `timeout_s` and some rank has not started turn n (or its heartbeat thread stopped, i.e.
the process is gone), the watchdog logs which rank it is and ends this process with exit code 1;
torchrun then stops the rest of the job and reports the failure. Before it ends the process it runs
`before_exit` (rank 0: stop and reap the front end, so that no process of the job outlives it:
torchrun signals only the workers still running, and an orphaned front end would hold the HTTP
port after the job has ended).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import torch.distributed as dist

log = logging.getLogger("moe_serve.watchdog")


class Watchdog:
    def __init__(self, rank: int, world_size: int, timeout_s: float, store=None):
        """store: a client of the job's store whose operations time out within timeout_s (so a
        host cut off from node 0 notices too); default: the process group's store."""
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.turn = 0
        self.turn_started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.store = store
        self._store_call_since: float | None = None  # when the watchdog's current store round began
        self.before_exit: Callable[[str], None] | None = None  # given the reason; runs before os._exit
        if store is None and world_size > 1 and dist.is_initialized():
            try:
                self.store = dist.group.WORLD.get_group_store()  # the store the default group was made with
            except Exception as e:  # no store: collective timeouts still bound the wait
                log.warning("watchdog disabled: no key-value store (%s)", e)

    def beat(self, turn: int) -> None:
        self.turn = turn
        self.turn_started = time.monotonic()
        if self.store is not None:
            self.store.set(f"moe_serve/turn/{self.rank}", str(turn))

    def start(self) -> None:
        if self.store is None:
            return
        self._thread = threading.Thread(target=self._run, name="rank-watchdog", daemon=True)
        self._thread.start()
        threading.Thread(target=self._deadman, name="rank-watchdog-store", daemon=True).start()

    def _exit(self, reason: str) -> None:
        """End this process with code 1 once `before_exit` has run (bounded by its own waits)."""
        try:
            if self.before_exit is not None:
                self.before_exit(reason)
        except Exception as e:  # the process ends anyway
            log.error("rank %d: stopping the processes this rank started: %s", self.rank, e)
        finally:
            logging.shutdown()
            os._exit(1)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)  # not inside a store call while the groups are torn down

    def _deadman(self) -> None:
        """A store call that never returns (a host whose link to node 0 is cut: the call waits on
        TCP, which gives up only after many minutes) cannot be interrupted; this thread sees it and
        ends the process."""
        period = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            since = self._store_call_since
            if since is not None and time.monotonic() - since > self.timeout_s:
                why = (f"the job's key-value store (MASTER_ADDR {os.environ.get('MASTER_ADDR', '?')}:"
                       f"{os.environ.get('MASTER_PORT', '?')}, on node 0) has not answered for "
                       f"{time.monotonic() - since:.0f}s: this host has lost node 0 (its link is down, or node 0 is "
                       f"gone)")
                log.error("rank %d: %s; stopping", self.rank, why)
                self._exit(why)

    def _run(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            now = time.monotonic()
            self._store_call_since = now
            try:
                self.store.set(f"moe_serve/alive/{self.rank}", str(time.time()))
                if now - self.turn_started < self.timeout_s:
                    continue
                behind = []
                for r in range(self.world_size):
                    if r == self.rank:
                        continue
                    if not self.store.check([f"moe_serve/turn/{r}", f"moe_serve/alive/{r}"]):
                        behind.append((r, 0, float("inf")))  # never checked in
                        continue
                    t = int(self.store.get(f"moe_serve/turn/{r}").decode())
                    alive = float(self.store.get(f"moe_serve/alive/{r}").decode())
                    if t < self.turn or time.time() - alive > self.timeout_s:
                        behind.append((r, t, time.time() - alive))
            except Exception as e:  # the store itself is gone: the job is going down anyway
                if self._stop.is_set():
                    return
                log.error("rank %d: lost the job's key-value store (%s); exiting", self.rank, e)
                self._exit(f"rank {self.rank} lost the job's key-value store ({e})")
            finally:
                self._store_call_since = None
            if behind:
                names = ", ".join(f"rank {r} (at turn {t}, last heartbeat {age:.0f}s ago)" for r, t, age in behind)
                why = f"rank {self.rank} waited {now - self.turn_started:.0f}s in turn {self.turn} for {names}: dead or hung"
                log.error("%s; stopping the job", why)
                self._exit(why)
