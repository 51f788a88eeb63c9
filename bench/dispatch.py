"""Dispatch+combine time and bytes per step, by backend, EP size and token count.

Shape legend: T tokens per rank, D hidden size, K top-k, E expert slots, W EP size.

Two ways to run it:
  python bench/dispatch.py                       spawns W gloo processes on this machine for each
                                                 --ep-sizes value (CPU; what CI machines can do);
  torchrun --nproc-per-node 8 bench/dispatch.py  one world of WORLD_SIZE ranks, NCCL on CUDA.
Rank 0 prints a table and writes bench/results/dispatch_<dist backend>_<device>.json.

Per (backend, W, T): routing is uniform random top-K of E (no load skew), the expert computation is
left out (y_RD = x_RD, the same shape and dtype as a real expert output), and the time is the median
over iterations of the slowest rank. "bytes sent" is what one rank puts on the wire per step, counted
at each torch.distributed call: all_to_all_single counts the rows sent to other ranks; all-gather
counts its input once per peer; reduce-scatter (W-1)/W of its input and all_reduce 2(W-1)/W (ring
algorithms); tiny counts/size exchanges are included.

It also measures how well an asynchronous all_to_all_single overlaps a matmul (two-micro-batch style):
overlap_efficiency = (t_compute + t_comm - t_both) / min(t_compute, t_comm), clamped to [0, 1]. On CPU
gloo the ranks share a few cores with the compute, so read that number as this machine's, not a GPU's.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from expert_parallel.runtime.dispatch import make_dispatcher  # noqa: E402
from expert_parallel.runtime.groups import destroy_process_groups, init_process_groups  # noqa: E402

RESULTS = REPO / "bench" / "results"


@contextlib.contextmanager
def count_bytes(rank: int, world_size: int):
    """Wrap the torch.distributed collectives the dispatchers use; yields a dict of bytes and calls."""
    tally = {"bytes": 0.0, "calls": 0}
    W, saved = world_size, {}

    def wrap(name, sent):
        fn = getattr(dist, name, None)
        if fn is None:
            return
        saved[name] = fn

        def counted(*args, **kwargs):
            tally["bytes"] += sent(*args, **kwargs)
            tally["calls"] += 1
            return fn(*args, **kwargs)
        setattr(dist, name, counted)

    def a2a(out, inp, output_split_sizes=None, input_split_sizes=None, **_):
        if not input_split_sizes:
            return inp.nbytes * (W - 1) / W
        row = inp.nbytes / max(inp.shape[0], 1)
        return row * (sum(input_split_sizes) - input_split_sizes[rank])

    wrap("all_to_all_single", a2a)
    for name in ("all_gather_single", "all_gather_into_tensor"):
        wrap(name, lambda out, inp, **_: inp.nbytes * (W - 1))
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        wrap(name, lambda out, inp, **_: inp.nbytes * (W - 1) / W)
    wrap("all_reduce", lambda t, *a, **_: 2 * t.nbytes * (W - 1) / W)
    wrap("all_gather", lambda outs, t, *a, **_: t.nbytes * (W - 1))
    try:
        yield tally
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(value: float, cpu_group) -> float:
    """The largest value over ranks: a collective step is as slow as its slowest rank."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group)
    return float(t.item())


