"""The flags and helpers every command line shares: `moe-serve serve`, the per-rank `python -m
launcher serve` (under torchrun, `moe-serve launch`), rank 0's front-end process, and the offline
benchmarks.

A leaf: it imports none of the command modules (`entrypoints/cli.py`, `launcher/`, the benchmarks'
and the placement tools' parsers, `entrypoints/openai/launch.py`), so each of them can import it
and the command modules form no import cycle (tests/unit/test_import_graph.py checks it).
"""
from __future__ import annotations

import argparse
import logging
import os

log = logging.getLogger("moe_serve.cli")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The flags of `moe-serve serve`: the engine's, then the HTTP server's."""
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


def add_rank_args(p: argparse.ArgumentParser) -> None:
    """The flags of `python -m launcher serve`: every flag of `moe-serve serve`, the job's network
    and timeouts, and elastic EP's. Rank 0 passes them all on to its front end, which parses them
    with this same function."""
    add_serve_args(p)
    p.add_argument("--dist-timeout", type=float, default=60.0,
                   help="seconds a rank may fall behind before the job stops with an error naming it")
    add_network_args(p)
    add_elastic_args(p)


def add_network_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dist-interface", default=None, metavar="NAME",
                   help="the network interface this rank uses to reach the others (gloo, NCCL's bootstrap, the "
                        "front end's sockets); default: the one that routes to MASTER_ADDR, or GLOO_SOCKET_IFNAME "
                        "where set")
    p.add_argument("--dist-join-timeout", type=float, default=120.0,
                   help="seconds every rank waits at start-up for MASTER_ADDR to answer and for every rank of every "
                        "node to join, before it stops with an error naming the ranks missing")


def add_elastic_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("elastic expert parallelism")
    g.add_argument("--enable-elastic-ep", action="store_true",
                   help="keep serving when a rank or a node is lost: the survivors regroup, re-place every expert "
                        "over themselves and resubmit the lost rank's requests (torchrun jobs)")
    g.add_argument("--elastic-join", default=None, metavar="HOST:PORT",
                   help="start a replacement rank that joins a running elastic job through its store (node 0's "
                        "MASTER_ADDR:MASTER_PORT); takes the lowest free rank id")
    g.add_argument("--elastic-timeout", type=float, default=5.0,
                   help="elastic EP: seconds a rank waits in one step before it asks the membership about the peers "
                        "it waits on: one whose core exited or whose heartbeat stopped is lost and the wait ends; "
                        "one whose heartbeat beats (a long prefill chunk) is waited for, up to --dist-timeout")
    g.add_argument("--elastic-heartbeat-timeout", type=float, default=3.0,
                   help="elastic EP: seconds without a heartbeat after which a rank counts as lost")


def check_elastic_args(ns: argparse.Namespace) -> None:
    if ns.elastic_join and not ns.enable_elastic_ep:
        raise ValueError("--elastic-join needs --enable-elastic-ep (the job it joins must be elastic)")
    if not ns.enable_elastic_ep:
        return
    for flag in ("elastic_timeout", "elastic_heartbeat_timeout"):
        if not getattr(ns, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')}={getattr(ns, flag)} must be > 0")
    if getattr(ns, "disaggregation_mode", "none") != "none":
        raise ValueError("--enable-elastic-ep with --disaggregation-mode is not supported: a regroup would drop the "
                         "KV transfers in flight")
    if ns.elastic_join:
        host, _, port = ns.elastic_join.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--elastic-join={ns.elastic_join!r} is not HOST:PORT (node 0's store)")


def resolve_model(model: str | None) -> tuple[str, str]:
    """The checkpoint to serve and a one-line description; no --model means the built-in default."""
    if model:
        return model, model
    from moe_serve.default_model.smollm2 import ensure_default_model

    path, description = ensure_default_model()
    log.info("no --model given: serving the built-in default model at %s (%s)", path, description)
    return path, description
