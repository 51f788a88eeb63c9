"""Decode step time with and without padding to the capture ladder (moe_serve/cuda_graph.py), eager.

    python bench/decode_padding.py [--model DIR] [--batches 3,5,9,17] [--steps 20]

Without --model a tiny Qwen3-MoE checkpoint (tests/checkpoints.py) is written to a temporary
directory. For each batch size B, B requests are prefilled, then `--steps` decode steps are timed
(engine steps: scheduler, input batch, forward, sampler; the median step's CPU time on one thread
is reported, steadier than wall time on a shared machine), with padding
forced on and off, alternating, each twice (the better of the two is printed).
On a GPU the padded steps are what the CUDA graphs replay; this measures the eager cost of the
padded rows themselves (the reason the CPU does not pad by default).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]


def step_ms(path: str, B: int, steps: int, pad: bool, device: str) -> float:
    from moe_serve import LLM, SamplingParams
    from moe_serve.protocol import NewRequest

    llm = LLM(path, dtype="float32", kv_cache_memory=16 << 20, show_progress=False, pad_decode=pad,
              enforce_eager=True, device=device)
    core = llm.engine
    for i in range(B):
        core.add_request(NewRequest(str(i), [5 + i, 77, 301, 42], SamplingParams(
            temperature=0, max_tokens=steps + 3, ignore_eos=True)))
    for _ in range(3):  # prefill and two warm-up decode steps
        core.step()
    times = []
    for _ in range(steps):
        t0 = time.process_time()  # CPU time, one thread: steadier than wall time on a shared machine
        core.step()
        times.append(time.process_time() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--batches", default="3,5,9,17")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    path = args.model
    if path is None:
        from tests.checkpoints import build_qwen3_moe

        path = build_qwen3_moe(tempfile.mkdtemp(prefix="decode_padding_"))
    from moe_serve.cuda_graph import capture_sizes, padded_size

    ladder = capture_sizes(64)
    print(f"{'batch':>5} {'padded':>6} {'eager ms':>9} {'padded ms':>9}")
    for B in (int(b) for b in args.batches.split(",")):
        runs = [step_ms(path, B, args.steps, pad, args.device) for _ in range(2) for pad in (False, True)]
        plain, padded = min(runs[0::2]), min(runs[1::2])
        print(f"{B:>5} {padded_size(B, ladder):>6} {plain:>9.2f} {padded:>9.2f}")


if __name__ == "__main__":
    main()
