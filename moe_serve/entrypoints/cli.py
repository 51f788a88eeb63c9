"""The `moe-serve` command: serve, router, default-model, env, bench, placement, launch."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from moe_serve.entrypoints.cli_args import add_serve_args


def cmd_serve(ns: argparse.Namespace) -> int:
    from moe_serve.entrypoints.openai.launch import run_single_process_server

    return run_single_process_server(ns)


def cmd_default_model(ns: argparse.Namespace) -> int:
    from moe_serve.default_model.smollm2 import build_smollm2_moe
    from moe_serve.default_model.tiny import build_tiny_model

    if ns.tiny:
        build_tiny_model(ns.out)
    else:
        build_smollm2_moe(ns.out)
    print(ns.out)
    return 0


def add_placement_parser(sub) -> None:
    from expert_parallel.placement.cli import add_placement_parser as add, run_placement

    add(sub).set_defaults(fn=run_placement)


def add_subcommands(sub) -> None:
    """Every subcommand of `moe-serve`, each added by the module that runs it. None of those
    modules imports this one (their shared flags are in cli_args.py): no import cycle."""
    from launcher.cli import add_launch_parser
    from moe_serve.benchmarks.cli import add_bench_parser
    from moe_serve.entrypoints.env import add_env_parser
    from moe_serve.entrypoints.router import add_router_parser

    p = sub.add_parser("serve", help="run the OpenAI-compatible server")
    add_serve_args(p)
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("default-model", help="write the built-in default checkpoint to a folder")
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="the tiny random model instead of SmolLM2-MoE")
    p.set_defaults(fn=cmd_default_model)
    for add in (add_router_parser, add_env_parser, add_bench_parser, add_placement_parser, add_launch_parser):
        add(sub)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("MOE_SERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="moe-serve", description="Serve mixture-of-experts language models.")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(argv)
    try:
        return ns.fn(ns)
    except ValueError as e:  # configuration errors: one clear line, no traceback
        print(f"moe-serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
