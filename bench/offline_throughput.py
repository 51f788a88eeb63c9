"""Offline throughput: moe-serve's `LLM` against Hugging Face transformers' `generate`, side by side.

The same checkpoint, the same prompts (random token ids of one length), greedy decoding and the same
number of output tokens per prompt (EOS ignored) in both engines, in one run on one machine:

- moe-serve: every prompt handed to `LLM.generate` at once (continuous batching, paged KV cache).
- transformers: `generate` on static batches of --batch-size prompts (default: all of them in one
  batch), `min_new_tokens = max_new_tokens` so that EOS cannot end a sequence early.

Also single-stream decode tokens/s of both, next to the speed of light of that decode: the bytes one
decode token must read (bench/sol.py: non-expert weights + the top-k experts actually used + the KV
cache) divided by the memory bandwidth measured at the start of the same run.

    python bench/offline_throughput.py --model synthetic-mixtral --dtype float32
    python bench/offline_throughput.py --model default --dtype bfloat16 --num-prompts 16
    python bench/offline_throughput.py --model path/to/checkpoint

Writes bench/results/offline_<model>_<dtype>.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The repository root first, and not bench/ itself: bench/kernels.py would shadow the `kernels` package.
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

import torch  # noqa: E402

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


# ---- moe-serve ---------------------------------------------------------------------------------
def run_ours(args, path: str, prompts: list[list[int]], warm: list[int]) -> tuple[dict, list[list[int]], dict]:
    from moe_serve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=path, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
              max_num_seqs=max(len(prompts), 1), max_num_batched_tokens=args.max_num_batched_tokens,
              show_progress=False)
    r = llm.engine.runner
    log(f"[ours] loaded in {time.perf_counter() - t0:.1f} s: weights {gb(r.weight_bytes)}, "
        f"KV cache {gb(r.kv_cache_bytes)}, moe_backend={llm.engine.cfg.moe_backend}, "
        f"attention_backend={llm.engine.cfg.attention_backend}")
    db = decode_bytes_of(llm)

    def gen(ps, n):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    gen([warm], 4)  # a prompt of its own: prefix caching must not make the timed runs cheaper
    dt, tokens = gen(prompts, args.output_len)
    n_out = sum(len(t) for t in tokens)
    log(f"[ours] batch: {len(prompts)} prompts x {args.output_len} tokens = {n_out} tokens in {dt:.2f} s "
        f"-> {n_out / dt:.1f} output tok/s")
    single = single_stream(lambda n: gen([prompts[-1]], n)[0], args.single_output_len, "ours")
    res = {"output_tokens": n_out, "elapsed_s": dt, "output_tokens_per_s": n_out / dt,
           "weight_bytes": r.weight_bytes, "kv_cache_bytes": r.kv_cache_bytes, "single_stream": single,
           "moe_backend": llm.engine.cfg.moe_backend, "attention_backend": llm.engine.cfg.attention_backend}
    del llm
    gc.collect()
    return res, tokens, db.as_dict() | {"_obj": db}


def single_stream(timed, n: int, who: str) -> dict:
    """Decode tokens/s of one sequence: (n - 1) tokens over (time for n tokens - time for 1 token),
    so that prefill and the first token are not counted."""
    t1 = min(timed(1) for _ in range(2))
    tn = timed(n)
    rate = (n - 1) / max(tn - t1, 1e-9)
    log(f"[{who}] single stream: prefill+1 token {t1 * 1e3:.0f} ms, {n} tokens {tn:.2f} s -> "
        f"{rate:.1f} decode tok/s ({1e3 / rate:.1f} ms/token)")
    return {"output_len": n, "first_token_s": t1, "total_s": tn, "decode_tokens_per_s": rate}


# ---- transformers ------------------------------------------------------------------------------
def run_hf(args, path: str, prompts: list[list[int]], warm: list[int]) -> tuple[dict, list[list[int]]]:
    import transformers
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[args.dtype]).eval()
    experts_impl = getattr(model.config, "_experts_implementation", None)
    attn_impl = getattr(model.config, "_attn_implementation", None)
    log(f"[hf] transformers {transformers.__version__} loaded in {time.perf_counter() - t0:.1f} s "
        f"(attention={attn_impl}, experts={experts_impl})")
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    @torch.inference_mode()
    def gen(batch: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        ids = torch.tensor(batch, dtype=torch.long)
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=pad)
        dt = time.perf_counter() - t
        return dt, out[:, ids.shape[1]:].tolist()

    gen([warm], 4)
    bs = args.batch_size or len(prompts)
    tokens: list[list[int]] = []
    total = 0.0
    nb = (len(prompts) + bs - 1) // bs
    for b in range(nb):
        chunk = prompts[b * bs:(b + 1) * bs]
        dt, toks = gen(chunk, args.output_len)
        total += dt
        tokens += toks
        log(f"[hf] batch {b + 1}/{nb}: {len(chunk)} prompts, {sum(map(len, toks))} tokens in {dt:.2f} s")
    n_out = sum(len(t) for t in tokens)
    log(f"[hf] all batches: {n_out} tokens in {total:.2f} s -> {n_out / total:.1f} output tok/s")
    single = single_stream(lambda n: gen([prompts[-1]], n)[0], args.single_output_len, "hf")
    res = {"output_tokens": n_out, "elapsed_s": total, "output_tokens_per_s": n_out / total, "batch_size": bs,
           "single_stream": single, "transformers": transformers.__version__,
           "attn_implementation": attn_impl, "experts_implementation": experts_impl}
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
        f"{platform.processor() or platform.machine()}")
    bw = measure_bandwidth("cpu", 512 << 20)
    log(f"memory bandwidth ({torch.get_num_threads()} threads, 512 MiB tensor copy, read + write): "
        f"{bw / 1e9:.1f} GB/s")
    prompts = make_prompts(path, args.num_prompts + 1, args.input_len, args.seed)
    warm = prompts.pop()

    ours, our_tokens, db_dict = run_ours(args, path, prompts, warm)
    db = db_dict.pop("_obj")
    hf, hf_tokens = (None, None) if args.skip_hf else run_hf(args, path, prompts, warm)

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
              "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
              "bandwidth_bytes_per_s": bw, "decode_bytes": db_dict, "single_stream_bytes_per_token": step,
              "single_stream_sol_tokens_per_s": sol, "moe_serve": ours, "transformers": hf}
    print()
    print(f"{'':26s}{'moe-serve':>12s}{'transformers':>14s}{'ratio':>8s}")
    hf_tp = hf["output_tokens_per_s"] if hf else float("nan")
    print(f"{'output tok/s (batch)':26s}{ours['output_tokens_per_s']:12.1f}{hf_tp:14.1f}"
          f"{ours['output_tokens_per_s'] / hf_tp:8.2f}x")
    s_ours = ours["single_stream"]["decode_tokens_per_s"]
    s_hf = hf["single_stream"]["decode_tokens_per_s"] if hf else float("nan")
    print(f"{'single-stream decode tok/s':26s}{s_ours:12.1f}{s_hf:14.1f}{s_ours / s_hf:8.2f}x")
    print(f"{'  % of speed of light':26s}{100 * s_ours / sol:11.0f}%{100 * s_hf / sol:13.0f}%"
          f"   (SOL {sol:.1f} tok/s = {bw / 1e9:.1f} GB/s / {step / 1e6:.1f} MB per token)")
    if hf:
        result["ratio_output_tokens_per_s"] = ours["output_tokens_per_s"] / hf_tp
        result["ratio_single_stream"] = s_ours / s_hf
        same = sum(a == b for x, y in zip(our_tokens, hf_tokens) for a, b in zip(x, y))
        first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                      for x, y in zip(our_tokens, hf_tokens)]
        identical = sum(d is None for d in first_diff)
        result["greedy_agreement"] = {"identical_sequences": identical, "sequences": len(prompts),
                                      "same_position_tokens": same, "tokens": sum(map(len, our_tokens))}
        print(f"greedy outputs identical for {identical}/{len(prompts)} prompts "
              f"(position-wise {same}/{sum(map(len, our_tokens))} tokens; random weights and "
              f"{args.dtype} rounding can flip near-tied tokens)")
    out = Path(args.out) if args.out else HERE / "results" / f"offline_{name}_{args.dtype}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
