"""Elastic expert parallelism (`--enable-elastic-ep`): a job that loses a rank, or a node, regroups
on the ranks left and goes on serving; a replacement started with `--elastic-join` joins back.

Processes. torchrun's agent stops every worker of a node when one of them fails, so under elastic
EP the torchrun worker does not run the engine core itself: it supervises a child process that
does (`supervise`). When a non-zero rank's core dies the worker records it in the job's store and
exits 0, so the agent leaves the node's other ranks running; when rank 0's core dies (it hosts the
front end) the worker fails and torchrun ends the job, with the reason logged.

Membership, in the job's key-value store (torchrun's, on node 0), under `moe_serve/elastic/`:
  alive/<rank>          a heartbeat every `heartbeat_interval` seconds from each core;
  exited/<rank>         written by a rank's supervisor the moment its core process ends;
  g<G>/here/<rank>      a survivor has stopped serving generation G - 1 and waits for G's members;
  g<G>/members          written by rank 0 (the coordinator): the ranks of generation G, in EP-rank order;
  g<G>/info/<rank>      each member's host, pid and expert slots once its core is rebuilt;
  join/<n>              a replacement waiting to join (it heartbeats as alive/j<n>);
  frontend              the front end's ZMQ addresses, for every core and every replacement.
Ranks keep the id they started with (a replacement takes the lowest free one) for the life of the
job: the front end addresses cores by it. The EP rank of generation G is the index in its member list.

Failure. A rank is lost when its core process ends (its supervisor records it at once) or its
heartbeat stops for `--elastic-heartbeat-timeout` (its host went silent). A slow rank is not lost:
every member watches the others (`Membership._watch_members`), and a rank that has waited in one
step for `--elastic-timeout` asks the membership about them; while every heartbeat beats it goes on
waiting (a long prefill chunk), up to `--dist-timeout` (the collectives' own timeout while serving:
a rank alive but hung). When a member is lost it ends its own wait (`interrupt_groups`): NCCL's
communicators are aborted, gloo's connections shut down. On gloo a dead process also resets its
connections at once. NCCL runs with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 in every core (`core_env`),
so that a failed or aborted collective raises in the survivor rather than ending its process.
Every survivor then leaves its step, says it is here for the next generation,
and waits; the coordinator waits until every member of the old generation is either here or lost
(its supervisor recorded its exit, or its heartbeat stopped for `--elastic-heartbeat-timeout`), adds
any replacement waiting to join, and writes the new members. They form new process groups under a
new store prefix (torch.distributed cannot shrink a gloo group; the old groups are aborted and
destroyed), and each rebuilds its engine core for the new EP size: every logical expert is placed
again over the members (default placement, with replicas where the slots do not divide evenly),
its weights read from the checkpoint, DeepEP's buffers and CUDA graphs made again, the KV cache
sized again. The coordinator then tells the front end, which resubmits every request in flight
with the tokens it has already streamed (recomputed, so greedy text is unchanged). A failure
during any of this (a second rank lost while regrouping) starts the next generation the same way.

Planned changes (a replacement waiting, `POST /scale_elastic_ep`) are agreed at a step boundary in
the per-turn all-reduce (core_proc.CoreLoop), and then follow the same path.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable

log = logging.getLogger("moe_serve.elastic")

PREFIX = "moe_serve/elastic/"
ENV_CORE = "MOE_SERVE_ELASTIC_CORE"  # set by the supervisor in its engine-core child
ENV_STALL = "MOE_SERVE_ELASTIC_STALL"  # tests: "<rank>:<seconds>", that rank sleeps once inside a step
# TORCH_NCCL_ASYNC_ERROR_HANDLING, read by each NCCL process group when it is made: 0 no handling
# (a collective on a dead peer waits for ever), 1 abort the communicators and tear the process down
# (torchrun exports 1 to every worker), 2 abort the communicators only (the error reaches the
# caller: the survivor regroups), 3 tear down without aborting.
NCCL_ASYNC_ERROR_HANDLING = "2"


def core_env(environ: dict[str, str]) -> dict[str, str]:
    """The environment of an elastic engine core: the supervisor's, with the core's marker and the
    NCCL error handling a regroup needs (NCCL_ASYNC_ERROR_HANDLING: CleanUpOnly), whatever torchrun
    or the user set."""
    return dict(environ, **{ENV_CORE: "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": NCCL_ASYNC_ERROR_HANDLING})


class ElasticError(RuntimeError):
    """Ends this rank (or, for rank 0, the job) with a message that names why."""


class Removed(Exception):
    """This rank is not a member of the next generation by plan (a scale-down): it exits cleanly."""


def add_elastic_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("elastic expert parallelism")
    g.add_argument("--enable-elastic-ep", action="store_true",
                   help="keep serving when a rank or a node is lost: the survivors regroup, re-place every expert "
                        "over themselves and resubmit the lost rank's requests (torchrun jobs)")
    g.add_argument("--elastic-join", default=None, metavar="HOST:PORT",
                   help="start a replacement rank that joins a running elastic job through its store (node 0's "
                        "MASTER_ADDR:MASTER_PORT); takes the lowest free rank id")
    g.add_argument("--elastic-timeout", type=float, default=5.0,
                   help="elastic EP: seconds a rank waits in one step before it asks the membership about the peers "
                        "it waits on: one whose core exited or whose heartbeat stopped is lost and the wait ends; "
                        "one whose heartbeat beats (a long prefill chunk) is waited for, up to --dist-timeout")
    g.add_argument("--elastic-heartbeat-timeout", type=float, default=3.0,
                   help="elastic EP: seconds without a heartbeat after which a rank counts as lost")


def check_elastic_args(ns: argparse.Namespace) -> None:
    if ns.elastic_join and not ns.enable_elastic_ep:
        raise ValueError("--elastic-join needs --enable-elastic-ep (the job it joins must be elastic)")
    if not ns.enable_elastic_ep:
        return
    for flag in ("elastic_timeout", "elastic_heartbeat_timeout"):
        if not getattr(ns, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')}={getattr(ns, flag)} must be > 0")
    if getattr(ns, "disaggregation_mode", "none") != "none":
        raise ValueError("--enable-elastic-ep with --disaggregation-mode is not supported: a regroup would drop the "
                         "KV transfers in flight")
    if ns.elastic_join:
        host, _, port = ns.elastic_join.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--elastic-join={ns.elastic_join!r} is not HOST:PORT (node 0's store)")


def is_collective_failure(e: BaseException) -> bool:
    """Whether an exception is a peer's loss seen through a collective (gloo, NCCL, the store)."""
    import torch.distributed as dist

    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in (
        "gloo", "Gloo", "NCCL", "Connection closed by peer", "Connection reset", "Timed out", "timed out",
        "Socket Timeout", "Broken pipe"))


