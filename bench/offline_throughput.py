"""Offline throughput: moe-serve's `LLM` against Hugging Face transformers' `generate`, side by side.

The same checkpoint, the same prompts (random token ids of one length), greedy decoding and the same
number of output tokens per prompt (EOS ignored) in both engines, in one run on one machine:

- moe-serve: every prompt handed to `LLM.generate` at once (continuous batching, paged KV cache).
- transformers: `generate` on static batches of --batch-size prompts (default: all of them in one
  batch), `min_new_tokens = max_new_tokens` so that EOS cannot end a sequence early.

Also single-stream decode tokens/s of both, next to the speed of light of that decode: the memory
bandwidth measured at the start of the same run (same thread count) divided by the bytes one decode
token must read (bench/sol.py: non-expert weights + the top-k experts actually used + the KV cache).
Every measurement runs --repeats times on prompts of its own and the fastest counts; greedy outputs
of the two engines are compared token by token.

On a CPU shared with other busy processes use --threads 1: OpenMP regions wait for their slowest
thread, and an engine step is many small ops (seen here: ~35x slower decode with 2 threads on 2
busy cores, against under 2x for transformers).

    python bench/offline_throughput.py --model synthetic-mixtral --dtype float32 --threads 1
    python bench/offline_throughput.py --model default --dtype bfloat16 --num-prompts 8 --input-len 32
    python bench/offline_throughput.py --model path/to/checkpoint

Writes bench/results/offline_<model>_<dtype>.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The repository root first, and not bench/ itself: bench/kernels.py would shadow the `kernels` package.
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

import torch  # noqa: E402

from bench.machine import describe, machine  # noqa: E402
from bench.sol import decode_bytes_of, gb, measure_bandwidth  # noqa: E402
from bench.synthetic_models import SYNTHETIC, resolve_model, token_pool  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_prompts(path: str, num: int, length: int, seed: int) -> list[list[int]]:
    """Random token ids that the checkpoint's tokenizer knows, skipping its special tokens."""
    pool = token_pool(path)
    rng = random.Random(seed)
    return [[rng.choice(pool) for _ in range(length)] for _ in range(num)]


# ---- workload ----------------------------------------------------------------------------------
@dataclass
class Workload:
    """Identical for both engines. Every timed call gets prompts of its own, so that moe-serve's
    prefix cache never makes a repeat cheaper (transformers has none)."""

    sets: list[list[list[int]]]  # --repeats sets of --num-prompts prompts (batch throughput; best set wins)
    singles: list[list[int]]  # single-stream prompts: 2 for time-to-first-token, then one per repeat
    warm: list[int]


def make_workload(path: str, args) -> Workload:
    prompts = make_prompts(path, args.repeats * args.num_prompts + 2 + args.repeats + 1, args.input_len, args.seed)
    n = args.num_prompts
    sets = [prompts[i * n:(i + 1) * n] for i in range(args.repeats)]
    rest = prompts[args.repeats * n:]
    return Workload(sets, rest[:-1], rest[-1])


def measure(gen, w: Workload, args, who: str) -> tuple[dict, list[list[int]]]:
    """Batch throughput (best of the repeats) and single-stream decode rate of one engine.

    gen(prompts, n) -> (seconds, output token ids per prompt)."""
    gen([w.warm], 4)
    times, first_tokens = [], None
    for i, ps in enumerate(w.sets):
        dt, tokens = gen(ps, args.output_len)
        n_out = sum(len(t) for t in tokens)
        if n_out != len(ps) * args.output_len:
            raise RuntimeError(f"[{who}] {n_out} output tokens, expected {len(ps) * args.output_len}")
        first_tokens = first_tokens or tokens
        times.append(dt)
        log(f"[{who}] batch {i + 1}/{len(w.sets)}: {len(ps)} prompts x {args.output_len} tokens = {n_out} "
            f"tokens in {dt:.2f} s -> {n_out / dt:.1f} output tok/s")
    n_out = len(w.sets[0]) * args.output_len
    best = min(times)
    # Single-stream decode: (n - 1) tokens over (time for n tokens - time for 1 token), so that
    # prefill and the first token are not counted.
    n = args.single_output_len
    t1 = min(gen([w.singles[i]], 1)[0] for i in range(2))
    tn = min(gen([p], n)[0] for p in w.singles[2:])
    rate = (n - 1) / max(tn - t1, 1e-9)
    log(f"[{who}] single stream: prefill + 1 token {t1 * 1e3:.0f} ms, {n} tokens {tn:.2f} s -> "
        f"{rate:.1f} decode tok/s ({1e3 / rate:.1f} ms/token)")
    res = {"output_tokens": n_out, "elapsed_s": best, "elapsed_s_all": times, "output_tokens_per_s": n_out / best,
           "single_stream": {"output_len": n, "first_token_s": t1, "total_s": tn, "decode_tokens_per_s": rate}}
    return res, first_tokens


