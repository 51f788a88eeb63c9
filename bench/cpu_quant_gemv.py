"""Single-row decode GEMV on the CPU over packed int8 / int4 weights (our C kernels,
moe_serve/kernels/cpu_ops/quant.c) against bf16 weights (moe.c's linear_f32, the kernel bf16
checkpoints decode with): time per GEMV, the weight bytes read per second (the packed bytes: codes,
scales and offsets; bf16: 2 bytes a weight) and that rate as a share of the machine's read bandwidth
(moe_serve.speed_of_light.measure_bandwidth, measured in the same run with the same threads).

Shapes: Qwen3-30B-A3B's expert (hidden 2048, moe_intermediate 768: gate_up 1536 x 2048 and down 2048 x
768) and a 2048 x 2048 linear. Each format keeps enough distinct copies of the weight (at least
speed_of_light.stream_bytes, twice the last-level cache) that every GEMV reads its weight from memory,
and runs them in turn. int4: group 128 with zero points (GPTQ / AWQ style offsets); int8: per channel
(G = K), signed codes stored + 128 with offsets -128 * scale. The kernels are called through ctypes
directly (no wrapper checks per call). Each format's fastest of `--rounds` passes over its copies is
kept; the outputs are checked against float64 over the dequantized weight.

Prefill (`--prefill-tokens`, default 128 and 512 rows; 0 for none): the same shapes with many
activation rows, the weight warm in cache (compute-bound): the packed formats through quant.c (the
panel GEMM: weight blocks widened from the codes once per panel group) beside the float kernel
(moe.c's panel GEMM over float32 and over bf16 weights), torch's GEMM over float32 weights (what a
float model's prefill runs above cpu_ops.LINEAR_PANEL_MAX_ROWS rows), quant.c with int8 activations
(GGUF files' default: the int8 panel with AVX-512 VNNI, the float panel elsewhere; its error against
float64 over float activations is the rounding's), and the torch path packed layers took before (the
weight dequantized per call, then torch's GEMM), fastest of --rounds calls each, in milliseconds,
checked against float64.

`--isa avx2` (or generic, avx512) runs vec.h's build for that ISA (MOE_SERVE_CPU_ISA) on a machine
that executes it: the AVX2 figures of an AVX-512 machine (our kernels only: torch's rows still run
torch's own kernels for the machine at hand).

    python bench/cpu_quant_gemv.py [--threads N] [--rounds 3] [--group 128] [--mbytes MB] [--isa ISA]
                                   [--prefill-tokens 128,512] [--no-decode]

Writes bench/results/cpu_quant_gemv_<isa>_threads<N>.json (`<isa>build` with --isa; with --no-decode,
the prefill cases only, cpu_quant_prefill_...) with the machine record (bench/machine.py).
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
from moe_serve import speed_of_light  # noqa: E402
from moe_serve.kernels import cpu_ops  # noqa: E402
from moe_serve.kernels.cpu_ops import quant  # noqa: E402
from moe_serve.quantization.packed import PackedWeight, quantize_reference  # noqa: E402

SHAPES = {"qwen3-30b-a3b expert gate_up": (1536, 2048), "qwen3-30b-a3b expert down": (2048, 768),
          "linear 2048x2048": (2048, 2048)}


def copies_of(t: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.empty((n, *t.shape), dtype=t.dtype)
    out.copy_(t.unsqueeze(0).expand_as(out))
    return out


def bench_format(fmt: str, w: torch.Tensor, group: int, budget: int, rounds: int, x: torch.Tensor) -> dict:
    N, K = w.shape
    lib = quant._lib()
    nt = torch.get_num_threads()
    y = torch.empty(1, N)
    if fmt == "bf16":
        wb = w.to(torch.bfloat16)
        per = wb.numel() * 2
        n = max(2, -(-budget // per))
        stack = copies_of(wb, n)
        ptrs = [stack[i].data_ptr() for i in range(n)]

        def run(p):
            lib.linear_f32(x.data_ptr(), K, 1, p, 1, K, N, y.data_ptr(), N, nt)
        ref_w = wb.double()
    else:
        bits = 4 if fmt == "int4" else 8
        pw = quantize_reference(w, bits, group if bits == 4 else K, symmetric=bits == 8)
        per = pw.nbytes
        n = max(2, -(-budget // per))
        qs, ss = copies_of(pw.qweight, n), copies_of(pw.scales, n)
        os_ = copies_of(pw.offsets, n) if pw.offsets is not None else None
        ptrs = [(qs[i].data_ptr(), ss[i].data_ptr(), os_[i].data_ptr() if os_ is not None else None)
                for i in range(n)]
        G = pw.group_size

        def run(p):
            rc = lib.quant_linear_f32(x.data_ptr(), K, 1, p[0], bits, p[1], 0, p[2], 0, G, K, N, y.data_ptr(), N, 0, nt)
            assert rc == 0, rc
        ref_w = PackedWeight(bits, qs[-1], ss[-1], os_[-1] if os_ is not None else None, G, (N, K)).dequantize().double()
    for p in ptrs:  # warm-up: first touch, the library's scratch
        run(p)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for p in ptrs:
            run(p)
        best = min(best, (time.perf_counter() - t0) / len(ptrs))
    run(ptrs[-1])
    ref = x.double() @ ref_w.T
    err = float((y.double() - ref).abs().max() / ref.abs().max())
    return {"format": fmt, "bytes_per_gemv": per, "copies": len(ptrs), "us": round(best * 1e6, 1),
            "GBps": round(per / best / 1e9, 2), "max_rel_err_vs_float64": err}


def _fastest(fn, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_prefill(w: torch.Tensor, M: int, group: int, rounds: int, g: torch.Generator) -> list[dict]:
    """y = x @ W^T for M rows of x, one row per way of computing it (see the module docstring)."""
    N, K = w.shape
    lib = quant._lib()
    nt = torch.get_num_threads()
    x = torch.randn(M, K, generator=g)
    y = torch.empty(M, N)
    wb = w.to(torch.bfloat16)
    ways = {"float32 panel (moe.c)": (lambda: lib.linear_panels_f32(x.data_ptr(), K, M, w.data_ptr(), 0, None, K, N,
                                                                     y.data_ptr(), N, nt), w),
            "bf16 panel (moe.c)": (lambda: lib.linear_panels_f32(x.data_ptr(), K, M, wb.data_ptr(), 1, None, K, N,
                                                                  y.data_ptr(), N, nt), wb),
            "float32 torch": (lambda: y.copy_(torch.nn.functional.linear(x, w)), w)}
    for bits in (8, 4):
        pw = quantize_reference(w, bits, group if bits == 4 else K, symmetric=bits == 8)
        ways[f"int{bits} quant.c"] = (lambda pw=pw, bits=bits: lib.quant_linear_f32(
            x.data_ptr(), K, M, pw.qweight.data_ptr(), bits, pw.scales.data_ptr(), int(pw.scales.dtype == torch.float16),
            pw.offsets.data_ptr() if pw.offsets is not None else None, pw.zero, pw.group_size, K, N, y.data_ptr(), N,
            0, nt), pw)
        ways[f"int{bits} quant.c int8 activations"] = (lambda pw=pw, bits=bits: lib.quant_linear_f32(
            x.data_ptr(), K, M, pw.qweight.data_ptr(), bits, pw.scales.data_ptr(), int(pw.scales.dtype == torch.float16),
            pw.offsets.data_ptr() if pw.offsets is not None else None, pw.zero, pw.group_size, K, N, y.data_ptr(), N,
            1, nt), pw)
        ways[f"int{bits} torch dequantize"] = (lambda pw=pw: y.copy_(torch.nn.functional.linear(x, pw.dequantize())),
                                               pw)
    rows = []
    for way, (fn, wt) in ways.items():
        t = _fastest(fn, rounds)
        fn()
        W = (wt.dequantize() if isinstance(wt, PackedWeight) else wt).double()
        ref = x.double() @ W.T
        err = float((y.double() - ref).abs().max() / ref.abs().max())
        rows.append({"way": way, "ms": round(t * 1e3, 3), "GFLOPs": round(2 * M * N * K / t / 1e9, 1),
                     "max_rel_err_vs_float64": err})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--group", type=int, default=128, help="int4 group size")
    p.add_argument("--mbytes", type=int, default=None, help="bytes of weight copies per format (default: "
                   "speed_of_light.stream_bytes)")
    p.add_argument("--isa", default=None, help="vec.h's build for this ISA (MOE_SERVE_CPU_ISA): avx512, avx2, generic")
    p.add_argument("--prefill-tokens", default="128,512", help="activation rows of the prefill cases (0: none)")
    p.add_argument("--no-decode", action="store_true", help="the prefill cases only (written as cpu_quant_prefill_*)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.isa:
        os.environ["MOE_SERVE_CPU_ISA"] = a.isa
    if not cpu_ops.available():
        print(f"the C kernels are not available here: {cpu_ops.status()['reason']}", file=sys.stderr)
        return 1
    torch.set_num_threads(a.threads)
    budget = a.mbytes * 2 ** 20 if a.mbytes else speed_of_light.stream_bytes("cpu")
    bw = speed_of_light.measure_bandwidth("cpu")
    print(f"read bandwidth {bw / 1e9:.2f} GB/s ({a.threads} threads); {budget / 2 ** 20:.0f} MB of copies a format")
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, (N, K) in SHAPES.items() if not a.no_decode else ():
        w = torch.randn(N, K, generator=g) * K ** -0.5
        x = torch.randn(1, K, generator=g)
        for fmt in ("bf16", "int8", "int4"):
            r = {"shape": name, "N": N, "K": K, **bench_format(fmt, w, a.group, budget, a.rounds, x)}
            r["pct_of_bandwidth"] = round(100 * r["GBps"] * 1e9 / bw, 1)
            rows.append(r)
            print(f"{name:>30} {fmt:>5}: {r['us']:8.1f} us  {r['GBps']:6.2f} GB/s  {r['pct_of_bandwidth']:5.1f}% "
                  f"of bandwidth  (rel err {r['max_rel_err_vs_float64']:.1e})")
    prefill = []
    for M in [int(v) for v in a.prefill_tokens.split(",") if int(v) > 0]:
        for name, (N, K) in SHAPES.items():
            w = torch.randn(N, K, generator=g) * K ** -0.5
            for r in bench_prefill(w, M, a.group, a.rounds, g):
                prefill.append({"shape": name, "N": N, "K": K, "tokens": M, **r})
                print(f"{name:>30} {M:4d} tokens {r['way']:>24}: {r['ms']:8.2f} ms  {r['GFLOPs']:6.1f} GFLOP/s  "
                      f"(rel err {r['max_rel_err_vs_float64']:.1e})")
    m = machine()
    result = {"bench": "cpu_quant_gemv", "machine": m, "threads": a.threads, "torch": torch.__version__,
              "read_bandwidth_GBps": round(bw / 1e9, 2), "rounds": a.rounds, "int4_group": a.group,
              "copies_bytes_per_format": budget, "load_average_after": [round(v, 2) for v in os.getloadavg()],
              "rows": rows, "prefill": prefill}
    tag = f"{a.isa}build" if a.isa else m["isa"]
    kind = "prefill" if a.no_decode else "gemv"
    out = Path(a.out) if a.out else HERE / "results" / f"cpu_quant_{kind}_{tag}_threads{a.threads}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
