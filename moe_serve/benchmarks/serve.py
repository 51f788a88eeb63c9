"""`moe-serve bench serve`: load any OpenAI-compatible server with streamed requests and measure
what its users see (TTFT, TPOT, inter-token and end-to-end latency, throughput), plus what the
server says about itself on /metrics while the load runs (peak KV cache usage; on moe-serve the
decode speed of light).

Requests arrive all at once (--request-rate inf, the default) or as a Poisson process
(--burstiness 1) or a gamma process (other burstiness) at --request-rate per second; at most
--max-concurrency are in flight. --concurrency-sweep 1,4,16 runs one level per value (each with a
fresh workload drawn from --seed + level) and plots latency and throughput against concurrency.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import httpx
import numpy as np

from moe_serve.benchmarks import datasets as D
from moe_serve.benchmarks.endpoint import (CHAT, COMPLETIONS, ENDPOINTS, BenchError, RequestResult, list_models,
                                           payload_for, server_tokenizer, stream_request)
from moe_serve.benchmarks.plot import INSTALL_HINT, have_matplotlib, plot_level, plot_sweep, png_path
from moe_serve.benchmarks.server_metrics import MetricsWatch

METRICS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
FIRST_TOKEN_ID = 100  # random token-id prompts draw from [100, --random-vocab-size)
SCHEMA_VERSION = 1


# ---- flags -------------------------------------------------------------------------------------
def add_cli_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None,
                   help="the server's root URL, e.g. http://gpu-box:8000 (default: http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default=COMPLETIONS, choices=ENDPOINTS,
                   help="completions: prompts as text or token ids; chat: one user message (or a conversation)")
    g.add_argument("--model", default=None, help="the model name to request (default: the first of GET /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    g.add_argument("--tokenizer", default=None,
                   help="sharegpt: a tokenizer.json (or a folder holding one) to count tokens with (default: the "
                        "server's POST /tokenize)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    g.add_argument("--metrics-interval", type=float, default=0.1,
                   help="seconds between polls of the server's /metrics during a level")

    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", default="random", choices=D.DATASETS)
    g.add_argument("--dataset-path", default=None, help="sharegpt: the ShareGPT-format JSON file")
    g.add_argument("--num-prompts", type=int, default=1000,
                   help="requests per level (multi_turn: conversations, each of --multi-turn-num-turns requests)")
    g.add_argument("--random-input-len", type=int, default=1024,
                   help="random: prompt tokens (words on the chat endpoint); multi_turn: words per user message")
    g.add_argument("--random-output-len", type=int, default=128, help="random and multi_turn: output tokens")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random and multi_turn: lengths drawn uniformly in [L(1-r), L(1+r)], 0 <= r < 1")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="random: tokens (words) of one prefix every request starts with")
    g.add_argument("--random-vocab-size", type=int, default=32000,
                   help=f"random token ids are drawn from [{FIRST_TOKEN_ID}, this); keep it within the model's "
                        "vocabulary")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: this output length for every request (default: the gpt turn's token count)")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)
    g.add_argument("--multi-turn-num-turns", type=int, default=3,
                   help="multi_turn: requests per conversation; turn k+1 resends turn k's prompt and answer")
    g.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos: outputs run to their full length (vLLM, SGLang and moe-serve)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests (multi_turn: conversations) per second; inf sends them all at once")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="shape of the gamma-distributed gaps between arrivals: 1 is Poisson, lower is burstier, "
                        "higher is more even")
    g.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    g.add_argument("--concurrency-sweep", default=None,
                   help="comma-separated max-concurrency levels, e.g. 1,4,16: one level each, then a PNG plot of "
                        "latency and throughput against concurrency")
    g.add_argument("--num-warmups", type=int, default=0, help="requests sent (and not measured) before the first level")

    g = p.add_argument_group("output")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="comma-separated, of ttft, tpot, itl, e2el")
    g.add_argument("--metric-percentiles", default="50,95,99", help="comma-separated percentiles, e.g. 25,50,99.9")
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument("--save-detailed", action="store_true",
                   help="with --save-result: also every request's lengths, latencies and error")
    g.add_argument("--result-dir", default=".", help="folder of the result JSON (and of a sweep's default plot)")
    g.add_argument("--result-filename", default=None,
                   help="default: serve-<dataset>-<model>-<date>.json")
    g.add_argument("--plot", type=png_path, default=None, metavar="PNG",
                   help="draw the run: latency and throughput against concurrency for a sweep, latency "
                        f"distributions and load over time for one level (needs matplotlib: {INSTALL_HINT})")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def csv_list(value: str, kind, flag: str) -> list:
    try:
        out = [kind(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {value!r}: expected comma-separated {kind.__name__}s") from None
    if not out:
        raise ValueError(f"{flag}: empty")
    return out


def validate(ns: argparse.Namespace) -> None:
    """Flag combinations argparse cannot check; raises ValueError naming the flag."""
    if ns.dataset_name == "sharegpt" and not ns.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT-format JSON file)")
    if ns.dataset_path and ns.dataset_name != "sharegpt":
        raise ValueError(f"--dataset-path is read by --dataset-name sharegpt only (not {ns.dataset_name})")
    if ns.dataset_path and not os.path.isfile(ns.dataset_path):
        raise ValueError(f"--dataset-path {ns.dataset_path}: no such file")
    positive = [("--num-prompts", ns.num_prompts), ("--random-input-len", ns.random_input_len),
                ("--random-output-len", ns.random_output_len), ("--multi-turn-num-turns", ns.multi_turn_num_turns),
                ("--prefix-repetition-prefix-len", ns.prefix_repetition_prefix_len),
                ("--prefix-repetition-num-prefixes", ns.prefix_repetition_num_prefixes),
                ("--prefix-repetition-output-len", ns.prefix_repetition_output_len),
                ("--request-timeout", ns.request_timeout), ("--metrics-interval", ns.metrics_interval),
                ("--burstiness", ns.burstiness), ("--request-rate", ns.request_rate)]
    for flag, v in positive:
        if not v > 0:
            raise ValueError(f"{flag} {v}: must be positive")
    for flag, v in [("--random-prefix-len", ns.random_prefix_len), ("--num-warmups", ns.num_warmups),
                    ("--prefix-repetition-suffix-len", ns.prefix_repetition_suffix_len)]:
        if v < 0:
            raise ValueError(f"{flag} {v}: must be >= 0")
    if ns.sharegpt_output_len is not None and ns.sharegpt_output_len < 1:
        raise ValueError(f"--sharegpt-output-len {ns.sharegpt_output_len}: must be >= 1")
    if not 0 <= ns.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio {ns.random_range_ratio}: must be in [0, 1)")
    if ns.random_vocab_size <= FIRST_TOKEN_ID:
        raise ValueError(f"--random-vocab-size {ns.random_vocab_size}: must be above {FIRST_TOKEN_ID}")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError(f"--max-concurrency {ns.max_concurrency}: must be >= 1")
    if ns.concurrency_sweep is not None:
        if ns.max_concurrency is not None:
            raise ValueError("give --concurrency-sweep or --max-concurrency, not both")
        sweep = csv_list(ns.concurrency_sweep, int, "--concurrency-sweep")
        if min(sweep) < 1:
            raise ValueError(f"--concurrency-sweep {ns.concurrency_sweep}: levels must be >= 1")
    metrics = csv_list(ns.percentile_metrics, str, "--percentile-metrics")
    bad = [m for m in metrics if m not in METRICS]
    if bad:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(bad)} (choose from {', '.join(METRICS)})")
    for q in csv_list(ns.metric_percentiles, float, "--metric-percentiles"):
        if not 0 <= q <= 100:
            raise ValueError(f"--metric-percentiles: {q} is not in [0, 100]")
    if ns.save_detailed and not ns.save_result:
        raise ValueError("--save-detailed needs --save-result")


# ---- the run -----------------------------------------------------------------------------------
@dataclass
class Load:
    """How requests are sent (one level's knobs besides the concurrency)."""

    base_url: str
    headers: dict
    model: str
    endpoint: str = COMPLETIONS
    request_rate: float = float("inf")
    burstiness: float = 1.0
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = False
    request_timeout: float = 600.0
    metrics_interval: float = 0.1
    disable_tqdm: bool = True
    watch_metrics: bool = True


@dataclass
class LevelRun:
    results: list[RequestResult]
    duration: float
    max_concurrency: int | None
    max_in_flight: int
    server: dict = field(default_factory=dict)


def num_requests(jobs: list) -> int:
    return sum(len(j.turns) if isinstance(j, D.Conversation) else 1 for j in jobs)


async def run_level(jobs: list, load: Load, max_concurrency: int | None) -> LevelRun:
    """Send every job (arrivals as load.request_rate / burstiness say, at most max_concurrency in
    flight; a conversation holds its slot for all its turns) and time the whole."""
    total = num_requests(jobs)
    limits = httpx.Limits(max_connections=(max_concurrency or total) + 4, max_keepalive_connections=None)
    timeout = httpx.Timeout(load.request_timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=load.base_url, headers=load.headers, limits=limits,
                                 timeout=timeout) as client, \
            httpx.AsyncClient(base_url=load.base_url, headers=load.headers, timeout=10.0) as mclient:
        watch = MetricsWatch(mclient, load.metrics_interval)
        if load.watch_metrics:
            await watch.start()
        from tqdm import tqdm

        bar = tqdm(total=total, disable=load.disable_tqdm, desc="requests", unit="req", leave=False)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        in_flight = peak = 0
        t_origin = time.perf_counter()

        async def send(prompt, output_len: int, prompt_len: int | None) -> RequestResult:
            nonlocal in_flight, peak
            body = payload_for(load.endpoint, load.model, prompt, output_len, load.temperature, load.ignore_eos)
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await stream_request(client, load.endpoint, body, t_origin, prompt_len)
            finally:
                in_flight -= 1
                bar.update(1)

        async def conversation(ci: int, conv: D.Conversation) -> list[RequestResult]:
            out: list[RequestResult] = []
            text, messages = "", []
            for k, turn in enumerate(conv.turns):
                if load.endpoint == CHAT:
                    messages.append({"role": "user", "content": turn.prompt})
                    prompt = list(messages)
                else:  # the previous prompt, the answer received, the new message
                    text += ("\n" if k else "") + f"User: {turn.prompt}\nAssistant:"
                    prompt = text
                r = await send(prompt, turn.output_len, None)
                r.conversation, r.turn = ci, k
                out.append(r)
                if not r.ok:
                    for rest in range(k + 1, len(conv.turns)):
                        out.append(RequestResult(error=f"not sent: turn {k} of its conversation failed",
                                                 conversation=ci, turn=rest))
                        bar.update(1)
                    break
                if load.endpoint == CHAT:
                    messages.append({"role": "assistant", "content": r.text})
                else:
                    text += r.text
            return out

        async def job(i: int, j) -> list[RequestResult]:
            async def go():
                if isinstance(j, D.Conversation):
                    return await conversation(i, j)
                return [await send(j.prompt, j.output_len, j.prompt_len)]

            if sem is None:
                return await go()
            async with sem:
                return await go()

        rng = np.random.default_rng(load.seed)
        tasks = []
        for i, j in enumerate(jobs):
            if i and math.isfinite(load.request_rate):
                # gamma gaps with mean 1/rate; shape 1 is exponential (Poisson arrivals)
                await asyncio.sleep(rng.gamma(load.burstiness, 1.0 / (load.request_rate * load.burstiness)))
            tasks.append(asyncio.create_task(job(i, j)))
        done = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_origin
        bar.close()
        if load.watch_metrics:
            await watch.stop()
    results = [r for rs in done for r in rs]
    return LevelRun(results, duration, max_concurrency, peak, watch.facts())  # all None when not watched


def metric_values(results: list[RequestResult]) -> dict[str, list[float]]:
    """Each latency metric's samples in ms, over the successful requests."""
    ok = [r for r in results if r.ok]
    return {"ttft": [1e3 * r.ttft for r in ok],
            "tpot": [1e3 * (r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1],
            "itl": [1e3 * x for r in ok for x in r.itl],
            "e2el": [1e3 * r.latency for r in ok]}


def pkey(q: float) -> str:
    return f"p{int(q)}" if float(q).is_integer() else f"p{q:g}"


def summarize(run: LevelRun, metrics: list[str], percentiles: list[float]) -> dict:
    """One level's figures: counts, throughputs, and per metric mean/median/std/min/max/pN in ms
    (None where there are no samples, e.g. TPOT of one-token outputs)."""
    ok = [r for r in run.results if r.ok]
    n_in, n_out = sum(r.prompt_len for r in ok), sum(r.output_len for r in ok)
    d = run.duration
    s: dict = {"max_concurrency": run.max_concurrency, "num_requests": len(run.results), "completed": len(ok),
               "failed": len(run.results) - len(ok), "duration": d, "total_input_tokens": n_in,
               "total_output_tokens": n_out, "request_throughput": len(ok) / d if d > 0 else 0.0,
               "output_throughput": n_out / d if d > 0 else 0.0,
               "total_token_throughput": (n_in + n_out) / d if d > 0 else 0.0,
               "max_concurrent_requests": run.max_in_flight,
               "usage_reported": bool(ok) and all(r.usage for r in ok)}
    values = metric_values(run.results)
    for m in metrics:
        xs = np.asarray(values[m], dtype=np.float64)
        have = xs.size > 0
        s[f"mean_{m}_ms"] = float(xs.mean()) if have else None
        s[f"median_{m}_ms"] = float(np.median(xs)) if have else None
        s[f"std_{m}_ms"] = float(xs.std()) if have else None
        s[f"min_{m}_ms"] = float(xs.min()) if have else None
        s[f"max_{m}_ms"] = float(xs.max()) if have else None
        for q in percentiles:
            s[f"{pkey(q)}_{m}_ms"] = float(np.percentile(xs, q)) if have else None
    s.update(run.server)
    errors = [r.error for r in run.results if not r.ok]
    s["errors"] = sorted(set(errors))[:5]
    return s


def detailed(run: LevelRun) -> list[dict]:
    return [{"ok": r.ok, "input_len": r.prompt_len, "output_len": r.output_len, "start_s": r.start,
             "ttft_ms": 1e3 * r.ttft if r.ok else None, "e2el_ms": 1e3 * r.latency if r.ok else None,
             "itl_ms": [1e3 * x for x in r.itl], "conversation": r.conversation, "turn": r.turn,
             "error": r.error or None} for r in run.results]


# ---- printing ----------------------------------------------------------------------------------
def _fmt(v, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def print_summary(s: dict, metrics: list[str], percentiles: list[float], kv_cache_bytes: int | None = None,
                  out=None) -> None:
    out = out or sys.stdout

    def row(label: str, v, spec: str = ".2f") -> None:
        print(f"{label:<45}{_fmt(v, spec) if not isinstance(v, str) else v:>12}", file=out)

    print("{s:=^60}".format(s=" Serving Benchmark Result "), file=out)
    row("Successful requests:", s["completed"], "d")
    row("Failed requests:", s["failed"], "d")
    row("Maximum request concurrency:", "unbounded" if s["max_concurrency"] is None else str(s["max_concurrency"]))
    row("Peak requests in flight (client):", s["max_concurrent_requests"], "d")
    row("Benchmark duration (s):", s["duration"])
    row("Total input tokens:", s["total_input_tokens"], "d")
    row("Total generated tokens:", s["total_output_tokens"], "d")
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    for m in metrics:
        short, long = METRICS[m]
        print("{s:-^60}".format(s=long), file=out)
        row(f"Mean {short} (ms):", s[f"mean_{m}_ms"])
        row(f"Median {short} (ms):", s[f"median_{m}_ms"])
        for q in percentiles:
            row(f"P{pkey(q)[1:]} {short} (ms):", s[f"{pkey(q)}_{m}_ms"])
    kind = s.get("server_kind")
    if kind:
        print("{s:-^60}".format(s=f"Server ({kind}, {s.get('metrics_polls', 0)} polls of /metrics)"), file=out)
        kv = s.get("peak_kv_cache_usage")
        row("Peak KV cache usage (%):", None if kv is None else 100 * kv)
        if kv is not None and kv_cache_bytes:
            row("Peak KV cache usage (MiB):", kv * kv_cache_bytes / 2**20, ".1f")
        row("Peak requests running (server):", s.get("peak_num_requests_running"), ".0f")
        if kind == "moe-serve":
            sol = s.get("decode_speed_of_light_fraction")
            row("Decode: % of speed of light:", None if sol is None else 100 * sol)
            for r, v in (s.get("decode_speed_of_light_fraction_per_rank") or {}).items():
                row(f"  rank {r}: % of speed of light:", 100 * v)
            bw = s.get("memory_bandwidth_bytes_per_second")
            row("Memory bandwidth assumed (GB/s):", None if bw is None else bw / 1e9, ".1f")
            row("Prompt tokens computed by the server:", s.get("server_prompt_tokens_computed"), "d")
            row("Prefix cache hit rate, since start (%):",
                None if s.get("prefix_cache_hit_rate") is None else 100 * s["prefix_cache_hit_rate"])
    if s.get("errors"):
        print("{s:-^60}".format(s="Errors"), file=out)
        for e in s["errors"]:
            print(f"  {e}", file=out)
    print("=" * 60, file=out, flush=True)


# ---- workload ----------------------------------------------------------------------------------
def _file_tokenizer(path: str):
    from tokenizers import Tokenizer

    f = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    try:
        tok = Tokenizer.from_file(f)
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception types
        raise ValueError(f"--tokenizer {path}: cannot load {f} ({e})") from None
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def make_workload(ns: argparse.Namespace, seed: int, counter=None, max_model_len: int | None = None,
                  token_pool: list[int] | None = None) -> list:
    """The jobs of one level, drawn from `seed`."""
    text = ns.endpoint == CHAT
    pool = token_pool if token_pool is not None else range(FIRST_TOKEN_ID, ns.random_vocab_size)
    if ns.dataset_name == "random":
        return D.random_samples(ns.num_prompts, ns.random_input_len, ns.random_output_len, ns.random_range_ratio,
                                ns.random_prefix_len, pool, text, seed)
    if ns.dataset_name == "prefix_repetition":
        return D.prefix_repetition_samples(ns.num_prompts, ns.prefix_repetition_prefix_len,
                                           ns.prefix_repetition_suffix_len, ns.prefix_repetition_num_prefixes,
                                           ns.prefix_repetition_output_len, pool, text, seed)
    if ns.dataset_name == "multi_turn":
        return D.multi_turn_conversations(ns.num_prompts, ns.multi_turn_num_turns, ns.random_input_len,
                                          ns.random_output_len, ns.random_range_ratio, seed)
    return D.sharegpt_samples(ns.dataset_path, ns.num_prompts, counter, ns.sharegpt_output_len, seed, max_model_len)


def describe(ns: argparse.Namespace) -> str:
    if ns.dataset_name == "random":
        return (f"random, input {ns.random_input_len} output {ns.random_output_len} range {ns.random_range_ratio}"
                + (f" prefix {ns.random_prefix_len}" if ns.random_prefix_len else ""))
    if ns.dataset_name == "prefix_repetition":
        return (f"prefix_repetition, {ns.prefix_repetition_num_prefixes} prefixes of {ns.prefix_repetition_prefix_len}"
                f" + suffix {ns.prefix_repetition_suffix_len}, output {ns.prefix_repetition_output_len}")
    if ns.dataset_name == "multi_turn":
        return (f"multi_turn, {ns.multi_turn_num_turns} turns, messages of {ns.random_input_len} words, "
                f"output {ns.random_output_len}")
    return f"sharegpt {ns.dataset_path}" + (f", output {ns.sharegpt_output_len}" if ns.sharegpt_output_len else "")


# ---- main --------------------------------------------------------------------------------------
def base_url_of(ns: argparse.Namespace) -> str:
    url = ns.base_url or f"http://{ns.host}:{ns.port}"
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


CONFIG_KEYS = ("endpoint", "dataset_name", "dataset_path", "num_prompts", "random_input_len", "random_output_len",
               "random_range_ratio", "random_prefix_len", "random_vocab_size", "sharegpt_output_len",
               "prefix_repetition_prefix_len", "prefix_repetition_suffix_len", "prefix_repetition_num_prefixes",
               "prefix_repetition_output_len", "multi_turn_num_turns", "burstiness", "max_concurrency",
               "num_warmups", "seed", "ignore_eos", "temperature", "request_timeout", "metrics_interval")


def config_of(ns: argparse.Namespace, base_url: str, model: str, sweep: list[int] | None, metrics: list[str],
              percentiles: list[float]) -> dict:
    c = {k: getattr(ns, k) for k in CONFIG_KEYS}
    c.update(base_url=base_url, model=model, request_rate=None if math.isinf(ns.request_rate) else ns.request_rate,
             concurrency_sweep=sweep, percentile_metrics=metrics, metric_percentiles=percentiles)
    return c


def run(ns: argparse.Namespace, server_facts: dict | None = None, token_pool: list[int] | None = None) -> int:
    """The whole `bench serve` command on parsed flags; 0 when every request succeeded, else 1.
    server_facts: what a caller that started the server knows (merged into the result's server)."""
    validate(ns)
    metrics = csv_list(ns.percentile_metrics, str, "--percentile-metrics")
    percentiles = csv_list(ns.metric_percentiles, float, "--metric-percentiles")
    sweep = csv_list(ns.concurrency_sweep, int, "--concurrency-sweep") if ns.concurrency_sweep else None
    base_url = base_url_of(ns)
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    counter = _file_tokenizer(ns.tokenizer) if ns.tokenizer and ns.dataset_name == "sharegpt" else None

    try:
        cards = list_models(base_url, headers)
    except BenchError:
        if ns.model is None:
            raise
        cards = []  # a server without /v1/models: fine when the model is named
    if ns.model is None:
        if not cards or not cards[0].get("id"):
            raise BenchError(f"{base_url}/v1/models lists no model; pass --model")
        model = cards[0]["id"]
        print(f"model: {model} (the first of {base_url}/v1/models)", flush=True)
    else:
        model = ns.model
    card = next((c for c in cards if c.get("id") == model), {})
    max_model_len = card.get("max_model_len")
    if ns.dataset_name == "sharegpt" and counter is None:
        counter = server_tokenizer(base_url, headers, model)
        if counter is None:
            print("warning: the server has no POST /tokenize and no --tokenizer was given: ShareGPT token counts "
                  "are estimated as 4/3 per word", file=sys.stderr)
            counter = lambda text: max(1, round(len(text.split()) * 4 / 3))  # noqa: E731
    if counter is not None:
        counter = functools.lru_cache(maxsize=None)(counter)  # each level draws from the same file

    load = Load(base_url, headers, model, ns.endpoint, ns.request_rate, ns.burstiness, ns.seed, ns.temperature,
                ns.ignore_eos, ns.request_timeout, ns.metrics_interval, ns.disable_tqdm)
    levels_c = sweep or [ns.max_concurrency]
    if ns.num_warmups:
        warm = make_workload(ns, ns.seed + 10_000, counter, max_model_len, token_pool)
        warm = [j.turns[0] if isinstance(j, D.Conversation) else j for j in warm][:ns.num_warmups]
        warm = (warm * ns.num_warmups)[:ns.num_warmups]
        print(f"warm-up: {len(warm)} request(s)", flush=True)
        r = asyncio.run(run_level(warm, Load(**{**vars(load), "request_rate": float("inf"), "watch_metrics": False,
                                                "disable_tqdm": True}), levels_c[0]))
        bad = [x.error for x in r.results if not x.ok]
        if bad:
            print(f"warning: {len(bad)} warm-up request(s) failed: {bad[0]}", file=sys.stderr)

    levels, runs = [], []
    server: dict = {"base_url": base_url, "model": model, "max_model_len": max_model_len, **(server_facts or {})}
    for i, c in enumerate(levels_c):
        jobs = make_workload(ns, ns.seed + i, counter, max_model_len, token_pool)
        rate = "inf" if math.isinf(ns.request_rate) else f"{ns.request_rate:g}/s, burstiness {ns.burstiness:g}"
        print(f"level {i + 1}/{len(levels_c)}: max concurrency {c or 'unbounded'}, request rate {rate}, "
              f"{num_requests(jobs)} requests ({describe(ns)}) to {base_url}{ns.endpoint}", flush=True)
        lr = asyncio.run(run_level(jobs, load, c))
        s = summarize(lr, metrics, percentiles)
        s["request_rate"] = None if math.isinf(ns.request_rate) else ns.request_rate
        s["burstiness"] = ns.burstiness
        if ns.save_detailed:
            s["requests"] = detailed(lr)
        print_summary(s, metrics, percentiles, server.get("kv_cache_bytes"))
        levels.append(s)
        runs.append(lr)
    server["kind"] = next((lv["server_kind"] for lv in levels if lv.get("server_kind")), None)
    bws = [lv["memory_bandwidth_bytes_per_second"] for lv in levels if lv.get("memory_bandwidth_bytes_per_second")]
    server["memory_bandwidth_bytes_per_second"] = bws[-1] if bws else None

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model)[-60:].strip("_") or "model"
    filename = ns.result_filename or f"serve-{ns.dataset_name}-{safe}-{stamp}.json"
    result_path = os.path.join(ns.result_dir, filename)
    plot = ns.plot
    if plot is None and sweep and len(sweep) > 1:
        if have_matplotlib():
            plot = os.path.splitext(result_path)[0] + ".png"
        else:
            print(f"note: no sweep plot drawn: matplotlib is not installed ({INSTALL_HINT})", file=sys.stderr)
    if plot:
        os.makedirs(os.path.dirname(os.path.abspath(plot)), exist_ok=True)
        title = f"{model}: {describe(ns)}, {ns.num_prompts} prompts per level, {ns.endpoint}"
        if sweep and len(sweep) > 1:
            plot_sweep(levels, title, plot)
        else:
            plot_level(levels[0], runs[0].results, title + f", max concurrency {levels_c[0] or 'unbounded'}", plot)
        print(f"plot: {plot}", flush=True)

    result = {"schema_version": SCHEMA_VERSION, "benchmark": "serve",
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "moe_serve_version": _version(),
              "config": config_of(ns, base_url, model, sweep, metrics, percentiles),
              "server": server, "levels": levels, "plot": plot}
    if ns.save_result:
        os.makedirs(ns.result_dir or ".", exist_ok=True)
        with open(result_path, "w") as f:
            json.dump(result, f, indent=2, allow_nan=False)
            f.write("\n")
        print(f"result: {result_path}", flush=True)
    return 0 if all(lv["failed"] == 0 for lv in levels) else 1


def _version() -> str:
    from moe_serve import __version__

    return __version__


def cmd(ns: argparse.Namespace) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    try:
        return run(ns)
    except BenchError as e:
        print(f"moe-serve bench serve: error: {e}", file=sys.stderr)
        return 1
