"""The `moe-serve` command: serve, router, default-model, env, bench, placement, launch."""
from __future__ import annotations

import argparse
import logging
import os
import sys

log = logging.getLogger("moe_serve.cli")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from moe_serve.engine.args import EngineArgs

    EngineArgs.add_cli_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("MOE_SERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (or set MOE_SERVE_API_KEY)")
    g.add_argument("--served-model-name", default=None, help="name in /v1/models (default: the model path)")
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="beyond this many waiting requests, answer 503 at once")
    g.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    g.add_argument("--log-interval", type=float, default=10.0, help="seconds between throughput log lines")
    g.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="larger request bodies are refused with 413 before they are read (default: room for the "
                        "longest prompt max_model_len allows, as JSON, plus 1 MiB)")
    g.add_argument("--http-header-timeout", type=float, default=10.0,
                   help="seconds a connection gets to send a request's headers (and to finish sending a refused body)")
    g.add_argument("--http-body-timeout", type=float, default=60.0,
                   help="seconds a request gets to send its whole body (then 408)")
    g.add_argument("--max-connections", type=int, default=2048,
                   help="beyond this many open connections, requests are answered 503 at once (0: no cap)")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="abort a request (freeing its KV blocks) that takes longer than this many seconds "
                        "(default: no limit); non-streaming requests get 408, streams an error event")
    g = p.add_argument_group("data-parallel routing (more than one rank)")
    g.add_argument("--load-balance-method", default="cache_aware", choices=("cache_aware", "least_load", "round_robin"),
                   help="which rank takes a new request: cache_aware (the rank holding the longest cached prefix "
                        "of its prompt, when it is at least --cache-aware-threshold of the prompt and that rank's "
                        "outstanding tokens exceed the least loaded rank's by at most --cache-aware-load-margin), "
                        "least_load (fewest outstanding tokens) or round_robin")
    g.add_argument("--cache-aware-threshold", type=float, default=0.5,
                   help="the share of a prompt a rank's cached prefix must cover for cache_aware to follow it")
    g.add_argument("--cache-aware-load-margin", type=int, default=4096,
                   help="outstanding tokens (prompt + tokens still to generate) a rank may carry beyond the least "
                        "loaded one and still take a request for its cached prefix")
    g = p.add_argument_group("chat output parsing")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="parse tool calls out of the output of chat requests with tools and tool_choice 'auto' "
                        "(needs --tool-call-parser)")
    g.add_argument("--tool-call-parser", default=None,
                   help="the model's tool-call format: hermes (Qwen2.5/Qwen3) | deepseek_v3 (DeepSeek-V3/R1) | "
                        "deepseek_v31 (DeepSeek-V3.1, V3.2-Exp) | deepseek_v32 (DeepSeek-V3.2, DSML) | "
                        "deepseek_v4 (DeepSeek-V4, DSML tool_calls) | mistral")
    g.add_argument("--reasoning-parser", default=None,
                   help="move <think>...</think> into reasoning_content: deepseek_r1 | deepseek_v4 (thinking only "
                        "when chat_template_kwargs turn it on) | qwen3")


def resolve_model(model: str | None) -> tuple[str, str]:
    """The checkpoint to serve and a one-line description; no --model means the built-in default."""
    if model:
        return model, model
    from moe_serve.default_model.smollm2 import ensure_default_model

    path, description = ensure_default_model()
    log.info("no --model given: serving the built-in default model at %s (%s)", path, description)
    return path, description


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


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("MOE_SERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="moe-serve", description="Serve mixture-of-experts language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run the OpenAI-compatible server")
    add_serve_args(p)
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("default-model", help="write the built-in default checkpoint to a folder")
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="the tiny random model instead of SmolLM2-MoE")
    p.set_defaults(fn=cmd_default_model)
    from moe_serve.entrypoints.env import add_env_parser
    from moe_serve.entrypoints.router import add_router_parser

    add_router_parser(sub)

    add_env_parser(sub)
    from moe_serve.benchmarks.cli import add_bench_parser

    add_bench_parser(sub)
    try:
        from expert_parallel.placement.cli import add_placement_parser, run_placement

        add_placement_parser(sub)
        sub.choices["placement"].set_defaults(fn=run_placement)
    except ImportError:  # pragma: no cover - the placement tools are part of the package
        pass
    try:
        from launcher.cli import add_launch_parser

        add_launch_parser(sub)
    except ImportError:
        pass
    ns = parser.parse_args(argv)
    try:
        return ns.fn(ns)
    except ValueError as e:  # configuration errors: one clear line, no traceback
        print(f"moe-serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
