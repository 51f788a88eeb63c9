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
during any of this (a second rank lost while regrouping) starts the next generation the same way;
a survivor waiting on the lost rank while its core is rebuilt (in the rendezvous of a group the
engine makes, a wait in the store) is woken by its watcher as in a step: its store connection is
shut down with the groups', and it reconnects for the next generation.

Planned changes (a replacement waiting, `POST /scale_elastic_ep`) are agreed at a step boundary in
the per-turn all-reduce (core_proc.CoreLoop), and then follow the same path.

Code. The engine-core process runs the one rank path (launcher/rank.py `run_rank`), with
`ElasticGenerations` (here) as its layer of generations; the membership in the store is
launcher/membership.py, each generation's process groups launcher/process_groups.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

from launcher import network
from launcher.membership import PREFIX, Membership, job_store
from launcher.process_groups import (drop_groups, form_groups, group_settings, interrupt_groups, set_timeout,
                                     socket_inodes)
from launcher.rank import Generations, agree_max_model_len

log = logging.getLogger("moe_serve.elastic")

ENV_CORE = "MOE_SERVE_ELASTIC_CORE"  # set by the supervisor in its engine-core child
ENV_STALL = "MOE_SERVE_ELASTIC_STALL"  # tests: "<rank>:<seconds>", that rank sleeps once inside a step
ENV_DIE_IN_BUILD = "MOE_SERVE_ELASTIC_DIE_IN_BUILD"  # tests: "<rank>:<generation>", it dies building that one
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


