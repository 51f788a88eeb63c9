"""CPU decode graphs (moe_serve/cpu_graph.py) against eager decode steps, side by side in one run.

For each model and batch size B, two engines on the same checkpoint (one with --enforce-eager),
B fresh random prompts of 16 tokens, greedy, EOS ignored: decode time per step is
(time of B x N tokens - time of B x 1 token) / (N - 1), the fastest of --repeats, the two engines
alternating so that a slow spell of the machine hits both. Also whether both engines produced the
same tokens for the same prompts.

    python bench/cpu_graphs.py --models qwen3-moe-tiny,qwen3-moe-mid --batches 1,8,32 --threads 1

Writes bench/results/cpu_graphs_<models>.json (or --out), with the machine (CPU, ISA, kernels).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

import torch  # noqa: E402

from bench.machine import machine  # noqa: E402
from bench.synthetic_models import resolve_model  # noqa: E402


def step_ms(llm, B: int, n: int, rng: random.Random) -> float:
    from moe_serve import SamplingParams

    def run(tokens: int):
        prompts = [[rng.randrange(10, 4000) for _ in range(16)] for _ in range(B)]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0))
        assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
        return time.perf_counter() - t0, outs

    run(4)  # warm
    t1 = min(run(1)[0] for _ in range(2))
    return (run(n)[0] - t1) / (n - 1) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen3-moe-tiny,qwen3-moe-mid")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from moe_serve import LLM, SamplingParams

    rows = []
    for model in args.models.split(","):
        path, name, desc = resolve_model(model)
        engines = {mode: LLM(path, dtype=args.dtype, kv_cache_memory=256 << 20, show_progress=False,
                             enforce_eager=(mode == "eager")) for mode in ("graphs", "eager")}
        captured = sorted(engines["graphs"].engine.runner.graphs.graphs) if engines["graphs"].engine.runner.graphs else []
        rng = random.Random(0)
        probe = [[rng.randrange(10, 4000) for _ in range(rng.randrange(4, 40))] for _ in range(11)]
        same = [[o.outputs[0].token_ids for o in e.generate(
            [{"prompt_token_ids": q} for q in probe],
            [SamplingParams(max_tokens=8 + 3 * i, ignore_eos=True, temperature=0) for i in range(len(probe))])]
            for e in engines.values()]
        for B in [int(b) for b in args.batches.split(",")]:
            ms = {"graphs": [], "eager": []}
            for r in range(args.repeats):
                for mode, llm in engines.items():
                    ms[mode].append(step_ms(llm, B, args.output_len, random.Random(r)))
            row = dict(model=name, batch=B, graphs_ms=min(ms["graphs"]), eager_ms=min(ms["eager"]),
                       graphs_over_eager=min(ms["graphs"]) / min(ms["eager"]))
            rows.append(row)
            print(f"{name} batch {B:3d}: decode step {row['graphs_ms']:.2f} ms with CPU graphs, {row['eager_ms']:.2f} "
                  f"eager ({row['graphs_over_eager']:.2f}x)", flush=True)
        rows.append(dict(model=name, description=desc, recorded_at_startup=captured, same_tokens=same[0] == same[1]))
        print(f"{name}: recorded at start-up {captured} (the others by their first step); greedy tokens equal: {same[0] == same[1]}", flush=True)
        del engines
    out = Path(args.out or HERE / "results" / f"cpu_graphs_{args.models.replace(',', '_')}_{args.dtype}.json")
    out.write_text(json.dumps(dict(host=machine(), threads=args.threads, dtype=args.dtype, output_len=args.output_len,
                                   rows=rows), indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