# ---- moe-serve ---------------------------------------------------------------------------------
def run_ours(args, path: str, w: Workload) -> tuple[dict, list[list[int]], object]:
    from moe_serve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=path, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
              max_num_seqs=max(args.num_prompts, 1), max_num_batched_tokens=args.max_num_batched_tokens,
              show_progress=False)
    r = llm.engine.runner
    log(f"[ours] loaded in {time.perf_counter() - t0:.1f} s: weights {gb(r.weight_bytes)}, "
        f"KV cache {gb(r.kv_cache_bytes)}, moe_backend={llm.engine.cfg.moe_backend}, "
        f"attention_backend={llm.engine.cfg.attention_backend}")
    db = decode_bytes_of(llm)
    # What start-up made, out of the collector's generations, as the server's core process does
    # after start-up (moe_serve/engine/core_proc.py): the step loop's collections then skip it.
    gc.collect()
    gc.freeze()

    def gen(ps, n):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    res, tokens = measure(gen, w, args, "ours")
    res.update(weight_bytes=r.weight_bytes, kv_cache_bytes=r.kv_cache_bytes,
               moe_backend=llm.engine.cfg.moe_backend, attention_backend=llm.engine.cfg.attention_backend)
    gc.unfreeze()
    del llm
    gc.collect()
    return res, tokens, db


