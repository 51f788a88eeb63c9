"""CPU decode attention (our C kernel, moe_serve/kernels/cpu_ops/attention.c) over a float32 and an FP8
key/value cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) at long contexts: time per call, the cache's
bytes read per second (keys and values of every sequence's context, the cache's own element size),
and each FP8 format's speed-up over float32.

One layer's decode: B sequences of one query token, N query heads over G kv heads of H (GQA, the
4-heads-a-key score path when N / G is a multiple of 4), blocks of 16 slots scattered through the
cache. The formats are timed in alternation, each round the fastest of `--iters` calls after a
warm-up, and the fastest round kept (other processes on a shared machine only slow a call down; the
load average after the run is recorded with the figures).
The FP8 outputs are checked against the float32 kernel over the same widened values.

    python bench/cpu_attention_fp8.py [--contexts 8192,32768] [--batch 1] [--heads 32,8,128]
                                      [--threads N] [--rounds 3] [--iters 5]

Writes bench/results/cpu_attention_fp8_<isa>_threads<N>.json with the machine record (bench/machine.py).
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

from bench.machine import machine  # noqa: E402
from moe_serve.kernels import cpu_ops  # noqa: E402

FORMATS = {"float32": torch.float32, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def inputs(B: int, ctx: int, N: int, G: int, H: int, bs: int = 16, seed: int = 0):
    """(q, {format: (k_cache, v_cache)}, block_tables, seq_lens): one float32 cache and its FP8
    copies, blocks handed out in a random order."""
    g = torch.Generator().manual_seed(seed)
    nblocks = B * (-(-ctx // bs))
    k = torch.randn(nblocks, bs, G, H, generator=g)
    v = torch.randn(nblocks, bs, G, H, generator=g)
    caches = {name: (k, v) if dt == torch.float32 else (k.to(dt), v.to(dt)) for name, dt in FORMATS.items()}
    tables = torch.randperm(nblocks, generator=g).view(B, -1).to(torch.int32)
    return torch.randn(B, N, H, generator=g), caches, tables, torch.full((B,), ctx, dtype=torch.int32)


def fastest(fn, iters: int) -> float:
    fn()
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_context(B: int, ctx: int, N: int, G: int, H: int, rounds: int, iters: int) -> list[dict]:
    q, caches, tables, lens = inputs(B, ctx, N, G, H)
    scale = H ** -0.5
    for k, v in caches.values():
        assert cpu_ops.decode_attention_fits(q, k, v, tables, lens)
    times = {name: float("inf") for name in caches}
    for _ in range(rounds):  # formats alternated within each round
        for name, (k, v) in caches.items():
            times[name] = min(times[name], fastest(lambda: cpu_ops.decode_attention(q, k, v, tables, lens, scale),
                                                   iters))
    rows = []
    for name, (k, v) in caches.items():
        out = cpu_ops.decode_attention(q, k, v, tables, lens, scale)
        ref = cpu_ops.decode_attention(q, k.float(), v.float(), tables, lens, scale)  # the same values, float32
        nbytes = B * ctx * G * 2 * H * k.element_size()
        rows.append({"context": ctx, "batch": B, "heads": N, "kv_heads": G, "head_dim": H, "cache": name,
                     "ms": round(times[name] * 1e3, 3), "cache_bytes_read": nbytes,
                     "cache_GBps": round(nbytes / times[name] / 1e9, 2),
                     "speedup_vs_float32": round(times["float32"] / times[name], 2),
                     "max_abs_diff_vs_float32_kernel_on_widened": float((out - ref).abs().max())})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="8192,32768")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", default="32,8,128", help="N query heads, G kv heads, head dim H")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not cpu_ops.available():
        print(f"the C kernels are not available here: {cpu_ops.status()['reason']}", file=sys.stderr)
        return 1
    N, G, H = (int(x) for x in a.heads.split(","))
    torch.set_num_threads(a.threads)
    rows = []
    for ctx in (int(c) for c in a.contexts.split(",")):
        for r in bench_context(a.batch, ctx, N, G, H, a.rounds, a.iters):
            rows.append(r)
            print(f"ctx {r['context']:>6} {r['cache']:>9}: {r['ms']:8.3f} ms  {r['cache_GBps']:6.2f} GB/s of cache  "
                  f"x{r['speedup_vs_float32']:.2f} vs float32")
    m = machine()
    result = {"bench": "cpu_attention_fp8", "machine": m, "threads": a.threads, "torch": torch.__version__,
              "rounds": a.rounds, "iters": a.iters, "load_average_after": [round(x, 2) for x in os.getloadavg()],
              "rows": rows}
    out = Path(a.out) if a.out else HERE / "results" / f"cpu_attention_fp8_{m['isa']}_threads{a.threads}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
