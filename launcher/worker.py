"""One rank of a multi-process job: process groups, this rank's engine core (its KV cache, scheduler
and share of the experts) running the core loop; global rank 0 also starts the front-end process
(HTTP, tokenization, output processing) that every rank's core talks to over ZMQ."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from launcher.network import DistNetworkError

log = logging.getLogger("moe_serve.launcher")


def parse(argv: list[str]) -> argparse.Namespace:
    from moe_serve.entrypoints.cli import add_serve_args

    p = argparse.ArgumentParser(prog="python -m launcher", description="one rank of a moe-serve job (use torchrun)")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve with experts sharded over all ranks")
    add_serve_args(s)
    s.add_argument("--dist-timeout", type=float, default=60.0,
                   help="seconds a rank may fall behind before the job stops with an error naming it")
    add_network_args(s)
    from launcher.elastic import add_elastic_args

    add_elastic_args(s)
    return p.parse_args(argv)


def add_network_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dist-interface", default=None, metavar="NAME",
                   help="the network interface this rank uses to reach the others (gloo, NCCL's bootstrap, the "
                        "front end's sockets); default: the one that routes to MASTER_ADDR, or GLOO_SOCKET_IFNAME "
                        "where set")
    p.add_argument("--dist-join-timeout", type=float, default=120.0,
                   help="seconds every rank waits at start-up for MASTER_ADDR to answer and for every rank of every "
                        "node to join, before it stops with an error naming the ranks missing")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank_env = "joining" if "--elastic-join" in argv else os.environ.get("RANK", "0")
    logging.basicConfig(level=os.environ.get("MOE_SERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s [rank {rank_env}] %(name)s: %(message)s")
    ns = parse(argv)
    try:
        rc = run(ns, argv[1:], argv)  # what follows "serve" goes to the front end as it is
    except ValueError as e:
        print(f"moe-serve (rank {rank_env}): error: {e}", file=sys.stderr)
        rc = 2
    except DistNetworkError as e:
        log.error("%s", e)
        print(f"moe-serve (rank {rank_env}): error: {e}", file=sys.stderr)
        rc = 1
    except Exception as e:
        log.exception("rank %s failed", rank_env)
        print(f"moe-serve (rank {rank_env}): error: {type(e).__name__}: {e}", file=sys.stderr)
        rc = 1
    # Everything is shut down and flushed; skip interpreter teardown, where destructors of the
    # communication library's background threads can abort a process that finished cleanly.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def run(ns: argparse.Namespace, serve_argv: list[str], argv: list[str] | None = None) -> int:
    import json

    from launcher import elastic

    elastic.check_elastic_args(ns)
    if ns.enable_elastic_ep:
        if ns.elastic_join or os.environ.get(elastic.ENV_CORE):
            return elastic.run_core(ns, serve_argv)
        return elastic.supervise(argv if argv is not None else ["serve", *serve_argv])

    from expert_parallel.runtime.groups import destroy_process_groups, init_process_groups
    from launcher import network
    from launcher.watchdog import Watchdog
    from moe_serve import platform
    from moe_serve.engine.args import EngineArgs
    from moe_serve.engine.core import build_engine
    from moe_serve.engine.core_proc import CoreLoop, install_signal_handlers
    from moe_serve.entrypoints.cli import resolve_model
    from moe_serve.entrypoints.openai.launch import spawn_frontend

    dev = platform.resolve_device(ns.device)
    backend = platform.dist_backend(dev)
    endpoint, peers, watch_store = join_network(ns, backend)
    try:
        groups = init_process_groups(backend, timeout_s=max(ns.dist_timeout * 2, 120))
    except (RuntimeError, dist_errors()) as e:
        if endpoint is None:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistNetworkError(
            f"the {backend} process group did not form: {first}. This rank used {endpoint.address} on "
            f"{endpoint.interface} ({endpoint.why})" + (f"; the ranks' addresses: {network.table_of(peers)}" if peers
                                                         else "") +
            ". Every rank must reach every other rank's address: on hosts with several interfaces set "
            "--dist-interface to the one that reaches the other nodes") from None
    rank, world = groups.rank, groups.world_size
    log.info("rank %d of %d (local rank %d, pid %d, device %s)", rank, world, groups.local_rank, os.getpid(),
             groups.device)
    watchdog = Watchdog(rank, world, ns.dist_timeout, watch_store)
    # Every rank resolves the model itself (the default one is built under a lock, once per machine),
    # so nodes without a shared filesystem work too.
    path, _ = resolve_model(ns.model)
    ns.device = str(groups.device)
    args = EngineArgs.from_cli(ns, path)
    args.show_progress = rank == 0
    cfg = args.create_engine_config(rank, world)
    frontend = None
    addrs = None
    if rank == 0:
        # The front end binds; every core connects to it, on this node or from the others.
        # On one node the cores reach it on loopback; across nodes, on rank 0's chosen address.
        multi_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world
        host = endpoint.address if multi_node and endpoint is not None else "127.0.0.1"
        frontend, in_ports, out_port = spawn_frontend(serve_argv + ["--model", path], world, host)
        if multi_node:
            log.info("front end sockets bound on %s (%s), for the cores of every node", host, endpoint.interface)
        addrs = json.dumps({"host": host, "in": in_ports, "out": out_port}).encode()
    loop, clean = None, False
    try:
        a = json.loads(broadcast_bytes(addrs, groups.cpu_group))
        if frontend is not None:  # the watchdog ends this process: the front end goes first
            out_url = network.url(a["host"], a["out"])
            watchdog.before_exit = lambda why: stop_frontend(frontend, why, out_url)
        core = build_engine(cfg, groups.ep_group, show_progress=rank == 0)
        agree_max_model_len(core, groups.cpu_group)
        peer_alive = (lambda: frontend.poll() is None) if frontend is not None else (lambda: True)
        loop = CoreLoop(core, rank, world, network.url(a["host"], a["in"][rank]), network.url(a["host"], a["out"]),
                        groups.cpu_group, on_turn=watchdog.beat, peer_alive=peer_alive)
        install_signal_handlers(loop)
        log.info("data-parallel attention on %d ranks, experts sharded %d ways (%s dispatch)", world, world,
                 cfg.parallel.all2all_backend)
        loop.ready()
        watchdog.start()
        rc = loop.run()
        if rank == 0 and args.expert_load_record:
            core.dump_load(args.expert_load_record)
            log.info("expert load written to %s", args.expert_load_record)
        loop.close()
        if frontend is not None:
            rc = rc or _wait(frontend)
        clean = True
        return rc
    except Exception as e:
        if loop is not None:
            loop.fatal(e)
        raise
    finally:
        watchdog.stop()
        if frontend is not None and frontend.poll() is None:
            frontend.terminate()
            _wait(frontend)
        # After a failure the other ranks may be inside a collective: leave teardown to exit.
        if clean and clean_exit(groups):
            destroy_process_groups(groups)


def dist_errors() -> type:
    import torch.distributed as dist

    return getattr(dist, "DistError", RuntimeError)


def join_network(ns: argparse.Namespace, backend: str):
    """Choose this rank's address, point gloo/NCCL at it, check that MASTER_ADDR answers from it,
    and (under torchrun) meet every rank in the job's store. Returns (endpoint, every rank's
    endpoint, a store client for the watchdog whose calls time out within --dist-timeout), with
    None for what a one-rank job or a job outside torchrun does not have."""
    import datetime

    import torch.distributed as dist

    from launcher import network

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


def stop_frontend(proc, reason: str, out_addr: str, timeout_s: float = 3.0) -> None:
    """Stop rank 0's front end and reap it, before this process ends on a failure it cannot
    recover from: the front end hears why as a core failure (its streams end with the reason),
    and is killed if it has not exited within timeout_s. torchrun signals only the workers still
    running, so a front end left behind would outlive the job, its HTTP port held."""
    if proc.poll() is not None:
        return
    try:
        import zmq

        from moe_serve.protocol import CoreFatal, input_encoder

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 500)
        sock.connect(out_addr)
        sock.send(input_encoder.encode(CoreFatal(0, reason)), zmq.NOBLOCK)
        sock.close()
        ctx.term()
    except Exception as e:  # it is stopped below either way
        log.warning("could not tell the front end why the job stops: %s", e)
        proc.terminate()
    _wait(proc, timeout_s)


def _wait(proc, timeout_s: float = 30.0) -> int:
    import subprocess

    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


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
