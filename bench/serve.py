"""`moe-serve bench serve` with --launch: start our server on a benchmark checkpoint, load it, stop it.

The load generator, workloads, summaries, JSON result and plots are the package's
(`moe_serve/benchmarks/`, the `moe-serve bench serve` command; every one of its flags works here).
This script adds what only the repository has: --launch starts `moe-serve serve` on a free port
with --model (a checkpoint, 'default' or a bench/synthetic_models.py name), draws random prompts
from that checkpoint's own (non-special) token ids, reports the peak KV cache in bytes from the
server's start-up log, and stops the server afterwards. Without --launch it is
`moe-serve bench serve` with this script's defaults.

Defaults that differ from `moe-serve bench serve`: --ignore-eos on (--no-ignore-eos turns it
off), 64 prompts of 128 tokens with 64 output tokens, 2 warm-up requests, and the result always
saved under bench/results/. The old flag names (--sweep, --num-requests, --concurrency,
--input-len, --output-len, --range-ratio, --vocab-size, --warmup-requests, --out) still work.

    python bench/serve.py --launch --model default --concurrency-sweep 1,4,16,32 --num-prompts 64
    python bench/serve.py --base-url http://127.0.0.1:8000 --model my-model --request-rate 4 --num-prompts 200
    python bench/serve.py --base-url http://gpu-box:8000 --model Qwen/Qwen3-30B-A3B --max-concurrency 64 \\
        --endpoint /v1/chat/completions --random-input-len 512 --random-output-len 256 --random-range-ratio 0.5

bench/overhead.py and bench/structured.py use this module's Server, free_port, log, WORDS,
run_level and print_level.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The repository root first, and not bench/ itself: bench/kernels.py would shadow the `kernels` package.
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

import httpx  # noqa: E402

from moe_serve.benchmarks import serve as bench_serve  # noqa: E402
from moe_serve.benchmarks.datasets import WORDS, Sample  # noqa: E402,F401  (WORDS: structured.py, synthetic_models.py)
from moe_serve.benchmarks.endpoint import CHAT, COMPLETIONS, BenchError  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- the package's load generator, for overhead.py's hand-made workloads ---------------------
async def run_level(args, requests: list[dict], concurrency: int | None, rate: float) -> dict:
    """One load level of `requests` ({"prompt": ids or text, "max_tokens": n}) with at most
    `concurrency` in flight and Poisson arrivals at `rate` per second, through moe_serve.benchmarks.
    `args` carries base_url, headers, served_model, temperature, ignore_eos, endpoint ('completions'
    | 'chat'), request_timeout, metrics_interval, seed. The summary has the package's keys plus this
    script's earlier names (concurrency, duration_s, output_tokens_per_s, *_e2e_ms, ...)."""
    load = bench_serve.Load(args.base_url, args.headers, args.served_model,
                            CHAT if args.endpoint == "chat" else COMPLETIONS, rate, 1.0, args.seed + 1,
                            args.temperature, args.ignore_eos, args.request_timeout, args.metrics_interval)
    jobs = [Sample(r["prompt"], r["max_tokens"], len(r["prompt"]) if isinstance(r["prompt"], list) else None)
            for r in requests]
    lr = await bench_serve.run_level(jobs, load, concurrency)
    s = bench_serve.summarize(lr, list(bench_serve.METRICS), [50, 95, 99])
    s["request_rate"] = None if math.isinf(rate) else rate
    s["burstiness"] = 1.0
    return with_legacy_names(s)


def with_legacy_names(s: dict) -> dict:
    s.update(concurrency=s["max_concurrency"], duration_s=s["duration"], output_tokens_per_s=s["output_throughput"],
             total_tokens_per_s=s["total_token_throughput"], prompt_tokens=s["total_input_tokens"],
             output_tokens=s["total_output_tokens"], peak_running=s.get("peak_num_requests_running"))
    for k in [k for k in s if k.endswith("_e2el_ms")]:
        s[k.replace("_e2el_ms", "_e2e_ms")] = s[k]
    if s.get("errors"):
        s["first_error"] = s["errors"][0]
    return s


def print_level(s: dict, kv_cache_bytes: int | None = None) -> None:
    metrics = [m for m in bench_serve.METRICS if f"mean_{m}_ms" in s]
    bench_serve.print_summary(s, metrics, [50, 95, 99], kv_cache_bytes)


