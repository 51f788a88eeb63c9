"""Decode step of a Gated DeltaNet layer's kernels against memory bandwidth: batch 1 and 32.

    python bench/gated_delta_decode.py                    # CUDA if there is one, else the CPU
    python bench/gated_delta_decode.py --batch 1 8 32 --backend torch triton

A Qwen3-Next-like linear-attention layer: 16 key heads repeated to 32 value heads, K = V = 128, a
short convolution of width 4 over q, k and v (2 * 16 * 128 + 32 * 128 = 8192 channels), the
recurrent state cached in float32, activations bf16 on CUDA (float32 on CPUs). One decode step is
the backend's `causal_conv1d` then `gated_delta_rule` (moe_serve/kernels/gated_delta), every sequence one
token continuing from its slot (slots scattered over a pool twice the batch).

Speed of light: a decode step must read and write every sequence's recurrent state and conv state
(B * 32 * 128 * 128 * 4 bytes = 2 MiB per sequence, and 48 KiB of conv state), so
    sol = 2 * state bytes / bandwidth,   % of SOL = sol / measured step time,
bandwidth measured in the same run with a large tensor copy (bench/sol.py). The step's own inputs
and outputs (a few KiB per sequence) are left out. On CUDA the torch backend's step is timed both
eager and replayed as a CUDA graph (it reads nothing on the host, so a graph holds it); the Triton
backend is timed as well where there is a GPU. Prints figures only.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The repository root first, and not bench/ itself: bench/kernels.py would shadow the `kernels` package.
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

import torch  # noqa: E402

from bench.sol import measure_bandwidth  # noqa: E402
from moe_serve.kernels.gated_delta import get_backend  # noqa: E402

HK, HV, K, V, KW = 16, 32, 128, 128, 4
C = 2 * HK * K + HV * V


class Step:
    """Inputs and caches of one decode step of B sequences; `run` is the step."""

    def __init__(self, ops, B: int, device: torch.device, dtype: torch.dtype):
        g = torch.Generator(device="cpu").manual_seed(B)
        slots = torch.randperm(2 * B, generator=g)[:B]

        def rand(*shape, dt=dtype):
            return torch.randn(*shape, generator=g).to(device=device, dtype=dt)

        self.ops, self.B = ops, B
        self.x, self.w = rand(B, C), rand(C, KW)
        self.conv_state = rand(2 * B, C, KW - 1)
        self.state = rand(2 * B, HV, K, V, dt=torch.float32)
        self.slots = slots.to(device)
        self.g = -torch.rand(B, HV, generator=g).to(device)
        self.beta = torch.rand(B, HV, generator=g).to(device=device, dtype=dtype)
        self.lens, self.ctx = [1] * B, [100] * B

    def run(self) -> torch.Tensor:
        y = self.ops.causal_conv1d(self.x, self.w, None, self.conv_state, self.slots, self.lens, self.ctx)
        q, k, v = y.split([HK * K, HK * K, HV * V], dim=-1)
        # the model repeats the key heads to the value heads before the rule
        q = q.view(self.B, HK, K).repeat_interleave(HV // HK, dim=1)
        k = k.view(self.B, HK, K).repeat_interleave(HV // HK, dim=1)
        return self.ops.gated_delta_rule(q, k, v.view(self.B, HV, V), self.g, self.beta, self.state, self.slots,
                                         self.lens, self.ctx, K ** -0.5)

    def state_bytes(self) -> int:
        """What the step must read and write: each sequence's recurrent and conv state, once each way."""
        per_seq = HV * K * V * self.state.element_size() + C * (KW - 1) * self.conv_state.element_size()
        return 2 * self.B * per_seq


def time_step(fn, device: torch.device, iters: int) -> float:
    """Seconds per call, median of 5 runs of `iters` calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        runs.append((time.perf_counter() - t0) / iters)
    return sorted(runs)[2]


def graphed(step: Step):
    """The step captured as a CUDA graph: replay is the call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step.run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run()
    return graph.replay


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--backend", nargs="+", default=None, help="torch and triton on CUDA, torch and cpu_c on CPUs (default)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=None, help="calls per timed run (default 200 CUDA, 10 CPU)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    backends = args.backend or (["torch", "triton"] if cuda else ["torch", "cpu_c"])
    iters = args.iters or (200 if cuda else 10)
    bandwidth = measure_bandwidth(device, 1 << 30 if cuda else 1 << 28)
    name = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"gated delta decode step: {name}; H={HV} (from {HK} key heads) K={K} V={V} conv {C}x{KW}, "
          f"{str(dtype).replace('torch.', '')} activations, float32 state; copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"{'backend':14s} {'batch':>5s} {'state MiB':>10s} {'step us':>10s} {'SOL us':>9s} {'% SOL':>7s}")
    for backend in backends:
        ops = get_backend(backend, device)
        for B in args.batch:
            step = Step(ops, B, device, dtype)
            sol = step.state_bytes() / bandwidth
            forms = [("", step.run)]
            if cuda:
                forms.append((" graph", graphed(step)))
            for label, fn in forms:
                t = time_step(fn, device, iters)
                print(f"{backend + label:14s} {B:5d} {step.state_bytes() / 2 / 2**20:10.1f} {t * 1e6:10.1f} "
                      f"{sol * 1e6:9.1f} {100 * sol / t:6.1f}%", flush=True)


if __name__ == "__main__":
    main()
