"""KV and state bytes per request at long context, and the most requests a fixed cache budget holds,
before and after per-layer cache kinds, for a GPT-OSS-120B-shaped and a Qwen3.5-MoE-shaped model.

    python bench/cache_kinds.py [--context 8192] [--budget-gib 40] [--block-size 16]

The models are built on the meta device from their configs (no weights) and their cache-owning
layers are grouped exactly as the engine groups them (moe_serve/runner/memory.py group_layers).
Per request at `context` tokens:
  - before: every attention layer kept the K/V of every token in one shared block table (GPT-OSS's
    sliding layers too); Qwen3.5-MoE was refused (no linear-attention support), so it has no
    "before";
  - after: full groups keep every token; sliding / chunked groups at most their window plus a
    partial block at each end (what a request holds between steps); state layers one live slot.
Requests that fit = budget // bytes per request (the full-context worst case). Prints a table.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

import torch  # noqa: E402

from attention.cache_kinds import FULL  # noqa: E402
from expert_parallel.runtime.dispatch.local import LocalDispatcher  # noqa: E402
from expert_parallel.runtime.layer import MoEContext  # noqa: E402
from moe_serve.models.registry import model_class  # noqa: E402
from moe_serve.runner.memory import attention_layers, group_layers  # noqa: E402

GPT_OSS_120B = dict(architectures=["GptOssForCausalLM"], hidden_size=2880, num_hidden_layers=36,
                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128,
                    num_experts_per_tok=4, intermediate_size=2880, vocab_size=201088, sliding_window=128,
                    max_position_embeddings=131072, rope_theta=150000.0,
                    layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(36)])
# Qwen3.5-MoE (35B-A3B's published shape): 40 layers, three Gated DeltaNet layers to one full.
QWEN3_5_MOE = dict(architectures=["Qwen3_5MoeForCausalLM"], hidden_size=2048, num_hidden_layers=40,
                   num_attention_heads=16, num_key_value_heads=2, head_dim=256, num_experts=256,
                   num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                   vocab_size=248320, linear_num_key_heads=16, linear_num_value_heads=32,
                   linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                   full_attention_interval=4, partial_rotary_factor=0.25, max_position_embeddings=262144,
                   rope_theta=10000000.0,
                   layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)])


def per_request(hf: dict, context: int, bs: int, dtype=torch.bfloat16) -> dict:
    E = hf.get("num_local_experts") or hf.get("num_experts")
    with torch.device("meta"):
        model = model_class(hf["architectures"][0])(hf, MoEContext(LocalDispatcher(E)), dtype)
    groups, state = group_layers(attention_layers(model))
    elem = torch.empty((), dtype=dtype).element_size()
    blocks = -(-context // bs)
    before = after = 0
    rows = []
    for kind, layers in groups:
        block_bytes = sum(elem * math.prod(s) for layer in layers for s in layer.cache_shape(1, bs))
        kept = blocks if kind == FULL else min(blocks, kind.tokens // bs + 2)
        before += blocks * block_bytes
        after += kept * block_bytes
        rows.append(f"{kind} x{len(layers)}: {kept * block_bytes / 2**20:.1f} MiB")
    slot = sum(layer.slot_bytes() for layer in state)
    if state:
        after += slot
        rows.append(f"state x{len(state)}: {slot / 2**20:.1f} MiB")
    return dict(before=before, after=after, rows=rows, supported_before=not state)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--budget-gib", type=float, default=40.0)
    ap.add_argument("--block-size", type=int, default=16)
    a = ap.parse_args()
    budget = int(a.budget_gib * 2**30)
    print(f"context {a.context} tokens, block size {a.block_size}, cache budget {a.budget_gib:g} GiB, bf16 KV")
    print(f"{'model':<16}{'before MiB/req':>16}{'after MiB/req':>15}{'requests before':>17}{'requests after':>16}"
          "  groups after")
    for name, hf in (("gpt-oss-120b", GPT_OSS_120B), ("qwen3.5-moe", QWEN3_5_MOE)):
        r = per_request(hf, a.context, a.block_size)
        before = f"{r['before'] / 2**20:.1f}" if r["supported_before"] else "refused"
        n_before = str(budget // r["before"]) if r["supported_before"] else "-"
        print(f"{name:<16}{before:>16}{r['after'] / 2**20:>15.1f}{n_before:>17}{budget // r['after']:>16}  "
              + "; ".join(r["rows"]))


if __name__ == "__main__":
    main()
