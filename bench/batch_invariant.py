"""What --batch-invariant costs: output tokens per second at 1 and at 32 concurrent requests, with and
without the flag, in one run on one machine.

For each setting, an engine on the same checkpoint; N requests of random 64-token prompts, greedy,
EOS ignored, --output-len tokens each, all submitted at once (offline `LLM.generate`); output tok/s
= N x output_len / wall time, the best of --repeats, the engines alternating so that a slow spell of
the machine hits both. Also whether the flag's outputs matched: with the flag, the first request's
tokens alone and in the batch of 32 (they must).

    python bench/batch_invariant.py --model qwen3-moe-tiny --threads 2

Writes bench/results/batch_invariant_<machine>.json (or --out), with the machine (CPU, ISA, kernels).
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

import torch  # noqa: E402

from bench.machine import cpu_model, isa, machine  # noqa: E402
from bench.synthetic_models import resolve_model  # noqa: E402


def run(llm, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    """(output tok/s, each request's token ids) for the prompts submitted together."""
    from moe_serve import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    dt = time.perf_counter() - t0
    return len(prompts) * output_len / dt, [list(o.outputs[0].token_ids) for o in outs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-moe-tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from moe_serve import LLM

    path, name, desc = resolve_model(args.model)
    engines = {flag: LLM(path, dtype=args.dtype, batch_invariant=flag, show_progress=False, max_num_seqs=64)
               for flag in (False, True)}
    rng = random.Random(0)
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = {n: [[rng.randrange(10, 4000) for _ in range(64)] for _ in range(n)] for n in levels}
    for llm in engines.values():  # warm-up: first-step costs out of the figures
        run(llm, prompts[levels[0]][:1], 4)
    best = {(flag, n): 0.0 for flag in engines for n in levels}
    tokens = {}
    for _ in range(args.repeats):
        for n in levels:
            for flag, llm in engines.items():
                tps, toks = run(llm, prompts[n], args.output_len)
                best[flag, n] = max(best[flag, n], tps)
                tokens[flag, n] = toks
    rows = [dict(concurrency=n, default_tok_s=round(best[False, n], 1), batch_invariant_tok_s=round(best[True, n], 1),
                 ratio=round(best[True, n] / best[False, n], 3)) for n in levels]
    # the flag's promise, on this run's own outputs: request 0 alone and inside the largest batch
    alone = run(engines[True], prompts[max(levels)][:1], args.output_len)[1][0]
    same = alone == tokens[True, max(levels)][0]
    for r in rows:
        print(f"concurrency {r['concurrency']:3d}: default {r['default_tok_s']:8.1f} tok/s, batch-invariant "
              f"{r['batch_invariant_tok_s']:8.1f} tok/s ({r['ratio']:.2f}x)")
    print("batch-invariant request 0 alone == in the batch of", max(levels), ":", same)
    slug = re.sub(r"[^a-z0-9]+", "-", f"{cpu_model()} {isa()}".lower()).strip("-")[:60]
    out = Path(args.out or HERE / "results" / f"batch_invariant_{slug}.json")
    out.write_text(json.dumps(dict(host=machine(), model=name, model_desc=desc, dtype=args.dtype, threads=args.threads,
                                   output_len=args.output_len, prompt_len=64, rows=rows,
                                   invariant_alone_equals_batched=same), indent=2) + "\n")
    print("wrote", out)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
