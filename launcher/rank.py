"""One rank's engine core, from its process groups to its clean exit: the one path every rank of a
torchrun job runs, plain or elastic.

    join the job -> resolve the model -> for each generation of the job's members:
        form the process groups -> the engine config -> (once) rank 0 starts the front end and
        every rank learns its sockets -> build the engine core -> serve it in the CoreLoop
    -> dump the expert load -> close -> wait for the front end -> tear the groups down

A plain run is an elastic run with one fixed generation. `Generations`, here, is that plain run:
the ranks torchrun started meet in their process groups, a watchdog turns a dead or hung rank into
an error, and a failure ends the job. Elastic EP (`launcher/elastic.py`) is a layer over the same
path: it overrides the hooks to form each generation from the job's membership in the store, and
`regroup` to start the next generation when a member is lost or joins.
"""
from __future__ import annotations

import argparse
import json
import logging
import os

from launcher import network
from launcher.frontend import start_frontend, stop_frontend, wait_process
from launcher.network import DistNetworkError

log = logging.getLogger("moe_serve.launcher")


class LeaveJob(Exception):
    """This rank leaves the job by plan (elastic EP's scale-down): it exits cleanly, with code 0."""


class Generations:
    """The job's members as this rank sees them, and how they meet; the hooks `run_rank` calls.

    This base is a plain run: one generation, the ranks torchrun started, formed in `join` (the
    process group is where a plain job meets), never another."""

    def __init__(self, ns: argparse.Namespace):
        self.ns = ns
        self.rank = int(os.environ.get("RANK", "0"))  # the id the front end addresses this core by
        self.groups = None
        self.cfg = None
        self.endpoint = None
        self.watchdog = None

    @property
    def generation(self) -> int:
        """The generation being formed or served: a plain run has only 0."""
        return 0

    def join(self) -> None:
        """Reach the other ranks: this rank's address, then the process groups, then the watchdog."""
        from expert_parallel.runtime.groups import init_process_groups
        from launcher.watchdog import Watchdog
        from moe_serve import platform

        ns = self.ns
        backend = platform.dist_backend(platform.resolve_device(ns.device))
        self.endpoint, peers, watch_store = join_network(ns, backend)
        try:
            groups = init_process_groups(backend, timeout_s=max(ns.dist_timeout * 2, 120))
        except (RuntimeError, dist_errors()) as e:
            if self.endpoint is None:
                raise
            ep, first = self.endpoint, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DistNetworkError(
                f"the {backend} process group did not form: {first}. This rank used {ep.address} on "
                f"{ep.interface} ({ep.why})" + (f"; the ranks' addresses: {network.table_of(peers)}" if peers
                                                else "") +
                ". Every rank must reach every other rank's address: on hosts with several interfaces set "
                "--dist-interface to the one that reaches the other nodes") from None
        self.groups, self.rank = groups, groups.rank
        log.info("rank %d of %d (local rank %d, pid %d, device %s)", groups.rank, groups.world_size,
                 groups.local_rank, os.getpid(), groups.device)
        self.watchdog = Watchdog(groups.rank, groups.world_size, ns.dist_timeout, watch_store)
        ns.device = str(groups.device)

    def form(self):
        """This generation's process groups."""
        return self.groups

    def engine_config(self, args, groups):
        self.cfg = args.create_engine_config(groups.rank, groups.world_size)
        return self.cfg

    def share_frontend(self, start) -> tuple:
        """Rank 0 starts the front end (`start(world_size, bind_host)` -> (process, addresses));
        every rank gets its addresses. Returns (the process or None, the addresses)."""
        world, frontend, addrs = self.groups.world_size, None, None
        if self.rank == 0:
            # The front end binds; every core connects to it, on this node or from the others.
            # On one node the cores reach it on loopback; across nodes, on rank 0's chosen address.
            multi_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world
            host = self.endpoint.address if multi_node and self.endpoint is not None else "127.0.0.1"
            frontend, addrs = start(world, host)
            if multi_node:
                log.info("front end sockets bound on %s (%s), for the cores of every node", host,
                         self.endpoint.interface)
        a = json.loads(broadcast_bytes(json.dumps(addrs).encode() if addrs is not None else None,
                                       self.groups.cpu_group))
        if frontend is not None:  # the watchdog ends this process: the front end goes first
            out_url = network.url(a["host"], a["out"])
            self.watchdog.before_exit = lambda why: stop_frontend(frontend, why, out_url)
        return frontend, a

    def build(self, cfg, groups):
        """This generation's engine core, ready to serve with the other members."""
        from moe_serve.engine.core import build_engine

        core = build_engine(cfg, groups.ep_group, show_progress=self.rank == 0)
        agree_max_model_len(core, groups.cpu_group)
        return core

    def loop_features(self) -> list:
        """The core loop's own step features, which outlive a generation's core: a plain run has none."""
        return []

    def on_turn(self, turn: int) -> None:
        """CoreLoop's on_turn: a step starts."""
        self.watchdog.beat(turn)

    def serving(self, loop, core, first: bool) -> None:
        """The CoreLoop serves this generation's core from now on (first: the loop is new)."""
        log.info("data-parallel attention on %d ranks, experts sharded %d ways (%s dispatch)", loop.world_size,
                 loop.world_size, self.cfg.parallel.all2all_backend)
        loop.ready()
        self.watchdog.start()

    def regroup(self, e: BaseException, loop, serving: bool) -> bool:
        """After `e` ended this generation (serving: while the loop ran; else while it formed):
        True when the next generation has formed and the rank goes on. A plain run has none."""
        return False

    def stop(self) -> None:
        """This rank is done (cleanly or not): stop the threads that watch the other ranks."""
        if self.watchdog is not None:
            self.watchdog.stop()

    def close(self, clean: bool) -> None:
        """Tear the groups down; after a failure the other ranks may be inside a collective: leave
        teardown to the process's exit."""
        from expert_parallel.runtime.groups import destroy_process_groups

        if clean and clean_exit(self.groups):
            destroy_process_groups(self.groups)