# ---- transformers ------------------------------------------------------------------------------
def run_hf(args, path: str, w: Workload) -> tuple[dict, list[list[int]]]:
    import transformers
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[args.dtype]).eval()
    experts_impl = getattr(model.config, "_experts_implementation", None)
    attn_impl = getattr(model.config, "_attn_implementation", None)
    log(f"[hf] transformers {transformers.__version__} loaded in {time.perf_counter() - t0:.1f} s "
        f"(attention={attn_impl}, experts={experts_impl})")
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    bs = args.batch_size or args.num_prompts

    @torch.inference_mode()
    def gen(prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        """Static batches of `bs` prompts, one after the other (all prompts have one length)."""
        total, tokens = 0.0, []
        for i in range(0, len(prompts), bs):
            ids = torch.tensor(prompts[i:i + bs], dtype=torch.long)
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=pad)
            total += time.perf_counter() - t
            tokens += out[:, ids.shape[1]:].tolist()
        return total, tokens

    res, tokens = measure(gen, w, args, "hf")
    res.update(batch_size=bs, transformers=transformers.__version__, attn_implementation=attn_impl,
               experts_implementation=experts_impl)
    del model
    gc.collect()
    return res, tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic-mixtral",
                   help=f"checkpoint directory, 'default' (built-in model) or one of {sorted(SYNTHETIC)}")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--single-output-len", type=int, default=None,
                   help="tokens for the single-stream decode measurement (default: --output-len)")
    p.add_argument("--batch-size", type=int, default=None, help="transformers static batch size (default: all)")
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="moe-serve KV cache bytes")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--skip-hf", action="store_true", help="measure moe-serve only")
    p.add_argument("--repeats", type=int, default=2,
                   help="timed runs per measurement, each on prompts of its own; the fastest counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/offline_<model>_<dtype>.json)")
    args = p.parse_args(argv)
    args.single_output_len = args.single_output_len or args.output_len
    if args.threads:
        torch.set_num_threads(args.threads)
    busy = os.getloadavg()[0]
    if busy > 0.5 * (os.cpu_count() or 1) and torch.get_num_threads() > 1:
        # OpenMP regions wait for their slowest thread: on CPUs that other processes keep busy,
        # many small ops per step (an engine's decode) slow down far more than a few big ones.
        log(f"warning: load average {busy:.1f} on {os.cpu_count()} CPUs and {torch.get_num_threads()} torch "
            f"threads: results are noisy; --threads 1 is steadier on a shared machine")

    path, name, desc = resolve_model(args.model)
    log(f"model: {desc} ({path}), dtype {args.dtype}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{describe()}")
    bw = measure_bandwidth("cpu", 512 << 20)
    log(f"memory bandwidth ({torch.get_num_threads()} threads, 512 MiB tensor copy, read + write): "
        f"{bw / 1e9:.1f} GB/s")
    w = make_workload(path, args)

    ours, our_tokens, db = run_ours(args, path, w)
    hf, hf_tokens = (None, None) if args.skip_hf else run_hf(args, path, w)

    # Speed of light of single-stream decode at the mean context length of the measured tokens.
    n = args.single_output_len
    ctx = args.input_len + n / 2
    step = db.step_bytes(1, int(ctx))
    sol = bw / step
    log(f"bytes per decode token: non-expert {gb(db.non_expert_bytes)} + {db.num_moe_layers} layers x "
        f"{db.top_k} experts x {db.expert_bytes / 1e6:.2f} MB + KV {ctx:.0f} tokens x {db.kv_bytes_per_token} B "
        f"= {gb(step)} -> speed of light {sol:.1f} tok/s at {bw / 1e9:.1f} GB/s")

    result = {"model": name, "model_path": path, "description": desc, "dtype": args.dtype,
              "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": machine(),
              "repeats": args.repeats, "bandwidth_bytes_per_s": bw, "decode_bytes": db.as_dict(),
              "single_stream_bytes_per_token": step, "single_stream_sol_tokens_per_s": sol,
              "moe_serve": ours, "transformers": hf}
    s_ours = ours["single_stream"]["decode_tokens_per_s"]
    s_hf = hf["single_stream"]["decode_tokens_per_s"] if hf else None
    hf_tp = hf["output_tokens_per_s"] if hf else None

    def cols(a: float, b: float | None, fmt: str, ratio: bool = True) -> str:
        if b is None:
            return f"{a:{fmt}}{'-':>14s}"
        return f"{a:{fmt}}{b:14{fmt[2:]}}" + (f"{a / b:8.2f}x" if ratio else "")

    print()
    print(f"{'':26s}{'moe-serve':>12s}{'transformers':>14s}{'ratio':>9s}")
    print(f"{'output tok/s (batch)':26s}" + cols(ours["output_tokens_per_s"], hf_tp, "12.1f"))
    print(f"{'single-stream decode tok/s':26s}" + cols(s_ours, s_hf, "12.1f"))
    print(f"{'  % of speed of light':26s}" + cols(100 * s_ours / sol, s_hf and 100 * s_hf / sol, "12.0f", False)
          + f"   (SOL {sol:.1f} tok/s = {bw / 1e9:.1f} GB/s / {step / 1e6:.1f} MB per token)")
    if hf:
        result["ratio_output_tokens_per_s"] = ours["output_tokens_per_s"] / hf_tp
        result["ratio_single_stream"] = s_ours / s_hf
        same = sum(a == b for x, y in zip(our_tokens, hf_tokens) for a, b in zip(x, y))
        first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                      for x, y in zip(our_tokens, hf_tokens)]
        identical = sum(d is None for d in first_diff)
        result["greedy_agreement"] = {"identical_sequences": identical, "sequences": len(our_tokens),
                                      "same_position_tokens": same, "tokens": sum(map(len, our_tokens))}
        print(f"greedy outputs identical for {identical}/{len(our_tokens)} prompts "
              f"(position-wise {same}/{sum(map(len, our_tokens))} tokens; "
              f"{args.dtype} rounding can flip near-tied greedy choices)")
    out = Path(args.out) if args.out else HERE / "results" / f"offline_{name}_{args.dtype}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