# --- the torchrun worker: supervisor of the engine-core process ----------------------------------
def supervise(argv: list[str]) -> int:
    """Run this rank's engine core as a child (the same command, ENV_CORE set) and wait for it."""
    rank = int(os.environ.get("RANK", "0"))
    env = core_env(dict(os.environ))
    _become_subreaper()
    child = subprocess.Popen([sys.executable, "-m", "launcher", *argv], env=env)
    log.info("rank %d: elastic EP: the engine core runs in process %d (this process, pid %d, supervises it)", rank,
             child.pid, os.getpid())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: child.send_signal(s))
    rc = child.wait()
    _reap_orphans(rank)
    try:
        store = job_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 5.0)
        store.set(f"{PREFIX}exited/{rank}", str(rc))
    except Exception as e:  # node 0 is gone: the job is ending anyway
        log.warning("rank %d: could not record the core's exit in the store: %s", rank, e)
    how = f"signal {-rc}" if rc < 0 else f"code {rc}"
    if rank == 0:
        if rc != 0:
            log.error("rank 0's engine core exited with %s: rank 0 hosts the front end, and an elastic job cannot "
                      "lose it; the job ends", how)
        return rc if rc >= 0 else 128 - rc
    if rc != 0:
        log.warning("rank %d's engine core exited with %s; the other ranks go on without it (elastic EP)", rank, how)
    return 0


