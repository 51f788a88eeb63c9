"""`moe-serve bench serve | throughput | latency`: the subcommands' parsers."""
from __future__ import annotations

import argparse


def add_bench_parser(sub) -> None:
    """Add `bench` and its three subcommands to the `moe-serve` subparsers."""
    bench = sub.add_parser("bench", help="benchmark a server (serve) or the offline engine (throughput, latency)",
                           description="Benchmarks in the shape of `vllm bench`.")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    from moe_serve.benchmarks import serve

    p = bsub.add_parser("serve", help="load an OpenAI-compatible server and measure TTFT/TPOT/ITL/E2E latency",
                        description=serve.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_cli_args(p)
    p.set_defaults(fn=serve.cmd)

    from moe_serve.benchmarks import offline

    p = bsub.add_parser("throughput", help="offline engine: requests/s and tokens/s of one batch of prompts",
                        description=offline.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    offline.add_throughput_args(p)
    p.set_defaults(fn=offline.run_throughput)
    p = bsub.add_parser("latency", help="offline engine: latency of one batch, average and percentiles",
                        description=offline.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    offline.add_latency_args(p)
    p.set_defaults(fn=offline.run_latency)
