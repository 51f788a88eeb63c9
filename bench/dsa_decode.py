"""Decode step of a DeepSeek-V3.2-shaped model at 2K, 8K and 32K context: dense MLA against DSA.

    python bench/dsa_decode.py [--context 2048 8192 32768] [--batch 1 8] [--layers 2] [--out F]

Two random-init models of one shape, DeepSeek-V3.2's attention (q_lora_rank 1536, kv_lora_rank 512,
rope 64, nope 128, v 128; indexer 64 heads of 128, index_topk 2048) with a narrower model around it
(hidden 2048 with V3.2's 128 heads, first layer dense, the others 16 experts top-4 of 512 and a shared expert;
float32): `DeepseekV3ForCausalLM` (dense MLA) and `DeepseekV32ForCausalLM` (DSA). Each is stepped
by hand, on this machine's default backends: B sequences whose caches hold S random tokens (no
prefill: a 32K prefill of the dense model takes minutes here), then one decode step (model forward
and the LM head) timed, median of 5.

Speed of light = max(bytes per step / bandwidth, attention FLOPs / peak FLOP rate). Bytes per step
= every non-expert weight + distinct experts touched * bytes per expert (bench/sol.py) + what
attention must read per layer: dense MLA every cached latent row (S * (512 + 64) * 4 bytes per
sequence), DSA every cached indexer key (S * 128 * 4) and the selected latent rows (min(S, 2048) *
576 * 4). Absorbed MLA is compute-heavy (every head scores every latent row: 128 * (576 + 512) * 2
FLOPs per cached token and sequence, 64 per byte read), and so is the indexer (64 * 128 * 2 per
token), so on a CPU the compute floor, not the bytes, bounds long contexts. Bandwidth: a tensor copy
in the same run; peak FLOP rate: a 2048^3 float32 matmul in the same run. Prints figures only.
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

from bench.sol import expected_distinct_experts, measure_bandwidth  # noqa: E402

SHAPE = dict(vocab_size=8192, hidden_size=2048, intermediate_size=4096, moe_intermediate_size=512,
             num_attention_heads=128, num_key_value_heads=128, n_routed_experts=16, n_shared_experts=1,
             num_experts_per_tok=4, n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
             q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
             index_n_heads=64, index_head_dim=128, index_topk=2048, max_position_embeddings=65536,
             rms_norm_eps=1e-6, rope_theta=10000.0, norm_topk_prob=True)
BLOCK = 64


def build(arch: str, layers: int):
    from expert_parallel.runtime.dispatch.local import LocalDispatcher
    from expert_parallel.runtime.layer import MoEContext
    from moe_serve import platform
    from moe_serve.models.registry import model_class

    hf = dict(SHAPE, num_hidden_layers=layers, architectures=[arch])
    model = model_class(arch)(hf, MoEContext(LocalDispatcher(hf["n_routed_experts"])), torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name else 0.1 * torch.randn(p.shape, generator=g))
    choice = platform.choose("cpu")
    platform.bind_ops(model, platform.resolve_ops(torch.device("cpu"), choice.moe_backend, choice.attention_backend,
                                                  choice.linear_backend, choice.norm_backend))
    return model


def caches_for(model, blocks: int):
    """Bind every attention layer to caches of `blocks` blocks of random values; bytes per token."""
    from attention.layer import PagedMLAAttention

    g = torch.Generator().manual_seed(1)
    per_token = 0
    for m in model.modules():
        if isinstance(m, PagedMLAAttention):
            shapes = m.cache_shape(blocks, BLOCK)
            m.bind([torch.randn(s, generator=g) for s in shapes])
            per_token += sum(s[2] * 4 for s in shapes)
    return per_token


def step_time(model, B: int, S: int) -> float:
    from attention.metadata import AttentionMetadata

    nb = -(-(S + 1) // BLOCK)
    tables = [list(range(b * nb, (b + 1) * nb)) for b in range(B)]
    meta_args = ([1] * B, [S + 1] * B, tables, BLOCK)
    ids = torch.randint(3, SHAPE["vocab_size"], (B,))
    pos = torch.full((B,), S, dtype=torch.int64)

    def run():
        meta = AttentionMetadata.build(*meta_args)
        with torch.no_grad():
            model.compute_logits(model(ids, pos, meta))

    run()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return sorted(times)[2]


def weight_bytes(model, B: int) -> float:
    from expert_parallel.runtime.layer import MoE

    moes = [m for m in model.modules() if isinstance(m, MoE)]
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total -= model.model.embed_tokens.weight.numel() * 4
    routed = sum(m.experts.w13.numel() * 4 + m.experts.w2.numel() * 4 for m in moes)
    per_expert = routed / max(1, sum(m.experts.w13.shape[0] for m in moes))
    touched = expected_distinct_experts(SHAPE["n_routed_experts"], SHAPE["num_experts_per_tok"], B)
    return total - routed + len(moes) * touched * per_expert


def matmul_rate(n: int = 2048) -> float:
    """FLOP/s of a float32 n^3 matmul, best of 5."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(5))
    return 2 * n ** 3 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def attention_flops(name: str, B: int, S: int) -> float:
    """FLOPs of one layer's decode attention: scores and weighted sums (MLA), and the indexer's scores."""
    N, L, R = SHAPE["num_attention_heads"], SHAPE["kv_lora_rank"], SHAPE["qk_rope_head_dim"]
    if name == "dense":
        return B * 2 * N * S * (2 * L + R)
    k = min(S, SHAPE["index_topk"])
    return B * (2 * N * k * (2 * L + R) + 2 * SHAPE["index_n_heads"] * SHAPE["index_head_dim"] * S)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    bw = measure_bandwidth("cpu", 1 << 30)
    flops = matmul_rate()
    L, R, I, K = SHAPE["kv_lora_rank"], SHAPE["qk_rope_head_dim"], SHAPE["index_head_dim"], SHAPE["index_topk"]
    print(f"DeepSeek-V3.2-shaped decode, {a.layers} layers, float32, CPU {torch.get_num_threads()} threads, "
          f"copy bandwidth {bw / 1e9:.1f} GB/s, matmul {flops / 1e9:.0f} GFLOP/s")
    print(f"{'batch':>5} {'context':>7} {'attention':>9} {'step ms':>8} {'bytes ms':>8} {'FLOP ms':>8} {'% SOL':>6} "
          f"{'attn MiB':>8} {'DSA speed-up':>12}")
    rows = []
    models = {name: build(arch, a.layers) for name, arch in (("dense", "DeepseekV3ForCausalLM"),
                                                            ("dsa", "DeepseekV32ForCausalLM"))}
    for B in a.batch:
        for S in a.context:
            blocks = B * -(-(S + 1) // BLOCK)
            res = {}
            for name, model in models.items():
                caches_for(model, blocks)
                t = step_time(model, B, S)
                per_seq = S * (L + R) * 4 if name == "dense" else S * I * 4 + min(S, K) * (L + R) * 4
                attn = a.layers * B * per_seq
                by_bytes = (weight_bytes(model, B) + attn) / bw
                by_flops = a.layers * attention_flops(name, B, S) / flops
                sol = max(by_bytes, by_flops)
                res[name] = t
                rows.append(dict(batch=B, context=S, attention=name, step_s=t, bytes_sol_s=by_bytes,
                                 flops_sol_s=by_flops, attention_bytes=attn))
                speed = f"{res['dense'] / t:11.2f}x" if name == "dsa" else ""
                print(f"{B:5d} {S:7d} {name:>9} {t * 1e3:8.1f} {by_bytes * 1e3:8.1f} {by_flops * 1e3:8.1f} "
                      f"{100 * sol / t:5.0f}% {attn / 2**20:8.1f} {speed:>12}", flush=True)
                for m in model.modules():  # free this context's caches before the next model's
                    if hasattr(m, "latent_cache"):
                        m.latent_cache = None
                    if hasattr(m, "index_cache"):
                        m.index_cache = None
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(shape=SHAPE, layers=a.layers, bandwidth_gb_s=bw / 1e9, matmul_gflops=flops / 1e9, threads=torch.get_num_threads(),
                           torch=torch.__version__, cpu=os.uname().machine, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