def routing(T: int, E: int, K: int, D: int, dtype, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(T, D, generator=g).to(dtype)
    ids_TK = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    w_TK = torch.softmax(torch.randn(T, K, generator=g), dim=1)
    return x_TD.to(device), ids_TK.to(device), w_TK.to(device)


def bench_case(groups, backend: str, T: int, args, dtype) -> dict:
    W, rank, dev = groups.world_size, groups.rank, groups.device
    disp = make_dispatcher(backend, args.experts, rank, W, groups.ep_group)
    x_TD, ids_TK, w_TK = routing(T, args.experts, args.top_k, args.hidden, dtype, dev, seed=rank * 7919 + T)

    def step():
        out = disp.dispatch(x_TD, ids_TK, w_TK)
        sync(dev)
        t1 = time.perf_counter()
        disp.combine(out.x_RD, out.handle)
        sync(dev)
        return t1, out.x_RD.shape[0]

    for _ in range(args.warmup):
        step()
    with count_bytes(rank, W) as tally:
        _, received = step()
    iters = args.iters if T <= 128 else max(3, args.iters // 4)
    d_ms, c_ms = [], []
    dist.barrier(group=groups.cpu_group)
    for _ in range(iters):
        t0 = time.perf_counter()
        t1, _ = step()
        t2 = time.perf_counter()
        d_ms.append((t1 - t0) * 1e3)
        c_ms.append((t2 - t1) * 1e3)
    d, c = statistics.median(d_ms), statistics.median(c_ms)
    return {"backend": backend, "ep_size": W, "tokens": T,
            "dispatch_ms": slowest(d, groups.cpu_group), "combine_ms": slowest(c, groups.cpu_group),
            "step_ms": slowest(d + c, groups.cpu_group),
            "bytes_sent": slowest(tally["bytes"], groups.cpu_group), "collectives": tally["calls"],
            "rows_received": int(slowest(received, groups.cpu_group))}


def measure_overlap(groups, args, dtype) -> dict:
    """Async all_to_all_single of a decode-sized payload against a matmul of similar duration."""
    W, dev, g = groups.world_size, groups.device, groups.ep_group
    rows = 128 * args.top_k // W  # rows sent to each peer by a 128-token top-K dispatch
    send = torch.randn(W * rows, args.hidden, device=dev).to(dtype)
    recv = torch.empty_like(send)
    a = torch.randn(256, 256, device=dev)

    def timed(fn, n=15):
        """Median of n single runs (each synced), slowest rank: robust to the odd descheduled run."""
        fn()
        sync(dev)
        dist.barrier(group=groups.cpu_group)
        runs = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            sync(dev)
            runs.append(time.perf_counter() - t0)
        return slowest(statistics.median(runs), groups.cpu_group)

    t_comm = timed(lambda: dist.all_to_all_single(recv, send, group=g))
    reps = 1

    def compute():
        for _ in range(reps):
            a @ a

    # Make the compute last about as long as the comm: overlap can hide at most the shorter one, so
    # a lopsided pair would measure mostly the longer phase. Two refinements absorb timer noise.
    for _ in range(2):
        reps = max(1, round(reps * t_comm / max(timed(compute), 1e-9)))

    def both():
        work = dist.all_to_all_single(recv, send, group=g, async_op=True)
        compute()
        work.wait()

    t_comp, t_both = timed(compute), timed(both)
    eff = (t_comp + t_comm - t_both) / max(min(t_comp, t_comm), 1e-12)
    return {"ep_size": W, "comm_ms": t_comm * 1e3, "compute_ms": t_comp * 1e3, "both_ms": t_both * 1e3,
            "overlap_efficiency": min(1.0, max(0.0, eff))}


def run_world(args) -> dict | None:
    """One world (this process is one rank). Returns rank 0's results, None on the others."""
    backend = "nccl" if torch.cuda.is_available() and not args.cpu else "gloo"
    groups = init_process_groups(backend, timeout_s=300)
    dtype = {"auto": torch.bfloat16 if groups.device.type == "cuda" else torch.float32,
             "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    rows = [bench_case(groups, b, T, args, dtype) for b in args.backends for T in args.tokens]
    overlap = measure_overlap(groups, args, dtype) if not args.no_overlap else None
    dist.barrier(group=groups.cpu_group)
    rank = groups.rank
    destroy_process_groups(groups)
    if rank != 0:
        return None
    device = torch.cuda.get_device_name(0) if groups.device.type == "cuda" else "cpu"
    return {"dist_backend": backend, "device": device, "device_type": groups.device.type,
            "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
            "hidden": args.hidden, "top_k": args.top_k, "experts": args.experts,
            "rows": rows, "overlap": [overlap] if overlap else []}


def spawn_world(W: int, argv: list[str], timeout_s: float) -> dict:
    """Start W local gloo ranks running this script; return rank 0's results."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp()) / "rank0.json"
    procs = []
    for rank in range(W):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(W), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        procs.append(subprocess.Popen([sys.executable, __file__, *argv, "--cpu", "--worker-out", str(out)],
                                      env=env, start_new_session=True))
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"EP={W} benchmark failed or exceeded {timeout_s} s")
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # each rank leads its own session
                p.wait()
    return json.loads(out.read_text())


def print_table(result: dict) -> None:
    print(f"\ndispatch+combine: {result['dist_backend']} on {result['device']}, {result['dtype']}, "
          f"D={result['hidden']}, top-{result['top_k']} of {result['experts']} experts, uniform routing")
    print(f"{'backend':<11} {'EP':>3} {'tokens':>6} {'dispatch ms':>11} {'combine ms':>10} {'step ms':>8} "
          f"{'MB sent/rank':>12} {'rows recv':>9}")
    for r in result["rows"]:
        print(f"{r['backend']:<11} {r['ep_size']:>3} {r['tokens']:>6} {r['dispatch_ms']:>11.3f} "
              f"{r['combine_ms']:>10.3f} {r['step_ms']:>8.3f} {r['bytes_sent'] / 1e6:>12.3f} {r['rows_received']:>9}")
    for o in result["overlap"]:
        print(f"overlap EP={o['ep_size']}: comm {o['comm_ms']:.3f} ms, compute {o['compute_ms']:.3f} ms, "
              f"both {o['both_ms']:.3f} ms -> overlap_efficiency {o['overlap_efficiency']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ep-sizes", type=int, nargs="+", default=[2, 4], help="spawned gloo worlds (no torchrun)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024], help="T per rank")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--backends", nargs="+", default=["all_to_all", "allgather", "reference"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    p.add_argument("--no-overlap", action="store_true", help="skip the overlap measurement")
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/...)")
    p.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()

    if "RANK" in os.environ:  # one rank of a world (torchrun, or spawned by spawn_world below)
        result = run_world(args)
        if result is not None and args.worker_out is not None:
            args.worker_out.write_text(json.dumps(result))
            return
        if result is None:
            return
    else:
        passthrough = [a for a in sys.argv[1:]]
        worlds = [spawn_world(W, passthrough, args.timeout_s) for W in args.ep_sizes]
        result = dict(worlds[0], rows=[r for w in worlds for r in w["rows"]],
                      overlap=[o for w in worlds for o in w["overlap"]])
    result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    print_table(result)
    out = args.out or RESULTS / f"dispatch_{result['dist_backend']}_{result['device_type']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"saved {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")


if __name__ == "__main__":
    main()
