"""Process layout of a server, and the front end's start-up.

Single process (`moe-serve serve`): this process is the front end (HTTP, tokenization, output
processing); it binds its ZMQ sockets and spawns one engine-core process
(`python -m moe_serve.engine.core_proc`) that connects to them.

torchrun (`-m launcher serve`): every rank's process is an engine core; global rank 0 spawns the
front end (`python -m moe_serve.entrypoints.openai.launch`), which binds its sockets and announces
their ports on a pipe; rank 0 passes them to every rank, and every core connects.

Either way the front end waits for every core's `CoreReady` before it answers on HTTP.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time

from fastapi.responses import JSONResponse, Response

log = logging.getLogger("moe_serve.launch")


def expert_load_routes(engine):
    """POST /expert_load/start | /expert_load/stop, GET or POST /expert_load/dump (rank 0's core
    holds the load summed over every rank)."""
    def add(app):
        @app.post("/expert_load/start")
        async def start():
            await engine.call("load_start")
            return JSONResponse({"recording": True})

        @app.post("/expert_load/stop")
        async def stop():
            await engine.call("load_stop")
            return JSONResponse({"recording": False})

        @app.api_route("/expert_load/dump", methods=["GET", "POST"])
        async def dump():
            return Response(await engine.call("load_dump"), media_type="application/json")

    return add


def run_frontend(ns: argparse.Namespace, path: str, client, check_alive) -> int:
    """Wait for the cores, then serve HTTP until SIGTERM/SIGINT or a core failure; returns the
    exit code (0 after a clean shutdown)."""
    from moe_serve.engine.async_engine import AsyncEngine
    from moe_serve.entrypoints.openai.api_server import HTTPLimits, build_app, serve
    from moe_serve.entrypoints.openai.request_limits import PromptLimits, default_max_body_bytes
    from moe_serve.tokenizer import Tokenizer

    # Loads, and measures its longest token, while the cores load their weights.
    tokenizer = Tokenizer(path)
    t0 = time.monotonic()
    token_chars, token_bytes = tokenizer.token_extent
    log.info("tokenizer: the longest token is %d characters (%d bytes); prompt length bound %s (%.2fs)", token_chars,
             token_bytes, "none" if tokenizer.chars_per_token is None else f"{tokenizer.chars_per_token:g} chars/token",
             time.monotonic() - t0)
    try:
        ready = client.wait_ready(check_alive)
    except RuntimeError as e:
        log.error("%s", e)
        client.close()
        return 1
    name = ns.served_model_name or ns.model or os.path.basename(os.path.normpath(path))
    engine = AsyncEngine(client, ready, tokenizer, name, ns.max_waiting_requests, ns.log_interval, check_alive,
                         ns.load_balance_method, ns.cache_aware_load_margin, ns.cache_aware_threshold,
                         ns.disaggregation_timeout, elastic=getattr(ns, "enable_elastic_ep", False))
    limits = PromptLimits(engine.max_model_len, tokenizer.chars_per_token, ns.block_size,
                          min(r.num_kv_blocks for r in ready))
    http = HTTPLimits(ns.max_request_body_bytes or default_max_body_bytes(engine.max_model_len, token_bytes,
                                                                           tokenizer.vocab_size),
                      ns.http_header_timeout, ns.http_body_timeout, ns.max_connections or None, ns.request_timeout)
    _raise_open_files(http.max_connections)
    from moe_serve.entrypoints.openai.weights_routes import weights_routes

    app = build_app(engine, name, engine.max_model_len, ns.api_key, [expert_load_routes(engine),
                    weights_routes(engine, path)], limits, http,
                    ns.enable_auto_tool_choice, ns.tool_call_parser, ns.reasoning_parser)
    log.info("front end ready: %d engine core(s), max_model_len %d, %s KV blocks of %d tokens; request bodies up to "
             "%d bytes, at most %s connections, request timeout %s", len(ready), engine.max_model_len,
             "/".join(str(r.num_kv_blocks) for r in ready), ns.block_size, http.max_body_bytes,
             http.max_connections or "unlimited", f"{ns.request_timeout:g}s" if ns.request_timeout else "off")
    return serve(app, engine, ns.host, ns.port, ns.shutdown_grace, http)


def http_flags_check(ns: argparse.Namespace) -> None:
    """Raise ValueError naming a server flag that is out of range."""
    for flag in ("http_header_timeout", "http_body_timeout"):
        if not getattr(ns, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')}={getattr(ns, flag)} must be > 0")
    if ns.request_timeout is not None and not ns.request_timeout > 0:
        raise ValueError(f"--request-timeout={ns.request_timeout} must be > 0")
    if ns.max_request_body_bytes is not None and ns.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes={ns.max_request_body_bytes} must be >= 1")
    if ns.max_connections < 0:
        raise ValueError(f"--max-connections={ns.max_connections} must be >= 0")
    if ns.cache_aware_load_margin < 0:
        raise ValueError(f"--cache-aware-load-margin={ns.cache_aware_load_margin} must be >= 0")
    if not 0 <= ns.cache_aware_threshold <= 1:
        raise ValueError(f"--cache-aware-threshold={ns.cache_aware_threshold} must be within [0, 1]")
    from moe_serve.entrypoints.openai.reasoning import REASONING_PARSERS
    from moe_serve.entrypoints.openai.tool_parsers import PARSERS

    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser (one of {', '.join(sorted(PARSERS))})")
    if ns.tool_call_parser is not None and ns.tool_call_parser not in PARSERS:
        raise ValueError(f"--tool-call-parser={ns.tool_call_parser} is not one of {', '.join(sorted(PARSERS))}")
    if ns.reasoning_parser is not None and ns.reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser={ns.reasoning_parser} is not one of "
                         f"{', '.join(sorted(REASONING_PARSERS))}")


def _raise_open_files(max_connections: int | None) -> None:
    """Every connection is a file descriptor: lift the soft limit toward the hard one if the cap
    needs it."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = (max_connections or 65536) + 256
        if soft != resource.RLIM_INFINITY and soft < want:
            new = want if hard == resource.RLIM_INFINITY else min(want, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ImportError, ValueError, OSError) as e:  # not fatal: the cap still answers 503
        log.warning("could not raise the open-file limit: %s", e)


