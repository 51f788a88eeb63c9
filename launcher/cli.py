"""`moe-serve launch`: torchrun wrapped. Everything after `--` is passed to `launcher serve`.

On one node it becomes torchrun (exec). Across nodes it first checks what torchrun's own agent
would otherwise wait on for many minutes with no word of why: on node 0 that --master-addr is this
host's and the ports are free; on the other nodes that node 0's store answers from the chosen
interface. It then runs torchrun with the join window bounded by --dist-join-timeout, and when the
nodes never met it says so in one line.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading

log = logging.getLogger("moe_serve.launch")

DEFAULT_MASTER_PORT = 29500


class LaunchError(ValueError):
    """A start-up condition that would keep the job from forming; the message says what to set."""


def add_launch_parser(sub) -> None:
    p = sub.add_parser("launch", help="start a multi-process (expert-parallel) server with torchrun",
                       description="moe-serve launch --nproc-per-node 8 -- --model CKPT --port 8000; several nodes: "
                                   "moe-serve launch --nnodes 2 --node-rank R --nproc-per-node 8 --master-addr NODE0_IP "
                                   "-- --model CKPT")
    p.add_argument("--nproc-per-node", type=int, required=True, help="processes (devices) on this node")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default=None,
                   help="several nodes: node 0's address as every node reaches it (node 0 hosts the job's store)")
    p.add_argument("--master-port", type=int, default=None,
                   help=f"the job's store port on node 0 (default {DEFAULT_MASTER_PORT}; one node: a free one)")
    p.add_argument("--rdzv-endpoint", default=None,
                   help="host:port of node 0, for torchrun's c10d rendezvous (instead of --master-addr)")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then the flags of `moe-serve serve`")
    p.set_defaults(fn=run_launch)


def _serve_args(ns: argparse.Namespace) -> list[str]:
    rest = list(ns.serve_args)
    return rest[1:] if rest and rest[0] == "--" else rest


def _check_counts(ns: argparse.Namespace) -> None:
    if ns.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node={ns.nproc_per_node} must be >= 1")
    if ns.nnodes < 1:
        raise ValueError(f"--nnodes={ns.nnodes} must be >= 1")
    if not 0 <= ns.node_rank < ns.nnodes:
        raise ValueError(f"--node-rank={ns.node_rank} must be in [0, {ns.nnodes - 1}] with --nnodes {ns.nnodes}")


def torchrun_command(ns: argparse.Namespace, join_timeout_s: float | None = None,
                     local_addr: str | None = None) -> list[str]:
    _check_counts(ns)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ns.nproc_per_node)]
    if ns.nnodes > 1:
        cmd += ["--nnodes", str(ns.nnodes), "--node-rank", str(ns.node_rank)]
        if ns.rdzv_endpoint:
            cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", ns.rdzv_endpoint]
            if join_timeout_s is not None:
                cmd += ["--rdzv-conf", f"join_timeout={int(join_timeout_s)}"]
        elif ns.master_addr:
            cmd += ["--master-addr", ns.master_addr, "--master-port", str(ns.master_port or DEFAULT_MASTER_PORT)]
            if join_timeout_s is not None:
                cmd += ["--rdzv-conf", f"timeout={max(1, int(join_timeout_s))}"]
        else:
            raise ValueError("--nnodes > 1 needs --master-addr (node 0's address as the other nodes reach it) or "
                             "--rdzv-endpoint host:port")
        if local_addr:
            cmd += ["--local-addr", local_addr]
    elif ns.master_port:
        cmd += ["--master-port", str(ns.master_port)]
    return cmd + ["-m", "launcher", "serve", *_serve_args(ns)]


def _port_free(port: int, host: str = "") -> OSError | None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a listener still makes bind fail
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def preflight(ns: argparse.Namespace, serve: argparse.Namespace) -> str | None:
    """Check, before torchrun starts, what would keep this node from joining; returns the address
    to give torchrun as --local-addr (the chosen interface's, under c10d rendezvous), or None."""
    from launcher import network

    if ns.rdzv_endpoint:
        host, _, port_s = ns.rdzv_endpoint.rpartition(":")
        if not host or not port_s.isdigit():
            raise LaunchError(f"--rdzv-endpoint={ns.rdzv_endpoint!r} is not host:port")
        master, port = host.strip("[]"), int(port_s)
    else:
        master, port = ns.master_addr, ns.master_port or DEFAULT_MASTER_PORT
    if ns.node_rank == 0:
        table = network.interface_table()
        mine = [a for _, a in network.resolve(master) if network.interface_of(a, table)]
        if not mine:
            raise LaunchError(f"{'--rdzv-endpoint' if ns.rdzv_endpoint else '--master-addr'} {master} is not an "
                              f"address of this host, and node 0 (--node-rank 0) hosts the job's store: give node "
                              f"0's own address as the other nodes reach it (this host has {network.describe(table)})")
        err = _port_free(port)
        if err is not None:
            raise LaunchError(f"port {port} on this host is taken ({err.strerror}): it is the job's store port; "
                              f"stop what holds it or choose another --master-port on every node")
        err = _port_free(serve.port, serve.host if serve.host not in ("0.0.0.0", "::") else "")
        if err is not None:
            raise LaunchError(f"--port {serve.port} on this host is taken ({err.strerror}): it is the HTTP "
                              f"endpoint's port (on node 0); stop what holds it or choose another --port")
    ep = network.choose_endpoint(master, port, serve.dist_interface)
    log.info("node %d reaches the job from %s on %s, because %s", ns.node_rank, ep.address, ep.interface, ep.why)
    if ns.node_rank > 0:
        took = network.wait_reachable(master, port, ep, serve.dist_join_timeout)
        log.info("node 0's store at %s:%d answers (after %.1fs)", master, port, took)
    return ep.address if ns.rdzv_endpoint else None


_JOINED = re.compile(r"waiting for clients\. (\d+)/(\d+) clients joined")


def supervise(cmd: list[str], ns: argparse.Namespace, join_timeout_s: float) -> int:
    """Run torchrun as a child, its output passed through; SIGTERM/SIGINT reach it. When it ends
    because the nodes never met, say so in one line."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace")
    seen: dict[str, str] = {}

    def pump():
        for line in proc.stderr:
            sys.stderr.write(line)
            m = _JOINED.search(line)
            if m:
                seen["joined"] = m.group(1)
                seen["of"] = m.group(2)

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: proc.send_signal(s))
    rc = proc.wait()
    t.join(5)
    if rc != 0 and "joined" in seen:
        print(f"moe-serve launch: error: only {seen['joined']} of {seen['of']} nodes joined within "
              f"{join_timeout_s:.0f}s (--dist-join-timeout): start `moe-serve launch --nnodes {ns.nnodes} --node-rank "
              f"R ...` on every other node with the same --master-addr and --master-port, and check that each "
              f"reaches {ns.master_addr}:{ns.master_port or DEFAULT_MASTER_PORT}", file=sys.stderr)
    return rc


def run_launch(ns: argparse.Namespace) -> int:
    from launcher.network import DistNetworkError
    from launcher.worker import parse

    _check_counts(ns)
    serve = parse(["serve", *_serve_args(ns)])  # a bad serve flag fails here, once, not in every rank
    if serve.elastic_join:  # replacements join a running elastic job through its store, not torchrun's rendezvous
        return join_elastic(ns)
    if ns.nnodes == 1:
        cmd = torchrun_command(ns)
        sys.stdout.flush()
        os.execv(cmd[0], cmd)  # torchrun takes over this process: signals reach it directly
    logging.basicConfig(level=os.environ.get("MOE_SERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s [node {ns.node_rank}] %(name)s: %(message)s")
    if not (ns.master_addr or ns.rdzv_endpoint):
        raise ValueError("--nnodes > 1 needs --master-addr (node 0's address as the other nodes reach it) or "
                         "--rdzv-endpoint host:port")
    try:
        local_addr = preflight(ns, serve)
    except DistNetworkError as e:
        raise LaunchError(str(e)) from None
    cmd = torchrun_command(ns, serve.dist_join_timeout, local_addr)
    return supervise(cmd, ns, serve.dist_join_timeout)


def join_elastic(ns: argparse.Namespace) -> int:
    """--elastic-join: start --nproc-per-node replacement ranks on this host (LOCAL_RANK 0..n-1, the
    devices they use), each taking the lowest free rank id of the running job; wait for them all."""
    logging.basicConfig(level=os.environ.get("MOE_SERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s [launch] %(name)s: %(message)s")
    cmd = [sys.executable, "-m", "launcher", "serve", *_serve_args(ns)]
    procs = [subprocess.Popen(cmd, env=dict(os.environ, LOCAL_RANK=str(i), LOCAL_WORLD_SIZE=str(ns.nproc_per_node)))
             for i in range(ns.nproc_per_node)]
    log.info("%d replacement rank(s) started (pids %s), joining the elastic job at %s", len(procs),
             ", ".join(str(p.pid) for p in procs), _serve_value(ns, "--elastic-join"))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: [p.send_signal(s) for p in procs if p.poll() is None])
    return max(abs(p.wait()) for p in procs)


def _serve_value(ns: argparse.Namespace, flag: str) -> str:
    args = _serve_args(ns)
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return "?"
