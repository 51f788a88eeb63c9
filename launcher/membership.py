"""Elastic EP's membership: this core's view of the job's members, through the job's key-value
store (torchrun's, on node 0), under `moe_serve/elastic/`: heartbeats, exits, who is here for the
next generation, the coordinator's member lists, replacements waiting to join. launcher/elastic.py's
docstring describes the keys and the protocol.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from typing import Callable

from launcher.rank import LeaveJob

log = logging.getLogger("moe_serve.elastic")

PREFIX = "moe_serve/elastic/"


class ElasticError(RuntimeError):
    """Ends this rank (or, for rank 0, the job) with a message that names why."""


class Removed(LeaveJob):
    """This rank is not a member of the next generation by plan (a scale-down): it exits cleanly."""


def job_store(host: str, port: int, timeout_s: float):
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))



class Coordinator:
    """What rank 0 does for the job besides its own part (a Membership's side): watch every member's
    heartbeat, notice replacements waiting, decide each generation's members and admit joiners."""

    def _watch(self, store) -> None:
        """Coordinator: refresh every member's heartbeat age, and notice replacements waiting."""
        for r in self.members:
            self._age(store, str(r))
        waiting = store.add(self.k("join_count"), 0)
        if waiting > self._joiners_handled:
            self.on_joiner()

    def _decide(self, target: int, remove: frozenset[int]) -> tuple[list[int], list[int]]:
        """Coordinator: wait until every old member is here or lost; add replacements waiting. A
        member still pending is heartbeating (else it is lost): busy finishing its step or ending a
        collective's wait on a lost peer, slower on a loaded machine. It has twice the settle time
        to arrive before it is left out, which the other ranks' wait for the member list
        (next_generation: three settle times and a heartbeat timeout) still covers."""
        store = self.store
        wait_s = 2 * self.settle_timeout
        deadline = time.monotonic() + wait_s
        while True:
            here, lost, pending = [], [], []
            for r in self.members:
                if r in remove:
                    continue
                if store.check([self.k(f"exited/{r}")]):
                    lost.append(r)  # (it may have said it was here, then died)
                elif store.check([self.k(f"g{target}/here/{r}")]):
                    here.append(r)
                elif self.lost(store, r) is not None:
                    lost.append(r)
                else:
                    pending.append(r)
            if not pending:
                break
            if time.monotonic() > deadline:
                log.warning("generation %d: ranks %s neither regrouped nor were lost within %.0fs: leaving them out",
                            target, pending, wait_s)
                lost += pending
                break
            time.sleep(0.02)
        for r in lost:
            why = self.lost(store, r) or "it did not regroup in time"
            log.warning("generation %d: rank %d is lost (%s)", target, r, why)
        members = sorted(here) + self._admit_joiners(target, sorted(here))
        return sorted(members), sorted(lost)

    def _admit_joiners(self, target: int, members: list[int]) -> list[int]:
        store, admitted = self.store, []
        count = store.add(self.k("join_count"), 0)
        for j in range(self._joiners_handled + 1, count + 1):
            self._joiners_handled = j
            free = [r for r in range(self.full_size) if r not in members and r not in admitted]
            if self._age(store, f"j{j}") > self.hb_timeout:
                continue  # gave up waiting
            if not free:
                store.set(self.k(f"join/{j}/assigned"), json.dumps({"error": f"the job is at its full size of "
                                                                             f"{self.full_size} ranks"}))
                continue
            # The id's previous holder is gone: its recorded exit and heartbeat are not the replacement's.
            store.delete_key(self.k(f"exited/{free[0]}"))
            with self._seen_lock:
                self._seen.pop(str(free[0]), None)
            store.set(self.k(f"join/{j}/assigned"), json.dumps({"rank": free[0], "generation": target}))
            log.info("generation %d: a replacement (join request %d) joins as rank %d", target, j, free[0])
            admitted.append(free[0])
        return admitted


class Membership(Coordinator):
    """This core's view of the job's members, through the store (see the module's docstring)."""

    def __init__(self, host: str, port: int, rank: int | None, heartbeat_timeout_s: float, settle_timeout_s: float,
                 store_timeout_s: float = 30.0, wait_check_s: float = 5.0):
        self.addr = (host, port)
        self.store_timeout = store_timeout_s
        self._connect()
        self.rank = rank
        self.hb_interval = min(0.5, heartbeat_timeout_s / 4)
        self.hb_timeout = heartbeat_timeout_s
        self.settle_timeout = settle_timeout_s
        self.generation = 0
        self.members: list[int] = []
        self.full_size = 0  # the job's size at start: the ids ranks may take
        self._seen: dict[str, tuple[bytes, float]] = {}  # heartbeat key -> (value, when it last changed here)
        self._seen_lock = threading.Lock()
        self._joiners_handled = 0
        self._stop = threading.Event()
        self._hb_key: str | None = None
        self._call_since: float | None = None  # when the heartbeat's store call in progress began
        self.on_joiner = lambda: None  # the coordinator's watcher calls it when a replacement waits
        # While serving: when this core's current turn began (None between generations), the seconds
        # a turn may last before the peers are asked about, and what ends the wait on a loss.
        self.turn_since: float | None = None
        # While a generation forms and its cores are built: when that began (None otherwise). A
        # member lost meanwhile ends this core's wait in the groups' rendezvous (a store wait, which
        # takes the store's timeout) as it ends a serving collective's.
        self.build_since: float | None = None
        self._phase_lock = threading.Lock()  # the watcher acts on the phase it saw, not the next one
        self.wait_check = wait_check_s
        # Ends this core's wait: (why, the connections to shut down).
        self.on_lost: Callable[[str, set[str]], None] = lambda why, sockets: None
        self._interrupted: int | None = None  # the generation whose wait was ended
        self.group_sockets: set[str] = set()  # the connections of this generation's groups

    def _connect(self) -> None:
        """This core's own store client (the heartbeat and the watcher have theirs), and the
        connection it holds: what a loss during a build shuts down to end a rendezvous's wait."""
        from launcher.process_groups import socket_inodes

        before = socket_inodes()
        self.store = job_store(*self.addr, self.store_timeout)
        self.store_sockets = socket_inodes() - before
        self._store_shut = False

    def _reconnect_if_shut(self) -> None:
        """(Under _phase_lock.) A new store client if the watcher shut this one to end a wait."""
        if self._store_shut:
            self._connect()

    def turn_began(self, turn: int) -> None:
        """CoreLoop's on_turn: a new step starts here."""
        self.turn_since = time.monotonic()

    def build_began(self) -> None:
        with self._phase_lock:
            self.build_since = time.monotonic()

    def build_ended(self) -> None:
        with self._phase_lock:
            self.build_since = None
            # the watcher ended a wait as the build finished: the next collective fails and
            # regroups, and the store serves until then
            self._reconnect_if_shut()

    def k(self, key: str) -> str:
        return PREFIX + key

    # heartbeats
    def start_heartbeat(self, key: str) -> None:
        """Beat as alive/<key> from a thread with its own store client; a store that stops answering
        (this host cut off from node 0) ends the process: it can no longer be part of the job."""
        self._hb_key = key
        if getattr(self, "_hb_thread", None) is not None:
            return
        self._hb_thread = threading.Thread(target=self._beat, name="elastic-heartbeat", daemon=True)
        self._hb_thread.start()
        threading.Thread(target=self._deadman, name="elastic-deadman", daemon=True).start()
        threading.Thread(target=self._watch_members, name="elastic-members", daemon=True).start()

    def _watch_members(self) -> None:
        """While this core serves or builds a generation: keep every member's heartbeat age fresh;
        once a step (or the build) has lasted `wait_check` seconds, a member whose core exited or
        whose heartbeat stopped is lost, and `on_lost` ends this core's wait (at most once per
        generation). A member that is merely slow is waited for. Its own store client and thread:
        the wait it ends may take a moment, and the heartbeat must go on meanwhile.

        During a build the wait may be a rendezvous in the job's store (a group the engine makes
        as it is built), which only the store's timeout would end: this core's store connection is
        shut down with the groups', and the next generation reconnects."""
        store = None
        while not self._stop.wait(self.hb_interval):
            building = self.turn_since is None
            since = self.build_since if building else self.turn_since
            gen, members = self.generation, list(self.members)
            if since is None or self._interrupted == gen:
                continue
            try:
                store = store or job_store(*self.addr, self.store_timeout)
                lost = [(r, why) for r in members if r != self.rank
                        for why in [self.lost(store, r)] if why is not None]
            except Exception as e:  # the heartbeat's deadman ends a process cut off from the store
                log.warning("rank %s: could not read the members' state: %s", self.rank, e)
                continue
            waited = time.monotonic() - since
            if not lost or waited < self.wait_check:
                continue
            with self._phase_lock:
                if (self.build_since if building else self.turn_since) != since or self.generation != gen:
                    continue
                why = "; ".join(f"rank {r} is lost ({w})" for r, w in lost)
                log.warning("rank %s: waited %.1fs in this %s (generation %d): %s: ending the wait", self.rank, waited,
                            "build" if building else "step", gen, why)
                self._interrupted = gen
                sockets = set(self.group_sockets)
                if building:
                    sockets |= self.store_sockets
                    self._store_shut = True
                try:
                    self.on_lost(why, sockets)
                except Exception as e:
                    log.warning("rank %s: ending the wait: %s", self.rank, e)

    def _deadman(self) -> None:
        """A store call that never returns (a cut link: TCP retries for many minutes, past the
        store's own timeout) cannot be interrupted; this thread sees it and ends the process."""
        limit = max(self.hb_timeout * 2, 2.0)
        while not self._stop.wait(self.hb_interval):
            since = self._call_since
            if since is not None and time.monotonic() - since > limit:
                log.error("rank %s: the job's store (node 0, %s:%d) has not answered for %.0fs: this host has lost node "
                          "0; stopping", self._hb_key, *self.addr, time.monotonic() - since)
                os._exit(1)

    def _beat(self) -> None:
        store = job_store(*self.addr, self.store_timeout)
        store.set_timeout(datetime.timedelta(seconds=max(self.hb_timeout * 2, 2.0)))
        n = 0
        while not self._stop.is_set():
            n += 1
            self._call_since = time.monotonic()
            try:
                store.add(self.k(f"alive/{self._hb_key}"), 1)  # a round trip (a set is sent and forgotten)
                self._call_since = None
            except Exception as e:
                if self._stop.is_set():
                    return
                log.error("rank %s: the job's store (node 0, %s:%d) stopped answering (%s): this host has lost node 0; "
                          "stopping", self._hb_key, *self.addr, e)
                os._exit(1)
            if self.rank == 0:
                try:
                    self._watch(store)
                except Exception as e:  # the coordinator's own store is local: not expected
                    log.warning("elastic watcher: %s", e)
            self._stop.wait(self.hb_interval)

    def _age(self, store, key: str) -> float:
        """Seconds since this process last saw alive/<key> change (clocks of other hosts never compared)."""
        full = self.k(f"alive/{key}")
        val = store.get(full) if store.check([full]) else b""
        now = time.monotonic()
        with self._seen_lock:
            prev = self._seen.get(key)
            if prev is None or prev[0] != val:
                self._seen[key] = (val, now)
                return 0.0 if val else now - (prev[1] if prev else now)
            return now - prev[1]

    def lost(self, store, r: int) -> str | None:
        """Why rank r counts as lost (its process ended; its heartbeat stopped), or None."""
        if store.check([self.k(f"exited/{r}")]):
            return f"its engine core exited ({store.get(self.k(f'exited/{r}')).decode()})"
        age = self._age(store, str(r))
        if age > self.hb_timeout:
            return f"no heartbeat for {age:.1f}s"
        return None

    def stop(self) -> None:
        self._stop.set()

    # agreeing on the next generation
    def next_generation(self, target: int, remove: frozenset[int] = frozenset()) -> tuple[list[int], list[int]]:
        """Stop at generation `target - 1` and agree on `target`'s members; returns (members, lost).
        Raises Removed when a planned change leaves this rank out, ElasticError when the coordinator
        is gone or left this rank out as lost."""
        with self._phase_lock:
            self.build_since = None
            self._reconnect_if_shut()
        self.store.set(self.k(f"g{target}/here/{self.rank}"), "1")
        if self.rank == 0:
            members, lost = self._decide(target, remove)
            self.store.set(self.k(f"g{target}/members"), json.dumps({"members": members, "lost": lost,
                                                                     "removed": sorted(remove)}))
        key = self.k(f"g{target}/members")
        deadline = time.monotonic() + self.settle_timeout * 3 + self.hb_timeout
        while not self.store.check([key]):
            if self.rank != 0:
                why = self.lost(self.store, 0)
                if why is not None:
                    raise ElasticError(f"rank 0 (the front end's host) is lost ({why}): an elastic job ends with it")
            if time.monotonic() > deadline:
                raise ElasticError(f"rank 0 did not name generation {target}'s members within "
                                   f"{deadline - time.monotonic() + self.settle_timeout * 3 + self.hb_timeout:.0f}s")
            time.sleep(0.02)
        got = json.loads(self.store.get(key))
        if self.rank in got["removed"]:
            raise Removed(f"rank {self.rank} leaves the job (a planned scale-down to {len(got['members'])} ranks)")
        if self.rank not in got["members"]:
            raise ElasticError(f"rank {self.rank} was counted as lost by generation {target} (it did not regroup in "
                               "time); it stops")
        self.generation, self.members = target, got["members"]
        return got["members"], got["lost"]

    def wait_to_join(self, timeout_s: float) -> tuple[int, int, list[int]]:
        """A replacement: ask to join and wait for the coordinator's answer at its next step
        boundary; returns (rank id, generation, members)."""
        j = self.store.add(self.k("join_count"), 1)
        self.start_heartbeat(f"j{j}")
        log.info("asked to join the elastic job at %s:%d (join request %d); waiting for a step boundary", *self.addr, j)
        key = self.k(f"join/{j}/assigned")
        deadline = time.monotonic() + timeout_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise ElasticError(f"the job at {self.addr[0]}:{self.addr[1]} did not admit this replacement within "
                                   f"{timeout_s:.0f}s (is it running with --enable-elastic-ep?)")
            time.sleep(0.05)
        got = json.loads(self.store.get(key))
        if "error" in got:
            raise ElasticError(f"the job refused this replacement: {got['error']}")
        self.rank, target = got["rank"], got["generation"]
        self.start_heartbeat(str(self.rank))
        members_key = self.k(f"g{target}/members")
        self.store.wait([members_key], datetime.timedelta(seconds=self.store_timeout))
        self.generation, self.members = target, json.loads(self.store.get(members_key))["members"]
        return self.rank, target, self.members

    def publish_info(self, info) -> None:
        import msgspec

        self.store.set(self.k(f"g{self.generation}/info/{self.rank}"), msgspec.json.encode(info))

    def infos(self) -> list:
        import msgspec

        from moe_serve.protocol import RankInfo

        keys = [self.k(f"g{self.generation}/info/{r}") for r in self.members]
        self.store.wait(keys, datetime.timedelta(seconds=self.store_timeout))
        return [msgspec.json.decode(self.store.get(key), type=RankInfo) for key in keys]
