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
    from moe_serve.entrypoints.openai.api_server import build_app, serve
    from moe_serve.tokenizer import Tokenizer

    tokenizer = Tokenizer(path)  # loads while the cores load their weights
    try:
        ready = client.wait_ready(check_alive)
    except RuntimeError as e:
        log.error("%s", e)
        client.close()
        return 1
    name = ns.served_model_name or ns.model or os.path.basename(os.path.normpath(path))
    engine = AsyncEngine(client, ready, tokenizer, name, ns.max_waiting_requests, ns.log_interval, check_alive)
    app = build_app(engine, name, engine.max_model_len, ns.api_key, [expert_load_routes(engine)])
    log.info("front end ready: %d engine core(s), max_model_len %d, %s KV blocks", len(ready),
             engine.max_model_len, "/".join(str(r.num_kv_blocks) for r in ready))
    return serve(app, engine, ns.host, ns.port, ns.shutdown_grace)


def run_single_process_server(ns: argparse.Namespace) -> int:
    import msgspec

    from moe_serve.engine.args import EngineArgs
    from moe_serve.engine.core_client import CoreClient
    from moe_serve.entrypoints.cli import resolve_model

    path, _ = resolve_model(ns.model)
    args = EngineArgs.from_cli(ns, path)
    args.create_engine_config()  # configuration errors surface here, before any process starts
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


def frontend_main(argv: list[str] | None = None) -> int:
    from moe_serve.engine.core_client import CoreClient
    from moe_serve.entrypoints.cli import add_serve_args

    p = argparse.ArgumentParser(prog="python -m moe_serve.entrypoints.openai.launch")
    add_serve_args(p)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--bind-host", default="127.0.0.1")
    p.add_argument("--announce-fd", type=int, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--dist-timeout", type=float, default=60.0)
    ns = p.parse_args(argv)
    rank_env = os.environ.get("RANK", "0")
    logging.basicConfig(level=os.environ.get("MOE_SERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s [rank {rank_env} front end] %(name)s: %(message)s")
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