def run_rank(ns: argparse.Namespace, serve_argv: list[str], gens: Generations) -> int:
    """Run this rank's engine core through every generation `gens` forms; returns the exit code.
    serve_argv: the serve flags as given, which rank 0 passes on to its front end."""
    from moe_serve.engine.args import EngineArgs
    from moe_serve.engine.core_proc import CoreLoop, install_signal_handlers
    from moe_serve.entrypoints.cli_args import resolve_model

    gens.join()
    # Every rank resolves the model itself (the default one is built under a lock, once per machine),
    # so nodes without a shared filesystem work too.
    path, _ = resolve_model(ns.model)
    args = EngineArgs.from_cli(ns, path)
    args.show_progress = gens.rank == 0
    frontend, a, loop, core, clean = None, None, None, None, False

    def start(world: int, host: str):
        proc, in_ports, out_port = start_frontend(serve_argv + ["--model", path], world, host)
        return proc, {"host": host, "in": in_ports, "out": out_port}

    try:
        while True:
            try:
                groups = gens.form()
                cfg = gens.engine_config(args, groups)
                if a is None:
                    frontend, a = gens.share_frontend(start)
                core = gens.build(cfg, groups)
            except Exception as e:
                core = None  # the rebuilt core gets its memory
                if gens.regroup(e, loop, serving=False):
                    continue
                raise
            first = loop is None
            if first:
                peer_alive = (lambda: frontend.poll() is None) if frontend is not None else (lambda: True)
                loop = CoreLoop(core, gens.rank, groups.world_size, network.url(a["host"], a["in"][gens.rank]),
                                network.url(a["host"], a["out"]), groups.cpu_group, on_turn=gens.on_turn,
                                peer_alive=peer_alive, features=gens.loop_features())
                install_signal_handlers(loop)
            else:
                loop.rebind(core, groups.world_size, groups.cpu_group, gens.generation)
            gens.serving(loop, core, first)
            try:
                rc = loop.run()
                break
            except Exception as e:
                core = None
                if not gens.regroup(e, loop, serving=True):
                    raise
        if gens.rank == 0 and args.expert_load_record:
            loop.core.dump_load(args.expert_load_record)
            log.info("expert load written to %s", args.expert_load_record)
        loop.close()
        if frontend is not None:
            rc = rc or wait_process(frontend)
        clean = True
        return rc
    except LeaveJob as e:
        log.info("%s", e)
        if loop is not None:
            loop.close()
        return 0
    except Exception as e:
        if loop is not None:
            loop.fatal(e)
        raise
    finally:
        gens.stop()
        if frontend is not None and frontend.poll() is None:
            frontend.terminate()
            wait_process(frontend)
        gens.close(clean)


def join_network(ns: argparse.Namespace, backend: str):
    """Choose this rank's address, point gloo/NCCL at it, check that MASTER_ADDR answers from it,
    and (under torchrun) meet every rank in the job's store. Returns (endpoint, every rank's
    endpoint, a store client for the watchdog whose calls time out within --dist-timeout), with
    None for what a one-rank job or a job outside torchrun does not have."""
    import datetime

    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None, None, None
    rank = int(os.environ.get("RANK", "0"))
    master, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    ep = network.choose_endpoint(master, port, ns.dist_interface)
    settings = network.apply(ep)
    log.info("rank %d reaches the other ranks from %s on %s, because %s (%s)", rank, ep.address, ep.interface,
             ep.why, ", ".join(s for s in settings if backend == "nccl" or not s.startswith("NCCL")))
    took = network.wait_reachable(master, port, ep, ns.dist_join_timeout)
    if took > 1:
        log.info("MASTER_ADDR %s:%d answered after %.0fs", master, port, took)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return ep, None, None  # no store runs before the process group does: torch's own timeout bounds the wait
    store = dist.TCPStore(master, port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=max(ns.dist_join_timeout, 1)))
    prefix = (f"moe_serve/net/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/"
              f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    peers = network.meet(store, rank, world, int(os.environ.get("GROUP_RANK", "0")), ep, ns.dist_join_timeout, prefix)
    if rank == 0:
        log.info("every rank joined: %s", network.table_of(peers))
    store.set_timeout(datetime.timedelta(seconds=ns.dist_timeout))
    return ep, peers, dist.PrefixStore(prefix + "/watchdog", store)


def dist_errors() -> type:
    import torch.distributed as dist

    return getattr(dist, "DistError", RuntimeError)


def broadcast_bytes(data: bytes | None, group, src: int = 0) -> bytes:
    """Rank src's bytes on every rank (two broadcasts over the CPU group: size, then bytes)."""
    import torch
    import torch.distributed as dist

    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None else \
        torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return buf.numpy().tobytes()


def agree_max_model_len(core, group) -> int:
    """Every rank serves the same context limit: the smallest any rank's KV cache allows."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([core.max_model_len], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    core.set_max_model_len(int(t))
    return int(t)


def clean_exit(groups) -> bool:
    """Meet every rank before tearing the groups down: one rank destroying its communicator while
    another still uses it aborts the process. False when the others are not there to meet."""
    import torch.distributed as dist

    if groups.world_size == 1:
        return True
    try:
        dist.barrier(group=groups.cpu_group)
        return True
    except Exception:  # a peer is gone: leave teardown to process exit
        return False

