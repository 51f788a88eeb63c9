"""Serving load generator for any OpenAI-compatible endpoint (moe-serve, vLLM, SGLang, ...).

Sends --num-requests streaming requests with synthetic prompts (random token ids or random words)
and output lengths (fixed or uniform), either open-loop at a Poisson --request-rate or closed-loop
with --concurrency requests in flight (both: Poisson arrivals, at most that many in flight).
Measures, per load level:

- request throughput and output tokens/s (completed requests / tokens over the wall time),
- TTFT (time to the first streamed content), TPOT ((latency - TTFT) / (output tokens - 1)) and
  inter-token latency (gaps between streamed chunks), each p50 / p95 / p99,
- the server's peak KV cache usage, polling /metrics in the background (moe_serve:kv_cache_usage_perc,
  or vLLM's / SGLang's equivalents); with --launch also the KV cache size, so the peak in bytes.

--sweep 1,4,16,32 runs one level per concurrency and draws latency and throughput against load
(PNG with matplotlib, else a hand-written SVG). --launch starts `moe-serve serve` on a free port
with --model (a checkpoint, 'default' or a bench/synthetic_models.py name) and stops it afterwards.

    python bench/serve.py --launch --model default --sweep 1,4,16,32 --num-requests 64
    python bench/serve.py --base-url http://127.0.0.1:8000 --model my-model --request-rate 4 --num-requests 200
    python bench/serve.py --base-url http://gpu-box:8000 --model Qwen/Qwen3-30B-A3B --concurrency 64 \\
        --prompt-kind words --input-len 512 --output-len 256 --dist uniform --range-ratio 0.5

Writes bench/results/serve_<model>_<time>.json (and .png / .svg for sweeps).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The repository root first, and not bench/ itself: bench/kernels.py would shadow the `kernels` package.
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

import httpx  # noqa: E402

# Plain, common English words: "random words" prompts read like text to any tokenizer.
WORDS = ("the of and to in is was for on are with as his they be at one have this from by hot word but "
         "what some we can out other were all there when up use your how said an each she which do their "
         "time if will way about many then them write would like so these her long make thing see him two "
         "has look more day could go come did number sound no most people my over know water than call first "
         "who may down side been now find any new work part take get place made live where after back little "
         "only round man year came show every good me give our under name very through just form sentence "
         "great think say help low line differ turn cause much mean before move right boy old too same tell "
         "does set three want air well also play small end put home read hand port large spell add even land "
         "here must big high such follow act why ask men change went light kind off need house picture try "
         "again animal point mother world near build self earth father head stand own page should country "
         "found answer school grow study still learn plant cover food sun four between state keep eye never "
         "last let thought city tree cross farm hard start might story saw far sea draw left late run while "
         "press close night real life few north open seem together next white children begin got walk example "
         "ease paper group always music those both mark often letter until mile river car feet care second book "
         "carry took science eat room friend began idea fish mountain stop once base hear horse cut sure watch "
         "color face wood main enough plain girl usual young ready above ever red list though feel talk bird "
         "soon body dog family direct pose leave song measure door product black short numeral class wind "
         "question happen complete ship area half rock order fire south problem piece told knew pass since top "
         "whole king space heard best hour better true during hundred five remember step early hold west ground "
         "interest reach fast verb sing listen six table travel less morning ten simple several vowel toward war "
         "lay against pattern slow center love person money serve appear road map rain rule govern pull cold "
         "notice voice unit power town fine certain fly fall lead cry dark machine note wait plan figure star "
         "box noun field rest correct able pound done beauty drive stood contain front teach week final gave "
         "green oh quick develop ocean warm free minute strong special mind behind clear tail produce fact").split()

KV_METRICS = ("moe_serve:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
              "sglang:token_usage")
RUNNING_METRICS = ("moe_serve:num_requests_running", "vllm:num_requests_running", "sglang:num_running_reqs")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- workload ----------------------------------------------------------------------------------
def sample_len(rng: random.Random, mean: int, dist: str, ratio: float) -> int:
    if dist == "fixed":
        return mean
    lo, hi = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def make_requests(args, pool: list[int] | None) -> list[dict]:
    """The request bodies (without model/stream fields): same seed, same workload on every engine."""
    rng = random.Random(args.seed)
    reqs = []
    for _ in range(args.num_requests):
        n_in = sample_len(rng, args.input_len, args.dist, args.range_ratio)
        n_out = sample_len(rng, args.output_len, args.dist, args.range_ratio)
        if args.prompt_kind == "ids":
            prompt: list[int] | str = [rng.choice(pool) for _ in range(n_in)]
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(n_in))
        reqs.append({"prompt": prompt, "max_tokens": n_out})
    return reqs


# ---- one request -------------------------------------------------------------------------------
@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


async def send(client: httpx.AsyncClient, args, body: dict) -> Result:
    res = Result()
    payload = {"model": args.served_model, "max_tokens": body["max_tokens"], "temperature": args.temperature,
               "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        payload["ignore_eos"] = True  # vLLM / SGLang / moe-serve extension: exact output lengths
    if args.endpoint == "chat":
        prompt = body["prompt"] if isinstance(body["prompt"], str) else " ".join(map(str, body["prompt"]))
        payload["messages"] = [{"role": "user", "content": prompt}]
        url = "/v1/chat/completions"
    else:
        payload["prompt"] = body["prompt"]
        url = "/v1/completions"
    chunks = 0
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.stream("POST", url, json=payload) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    res.prompt_tokens = msg["usage"].get("prompt_tokens", 0)
                    res.output_tokens = msg["usage"].get("completion_tokens", 0)
                for ch in msg.get("choices") or ():
                    text = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                    if not text:
                        continue  # role-only chunks, or tokens that decode to nothing yet
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
        res.latency = time.perf_counter() - t0
        if res.output_tokens == 0:  # server without usage in streams: one token per chunk
            res.output_tokens = chunks
        if chunks == 0:
            res.ttft = res.latency
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, asyncio.TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


# ---- /metrics polling --------------------------------------------------------------------------
def parse_gauge(text: str, names: tuple[str, ...]) -> float | None:
    for name in names:
        m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)\s*$", text, re.M)
        if m:
            return float(m.group(1))
    return None


async def poll_metrics(client: httpx.AsyncClient, interval: float, state: dict, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            r = await client.get("/metrics", timeout=5.0)
            if r.status_code == 200:
                kv = parse_gauge(r.text, KV_METRICS)
                run = parse_gauge(r.text, RUNNING_METRICS)
                if kv is not None:
                    state["kv_peak"] = max(state.get("kv_peak", 0.0), kv)
                if run is not None:
                    state["running_peak"] = max(state.get("running_peak", 0.0), run)
                state["polls"] = state.get("polls", 0) + 1
        except httpx.HTTPError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


# ---- one load level ----------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    s = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
         "request_throughput": len(ok) / duration, "output_tokens_per_s": out_tok / duration,
         "total_tokens_per_s": (out_tok + sum(r.prompt_tokens for r in ok)) / duration,
         "prompt_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": out_tok}
    for name, xs in (("ttft", [r.ttft for r in ok]), ("tpot", tpot), ("itl", itl),
                     ("e2e", [r.latency for r in ok])):
        s[f"mean_{name}_ms"] = 1e3 * sum(xs) / len(xs) if xs else float("nan")
        for q in (50, 95, 99):
            s[f"p{q}_{name}_ms"] = 1e3 * pct(xs, q)
    errors = [r.error for r in results if not r.ok]
    if errors:
        s["first_error"] = errors[0]
    return s


async def run_level(args, requests: list[dict], concurrency: int | None, rate: float) -> dict:
    limits = httpx.Limits(max_connections=(concurrency or len(requests)) + 8, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=args.base_url, headers=args.headers, limits=limits,
                                 timeout=timeout) as client:
        state: dict = {}
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_metrics(client, args.metrics_interval, state, stop))
        sem = asyncio.Semaphore(concurrency) if concurrency else None
        rng = random.Random(args.seed + 1)
        done = 0
        step = max(1, len(requests) // 4)

        async def one(body):
            nonlocal done
            if sem is None:
                r = await send(client, args, body)
            else:
                async with sem:
                    r = await send(client, args, body)
            done += 1
            if done % step == 0 or done == len(requests):
                log(f"  {done}/{len(requests)} done")
            return r

        t0 = time.perf_counter()
        tasks = []
        for body in requests:
            tasks.append(asyncio.create_task(one(body)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        stop.set()
        await poller
    s = summarize(results, duration)
    s.update(concurrency=concurrency, request_rate=None if math.isinf(rate) else rate,
             peak_kv_cache_usage=state.get("kv_peak"), peak_running=state.get("running_peak"),
             metrics_polls=state.get("polls", 0))
    return s


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


# ---- plots -------------------------------------------------------------------------------------
SERIES = [("p50_ttft_ms", "TTFT p50"), ("p95_ttft_ms", "TTFT p95"), ("p50_tpot_ms", "TPOT p50"),
          ("p95_tpot_ms", "TPOT p95"), ("p95_itl_ms", "ITL p95")]


def plot(levels: list[dict], title: str, out_base: Path) -> Path:
    xs = [lv["concurrency"] for lv in levels]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return svg_plot(levels, title, out_base.with_suffix(".svg"))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in SERIES:
        a1.plot(xs, [lv[key] for lv in levels], marker="o", label=label)
    a1.set(xscale="log", yscale="log", xlabel="concurrency (requests in flight)", ylabel="latency (ms)",
           title="latency against load")
    a1.set_xticks(xs, [str(x) for x in xs])
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    a1.yaxis.set_major_formatter(plain)
    a1.yaxis.set_minor_formatter(plain)
    a1.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=8)
    a2.plot(xs, [lv["output_tokens_per_s"] for lv in levels], marker="o", color="tab:green")
    a2.set(xscale="log", xlabel="concurrency (requests in flight)", ylabel="output tokens/s",
           title="throughput against load")
    a2.set_xticks(xs, [str(x) for x in xs])
    a2.grid(True, which="both", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = out_base.with_suffix(".png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def svg_plot(levels: list[dict], title: str, path: Path) -> Path:
    """Latency (log-log) against concurrency as a plain SVG, for machines without matplotlib."""
    W, H, L, R, T, B = 640, 400, 60, 130, 40, 50
    xs = [math.log(lv["concurrency"]) for lv in levels]
    vals = [lv[k] for lv in levels for k, _ in SERIES if lv[k] > 0 and math.isfinite(lv[k])]
    lo, hi = math.log(min(vals)), math.log(max(vals))
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    hi = hi if hi > lo else lo + 1
    px = lambda x: L + (x - x0) / (x1 - x0) * (W - L - R)  # noqa: E731
    py = lambda y: H - B - (math.log(y) - lo) / (hi - lo) * (H - T - B)  # noqa: E731
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<text x="{W / 2}" y="20" text-anchor="middle">{title}</text>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>',
           f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">concurrency</text>',
           f'<text x="14" y="{(T + H - B) / 2}" transform="rotate(-90 14 {(T + H - B) / 2})" '
           f'text-anchor="middle">latency (ms, log)</text>']
    for lv, x in zip(levels, xs):
        out.append(f'<text x="{px(x)}" y="{H - B + 15}" text-anchor="middle">{lv["concurrency"]}</text>')
    for v in (min(vals), max(vals)):
        out.append(f'<text x="{L - 5}" y="{py(v) + 4}" text-anchor="end">{v:.0f}</text>')
    for i, (key, label) in enumerate(SERIES):
        pts = [(px(x), py(lv[key])) for lv, x in zip(levels, xs) if lv[key] > 0 and math.isfinite(lv[key])]
        c = colors[i % len(colors)]
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="'
                   + " ".join(f"{a:.1f},{b:.1f}" for a, b in pts) + '"/>')
        out.append(f'<text x="{W - R + 10}" y="{T + 15 * i + 10}" fill="{c}">{label}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")
    return path


# ---- main --------------------------------------------------------------------------------------
def print_level(s: dict) -> None:
    kv = "n/a" if s.get("peak_kv_cache_usage") is None else f"{100 * s['peak_kv_cache_usage']:.2f}%"
    kvb = f" = {s['peak_kv_cache_bytes'] / 2**20:.1f} MiB" if s.get("peak_kv_cache_bytes") is not None else ""
    print(f"  requests {s['completed']} ok / {s['failed']} failed in {s['duration_s']:.1f} s: "
          f"{s['request_throughput']:.2f} req/s, {s['output_tokens_per_s']:.1f} output tok/s")
    for name in ("ttft", "tpot", "itl", "e2e"):
        print(f"  {name.upper():5s} ms  mean {s[f'mean_{name}_ms']:8.1f}  p50 {s[f'p50_{name}_ms']:8.1f}  "
              f"p95 {s[f'p95_{name}_ms']:8.1f}  p99 {s[f'p99_{name}_ms']:8.1f}")
    print(f"  peak KV cache usage {kv}{kvb}, peak running {s.get('peak_running')} "
          f"({s['metrics_polls']} polls of /metrics)")
    if s.get("first_error"):
        print(f"  first error: {s['first_error']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", default=None,
                   help="model name to request; with --launch, the checkpoint to serve (a path, 'default', "
                        "or a bench/synthetic_models.py name). Default: the first of /v1/models")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="Poisson arrivals per second (default inf: all at once)")
    load.add_argument("--concurrency", type=int, default=None, help="at most this many requests in flight")
    load.add_argument("--sweep", default=None, help="comma-separated concurrency levels, e.g. 1,4,16,32")
    load.add_argument("--num-requests", type=int, default=64, help="requests per load level")
    load.add_argument("--warmup-requests", type=int, default=2)
    wl = p.add_argument_group("workload")
    wl.add_argument("--prompt-kind", choices=["ids", "words"], default="ids",
                    help="random token ids (exact prompt lengths) or random English words (any tokenizer)")
    wl.add_argument("--input-len", type=int, default=128, help="prompt tokens (words for --prompt-kind words)")
    wl.add_argument("--output-len", type=int, default=64)
    wl.add_argument("--dist", choices=["fixed", "uniform"], default="fixed")
    wl.add_argument("--range-ratio", type=float, default=0.5, help="uniform: lengths in [L(1-r), L(1+r)]")
    wl.add_argument("--vocab-size", type=int, default=None,
                    help="token ids are drawn from [100, vocab) (default: the checkpoint's with --launch, else 32000)")
    wl.add_argument("--temperature", type=float, default=0.0)
    wl.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="let EOS end outputs early (default: ignore_eos, exact output lengths)")
    wl.add_argument("--seed", type=int, default=0)
    srv = p.add_argument_group("--launch (our server)")
    srv.add_argument("--launch", action="store_true", help="start moe-serve on a free port, stop it at the end")
    srv.add_argument("--dtype", default=None)
    srv.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="bytes")
    srv.add_argument("--max-num-seqs", type=int, default=64)
    srv.add_argument("--server-threads", type=int, default=None, help="OMP_NUM_THREADS for the server")
    srv.add_argument("--server-args", default="", help="more `moe-serve serve` flags, one string")
    srv.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--metrics-interval", type=float, default=0.25)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/serve_<model>_<time>.json)")
    args = p.parse_args(argv)
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    server, pool, info = None, None, {}
    if args.launch:
        from bench.synthetic_models import resolve_model, token_pool

        path, name, desc = resolve_model(args.model or "default")
        args.served_model = name
        info = {"model_path": path, "description": desc}
        pool = token_pool(path)
        if args.vocab_size:
            pool = [i for i in pool if i < args.vocab_size]
        server = Server(args, path)
    try:
        if server:
            server.wait_ready(args.startup_timeout)
            args.base_url = server.base_url
            info.update(server.kv_cache())
            log(f"server ready at {args.base_url}: {desc}; KV cache {info}")
        elif args.model:
            args.served_model = args.model
        else:
            try:
                r = httpx.get(args.base_url + "/v1/models", headers=args.headers, timeout=10.0)
                args.served_model = r.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
                raise SystemExit(f"cannot list models at {args.base_url}/v1/models ({type(e).__name__}: {e}); "
                                 f"is the server up? Pass --model to skip this, or --launch") from None
        if pool is None:
            pool = list(range(100, args.vocab_size or 32000))
        requests = make_requests(args, pool)
        if args.warmup_requests:
            warm = make_requests(argparse.Namespace(**{**vars(args), "seed": args.seed + 99,
                                                       "num_requests": args.warmup_requests}), pool)
            asyncio.run(run_level(args, [{**w, "max_tokens": min(w["max_tokens"], 8)} for w in warm], None,
                                  float("inf")))
        levels_c = [int(x) for x in args.sweep.split(",")] if args.sweep else [args.concurrency]
        levels = []
        for c in levels_c:
            what = f"concurrency {c}" if c else "unbounded concurrency"
            what += f", Poisson {args.request_rate}/s" if math.isfinite(args.request_rate) else ""
            log(f"level: {what}, {len(requests)} requests ({args.prompt_kind} prompts, in {args.input_len}, "
                f"out {args.output_len}, {args.dist})")
            s = asyncio.run(run_level(args, requests, c, args.request_rate))
            if s.get("peak_kv_cache_usage") is not None and info.get("kv_cache_bytes"):
                s["peak_kv_cache_bytes"] = s["peak_kv_cache_usage"] * info["kv_cache_bytes"]
            print_level(s)
            levels.append(s)
    finally:
        if server:
            server.stop()
            log("server stopped")

    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", args.served_model)[-60:]
    out = Path(args.out) if args.out else HERE / "results" / f"serve_{safe}_{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("headers", "api_key")}
    config["request_rate"] = None if math.isinf(args.request_rate) else args.request_rate
    result = {"config": config, "server": info, "levels": levels}
    if len(levels) > 1 and all(lv["concurrency"] for lv in levels):
        title = (f"{args.served_model}: {args.num_requests} requests per level, {args.prompt_kind} prompts "
                 f"in={args.input_len} out={args.output_len} ({args.dist})")
        result["plot"] = str(plot(levels, title, out.with_suffix("")))
        log(f"wrote {result['plot']}")
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out}")
    return 0 if all(lv["failed"] == 0 for lv in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
