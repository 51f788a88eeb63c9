"""Elastic EP on CPU ranks (torchrun, gloo): recovery time after a rank's loss, and what elastic costs
a step when nothing fails.

    python bench/elastic.py                          qwen3-moe-tiny, 4 ranks, 3 kills, two hosts too
    python bench/elastic.py --json bench/results/elastic_cpu.json

Recovery: 8 greedy streams run; a rank's engine core is SIGKILLed (a different rank each trial,
a replacement joins back before the next). Reported per trial: from the kill to the first token any
stream receives after it (the job serving again), to the moment every stream has received one (all
resubmitted requests recomputed), and the engine's own figure (moe_serve:elastic_recovery_seconds:
failure seen to the members serving). Two hosts (network namespaces joined by veth, 2 ranks each,
root only): host 1's link is cut instead; the survivors notice within the collective timeout
(--elastic-timeout, 2 s here) and the heartbeat timeout.
Steady state: the same load (16 streams x 64 tokens) on a job without and with --enable-elastic-ep,
alternated in rounds: TPOT p50 and output tokens/s. Elastic adds a heartbeat thread (one store round
trip every 0.5 s) and a supervisor process; the per-turn agreement carries one more integer.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from machine import machine  # noqa: E402
from synthetic_models import resolve_model  # noqa: E402
from tests.distributed.hosts import TwoHosts, torchrun  # noqa: E402
from tests.e2e.server import free_port  # noqa: E402

ELASTIC = ["--enable-elastic-ep", "--elastic-timeout", "2", "--elastic-heartbeat-timeout", "2"]


def serve_args(path: str) -> list[str]:
    return ["--model", path, "--dtype", "float32", "--max-num-batched-tokens", "64", "--kv-cache-memory", str(256 << 20)]


class Job:
    def __init__(self, nproc: int, args: list[str], log_path: str):
        self.port, self.master_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path, self.args = log_path, args
        self._log = open(log_path, "w")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(self.master_port), "-m", "launcher", "serve", "--port", str(self.port), *args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                     start_new_session=True)
        wait_healthy(self.url, self.proc)

    def join(self) -> subprocess.Popen:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        return subprocess.Popen([sys.executable, "-m", "launcher", "serve", *self.args, "--elastic-join",
                                 f"127.0.0.1:{self.master_port}"], stdout=self._log, stderr=subprocess.STDOUT,
                                env=env, cwd=ROOT, start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


def wait_healthy(url: str, proc, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"job exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(url)


async def streams(url: str, n: int, tokens: int, at: float | None = None, act=None) -> list[list[float]]:
    """n greedy streams at once; returns each one's token arrival times. `act` runs `at` seconds
    after every stream has its first token."""
    times: list[list[float]] = [[] for _ in range(n)]
    started = asyncio.Event()

    async def one(h, i):
        body = {"prompt": [5 + i, 77, 301 + i, 42], "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with h.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    times[i].append(time.monotonic())
                    if all(times):
                        started.set()

    async with httpx.AsyncClient(timeout=300) as h:
        tasks = [asyncio.create_task(one(h, i)) for i in range(n)]
        if act is not None:
            await started.wait()
            await asyncio.sleep(at)
            act()
        await asyncio.gather(*tasks)
    return times


def after(times: list[list[float]], t0: float) -> tuple[float, float]:
    """(first token any stream got after t0, the time by which every stream had one) - t0."""
    firsts = [next(t for t in ts if t > t0) - t0 for ts in times]
    return min(firsts), max(firsts)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def ranks(url: str) -> dict:
    return httpx.get(url + "/ranks", timeout=5).json()


def recovery_one_host(path: str, nproc: int, trials: int, log: str) -> list[dict]:
    job = Job(nproc, serve_args(path) + ELASTIC, log)
    out = []
    try:
        for k in range(trials):
            victim = nproc - 1 - k % (nproc - 1)
            pid = next(r["pid"] for r in ranks(job.url)["ranks"] if r["rank"] == victim)
            before = metric(job.url, "moe_serve:elastic_recovery_seconds_sum")
            killed = {}

            def kill():
                killed["t"] = time.monotonic()
                os.kill(pid, signal.SIGKILL)

            times = asyncio.run(streams(job.url, 8, 160, 0.5, kill))
            first, every = after(times, killed["t"])
            engine = metric(job.url, "moe_serve:elastic_recovery_seconds_sum") - before
            out.append({"killed_rank": victim, "first_token_after_s": round(first, 3),
                        "every_stream_after_s": round(every, 3), "engine_recovery_s": round(engine, 3)})
            print(f"trial {k}: rank {victim} killed: first token {first:.3f}s after, every stream {every:.3f}s, "
                  f"engine {engine:.3f}s", flush=True)
            j = job.join()
            deadline = time.monotonic() + 120
            while ranks(job.url)["world_size"] != nproc:
                if time.monotonic() > deadline or j.poll() is not None:
                    raise RuntimeError("the replacement did not join")
                time.sleep(0.2)
    finally:
        job.stop()
    return out


def recovery_two_hosts(path: str, log_dir: str) -> dict | None:
    hosts = TwoHosts()
    why = hosts.create()
    if why is not None:
        print(f"two hosts skipped: {why}")
        return None
    try:
        port, master_port = free_port(), free_port()
        args = serve_args(path) + ELASTIC + ["--host", "0.0.0.0", "--port", str(port)]
        logs = [f"{log_dir}/elastic-host{n}.log" for n in (0, 1)]
        procs = [hosts.run(n, torchrun(hosts, n, 2, master_port, args), logs[n]) for n in (0, 1)]
        url = hosts.wait_healthy(port, procs, logs)
        cut = {}

        def cut_link():
            cut["t"] = time.monotonic()
            hosts.link(1, False)

        times = asyncio.run(streams(url, 8, 240, 0.5, cut_link))
        first, every = after(times, cut["t"])
        engine = metric(url, "moe_serve:elastic_recovery_seconds_sum")
        print(f"two hosts: link cut: first token {first:.3f}s after, every stream {every:.3f}s, engine {engine:.3f}s",
              flush=True)
        return {"first_token_after_s": round(first, 3), "every_stream_after_s": round(every, 3),
                "engine_recovery_s": round(engine, 3)}
    finally:
        hosts.destroy()


def steady_state(path: str, nproc: int, rounds: int, log_dir: str) -> dict:
    jobs = {"plain": Job(nproc, serve_args(path), f"{log_dir}/elastic-plain.log"),
            "elastic": Job(nproc, serve_args(path) + ELASTIC, f"{log_dir}/elastic-on.log")}
    res: dict[str, dict[str, list[float]]] = {k: {"tpot_ms": [], "tok_s": []} for k in jobs}
    try:
        for name, job in jobs.items():
            asyncio.run(streams(job.url, 16, 16))  # warm
        for _ in range(rounds):
            for name, job in jobs.items():
                t0 = time.monotonic()
                times = asyncio.run(streams(job.url, 16, 64))
                wall = time.monotonic() - t0
                gaps = [b - a for ts in times for a, b in zip(ts, ts[1:])]
                res[name]["tpot_ms"].append(1000 * float(np.median(gaps)))
                res[name]["tok_s"].append(sum(len(ts) for ts in times) / wall)
    finally:
        for job in jobs.values():
            job.stop()
    out = {k: {m: round(float(np.median(v)), 3) for m, v in r.items()} for k, r in res.items()}
    out["elastic_over_plain"] = {"tpot_p50": round(out["elastic"]["tpot_ms"] / out["plain"]["tpot_ms"], 3),
                                 "tok_s": round(out["elastic"]["tok_s"] / out["plain"]["tok_s"], 3)}
    print(f"steady state: {json.dumps(out)}", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-moe-tiny")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-two-hosts", action="store_true")
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    path, name, desc = resolve_model(ns.model)
    result = {"benchmark": "elastic_ep", "model": name, "model_description": desc, "ranks": ns.ranks,
              "machine": machine(), "date": time.strftime("%Y-%m-%d"),
              "flags": ELASTIC,
              "recovery_one_host": recovery_one_host(path, ns.ranks, ns.trials, f"{ns.log_dir}/elastic-kill.log"),
              "recovery_two_hosts_2x2": None if ns.no_two_hosts else recovery_two_hosts(path, ns.log_dir),
              "steady_state": steady_state(path, ns.ranks, ns.rounds, ns.log_dir)}
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"written to {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
