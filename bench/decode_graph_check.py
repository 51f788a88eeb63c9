"""GPU check of the decode CUDA graphs (moe_serve/cuda_graph.py): graph replay gives the eager tokens.

    python bench/decode_graph_check.py [--archs qwen3_moe,deepseek_v3] [--max-num-seqs 16]

On a CUDA device, for each tiny test checkpoint (tests/checkpoints.py, float32, Triton kernels):
one engine with graphs (the default) and one with enforce_eager run the same requests (greedy,
different lengths, so decode batches of 9, 8, ..., 1 that are mostly not ladder sizes, shrinking),
and their tokens must be equal; it prints each engine's capture time, graph memory and the median
decode step. Exit status: 0 equal, 1 a mismatch or no graphs were captured, 2 no CUDA device.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

import torch  # noqa: E402

PROMPTS = [[5 + i, 77, 301, 42 + i][: 2 + i % 3] for i in range(9)]


def run(path: str, eager: bool, max_num_seqs: int, device: str = "cuda") -> tuple[list[list[int]], dict]:
    from moe_serve import LLM, SamplingParams
    from moe_serve.protocol import NewRequest

    llm = LLM(path, dtype="float32", kv_cache_memory=64 << 20, max_num_seqs=max_num_seqs, show_progress=False,
              enforce_eager=eager, device=device)
    core, runner = llm.engine, llm.engine.runner
    for i, p in enumerate(PROMPTS):
        core.add_request(NewRequest(str(i), p, SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True)))
    toks = {str(i): [] for i in range(len(PROMPTS))}
    steps = []
    while core.has_unfinished():
        t0 = time.perf_counter()
        for o in core.step():
            toks[o.request_id] += o.new_token_ids
        steps.append(time.perf_counter() - t0)
    g = runner.graphs
    info = {"graphs": sorted(g.graphs) if g else [], "capture_s": g.capture_s if g else 0.0,
            "graph_mib": g.memory_bytes / 2**20 if g else 0.0,
            "median_step_ms": sorted(steps[1:])[len(steps[1:]) // 2] * 1e3 if len(steps) > 1 else 0.0}
    return [toks[str(i)] for i in range(len(PROMPTS))], info


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--archs", default="qwen3_moe,deepseek_v3")
    p.add_argument("--max-num-seqs", type=int, default=16)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("decode_graph_check.py: no CUDA device here (the graphs are captured on CUDA only)", file=sys.stderr)
        return 2
    from tests.checkpoints import BUILDERS

    ok = True
    for arch in args.archs.split(","):
        path = BUILDERS[arch](tempfile.mkdtemp(prefix=f"graph_check_{arch}_"))
        want, eager = run(path, True, args.max_num_seqs)
        got, graphs = run(path, False, args.max_num_seqs)
        same = got == want
        ok &= same and bool(graphs["graphs"])
        print(f"{arch}: tokens {'equal' if same else 'DIFFER'}; graphs {graphs['graphs']} captured in "
              f"{graphs['capture_s']:.1f}s, {graphs['graph_mib']:.1f} MiB; median step {graphs['median_step_ms']:.2f} ms "
              f"with graphs, {eager['median_step_ms']:.2f} ms eager", flush=True)
        if not same:
            for i, (a, b) in enumerate(zip(got, want)):
                if a != b:
                    print(f"  request {i}: graphs {a} eager {b}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
