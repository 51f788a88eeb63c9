"""Speculative decoding with n-gram drafts against none, side by side in one run.

The workload speculation is for: a chat prompt that gives a long text and asks the model to repeat
it with one small edit, so most of the answer is in the prompt. Greedy decoding, EOS ignored, the
same number of output tokens in every run. For single-stream (batch 1) and batch 8, each engine
(plain, then ngram with K draft tokens) decodes the same prompts; the fastest of --repeats runs
counts. Reported: output tokens/s, the ratio, the mean acceptance length (tokens emitted per
verified piece), the target forwards (steps), and where greedy outputs first differ, if anywhere:
in float32 they must not; in bfloat16 a batched verify step rounds differently from a one-token
step, as a batch of 8 does from a batch of 1 in the plain engine (also measured), so a near-tie can
flip a token.

    python bench/spec_decode.py                          # the built-in default model
    python bench/spec_decode.py --model path --num-speculative-tokens 4 --max-tokens 128

Writes bench/results/spec_decode_<model>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

import torch  # noqa: E402

from bench.machine import describe, machine  # noqa: E402
from bench.synthetic_models import resolve_model  # noqa: E402

TEXT = ("The river rose slowly through the night, and by morning the low fields beside the mill were under a "
        "hand of brown water. The miller walked the bank with his lantern, counting the posts that still stood, "
        "and wrote each number in the small book he kept for the purpose. When the bell rang at seven he went in, "
        "ate bread and cheese by the stove, and told his daughter that the bridge would hold if the rain stopped "
        "before noon. It did not stop. By evening the water had reached the second step of the house, and the "
        "geese had moved themselves to the hayloft without being asked.")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prompts(llm, n: int) -> list[dict]:
    """n chat prompts asking for the text back with one edit (a different edit each, so that the
    batch's sequences are not identical)."""
    names = ["Anna", "Marek", "Ines", "Tomas", "Lea", "Piotr", "Sofia", "Jonas", "Clara", "Emil"]
    out = []
    for i in range(n):
        msg = (f"Repeat the following text exactly, but call the miller's daughter {names[i % len(names)]} the "
               f"first time she appears, as 'his daughter {names[i % len(names)]}'.\n\n{TEXT}")
        ids = llm.tokenizer.chat_prompt_ids([{"role": "user", "content": msg}], add_generation_prompt=True)
        out.append({"prompt_token_ids": ids})
    return out


def run(llm, ps: list[dict], max_tokens: int, repeats: int) -> tuple[float, list[list[int]], int]:
    from moe_serve import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    best, outs, steps = float("inf"), None, 0
    for _ in range(repeats):
        s0 = llm.engine.num_steps
        t0 = time.perf_counter()
        res = llm.generate(ps, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        if dt < best:
            best, outs, steps = dt, [r.outputs[0].token_ids for r in res], llm.engine.num_steps - s0
    return best, outs, steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="a checkpoint, 'default', or a bench/synthetic_models.py name")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from moe_serve import LLM

    path, name, desc = resolve_model(args.model)
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    common = dict(dtype=args.dtype, show_progress=False, speed_of_light_window=1e9)
    log(f"model {desc}; threads {torch.get_num_threads()}; {describe()}")
    plain = LLM(path, **common)
    spec = LLM(path, speculative_config=spec_cfg, **common)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        ps = prompts(plain, b)
        for llm in (plain, spec):  # warm-up
            llm.generate(ps[:1], None, use_tqdm=False)
        t_plain, out_plain, steps_plain = run(plain, ps, args.max_tokens, args.repeats)
        s = spec.engine.spec
        d0, a0 = s.num_drafts, s.num_accepted_tokens
        t_spec, out_spec, steps_spec = run(spec, ps, args.max_tokens, args.repeats)
        drafts, accepted = s.num_drafts - d0, s.num_accepted_tokens - a0
        # Where greedy outputs part (None: never). Batched half-precision steps of different shapes
        # (a verify piece is 1 + K rows) round differently, so a near-tie can flip; the same happens
        # to the plain engine between batch sizes, which the last figure measures.
        diverge = [_first_difference(a, b) for a, b in zip(out_plain, out_spec)]
        alone = [_first_difference(run(plain, [q], args.max_tokens, 1)[1][0], a) for q, a in zip(ps, out_plain)] \
            if b > 1 else [None]
        tokens = b * args.max_tokens
        row = {"batch": b, "output_tokens": tokens,
               "plain_tok_s": tokens / t_plain, "ngram_tok_s": tokens / t_spec, "speedup": t_plain / t_spec,
               "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
               "plain_steps": steps_plain, "ngram_steps": steps_spec,
               "identical_outputs": out_plain == out_spec, "first_difference_plain_vs_ngram": diverge,
               "first_difference_plain_batch1_vs_batched": alone}
        rows.append(row)
        log(f"batch {b}: plain {row['plain_tok_s']:.1f} tok/s ({steps_plain} steps), ngram K={args.num_speculative_tokens} "
            f"{row['ngram_tok_s']:.1f} tok/s ({steps_spec} steps): {row['speedup']:.2f}x; mean acceptance length "
            f"{row['mean_acceptance_length'] or 0:.2f}; identical outputs: {row['identical_outputs']} (first "
            f"differences {diverge}; plain alone vs in the batch: {alone})")
    result = {"model": desc, "machine": machine(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "speculative_config": spec_cfg, "max_tokens": args.max_tokens, "rows": rows}
    out = Path(args.out) if args.out else HERE / "results" / f"spec_decode_{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out}")
    return 0


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


if __name__ == "__main__":
    sys.exit(main())
