"""Decode tok/s of a Qwen3.5-MoE-shaped hybrid model at batch 1 and 32, next to its speed of light.

    python bench/hybrid_decode.py [--batch 1 32] [--context 256] [--tokens 16] [--threads N]
    python bench/hybrid_decode.py --linear-attention-backend torch cpu_c   # side by side, one run

A random-init `Qwen3_5MoeForCausalLM` written by transformers (8 layers, three Gated DeltaNet layers
to one full-attention layer, D=512, 32 experts top-4 of F=256 with a shared expert, float32), served
by `moe_serve.LLM` with the default backends of this machine (the linear-attention one as asked).
Decode tokens/s: B fresh prompts (no prefix hits) are stepped until each has its first token, then
--tokens pure-decode steps are timed (best of 2); a prefill's noise is not in the figure.

Speed of light = batch * bandwidth / bytes per step, where bytes per step = every non-expert weight
+ distinct experts touched per MoE layer * bytes per expert (bench/sol.py) + the full layers' KV of
every cached token + every sequence's linear-attention state read and written once (2 * state
bytes: the recurrent state float32, the conv state). Bandwidth: a tensor copy in the same run.
Prints figures only.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

import torch  # noqa: E402

from bench.sol import expected_distinct_experts, measure_bandwidth  # noqa: E402

SHAPE = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
             head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
             shared_expert_intermediate_size=256, linear_num_key_heads=4, linear_num_value_heads=8,
             linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=4,
             max_position_embeddings=4096, tie_word_embeddings=False)


def build(path: str) -> str:
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM

    from moe_serve.default_model.tokenizer_train import special_token_ids, train_tokenizer
    from tests.checkpoints import widen_

    train_tokenizer(path, SHAPE["vocab_size"])
    special = special_token_ids(path)
    cfg = Qwen3_5MoeTextConfig(**SHAPE, eos_token_id=special["<|im_end|>"], pad_token_id=special["<|endoftext|>"],
                               layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                            for i in range(SHAPE["num_hidden_layers"])])
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    widen_(model, 1)
    model.save_pretrained(path)
    return path


def step_bytes(llm, batch: int, context: int) -> tuple[float, dict]:
    from expert_parallel.runtime.layer import MoE

    runner = llm.engine.runner
    model = runner.model
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    routed = sum(m.experts.w13.numel() * m.experts.w13.element_size() + m.experts.w2.numel() * m.experts.w2.element_size()
                 for m in moes)
    per_expert = routed // (len(moes) * moes[0].experts.w13.shape[0])
    emb = model.model.embed_tokens.weight
    non_expert = sum(params.values()) - routed - emb.numel() * emb.element_size()
    bs = llm.engine.cfg.cache.block_size
    elem = torch.empty((), dtype=llm.engine.cfg.model.dtype).element_size()
    kv_per_token = sum(elem * math.prod(s) for layer in runner.attn_layers if hasattr(layer, "cache_shape")
                       for s in layer.cache_shape(1, bs)) // bs
    state = runner.state_layers
    state_bytes = sum(layer.slot_bytes() for layer in state)
    experts = expected_distinct_experts(moes[0].num_experts, moes[0].gate.top_k, batch)
    total = non_expert + len(moes) * experts * per_expert + batch * context * kv_per_token + 2 * batch * state_bytes
    return total, dict(non_expert_bytes=non_expert, expert_bytes=per_expert, distinct_experts=experts,
                       kv_bytes_per_token=kv_per_token, state_bytes_per_seq=state_bytes)


def decode_steps(llm, B: int, context: int, steps: int, rng) -> float:
    """Decode tokens/s of B fresh sequences of `context` prompt tokens: the engine is stepped until
    every sequence has its first token (prefill done), then `steps` pure-decode steps are timed."""
    from moe_serve import SamplingParams
    from moe_serve.protocol import NewRequest

    core = llm.engine
    tag = f"{B}-{rng.random()}"
    for i in range(B):
        prompt = [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(context)]
        core.add_request(NewRequest(f"{tag}-{i}", prompt, SamplingParams(temperature=0, max_tokens=steps + 2,
                                                                          ignore_eos=True)))
    started: set = set()
    while len(started) < B:
        started |= {o.request_id for o in core.step() if o.new_token_ids}
    t, n = time.perf_counter(), 0
    for _ in range(steps):
        n += sum(len(o.new_token_ids) for o in core.step())
    dt = time.perf_counter() - t
    while core.has_unfinished():
        core.step()
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--linear-attention-backend", nargs="+", default=["auto"],
                    help="one engine per name, each run on the same prompts (e.g. torch cpu_c: side by side)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from moe_serve import LLM, SamplingParams

    path = build(tempfile.mkdtemp(prefix="qwen3_5-bench-"))
    bw = measure_bandwidth("cpu", 1 << 30)
    rows = []
    for backend in a.linear_attention_backend:
        llm = LLM(path, dtype="float32", kv_cache_memory=1 << 30, max_num_seqs=max(a.batch), show_progress=False,
                  linear_attention_backend=backend)
        name = llm.engine.cfg.linear_attention_backend
        rng = random.Random(0)  # the same prompts for every backend
        for B in a.batch:
            decode_steps(llm, B, a.context, 2, rng)  # warm-up
            tok_s = max(decode_steps(llm, B, a.context, a.tokens, rng) for _ in range(2))
            total, parts = step_bytes(llm, B, a.context + a.tokens // 2)
            sol = B * bw / total
            rows.append(dict(linear_attention_backend=name, batch=B, tok_s=tok_s, sol_tok_s=sol,
                             pct_sol=100 * tok_s / sol, step_bytes=total, **parts))
            print(f"{name:6s} batch {B:>3}: {tok_s:8.1f} tok/s decode, speed of light {sol:8.1f} tok/s "
                  f"({100 * tok_s / sol:.0f}%), {total / 2**20:.1f} MiB per step "
                  f"(state {2 * B * parts['state_bytes_per_seq'] / 2**20:.1f} MiB)", flush=True)
        del llm
    result = dict(model="qwen3.5-moe-mid (random init)", shape=SHAPE, bandwidth_gb_s=bw / 1e9,
                  threads=torch.get_num_threads(), torch=torch.__version__, cpu=os.uname().machine, rows=rows)
    print(f"bandwidth {bw / 1e9:.1f} GB/s, {torch.get_num_threads()} threads")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