def _become_subreaper() -> None:
    """Linux: what the core starts (rank 0's front end) and leaves behind when it dies is
    re-parented to this supervisor, not to init, so that _reap_orphans can wait for it: the
    worker must not end, and torchrun report the job's end, while a process of it still runs."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _reap_orphans(rank: int, timeout_s: float = 5.0) -> None:
    """Wait for the core's orphans (the front end dies with its parent: launch.py's parent-death
    signal), killing any still there after timeout_s."""
    for kill in (False, True):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return  # none left
            if not pid:
                time.sleep(0.02)
        if kill:
            break
        for d in os.listdir("/proc"):
            try:
                with open(f"/proc/{d}/stat") as f:
                    if d.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                        log.warning("rank %d: killing process %s, left behind by the engine core", rank, d)
                        os.kill(int(d), signal.SIGKILL)
            except (OSError, ValueError, IndexError):
                pass
    log.warning("rank %d: processes left behind by the engine core did not exit", rank)


def job_store(host: str, port: int, timeout_s: float):
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


# --- membership in the job's store ----------------------------------------------------------------
class Membership:
    """This core's view of the job's members, through the store (see the module's docstring)."""

    def __init__(self, host: str, port: int, rank: int | None, heartbeat_timeout_s: float, settle_timeout_s: float,
                 store_timeout_s: float = 30.0, wait_check_s: float = 5.0):
        self.addr = (host, port)
        self.store = job_store(host, port, store_timeout_s)
        self.rank = rank
        self.hb_interval = min(0.5, heartbeat_timeout_s / 4)
        self.hb_timeout = heartbeat_timeout_s
        self.settle_timeout = settle_timeout_s
        self.store_timeout = store_timeout_s
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
        self.wait_check = wait_check_s
        self.on_lost: Callable[[str], None] = lambda why: None
        self._interrupted: int | None = None  # the generation whose wait was ended
        self.group_sockets: set[str] = set()  # the connections of this generation's groups

    def turn_began(self, turn: int) -> None:
        """CoreLoop's on_turn: a new step starts here."""
        self.turn_since = time.monotonic()

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
        """While this core serves: keep every member's heartbeat age fresh; once a step has lasted
        `wait_check` seconds, a member whose core exited or whose heartbeat stopped is lost, and
        `on_lost` ends this core's wait (at most once per generation). A member that is merely
        slow is waited for. Its own store client and thread: the wait it ends may take a moment,
        and the heartbeat must go on meanwhile."""
        store = None
        while not self._stop.wait(self.hb_interval):
            since, gen, members = self.turn_since, self.generation, list(self.members)
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
            if not lost or waited < self.wait_check or self.turn_since != since or self.generation != gen:
                continue
            why = "; ".join(f"rank {r} is lost ({w})" for r, w in lost)
            log.warning("rank %s: waited %.1fs in this step (generation %d): %s: ending the wait", self.rank, waited,
                        gen, why)
            self._interrupted = gen
            try:
                self.on_lost(why)
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

    def _watch(self, store) -> None:
        """Coordinator: refresh every member's heartbeat age, and notice replacements waiting."""
        for r in self.members:
            self._age(store, str(r))
        waiting = store.add(self.k("join_count"), 0)
        if waiting > self._joiners_handled:
            self.on_joiner()

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

    def _decide(self, target: int, remove: frozenset[int]) -> tuple[list[int], list[int]]:
        """Coordinator: wait until every old member is here or lost; add replacements waiting."""
        store = self.store
        deadline = time.monotonic() + self.settle_timeout
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
                            target, pending, self.settle_timeout)
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


# --- process groups of one generation ---------------------------------------------------------------
def form_groups(m: Membership, backend: str, device, timeout_s: float, build_timeout_s: float):
    """The world and control groups of m's generation, over a store prefix of their own. Every
    member is waiting for the member list, so they meet within timeout_s (a member lost after it
    was named fails the generation that soon); the groups' collectives then wait up to
    build_timeout_s while the cores are rebuilt."""
    import torch
    import torch.distributed as dist

    from expert_parallel.runtime.groups import ProcessGroups

    n, rank = len(m.members), m.members.index(m.rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    if n == 1:
        m.group_sockets = set()
        return ProcessGroups(0, 1, int(os.environ.get("LOCAL_RANK", "0")), None, None, device)
    store = dist.PrefixStore(m.k(f"g{m.generation}/pg"), m.store)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    before = _socket_inodes()
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=n, timeout=timeout, **kwargs)
    cpu = dist.new_group(ranks=list(range(n)), backend="gloo", timeout=timeout)
    m.group_sockets = _socket_inodes() - before  # the groups' connections (what interrupt_groups shuts)
    groups = ProcessGroups(rank, n, int(os.environ.get("LOCAL_RANK", "0")), dist.group.WORLD, cpu,
                         device if device.type == "cuda" else torch.device("cpu"))
    set_timeout(groups, build_timeout_s)
    return groups


