"""Prefill/decode disaggregation against colocated serving, same run, same workload:

    python bench/disagg.py                         synthetic-qwen3, 16 streams, 4 long prompts
    python bench/disagg.py --json bench/results/disagg_cpu.json

Setups (each process pinned with `taskset`, one thread per process):
- colocated-1core: one instance on core 0;
- colocated-2cores: one instance on cores 0-1 with two threads (the same cores as the pair);
- disagg-1+1: a prefill instance on core 0, a decode instance on core 1.
Every setup is reached through `moe-serve router` (cores 0-1; `--worker`, or `--prefill --decode`
for the pair), so that the relay costs the same everywhere.

Workload: `--streams` requests with short prompts decode `--output-len` tokens each; once they all
stream, `--long-prompts` prompts of `--long-len` tokens arrive `--gap` seconds apart (one token
each). Reported: the decoding streams' inter-token latency p50/p95/max and TPOT p50/p95 (the stall
a long prompt causes shows in p95/max), the long prompts' TTFT p50/max, output tokens/s; for the
pair, the KV moved per long prompt (bytes, per token), the write time per request and per token as
the prefill side measures it (post to completion), and the decode side's wait from reserving
blocks to the KV's arrival (`moe_serve:kv_transfer_wait_seconds`).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine  # noqa: E402
from synthetic_models import resolve_model  # noqa: E402  (takes bench/ off the path: its kernels.py
#                                                         would shadow the `kernels` package transformers imports)

ROOT = str(Path(__file__).resolve().parents[1])


def free_port() -> int:
    sys.path.insert(0, ROOT)
    from tests.e2e.server import free_port as fp

    return fp()


class Proc:
    def __init__(self, cores: str, threads: int, args: list[str], command: str = "serve"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/moe-serve-bench-disagg-{self.port}.log"
        cmd = ["taskset", "-c", cores, sys.executable, "-m", "moe_serve.entrypoints.cli", command, "--host",
               "127.0.0.1", "--port", str(self.port), *args]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=ROOT)
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, env=env,
                                     cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{command} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{command} did not become healthy; see {self.log_path}")

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


async def one(client, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    times = []
    async with client.stream("POST", url + "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0}) as r:  # logprobs: an event per token even when its text is held back
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                lp = json.loads(line[6:])["choices"][0].get("logprobs") or {}
                now = time.perf_counter()
                times += [now] * max(1, len(lp.get("tokens") or ()))
    return {"ttft": times[0] - t0, "gaps": [b - a for a, b in zip(times, times[1:])], "tokens": len(times)}


async def workload(url: str, model: str, ns, rng: random.Random) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        await one(client, url, model, [rng.randrange(10, 4000) for _ in range(8)], 2)  # warm
        streams = [asyncio.create_task(one(client, url, model, [rng.randrange(10, 4000) for _ in range(16)],
                                           ns.output_len)) for _ in range(ns.streams)]
        await asyncio.sleep(ns.gap)
        t0 = time.perf_counter()
        longs = []
        for _ in range(ns.long_prompts):
            longs.append(asyncio.create_task(one(client, url, model, [rng.randrange(10, 4000)
                                                                      for _ in range(ns.long_len)], 1)))
            await asyncio.sleep(ns.gap)
        s = await asyncio.gather(*streams)
        lg = await asyncio.gather(*longs)
        wall = time.perf_counter() - t0
    gaps = sorted(g for r in s for g in r["gaps"])
    tpot = sorted(sum(r["gaps"]) / len(r["gaps"]) for r in s if r["gaps"])

    def q(v, p):
        return v[min(len(v) - 1, int(p * len(v)))] * 1000

    return {"itl_ms": {"p50": q(gaps, 0.5), "p95": q(gaps, 0.95), "max": gaps[-1] * 1000},
            "tpot_ms": {"p50": q(tpot, 0.5), "p95": q(tpot, 0.95)},
            "long_ttft_ms": {"p50": statistics.median(r["ttft"] for r in lg) * 1000,
                             "max": max(r["ttft"] for r in lg) * 1000},
            "stream_ttft_ms_p50": statistics.median(r["ttft"] for r in s) * 1000,
            "output_tokens_per_s": sum(r["tokens"] for r in s) / wall}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic-qwen3")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--long-prompts", type=int, default=4)
    p.add_argument("--long-len", type=int, default=1024)
    p.add_argument("--gap", type=float, default=1.0, help="seconds between long prompts (and before the first)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    path, short, description = resolve_model(ns.model)
    common = ["--model", path, "--dtype", ns.dtype, "--served-model-name", "m", "--kv-cache-memory", str(256 << 20),
              "--max-num-seqs", "32"]
    out = {"machine": machine(), "date": dt.date.today().isoformat(), "model": description,
           "command": "python bench/disagg.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "workload": {k: getattr(ns, k) for k in ("streams", "output_len", "long_prompts", "long_len", "gap")},
           "setups": {}}
    def routed(*instances, prefill=None):
        args = ["--prefill", prefill.url, "--decode"] if prefill is not None else ["--worker"]
        return [*([prefill] if prefill else []), *instances,
                Proc("0-1", 1, args + [i.url for i in instances], "router")]

    setups = {
        "colocated-1core": lambda: routed(Proc("0", 1, common)),
        "colocated-2cores": lambda: routed(Proc("0-1", 2, common)),
        "disagg-1+1": lambda: routed(Proc("1", 1, common + ["--disaggregation-mode", "decode"]),
                                     prefill=Proc("0", 1, common + ["--disaggregation-mode", "prefill"])),
    }
    for name, make in setups.items():
        procs = make()
        try:
            front = procs[-1]
            res = asyncio.run(workload(front.url, "m", ns, random.Random(0)))
            if name.startswith("disagg"):
                pm, dm = procs[0].metrics(), procs[1].metrics()
                n = pm["moe_serve:kv_transfer_sent_requests_total"]
                moved = pm["moe_serve:kv_transfer_sent_bytes_total"]
                tokens = n and (ns.long_prompts * (ns.long_len - 1) + ns.streams * 15 + 7 + 1) / n
                res["kv_transfer"] = {
                    "requests": int(n), "bytes": int(moved), "bytes_per_token": moved / max(1, n * tokens),
                    "write_ms_per_request": 1000 * pm["moe_serve:kv_transfer_send_seconds_total"] / max(n, 1),
                    "write_GBps": moved / max(pm["moe_serve:kv_transfer_send_seconds_total"], 1e-9) / 1e9,
                    "decode_wait_ms_mean": 1000 * dm["moe_serve:kv_transfer_wait_seconds_sum"]
                    / max(dm["moe_serve:kv_transfer_wait_seconds_count"], 1),
                    "fallbacks": int(dm["moe_serve:kv_transfer_fallbacks_total"])}
            out["setups"][name] = res
            print(name, json.dumps(res), flush=True)
        finally:
            for pr in reversed(procs):
                pr.stop()
    base = out["setups"]["colocated-2cores"]
    d = out["setups"]["disagg-1+1"]
    out["disagg_vs_colocated_2cores"] = {"itl_p95": d["itl_ms"]["p95"] / base["itl_ms"]["p95"],
                                         "itl_max": d["itl_ms"]["max"] / base["itl_ms"]["max"],
                                         "tpot_p50": d["tpot_ms"]["p50"] / base["tpot_ms"]["p50"],
                                         "long_ttft_p50": d["long_ttft_ms"]["p50"] / base["long_ttft_ms"]["p50"]}
    print(json.dumps(out["disagg_vs_colocated_2cores"]))
    if ns.json:
        Path(ns.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
