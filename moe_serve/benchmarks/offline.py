"""`moe-serve bench throughput` and `moe-serve bench latency`: the offline engine (`moe_serve.LLM`)
in this process, every engine flag of `moe-serve serve` accepted.

throughput: all prompts handed to one LLM.generate call; requests/s, total and output tokens/s.
latency: batches of --batch-size random prompts, timed one generate call each after warm-up calls;
the average and percentiles of the per-batch latency.

Both also give the decode speed of light of the timed part: the engine's DecodeMeter counts the
bytes its decode-only steps must read and their time, so the fraction is (bytes / memory
bandwidth) / seconds over exactly the timed calls (LLM.generate closes the meter's window at its
end).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import time

import numpy as np

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


# ---- flags -------------------------------------------------------------------------------------
def add_throughput_args(p: argparse.ArgumentParser) -> None:
    from moe_serve.engine.args import EngineArgs

    EngineArgs.add_cli_args(p)
    g = p.add_argument_group("benchmark")
    g.add_argument("--dataset-name", default="random", choices=["random", "sharegpt"])
    g.add_argument("--dataset-path", default=None, help="sharegpt: the ShareGPT-format JSON file")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--input-len", type=int, default=None, help="random: prompt tokens (default 1024)")
    g.add_argument("--output-len", type=int, default=None,
                   help="output tokens of every request (default: random 128; sharegpt the gpt turn's length)")
    g.add_argument("--output-json", default=None, help="write the figures to this JSON file")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_latency_args(p: argparse.ArgumentParser) -> None:
    from moe_serve.engine.args import EngineArgs

    EngineArgs.add_cli_args(p)
    g = p.add_argument_group("benchmark")
    g.add_argument("--input-len", type=int, default=32, help="prompt tokens of each request")
    g.add_argument("--output-len", type=int, default=128, help="output tokens of each request")
    g.add_argument("--batch-size", type=int, default=8, help="requests per generate call")
    g.add_argument("--num-iters-warmup", type=int, default=10, help="untimed calls first")
    g.add_argument("--num-iters", type=int, default=30, help="timed calls")
    g.add_argument("--output-json", default=None, help="write the figures to this JSON file")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar over the iterations")


# ---- shared ------------------------------------------------------------------------------------
def make_llm(ns: argparse.Namespace):
    """The offline engine from the engine flags (no --model: the built-in default model)."""
    from moe_serve import LLM
    from moe_serve.engine.args import EngineArgs
    from moe_serve.entrypoints.cli_args import resolve_model

    path, _ = resolve_model(ns.model)
    kw = dataclasses.asdict(EngineArgs.from_cli(ns, path))
    kw.pop("model")
    return LLM(path, **kw)


def token_pool(llm) -> range:
    vocab = llm.engine.vocab_size
    return range(min(100, vocab // 4), vocab)


def random_prompts(rng: random.Random, n: int, length: int, pool: range) -> list[dict]:
    return [{"prompt_token_ids": [pool[rng.randrange(len(pool))] for _ in range(length)]} for _ in range(n)]


def meter_totals(llm) -> tuple[int, float, int] | None:
    m = getattr(llm.engine, "meter", None)
    return None if m is None else (m.total_bytes, m.total_seconds, m.total_steps)


def speed_of_light(llm, before: tuple | None, after: tuple | None) -> dict:
    """The decode speed of light between two meter_totals readings."""
    m = getattr(llm.engine, "meter", None)
    out = {"decode_speed_of_light_fraction": None, "decode_steps": 0, "decode_seconds": 0.0,
           "memory_bandwidth_bytes_per_second": None, "memory_bandwidth_source": None}
    if m is None or before is None or after is None:
        return out
    d_bytes, d_s, d_steps = after[0] - before[0], after[1] - before[1], after[2] - before[2]
    out.update(decode_steps=d_steps, decode_seconds=d_s, memory_bandwidth_bytes_per_second=m.bandwidth,
               memory_bandwidth_source=m.source)
    if d_s > 0 and m.bandwidth > 0:
        out["decode_speed_of_light_fraction"] = d_bytes / m.bandwidth / d_s
    return out


def print_sol(s: dict) -> None:
    f = s["decode_speed_of_light_fraction"]
    if f is None:
        print("Decode speed of light: n/a (no meter, or no decode-only step in the timed part)")
        return
    print(f"Decode speed of light: {100 * f:.2f}% ({s['decode_steps']} decode steps in {s['decode_seconds']:.3f} s, "
          f"memory bandwidth {s['memory_bandwidth_bytes_per_second'] / 1e9:.1f} GB/s: "
          f"{s['memory_bandwidth_source']})")


def write_json(path: str | None, obj: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, allow_nan=False)
        f.write("\n")
    print(f"result: {path}")


def _common(ns: argparse.Namespace, llm) -> dict:
    return {"model": llm.args.model, "dtype": ns.dtype, "device": str(llm.engine.cfg.device)}


# ---- throughput --------------------------------------------------------------------------------
def throughput_requests(ns: argparse.Namespace, llm) -> tuple[list[dict], list[int]]:
    """(prompts, output lengths)."""
    rng = random.Random(ns.seed)
    if ns.dataset_name == "random":
        n_in, n_out = ns.input_len or 1024, ns.output_len or 128
        return random_prompts(rng, ns.num_prompts, n_in, token_pool(llm)), [n_out] * ns.num_prompts
    from moe_serve.benchmarks.datasets import sharegpt_samples

    def count(text: str) -> int:
        return len(llm.tokenizer.encode(text))

    samples = sharegpt_samples(ns.dataset_path, ns.num_prompts, count, ns.output_len, ns.seed,
                               llm.engine.max_model_len)
    return [{"prompt_token_ids": llm.tokenizer.encode(s.prompt)} for s in samples], [s.output_len for s in samples]


def validate_throughput(ns: argparse.Namespace) -> None:
    if ns.dataset_name == "sharegpt" and not ns.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT-format JSON file)")
    if ns.dataset_path and ns.dataset_name != "sharegpt":
        raise ValueError("--dataset-path is read by --dataset-name sharegpt only")
    if ns.dataset_path and not os.path.isfile(ns.dataset_path):
        raise ValueError(f"--dataset-path {ns.dataset_path}: no such file")
    if ns.dataset_name == "sharegpt" and ns.input_len is not None:
        raise ValueError("--input-len applies to --dataset-name random only (ShareGPT prompts have their own)")
    for flag, v in (("--num-prompts", ns.num_prompts), ("--input-len", ns.input_len), ("--output-len", ns.output_len)):
        if v is not None and v < 1:
            raise ValueError(f"{flag} {v}: must be >= 1")


def run_throughput(ns: argparse.Namespace) -> int:
    validate_throughput(ns)
    from moe_serve import SamplingParams

    llm = make_llm(ns)
    prompts, out_lens = throughput_requests(ns, llm)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in out_lens]
    before = meter_totals(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not ns.disable_tqdm)
    elapsed = time.perf_counter() - t0
    sol = speed_of_light(llm, before, meter_totals(llm))
    n_prompt = sum(len(p["prompt_token_ids"]) for p in prompts)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    r = {"benchmark": "throughput", **_common(ns, llm), "dataset_name": ns.dataset_name,
         "dataset_path": ns.dataset_path,
         "input_len": (ns.input_len or 1024) if ns.dataset_name == "random" else None,
         "output_len": ns.output_len or (128 if ns.dataset_name == "random" else None),
         "elapsed_time": elapsed, "num_requests": len(prompts),
         "total_prompt_tokens": n_prompt, "total_output_tokens": n_out, "total_num_tokens": n_prompt + n_out,
         "requests_per_second": len(prompts) / elapsed, "tokens_per_second": (n_prompt + n_out) / elapsed,
         "output_tokens_per_second": n_out / elapsed, **sol}
    print(f"Throughput: {r['requests_per_second']:.2f} requests/s, {r['tokens_per_second']:.2f} total tokens/s, "
          f"{r['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {n_prompt}")
    print(f"Total num output tokens:  {n_out}")
    print(f"Elapsed time (s):         {elapsed:.4f}")
    print_sol(sol)
    write_json(ns.output_json, r)
    return 0


# ---- latency -----------------------------------------------------------------------------------
def validate_latency(ns: argparse.Namespace) -> None:
    for flag, v in (("--input-len", ns.input_len), ("--output-len", ns.output_len), ("--batch-size", ns.batch_size),
                    ("--num-iters", ns.num_iters)):
        if v < 1:
            raise ValueError(f"{flag} {v}: must be >= 1")
    if ns.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup {ns.num_iters_warmup}: must be >= 0")


def run_latency(ns: argparse.Namespace) -> int:
    validate_latency(ns)
    from tqdm import tqdm

    from moe_serve import SamplingParams

    llm = make_llm(ns)
    rng = random.Random(ns.seed)
    pool = token_pool(llm)
    params = SamplingParams(max_tokens=ns.output_len, ignore_eos=True, temperature=0)

    def once() -> float:
        # fresh prompts per call: each one is prefilled, not served from the prefix cache
        prompts = random_prompts(rng, ns.batch_size, ns.input_len, pool)
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - t0

    for _ in tqdm(range(ns.num_iters_warmup), desc="warm-up", disable=ns.disable_tqdm):
        once()
    before = meter_totals(llm)
    latencies = [once() for _ in tqdm(range(ns.num_iters), desc="timed", disable=ns.disable_tqdm)]
    sol = speed_of_light(llm, before, meter_totals(llm))
    arr = np.asarray(latencies)
    pct = {str(q): float(np.percentile(arr, q)) for q in LATENCY_PERCENTILES}
    r = {"benchmark": "latency", **_common(ns, llm), "input_len": ns.input_len, "output_len": ns.output_len,
         "batch_size": ns.batch_size, "num_iters_warmup": ns.num_iters_warmup, "num_iters": ns.num_iters,
         "avg_latency": float(arr.mean()), "latencies": latencies, "percentiles": pct, **sol}
    print(f"Avg latency: {r['avg_latency']:.6f} seconds")
    for q, v in pct.items():
        print(f"{q}% percentile latency: {v:.6f} seconds")
    print_sol(sol)
    write_json(ns.output_json, r)
    return 0

