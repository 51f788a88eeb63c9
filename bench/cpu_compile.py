"""CPU decode forward: what the engine runs (eager, our C kernels) against `torch.compile` of the
same forward, side by side in one run.

For each batch size B, B requests are prefilled and the model forward of one padded decode step of B
rows is captured as it is called (its ids, positions and attention metadata). That forward is then
timed, with torch's CPU threads as set, in three ways:

- eager: what the engine runs on the CPU (the C kernels of moe_serve/kernels/cpu_ops);
- eager, torch ops: the same forward with the C kernels off (`platform.capturable(model)`, the capturable
  torch-op path a CUDA graph would hold);
- compiled: `torch.compile(dynamic=False)` of that torch-op path (Inductor's C++ backend; the C
  kernels are ctypes calls a graph cannot hold), one compile per padded size, whose compile time is
  reported next to the per-step saving it buys. torch 2.13's fake-tensor rule for its grouped GEMM
  accepts only bf16, so a float32 model's experts cannot be traced: they run eagerly between the
  compiled graphs (`torch.compiler.disable` on the grouped-GEMM experts), and everything else of
  the layer (norms, attention projections, RoPE, paged attention's torch path, router) is compiled.

    python bench/cpu_compile.py [--model qwen3-moe-tiny|qwen3-moe-mid|DIR] [--batches 1,8,32] [--threads 1]

Writes bench/results/cpu_compile_<model>.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

import torch  # noqa: E402

from bench.synthetic_models import resolve_model  # noqa: E402


def decode_inputs(llm, B: int):
    """The (ids, positions, meta, step) of one padded decode step of B sequences, as the model sees them."""
    from moe_serve import SamplingParams
    from moe_serve.protocol import NewRequest

    core, model = llm.engine, llm.engine.runner.model
    for i in range(B):
        core.add_request(NewRequest(f"{B}-{i}", [5 + i, 77, 301, 42, 9, 8, 7], SamplingParams(
            temperature=0, max_tokens=4, ignore_eos=True)))
    seen = []
    plain = model.forward

    def forward(ids_T, positions_T, meta, step):
        if meta.is_decode_only and not seen:
            seen.append((ids_T, positions_T, meta, step))
        return plain(ids_T, positions_T, meta, step)

    model.forward = forward
    try:
        while core.has_unfinished():
            core.step()
    finally:
        model.forward = plain
    return seen[0]


def time_ms(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-moe-tiny")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from moe_serve.kernels import grouped_gemm
    from moe_serve.kernels.grouped_gemm import fused_experts_grouped, grouped_mm_available
    from moe_serve import LLM
    from moe_serve.platform import capturable

    path, name, desc = resolve_model(args.model)
    print(f"{desc}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    llm = LLM(path, dtype="float32", kv_cache_memory=64 << 20, show_progress=False, pad_decode=True)
    model = llm.engine.runner.model
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        ids, pos, meta, step = decode_inputs(llm, B)
        B = ids.shape[0]  # the padded size
        with torch.inference_mode():
            ref = model(ids, pos, meta, step)
            eager = time_ms(lambda: model(ids, pos, meta, step), args.steps)
            with capturable(model):
                torch_ops = time_ms(lambda: model(ids, pos, meta, step), args.steps)
                torch._dynamo.reset()
                compiled_fn = torch.compile(model.forward, dynamic=False)
                # The probe's answer here, as a constant (dynamo would re-run it on fake tensors),
                # and the experts outside the graphs (see above).
                available = grouped_mm_available(torch.float32, "cpu")
                grouped_gemm.grouped_mm_available = lambda dtype, device_type: available
                grouped_gemm.fused_experts_grouped = torch.compiler.disable(fused_experts_grouped)
                try:
                    t0 = time.perf_counter()
                    out = compiled_fn(ids, pos, meta, step)
                    compile_s = time.perf_counter() - t0
                    compiled = time_ms(lambda: compiled_fn(ids, pos, meta, step), args.steps)
                finally:
                    grouped_gemm.grouped_mm_available = grouped_mm_available
                    grouped_gemm.fused_experts_grouped = fused_experts_grouped
        err = (out.float() - ref.float()).abs().max().item()
        saving = eager - compiled
        row = dict(batch=B, eager_ms=eager, torch_ops_ms=torch_ops, compiled_ms=compiled, compile_s=compile_s,
                   max_abs_diff=err,
                   steps_to_repay=(compile_s * 1e3 / saving) if saving > 0 else None)
        rows.append(row)
        print(f"  batch {B:4d}: eager (C kernels) {eager:7.2f} ms | eager torch ops {torch_ops:7.2f} ms | "
              f"compiled torch ops {compiled:7.2f} ms after {compile_s:.1f} s of compile "
              f"(max |diff| vs eager {err:.1e})", flush=True)
    out_path = HERE / "results" / f"cpu_compile_{name}.json"
    out_path.write_text(json.dumps(dict(model=name, description=desc, torch=torch.__version__,
                                        threads=torch.get_num_threads(), machine=platform.machine(), rows=rows),
                                   indent=1) + "\n")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
