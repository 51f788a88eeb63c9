"""Tune the Triton grouped GEMM for one expert shape on the local GPU and write its config JSON.

    python -m moe_serve.kernels.grouped_gemm.tune --E 128 --N 768 --K 2048 --dtype bf16 [--top-k 8]

N is the expert intermediate size F and K the hidden size D (w13 is (E, 2N, K)). For each batch size
the candidates are timed with triton.testing.do_bench on balanced random routing, the fastest one
that also matches the torch reference is kept, and the result goes to
moe_serve/kernels/grouped_gemm/configs/<config_file_name> (see config.py). Needs CUDA; exits 2 without it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from moe_serve.kernels.grouped_gemm.config import CONFIG_DIR, DTYPE_NAMES, config_file_name, device_name

DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
DEVICE = "cuda"
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 8192)


def candidates(T: int, E: int, top_k: int, dtype: torch.dtype, smem_bytes: int, quick: bool) -> list[dict]:
    """Configs worth timing at batch size T: row blocks no taller than twice the mean expert load,
    and pipelines that fit in shared memory (the gated GEMM stages one A and two B tiles)."""
    pairs_per_expert = T * top_k / E
    block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * pairs_per_expert)]
    block_ns = (64, 128) if quick else (32, 64, 128, 256)
    block_ks = (64, 128) if quick else (64, 128, 256)
    groups = (1, 16) if quick else (1, 8, 16, 32)
    warps = (4, 8)
    stages = (3, 4) if quick else (2, 3, 4, 5)
    elt = torch.finfo(dtype).bits // 8
    out = []
    for bm, bn, bk, g, w, s in itertools.product(block_ms, block_ns, block_ks, groups, warps, stages):
        if s * (bm * bk + 2 * bk * bn) * elt > smem_bytes:
            continue
        if bm == 16 and g > 1 and pairs_per_expert <= 16:
            continue  # decode: one row block per expert, grouping changes nothing
        out.append({"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": g,
                    "num_warps": w, "num_stages": s})
    return out


def make_inputs(T: int, E: int, N: int, K: int, top_k: int, dtype: torch.dtype, seed: int = 0):
    """Random layer inputs scaled so activations stay O(1), with softmax top-k routing."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(T, K, device=DEVICE, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * N, K, device=DEVICE, generator=g) / K ** 0.5).to(dtype)
    w2 = (torch.randn(E, K, N, device=DEVICE, generator=g) / N ** 0.5).to(dtype)
    logits = torch.randn(T, E, device=DEVICE, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return x, w13, w2, weights, ids.to(torch.int32)


def tune_batch(T: int, args, dtype: torch.dtype, smem_bytes: int) -> tuple[dict, float]:
    """The fastest correct config at batch size T and its time in ms."""
    import triton.testing

    from moe_serve.kernels.grouped_gemm.reference import fused_experts_reference
    from moe_serve.kernels.grouped_gemm.triton_kernel import fused_experts_triton

    x, w13, w2, weights, ids = make_inputs(T, args.E, args.N, args.K, args.top_k, dtype)
    ref = fused_experts_reference(x.float(), w13.float(), w2.float(), weights, ids)
    out = torch.empty_like(x)
    best: tuple[float, dict] | None = None
    skipped = 0
    for cfg in candidates(T, args.E, args.top_k, dtype, smem_bytes, args.quick):
        try:
            fused_experts_triton(x, w13, w2, weights, ids, config=cfg, out_TD=out)
            err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            if not err < 3e-2:
                raise RuntimeError(f"relative error {err:.3g}")
            ms = triton.testing.do_bench(
                lambda: fused_experts_triton(x, w13, w2, weights, ids, config=cfg, out_TD=out),
                warmup=10, rep=40)
        except Exception as e:  # out of shared memory / registers, or a wrong result: not a candidate
            skipped += 1
            if args.verbose:
                print(f"  T={T} skip {cfg}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
            continue
        if best is None or ms < best[0]:
            best = (ms, cfg)
    if best is None:
        raise RuntimeError(f"no candidate config ran at T={T} ({skipped} failed)")
    return best[1], best[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_serve.kernels.grouped_gemm.tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--E", type=int, required=True, help="experts on this rank")
    p.add_argument("--N", type=int, required=True, help="expert intermediate size F")
    p.add_argument("--K", type=int, required=True, help="hidden size D")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)),
                   help="comma-separated token counts to tune for")
    p.add_argument("--quick", action="store_true", help="a smaller search space (minutes, not an hour)")
    p.add_argument("--out-dir", type=Path, default=CONFIG_DIR)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: moe_serve.kernels.grouped_gemm.tune times kernels on a CUDA GPU and none is visible here "
              "(torch.cuda.is_available() is False); run it on the GPU the configs are for.", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    props = torch.cuda.get_device_properties(0)
    smem_bytes = getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024
    dev = device_name(torch.device("cuda", 0))
    print(f"tuning E={args.E} N={args.N} K={args.K} {args.dtype} top-{args.top_k} on {dev}")
    results: dict[str, dict] = {}
    for T in batch_sizes:
        t0 = time.time()
        cfg, ms = tune_batch(T, args, dtype, smem_bytes)
        results[str(T)] = cfg
        print(f"T={T:6d}  {ms * 1e3:9.1f} us  {cfg}  (searched in {time.time() - t0:.0f} s)", flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / config_file_name(args.E, args.N, args.K, dtype, dev)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