def group_settings(groups) -> dict:
    """What this core's groups run with, read back from them: each group's backend and timeout,
    and the NCCL error handling in this process's environment (read when an NCCL group is made)."""
    import torch

    out = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")}
    if groups.world_size == 1:
        return out
    for name, g in (("ep_group", groups.ep_group), ("cpu_group", groups.cpu_group)):
        dev = torch.device("cuda") if name == "ep_group" and groups.device.type == "cuda" else torch.device("cpu")
        b = g._get_backend(dev)
        out[name] = {"backend": b.name(), "timeout_s": b.options._timeout.total_seconds()}
    return out


def _socket_inodes() -> set[str]:
    """The socket inodes of this process's open descriptors ("socket:[N]")."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out.add(link)
    return out


def interrupt_groups(group_sockets: set[str], store_addr: tuple[str, int]) -> int:
    """End the collective this process waits in, from another thread, after a member was lost:
    NCCL communicators are aborted (ncclCommAbort makes their kernels return; with
    TORCH_NCCL_ASYNC_ERROR_HANDLING=2 the error reaches the caller), and the connections the
    groups opened are shut down: gloo's abort does not end an operation in progress (torch 2.13),
    a closed connection does, as a dead peer's does. The job's store connections are left alone.
    Returns the number of connections shut down."""
    import torch

    if torch.cuda.is_available():
        import torch.distributed as dist

        if dist.is_initialized():
            from torch.distributed.distributed_c10d import _world

            for pg in list(_world.pg_map):
                try:
                    pg._get_backend(torch.device("cuda")).abort()
                except Exception:  # a gloo group: no CUDA backend
                    pass
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") not in group_sockets:
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.getpeername()[1] != store_addr[1]:
                s.shutdown(socket.SHUT_RDWR)  # (the duplicate shares the connection)
                n += 1
        except OSError:  # a listening socket, or closed meanwhile
            pass
        finally:
            s.close()
    return n


def set_timeout(groups, timeout_s: float) -> None:
    """The collective timeout while serving: short, so a silent host is noticed within it."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    if groups.world_size == 1:
        return
    for g in (groups.ep_group, groups.cpu_group):
        try:
            _set_pg_timeout(datetime.timedelta(seconds=timeout_s), g)
        except Exception as e:  # a backend without it keeps its timeout
            log.warning("could not set the collective timeout to %gs: %s", timeout_s, e)


def drop_groups() -> None:
    """Abort and destroy every process group of this process (after a peer's loss, or to regroup)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    from torch.distributed.distributed_c10d import _world

    for pg in list(_world.pg_map):
        for dev in ("cpu", "cuda"):
            try:
                pg._get_backend(torch.device(dev)).abort()
            except Exception:
                pass
    try:
        dist.destroy_process_group()
    except Exception as e:
        log.warning("destroying the old process groups: %s", e)


def elastic_config(args, rank: int, world_size: int):
    """The engine config for EP rank `rank` of `world_size`: a placement file made for another
    size is dropped (the default placement, with replicas where the slots do not divide evenly),
    and EPLB's redundant slots grow to the next multiple of the size."""
    import dataclasses

    from moe_serve.models.registry import num_logical_experts

    cfg = args.create_engine_config(rank, world_size) if args.expert_placement is None else None
    if cfg is None:
        saved, args.expert_placement = args.expert_placement, None
        try:
            cfg = args.create_engine_config(rank, world_size)
        finally:
            args.expert_placement = saved
        log.info("elastic EP: the expert placement file %s is not used after a regroup (default placement over "
                 "%d ranks)", saved, world_size)
    par = cfg.parallel
    if par.eplb is not None:
        E = num_logical_experts(cfg.model.architecture, cfg.model.hf)
        slots = -(-(E + par.eplb.num_redundant_experts) // world_size) * world_size
        eplb = dataclasses.replace(par.eplb, num_redundant_experts=slots - E)
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(par, eplb=eplb))
    return cfg


def release_core(loop) -> None:
    """Drop a core's model, cache and threads so the rebuilt one has the memory."""
    core = loop.core
    loop.core = None
    if core is not None:
        for part in (core.grammars.shutdown, core.eplb.close if core.eplb is not None else None):
            try:
                part and part()
            except Exception as e:
                log.warning("releasing the old engine core: %s", e)
    del core
    gc.unfreeze()
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass


def host_name() -> str:
    return socket.gethostname()


