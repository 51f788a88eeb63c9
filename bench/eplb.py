"""Expert rebalancing while serving: skewed synthetic traffic through HTTP on CPU ranks (torchrun, gloo).

    python bench/eplb.py                                  qwen3-moe-tiny, 4 ranks
    python bench/eplb.py --model qwen3-moe-mid --requests 64 --json bench/results/eplb_cpu.json

Two jobs serve the same traffic: one without rebalancing, one with --enable-eplb (spare slots, a
short window and interval so several rebalances happen in the run). The traffic is skewed: every
prompt draws its tokens from a small hot subset of the vocabulary (Zipf over a random order), so a
few experts get most routed tokens (how skewed depends on the random router; the first window's
balancedness says). Reported:
  - per rebalance window (from the ranks' log lines): balancedness of the window (mean / max routed
    tokens per rank; the first one is before any rebalance), mean step time, the mean time of
    the steps right after a layer switched (their boundary work included), and that boundary work
    alone (swapping the weights and maps, posting the next layer's transfer);
  - TPOT (gaps between streamed tokens): p50 / p99 without rebalancing, and with it, split into
    gaps that overlap a rebalance (tuning to last switch) and the rest.
On a small shared CPU the step time is mostly host overhead and noise, so balancedness is the
figure that carries over; the step-time and TPOT columns show what a rebalance costs the steps.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_models import resolve_model, token_pool  # noqa: E402

DONE = re.compile(r"^(\S+ \S+) INFO \[rank 0\] moe_serve\.eplb: expert rebalancing (\d+) done: (\d+) MoE layers moved, "
                  r"([0-9.]+) MiB received here, ([0-9.]+)s from tuning to the last switch; balancedness of the last "
                  r"window ([0-9.]+); mean step ([0-9.]+) ms, switch steps ([0-9.]+) ms \(switch boundaries ([0-9.]+) ms\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    def __init__(self, nproc: int, serve_args: list[str], log_path: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(free_port()), "-m", "launcher", "serve", "--port", str(self.port), *serve_args]
        self._log = open(log_path, "w")
        root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=root,
                                     start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"job exited with {self.proc.returncode}; see {log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"job did not become healthy; see {log_path}")

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def skewed_prompts(pool: list[int], n: int, length: int, hot: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    hot_ids = rng.permutation(pool)[:hot]
    p = 1.0 / np.arange(1, hot + 1)
    return [[int(t) for t in rng.choice(hot_ids, size=length, p=p / p.sum())] for _ in range(n)]


async def stream_all(url: str, prompts, max_tokens: int, concurrency: int) -> list[list[float]]:
    """Token arrival times (wall clock, seconds) per request, streamed."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as h:
        async def one(p):
            async with sem:
                times = []
                body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
                async with h.stream("POST", url + "/v1/completions", json=body) as r:
                    assert r.status_code == 200, await r.aread()
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            times.append(time.time())
                return times
        return await asyncio.gather(*[one(p) for p in prompts])


def gaps(times: list[list[float]]) -> list[tuple[float, float]]:
    return [(a, b) for ts in times for a, b in zip(ts, ts[1:])]


def pct(xs, q):
    return float(np.percentile(xs, q)) * 1e3 if len(xs) else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-moe-tiny")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--hot-tokens", type=int, default=12, help="distinct tokens the prompts are drawn from")
    ap.add_argument("--redundant", type=int, default=4, help="--num-redundant-experts")
    ap.add_argument("--window", type=int, default=32, help="--eplb-window-size")
    ap.add_argument("--interval", type=int, default=32, help="--eplb-step-interval")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replica-split", default="balanced", choices=["balanced", "round_robin"],
                    help="the rebalancing job's --replica-split")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    path, name, desc = resolve_model(args.model)
    prompts = skewed_prompts(token_pool(path), args.requests, args.prompt_len, args.hot_tokens, args.seed)
    common = ["--model", path, "--dtype", "float32", "--kv-cache-memory", str(64 << 20), "--max-num-seqs", "64"]
    eplb = ["--enable-eplb", "--num-redundant-experts", str(args.redundant), "--eplb-window-size", str(args.window),
            "--eplb-step-interval", str(args.interval), "--replica-split", args.replica_split]
    out = {"model": desc, "nproc": args.nproc, "requests": args.requests, "concurrency": args.concurrency,
           "eplb": {"redundant": args.redundant, "window": args.window, "interval": args.interval,
                    "replica_split": args.replica_split}}
    runs = {}
    for label, extra in (("without", []), ("with", eplb)):
        job = Job(args.nproc, common + extra, f"/tmp/moe-serve-bench-eplb-{label}.log")
        try:
            asyncio.run(stream_all(job.url, prompts[:4], 8, 4))  # warm-up
            t0 = time.time()
            times = asyncio.run(stream_all(job.url, prompts, args.max_tokens, args.concurrency))
            runs[label] = (times, time.time() - t0, job.log())
        finally:
            job.stop()
    windows, spans = [], []
    for m in filter(None, map(DONE.match, runs["with"][2].splitlines())):
        end = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        took = float(m.group(5))
        spans.append((end - took, end))
        windows.append({"rebalance": int(m.group(2)), "layers_moved": int(m.group(3)),
                        "mib_received_rank0": float(m.group(4)), "transfer_s": took,
                        "balancedness": float(m.group(6)), "mean_step_ms": float(m.group(7)),
                        "switch_step_ms": float(m.group(8)), "switch_boundary_ms": float(m.group(9))})
    during = lambda a, b: any(a < e and b > s for s, e in spans)  # noqa: E731
    g_with = gaps(runs["with"][0])
    tpot = {
        "without": [b - a for a, b in gaps(runs["without"][0])],
        "with, during a rebalance": [b - a for a, b in g_with if during(a, b)],
        "with, outside": [b - a for a, b in g_with if not during(a, b)],
    }
    out["windows"] = windows
    out["tpot_ms"] = {k: {"n": len(v), "p50": round(pct(v, 50), 2), "p99": round(pct(v, 99), 2)} for k, v in tpot.items()}
    out["duration_s"] = {k: round(v[1], 2) for k, v in runs.items()}
    print(f"{desc}; {args.nproc} CPU ranks, {args.requests} requests x {args.max_tokens} tokens, "
          f"concurrency {args.concurrency}")
    print(f"{'rebalance':>9} {'moved':>5} {'MiB in':>7} {'took s':>7} {'balanced':>8} {'step ms':>8} {'switch ms':>9} "
          f"{'boundary ms':>11}")
    for w in windows:
        print(f"{w['rebalance']:>9} {w['layers_moved']:>5} {w['mib_received_rank0']:>7.2f} {w['transfer_s']:>7.3f} "
              f"{w['balancedness']:>8.3f} {w['mean_step_ms']:>8.2f} {w['switch_step_ms']:>9.2f} "
              f"{w['switch_boundary_ms']:>11.3f}")
    for k, v in out["tpot_ms"].items():
        print(f"TPOT {k:<26} n={v['n']:<6} p50 {v['p50']:8.2f} ms  p99 {v['p99']:8.2f} ms")
    print(f"run time: without {out['duration_s']['without']} s, with {out['duration_s']['with']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