# --- the engine-core process of an elastic rank: the generations of run_rank ----------------------
class ElasticGenerations(Generations):
    """The job's generations from its membership in the store: generation 0 is the ranks torchrun
    started (or, for a replacement, the one it is admitted to); a lost member, a replacement waiting
    or a planned change of size ends one at a step boundary, and the survivors form the next."""

    def __init__(self, ns: argparse.Namespace):
        super().__init__(ns)
        self.m: Membership | None = None
        self.settle = ns.elastic_timeout + ns.elastic_heartbeat_timeout + 2.0
        self.device = self.backend = None
        # Why the generation being formed began: the ranks lost, the reason, when the old one failed,
        # and the ranks a planned change of size leaves out.
        self.lost: list[int] = []
        self.reason, self.t_fail, self.remove = "", None, frozenset()
        from moe_serve.engine.features.regroup import Regrouping

        self.regrouping = Regrouping()  # a replacement waiting or a "scale" call: regroup at a turn

    def loop_features(self) -> list:
        return [self.regrouping]

    def join(self) -> None:
        """Reach node 0's store from this rank's address, join the membership (a replacement: wait
        to be admitted) and start the heartbeat."""
        import faulthandler

        from moe_serve import platform

        ns = self.ns
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # where every thread is, for an operator
        # Before any NCCL group is made (a replacement runs its core in the torchrun worker itself, not
        # under supervise(), so its environment is torchrun's).
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_ASYNC_ERROR_HANDLING
        dev = platform.resolve_device(ns.device)
        if dev.type == "cuda" and dev.index is None:  # one GPU per rank, as torchrun numbers them on a node
            import torch

            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(dev)  # before any NCCL call: a communicator binds the current device
        self.device, self.backend = dev, platform.dist_backend(dev)
        if ns.elastic_join:
            master, _, port_s = ns.elastic_join.rpartition(":")
            master, port = master.strip("[]"), int(port_s)
        else:
            if "MASTER_ADDR" not in os.environ or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
                raise ValueError("--enable-elastic-ep runs under torchrun (moe-serve launch), whose store on node 0 "
                                 "holds the job's membership; a replacement joins with --elastic-join HOST:PORT")
            master, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.endpoint = ep = network.choose_endpoint(master, port, ns.dist_interface)
        network.apply(ep)
        network.wait_reachable(master, port, ep, ns.dist_join_timeout)
        self.m = m = Membership(master, port, None if ns.elastic_join else int(os.environ["RANK"]),
                                ns.elastic_heartbeat_timeout, self.settle, max(ns.dist_join_timeout, 30.0),
                                wait_check_s=ns.elastic_timeout)

        def end_wait(why: str, sockets: set[str]) -> None:
            n = interrupt_groups(sockets, m.addr, m.store_sockets)
            log.info("rank %s: aborted this generation's communicators and shut %d of its connections", m.rank, n)

        m.on_lost = end_wait
        if ns.elastic_join:
            rank, gen, members = m.wait_to_join(ns.dist_join_timeout)
            m.full_size = int(json.loads(m.store.get(m.k("frontend")))["world"])
            log.info("joined as rank %d of generation %d (members %s)", rank, gen, members)
        else:
            rank, members = m.rank, list(range(int(os.environ["WORLD_SIZE"])))
            m.generation, m.members, m.full_size = 0, members, len(members)
            m.start_heartbeat(str(rank))
        self.rank = rank

    @property
    def generation(self) -> int:
        return self.m.generation if self.m is not None else 0

    def form(self):
        m, ns = self.m, self.ns
        m.build_began()  # until serving(): a member lost meanwhile ends this core's waits
        groups = form_groups(m, self.backend, self.device, self.settle if m.generation else max(ns.dist_timeout, 30.0),
                             max(ns.dist_timeout, 30.0))
        log.info("generation %d: rank %d is EP rank %d of %d (pid %d, members %s)", m.generation, self.rank,
                 groups.rank, groups.world_size, os.getpid(), m.members)
        return groups

    def engine_config(self, args, groups):
        self.cfg = elastic_config(args, groups.rank, groups.world_size)
        return self.cfg

    def share_frontend(self, start) -> tuple:
        """Rank 0 of generation 0 starts the front end and writes its addresses in the store, where
        every core, replacements too, reads them."""
        m, frontend = self.m, None
        if self.rank == 0 and m.generation == 0:
            multi_node = int(os.environ.get("LOCAL_WORLD_SIZE", m.full_size)) != m.full_size
            host = self.endpoint.address if multi_node else "127.0.0.1"
            frontend, addrs = start(m.full_size, host)
            m.store.set(m.k("frontend"), json.dumps({**addrs, "world": m.full_size}))
        m.store.wait([m.k("frontend")], datetime.timedelta(seconds=max(self.ns.dist_join_timeout, 30.0)))
        return frontend, json.loads(m.store.get(m.k("frontend")))

    def build(self, cfg, groups):
        from moe_serve.engine.core import build_engine
        from moe_serve.protocol import RankInfo

        m, rank = self.m, self.rank
        if os.environ.get(ENV_DIE_IN_BUILD) == f"{rank}:{m.generation}":
            log.warning("rank %d: dying while generation %d is built (%s)", rank, m.generation, ENV_DIE_IN_BUILD)
            os.kill(os.getpid(), signal.SIGKILL)
        sockets = socket_inodes()
        core = build_engine(cfg, groups.ep_group, show_progress=rank == 0 and m.generation == 0)
        m.group_sockets |= socket_inodes() - sockets  # groups the engine made (EPLB's transfers)
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
        set_timeout(groups, max(self.ns.dist_timeout, self.ns.elastic_timeout))
        log.info("generation %d: rank %d's groups: %s", m.generation, rank, json.dumps(group_settings(groups)))
        return core

    def on_turn(self, turn: int) -> None:
        self.m.turn_began(turn)

    def serving(self, loop, core, first: bool) -> None:
        from moe_serve.protocol import ElasticChange

        m = self.m
        m.build_ended()
        if first:
            loop.generation = m.generation
            loop.ready(announce=m.generation == 0 and not self.ns.elastic_join)
        if self.rank == 0:
            m.on_joiner = self.regrouping.ask
            if m.generation > 0:
                seconds = time.monotonic() - self.t_fail if self.t_fail else 0.0
                log.info("generation %d serving on %d ranks %s, %.2fs after %s", m.generation, len(m.members),
                         m.members, seconds, self.reason)
                loop.send(ElasticChange(m.generation, "serving", m.infos(), self.lost, self.reason, seconds,
                                        core.max_model_len))
        self.lost, self.reason, self.t_fail, self.remove = [], "", None, frozenset()

    def regroup(self, e: BaseException, loop, serving: bool) -> bool:
        """Start the next generation after a loss or an agreed change; False for any other error
        (and for a failure to form generation 0: the job never started)."""
        if not serving:
            return self._form_again(e, loop)
        from moe_serve.engine.features.regroup import Regroup
        from moe_serve.protocol import ElasticChange

        m = self.m
        m.turn_since = None
        if isinstance(e, Regroup):
            self.t_fail, self.reason = time.monotonic(), e.reason
            if e.size is not None:
                self.remove = frozenset(sorted(m.members, reverse=True)[:max(0, len(m.members) - e.size)])
            log.info("generation %d: %s: regrouping at this step", m.generation, self.reason)
        elif is_collective_failure(e):
            self.t_fail, self.reason = time.monotonic(), f"a collective failed ({_first_line(e)})"
            log.warning("generation %d: %s: a rank is lost; regrouping", m.generation, self.reason)
        else:
            return False
        if self.rank == 0:
            loop.send(ElasticChange(m.generation + 1, "recovering", reason=self.reason))
        drop_groups()
        release_core(loop)
        _, self.lost = m.next_generation(m.generation + 1, self.remove)
        return True

    def _form_again(self, e: BaseException, loop) -> bool:
        """A generation failed to form (a member lost meanwhile): the next one, the same way."""
        m = self.m
        if (m.generation == 0 and not self.ns.elastic_join) or not is_collective_failure(e):
            return False
        log.warning("generation %d failed to form (%s): regrouping again", m.generation, _first_line(e))
        drop_groups()
        if loop is not None:
            release_core(loop)
        self.t_fail = self.t_fail or time.monotonic()
        _, more = m.next_generation(m.generation + 1)
        self.lost = sorted(set(self.lost) | set(more))
        return True

    def stop(self) -> None:
        if self.m is not None:
            self.m.stop()

    def close(self, clean: bool) -> None:
        """Nothing to tear down: an elastic core's groups end with its process."""


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
