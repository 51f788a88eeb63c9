"""`moe-serve launch`: torchrun wrapped. Everything after `--` is passed to `launcher serve`."""
from __future__ import annotations

import argparse
import os
import sys


def add_launch_parser(sub) -> None:
    p = sub.add_parser("launch", help="start a multi-process (expert-parallel) server with torchrun",
                       description="moe-serve launch --nproc-per-node 8 -- --model CKPT --port 8000")
    p.add_argument("--nproc-per-node", type=int, required=True, help="processes (devices) on this node")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--rdzv-endpoint", default=None, help="host:port of node 0 (multi-node)")
    p.add_argument("--master-port", type=int, default=None, help="single node: the rendezvous port")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then the flags of `moe-serve serve`")
    p.set_defaults(fn=run_launch)


def torchrun_command(ns: argparse.Namespace) -> list[str]:
    rest = list(ns.serve_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if ns.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node={ns.nproc_per_node} must be >= 1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ns.nproc_per_node)]
    if ns.nnodes > 1:
        if not ns.rdzv_endpoint:
            raise ValueError("--rdzv-endpoint host:port is required with --nnodes > 1")
        cmd += ["--nnodes", str(ns.nnodes), "--node-rank", str(ns.node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", ns.rdzv_endpoint]
    elif ns.master_port:
        cmd += ["--master-port", str(ns.master_port)]
    return cmd + ["-m", "launcher", "serve", *rest]


def run_launch(ns: argparse.Namespace) -> int:
    cmd = torchrun_command(ns)
    sys.stdout.flush()
    os.execv(cmd[0], cmd)  # torchrun takes over this process: signals reach it directly
    return 0
