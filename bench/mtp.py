"""Speculative decoding with the checkpoint's MTP layer, K = 1, 2, 3 against none, side by side in
one run, on DeepSeek-V3-shaped random checkpoints built here (MLA with q/kv LoRA, 64 routed
experts top-6 in 8 groups, a shared expert, yarn RoPE; vocab 512):

  - "copy": one MoE layer and an MTP layer that is the model shifted by one token
    (tests/checkpoints.py build_deepseek_mtp), so drafts are often right: what speculation buys;
  - "random": sixteen MoE layers and random MTP weights, so drafts are nearly always rejected: what
    drafting costs when it buys nothing (the MTP layer costs about a layer: 1/16 of a step here,
    1/61 on DeepSeek-V3; on the one-layer "copy" model it costs as much as the model).

For batch 1 and 8, greedy, EOS ignored, the same output length everywhere: output tok/s, target
forwards (engine steps) per generated token per sequence, time per step, mean acceptance length,
and whether the outputs equal the plain engine's (float32: they must). The fastest of --repeats.

    python bench/mtp.py                 # writes bench/results/mtp_deepseek_cpu.json
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

import torch  # noqa: E402

from bench.machine import describe, machine  # noqa: E402

SHAPE = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=256,
             qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=64, num_experts_per_tok=6,
             n_group=8, topk_group=4, moe_intermediate_size=256, n_shared_experts=1, intermediate_size=2048,
             max_position_embeddings=4096)
VARIANTS = {"copy": dict(copy=True, num_hidden_layers=1), "random": dict(copy=False, num_hidden_layers=16)}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(llm, prompts, max_tokens: int, repeats: int):
    from moe_serve import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    best = None
    for _ in range(repeats):
        s0, d0 = llm.engine.num_steps, (llm.engine.spec.num_drafts, llm.engine.spec.num_accepted_tokens)
        t0 = time.perf_counter()
        res = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        if best is None or dt < best[0]:
            s = llm.engine.spec
            best = (dt, [r.outputs[0].token_ids for r in res], llm.engine.num_steps - s0,
                    s.num_drafts - d0[0], s.num_accepted_tokens - d0[1])
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ks", default="1,2,3")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variants", default="copy,random")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(HERE / "results" / "mtp_deepseek_cpu.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from moe_serve import LLM
    from tests.checkpoints import VOCAB, build_deepseek_mtp

    log(f"threads {torch.get_num_threads()}; {describe()}")
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for variant in args.variants.split(","):
            path = build_deepseek_mtp(f"{root}/{variant}", **VARIANTS[variant], **SHAPE)
            rng = random.Random(0)
            common = dict(dtype="float32", show_progress=False, num_kv_blocks=256, speed_of_light_window=1e9)
            engines = {0: LLM(path, **common)}
            for k in (int(x) for x in args.ks.split(",")):
                engines[k] = LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": k}, **common)
            for b in (int(x) for x in args.batches.split(",")):
                ps = [{"prompt_token_ids": [rng.randrange(10, VOCAB) for _ in range(args.prompt_len)]} for _ in range(b)]
                for llm in engines.values():  # warm-up
                    run(llm, ps[:1], 4, 1)
                base = None
                for k, llm in engines.items():
                    dt, outs, steps, drafts, accepted = run(llm, ps, args.max_tokens, args.repeats)
                    tokens = b * args.max_tokens
                    row = {"variant": variant, "layers": VARIANTS[variant]["num_hidden_layers"], "batch": b, "k": k,
                           "output_tok_s": tokens / dt, "steps": steps,
                           "target_forwards_per_token": steps / args.max_tokens,
                           "step_ms": 1e3 * dt / steps, "mean_acceptance_length": 1 + accepted / drafts if drafts else None}
                    if k == 0:
                        base = (dt, outs)
                    row["speedup"] = base[0] / dt
                    row["identical_outputs"] = outs == base[1]
                    rows.append(row)
                    log(f"{variant} batch {b} K={k}: {row['output_tok_s']:.1f} tok/s ({row['speedup']:.2f}x), "
                        f"{row['target_forwards_per_token']:.2f} target forwards per token, {row['step_ms']:.1f} ms "
                        f"per step, acceptance length {row['mean_acceptance_length'] or 0:.2f}, identical "
                        f"{row['identical_outputs']}")
    result = {"machine": machine(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "shape": SHAPE, "vocab": VOCAB, "dtype": "float32",
              "max_tokens": args.max_tokens, "prompt_len": args.prompt_len, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