def run_single_process_server(ns: argparse.Namespace) -> int:
    import msgspec

    from moe_serve.engine.args import EngineArgs
    from moe_serve.engine.core_client import CoreClient
    from moe_serve.entrypoints.cli_args import resolve_model

    path, _ = resolve_model(ns.model)
    args = EngineArgs.from_cli(ns, path)
    args.create_engine_config()  # configuration errors surface here, before any process starts
    http_flags_check(ns)
    client = CoreClient(1)
    (in_addr,), out_addr = client.addresses()
    cmd = [sys.executable, "-m", "moe_serve.engine.core_proc", "--engine-args", msgspec.json.encode(args).decode(),
           "--in-addr", in_addr, "--out-addr", out_addr]
    proc = subprocess.Popen(cmd)
    log.info("engine core process started (pid %d)", proc.pid)

    def check_alive() -> str | None:
        rc = proc.poll()
        return None if rc is None else f"the engine core process (pid {proc.pid}) exited with code {rc}"

    try:
        rc = run_frontend(ns, path, client, check_alive)
    finally:
        _reap(proc)
    return rc


def _reap(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """Give a core that was told to exit time to do so; then make sure."""
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("engine core (pid %d) did not exit within %.0fs; killing it", proc.pid, timeout_s)
        proc.kill()
        proc.wait(10)


# --- the front end of a torchrun job (spawned by global rank 0) -----------------------------------
def spawn_frontend(serve_argv: list[str], world_size: int, bind_host: str) -> tuple[subprocess.Popen, list[int], int]:
    """Start the front end; returns the process, its per-rank input ports and its output port."""
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "moe_serve.entrypoints.openai.launch", "--world-size", str(world_size),
           "--bind-host", bind_host, "--announce-fd", str(w), "--parent-pid", str(os.getpid()), *serve_argv]
    proc = subprocess.Popen(cmd, pass_fds=(w,))
    os.close(w)
    with os.fdopen(r) as f:
        line = f.readline()
    if not line:
        proc.wait(30)
        raise RuntimeError(f"the front end exited with code {proc.returncode} before it started")
    ports = json.loads(line)
    return proc, ports["in"], ports["out"]


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this front end the moment rank 0's process ends, however it ends.
    Rank 0 stops and reaps its front end on every exit it makes itself (launcher/worker.py); this
    covers the ones it cannot (SIGKILL, the OOM killer), where a front end that only noticed by
    polling would outlive the job for seconds, its HTTP port held. (The signal follows the thread
    that started this process: rank 0 spawns it from its main thread, which lives as long as it.)"""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    except (OSError, AttributeError) as e:  # not Linux: check_alive's polling still notices
        log.debug("no parent-death signal: %s", e)
        return
    if os.getppid() != parent_pid:  # rank 0 ended before the signal was set
        os._exit(1)


def frontend_main(argv: list[str] | None = None) -> int:
    from moe_serve.engine.core_client import CoreClient
    from moe_serve.entrypoints.cli_args import add_elastic_args, add_serve_args

    p = argparse.ArgumentParser(prog="python -m moe_serve.entrypoints.openai.launch")
    add_serve_args(p)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--bind-host", default="127.0.0.1")
    p.add_argument("--announce-fd", type=int, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    # The launcher's own flags: rank 0 passes every serve flag on, and they are used there.
    p.add_argument("--dist-timeout", type=float, default=60.0)
    p.add_argument("--dist-interface", default=None)
    p.add_argument("--dist-join-timeout", type=float, default=120.0)
    add_elastic_args(p)
    ns = p.parse_args(argv)
    http_flags_check(ns)
    rank_env = os.environ.get("RANK", "0")
    logging.basicConfig(level=os.environ.get("MOE_SERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s [rank {rank_env} front end] %(name)s: %(message)s")
    _die_with_parent(ns.parent_pid)
    client = CoreClient(ns.world_size, ns.bind_host)
    with os.fdopen(ns.announce_fd, "w") as f:
        f.write(json.dumps({"in": client.in_ports, "out": client.out_port}) + "\n")

    def check_alive() -> str | None:
        if os.getppid() != ns.parent_pid:
            return "rank 0's engine core process is gone (the job is stopping)"
        return None

    t0 = time.monotonic()
    rc = run_frontend(ns, ns.model, client, check_alive)
    log.info("front end exiting (code %d) after %.0fs", rc, time.monotonic() - t0)
    return rc


if __name__ == "__main__":
    rc = frontend_main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