# ---- --launch ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`moe-serve serve` in its own process group on a free port; stopped (the group) in stop()."""

    def __init__(self, args, path: str):
        self.port = free_port()
        self.log_path = os.path.join(tempfile.mkdtemp(prefix="moe-serve-bench-"), "server.log")
        cmd = [sys.executable, "-m", "moe_serve.entrypoints.cli", "serve", "--model", path,
               "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", args.served_model,
               "--kv-cache-memory", str(args.kv_cache_memory), "--max-num-seqs", str(args.max_num_seqs),
               *args.server_args.split()]
        if args.dtype:
            cmd += ["--dtype", args.dtype]
        env = dict(os.environ)
        if args.server_threads:
            env["OMP_NUM_THREADS"] = str(args.server_threads)
        env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
        log(f"launching: {' '.join(cmd)}  (log: {self.log_path})")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=str(HERE.parent),
                                     start_new_session=True)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"server not healthy after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def kv_cache(self) -> dict:
        """KV cache size from the engine's start-up log line."""
        with open(self.log_path) as f:
            text = f.read()
        m = re.search(r"KV cache: (\d+) blocks x (\d+) tokens = (\d+) tokens, ([0-9.]+) MiB", text)
        if not m:
            return {}
        return {"kv_cache_blocks": int(m.group(1)), "kv_cache_tokens": int(m.group(3)),
                "kv_cache_bytes": int(float(m.group(4)) * 2**20)}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log.close()


# ---- main --------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    bench_serve.add_cli_args(p)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let EOS end outputs early (this script's default: --ignore-eos)")
    srv = p.add_argument_group("--launch (our server)")
    srv.add_argument("--launch", action="store_true",
                     help="start moe-serve on a free port with --model as the checkpoint, stop it at the end")
    srv.add_argument("--dtype", default=None)
    srv.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="bytes")
    srv.add_argument("--max-num-seqs", type=int, default=64)
    srv.add_argument("--server-threads", type=int, default=None, help="OMP_NUM_THREADS for the server")
    srv.add_argument("--server-args", default="", help="more `moe-serve serve` flags, one string")
    srv.add_argument("--startup-timeout", type=float, default=900.0)
    old = [("--sweep", "concurrency_sweep", str), ("--num-requests", "num_prompts", int),
           ("--concurrency", "max_concurrency", int), ("--input-len", "random_input_len", int),
           ("--output-len", "random_output_len", int), ("--range-ratio", "random_range_ratio", float),
           ("--vocab-size", "random_vocab_size", int), ("--warmup-requests", "num_warmups", int),
           ("--out", "out", str)]
    for flag, dest, typ in old:  # this script's earlier names
        p.add_argument(flag, dest=dest, type=typ, help=argparse.SUPPRESS)
    p.set_defaults(ignore_eos=True, num_prompts=64, random_input_len=128, random_output_len=64, num_warmups=2,
                   save_result=True, result_dir=str(HERE / "results"), out=None,
                   random_vocab_size=None)  # --launch: the checkpoint's token ids; else 32000
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.out:
        args.result_dir, args.result_filename = os.path.dirname(os.path.abspath(args.out)), os.path.basename(args.out)
    try:
        bench_serve.validate(argparse.Namespace(**{**vars(args), "random_vocab_size": args.random_vocab_size or 32000}))
    except ValueError as e:
        p.error(str(e))
    server, pool, facts = None, None, {}
    if args.launch:
        from bench.synthetic_models import resolve_model, token_pool

        path, name, desc = resolve_model(args.model or "default")
        args.served_model = args.model = name
        facts = {"model_path": path, "description": desc}
        pool = token_pool(path)
        if args.random_vocab_size is not None:
            pool = [i for i in pool if i < args.random_vocab_size]
        args.random_vocab_size = max(pool) + 1  # for the record: the ids come from the checkpoint's tokenizer
        server = Server(args, path)
    try:
        if server:
            server.wait_ready(args.startup_timeout)
            args.base_url = server.base_url
            facts.update(server.kv_cache())
            log(f"server ready at {args.base_url}: {desc}; KV cache {facts}")
        if args.result_filename is None:
            safe = re.sub(r"[^A-Za-z0-9._-]+", "_", args.model or "model")[-60:]
            args.result_filename = f"serve_{safe}_{time.strftime('%Y%m%d-%H%M%S')}.json"
        if args.random_vocab_size is None:
            args.random_vocab_size = 32000
        return bench_serve.run(args, server_facts=facts, token_pool=pool)
    except BenchError as e:
        print(f"bench/serve.py: error: {e}", file=sys.stderr)
        return 1
    finally:
        if server:
            server.stop()
            log("server stopped")


if __name__ == "__main__":
    sys.exit(main())