# --- the engine-core process of an elastic rank -------------------------------------------------------
def run_core(ns: argparse.Namespace, serve_argv: list[str]) -> int:
    """One rank's engine core through every generation it is a member of; returns its exit code."""
    from launcher import network
    from launcher.worker import agree_max_model_len
    from moe_serve import platform
    from moe_serve.engine.args import EngineArgs
    from moe_serve.engine.core import build_engine
    from moe_serve.engine.core_proc import CoreLoop, Regroup, install_signal_handlers
    from moe_serve.entrypoints.cli import resolve_model
    from moe_serve.entrypoints.openai.launch import spawn_frontend
    from moe_serve.protocol import ElasticChange, RankInfo

    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where every thread is, for an operator
    # Before any NCCL group is made (a replacement runs its core in the torchrun worker itself, not
    # under supervise(), so its environment is torchrun's).
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_ASYNC_ERROR_HANDLING
    dev = platform.resolve_device(ns.device)
    if dev.type == "cuda" and dev.index is None:  # one GPU per rank, as torchrun numbers them on a node
        import torch

        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)  # before any NCCL call: a communicator binds the current device
    backend = platform.dist_backend(dev)
    if ns.elastic_join:
        master, _, port_s = ns.elastic_join.rpartition(":")
        master, port = master.strip("[]"), int(port_s)
    else:
        if "MASTER_ADDR" not in os.environ or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            raise ValueError("--enable-elastic-ep runs under torchrun (moe-serve launch), whose store on node 0 "
                             "holds the job's membership; a replacement joins with --elastic-join HOST:PORT")
        master, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    ep = network.choose_endpoint(master, port, ns.dist_interface)
    network.apply(ep)
    network.wait_reachable(master, port, ep, ns.dist_join_timeout)
    settle = ns.elastic_timeout + ns.elastic_heartbeat_timeout + 2.0
    m = Membership(master, port, None if ns.elastic_join else int(os.environ["RANK"]), ns.elastic_heartbeat_timeout,
                   settle, max(ns.dist_join_timeout, 30.0), wait_check_s=ns.elastic_timeout)

    def end_wait(why: str) -> None:
        n = interrupt_groups(m.group_sockets, m.addr)
        log.info("rank %s: aborted this generation's communicators and shut %d of its connections", m.rank, n)

    m.on_lost = end_wait
    if ns.elastic_join:
        rank, gen, members = m.wait_to_join(ns.dist_join_timeout)
        m.full_size = int(json.loads(m.store.get(m.k("frontend")))["world"])
        log.info("joined as rank %d of generation %d (members %s)", rank, gen, members)
    else:
        rank, gen, members = m.rank, 0, list(range(int(os.environ["WORLD_SIZE"])))
        m.generation, m.members, m.full_size = gen, members, len(members)
        m.start_heartbeat(str(rank))
    path, _ = resolve_model(ns.model)
    args = EngineArgs.from_cli(ns, path)
    args.show_progress = rank == 0
    frontend = None
    if rank == 0 and gen == 0:
        multi_node = int(os.environ.get("LOCAL_WORLD_SIZE", m.full_size)) != m.full_size
        host = ep.address if multi_node else "127.0.0.1"
        frontend, in_ports, out_port = spawn_frontend(serve_argv + ["--model", path], m.full_size, host)
        m.store.set(m.k("frontend"), json.dumps({"host": host, "in": in_ports, "out": out_port,
                                                 "world": m.full_size}))
    m.store.wait([m.k("frontend")], datetime.timedelta(seconds=max(ns.dist_join_timeout, 30.0)))
    a = json.loads(m.store.get(m.k("frontend")))
    loop, lost, reason, t_fail = None, [], "", None
    remove: frozenset[int] = frozenset()
    peer_alive = (lambda: frontend.poll() is None) if frontend is not None else (lambda: True)
    try:
        while True:
            try:
                groups = form_groups(m, backend, dev, settle if m.generation else max(ns.dist_timeout, 30.0),
                                     max(ns.dist_timeout, 30.0))
                log.info("generation %d: rank %d is EP rank %d of %d (pid %d, members %s)", m.generation, rank,
                         groups.rank, groups.world_size, os.getpid(), m.members)
                cfg = elastic_config(args, groups.rank, groups.world_size)
                sockets = _socket_inodes()
                core = build_engine(cfg, groups.ep_group, show_progress=rank == 0 and m.generation == 0)
                m.group_sockets |= _socket_inodes() - sockets  # groups the engine made (EPLB's transfers)
                _stall_for_tests(core, rank)
                if groups.world_size > 1:
                    agree_max_model_len(core, groups.cpu_group)
                m.publish_info(RankInfo(rank, host_name(), os.getpid(), core.moe_ctx.dispatcher.slots_per_rank))
                if groups.world_size > 1:
                    import torch.distributed as dist

                    dist.barrier(group=groups.cpu_group)
                # While serving, a collective waits for a slow peer whose heartbeat beats up to
                # --dist-timeout (a rank hung that long counts as lost); a lost one ends the wait
                # sooner (Membership._watch_members).
                set_timeout(groups, max(ns.dist_timeout, ns.elastic_timeout))
                log.info("generation %d: rank %d's groups: %s", m.generation, rank, json.dumps(group_settings(groups)))
            except Exception as e:
                if (m.generation == 0 and not ns.elastic_join) or not is_collective_failure(e):
                    raise
                log.warning("generation %d failed to form (%s): regrouping again", m.generation, _first_line(e))
                drop_groups()
                core = None  # (the loop's reference goes in release_core: the rebuilt core gets the memory)
                if loop is not None:
                    release_core(loop)
                t_fail = t_fail or time.monotonic()
                members, more = m.next_generation(m.generation + 1)
                lost = sorted(set(lost) | set(more))
                continue
            if loop is None:
                loop = CoreLoop(core, rank, groups.world_size, network.url(a["host"], a["in"][rank]),
                                network.url(a["host"], a["out"]), groups.cpu_group, on_turn=m.turn_began,
                                peer_alive=peer_alive)
                install_signal_handlers(loop)
                loop.elastic, loop.generation = True, m.generation
                loop.ready(announce=m.generation == 0 and not ns.elastic_join)
            else:
                loop.rebind(core, groups.world_size, groups.cpu_group, m.generation)
            if rank == 0:
                m.on_joiner = loop.ask_regroup
                if m.generation > 0:
                    seconds = time.monotonic() - t_fail if t_fail else 0.0
                    log.info("generation %d serving on %d ranks %s, %.2fs after %s", m.generation, len(m.members),
                             m.members, seconds, reason)
                    loop.send(ElasticChange(m.generation, "serving", m.infos(), lost, reason, seconds,
                                            core.max_model_len))
            lost, reason, t_fail, remove = [], "", None, frozenset()
            try:
                rc = loop.run()
                break
            except Regroup as r:
                m.turn_since = None
                t_fail, reason = time.monotonic(), r.reason
                if r.size is not None:
                    remove = frozenset(sorted(m.members, reverse=True)[:max(0, len(m.members) - r.size)])
                log.info("generation %d: %s: regrouping at this step", m.generation, reason)
            except Exception as e:
                m.turn_since = None
                if not is_collective_failure(e):
                    raise
                t_fail, reason = time.monotonic(), f"a collective failed ({_first_line(e)})"
                log.warning("generation %d: %s: a rank is lost; regrouping", m.generation, reason)
            if rank == 0:
                loop.send(ElasticChange(m.generation + 1, "recovering", reason=reason))
            drop_groups()
            core = None
            release_core(loop)
            members, lost = m.next_generation(m.generation + 1, remove)
        if rank == 0 and args.expert_load_record:
            loop.core.dump_load(args.expert_load_record)
        loop.close()
        if frontend is not None:
            from launcher.worker import _wait

            rc = rc or _wait(frontend)
        return rc
    except Removed as e:
        log.info("%s", e)
        if loop is not None:
            loop.close()
        return 0
    except Exception as e:
        if loop is not None:
            loop.fatal(e)
        raise
    finally:
        m.stop()
        if frontend is not None and frontend.poll() is None:
            frontend.terminate()
            from launcher.worker import _wait

            _wait(frontend)


def _stall_for_tests(core, rank: int) -> None:
    """ENV_STALL="<rank>:<seconds>" (tests): that rank sleeps once, inside its first step with
    tokens, while its heartbeat goes on: a slow rank, as a long prefill chunk makes one."""
    spec = os.environ.get(ENV_STALL)
    if not spec or int(spec.split(":")[0]) != rank:
        return
    seconds, execute = float(spec.split(":")[1]), core.execute

    def stalled(sched, *args, **kwargs):
        if sched.num_batched_tokens > 0 and core.execute is stalled:
            core.execute = execute
            os.environ.pop(ENV_STALL, None)  # once in this process's life, not once per generation
            log.warning("rank %d: stalling %.1fs inside this step (%s)", rank, seconds, ENV_STALL)
            time.sleep(seconds)
        return execute(sched, *args, **kwargs)

    core.execute = stalled


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__
