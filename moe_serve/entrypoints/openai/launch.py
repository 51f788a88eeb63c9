"""Server start-up shared by the single-process server and rank 0 of a multi-process job:
placement loading, expert-load recording and its HTTP routes."""
from __future__ import annotations

import argparse
import logging
import os

from fastapi.responses import JSONResponse

from moe_serve.protocol import LoadRecordControl

log = logging.getLogger("moe_serve.launch")


def load_placement_arg(path: str | None, world_size: int):
    """--expert-placement: per MoE layer, the logical expert of every physical slot (or None)."""
    if not path:
        return None
    from expert_parallel.placement import load_placement

    p = load_placement(path)
    if p.slots % world_size:
        raise ValueError(f"expert placement {path}: slots={p.slots} is not divisible by the {world_size} ranks")
    if p.gpus != world_size:
        log.warning("expert placement %s was tuned for gpus=%d; serving it on %d ranks (%d slots each)", path,
                    p.gpus, world_size, p.slots // world_size)
    log.info("expert placement %s: %d MoE layers, %d slots", path, p.num_layers, p.slots)
    return [list(map(int, layer)) for layer in p.physical_to_logical]


def expert_load_routes(engine, recorder):
    """POST /expert_load/start | /expert_load/stop, GET or POST /expert_load/dump."""
    def add(app):
        @app.post("/expert_load/start")
        async def start():
            engine.control(LoadRecordControl("start"))
            return JSONResponse({"recording": True})

        @app.post("/expert_load/stop")
        async def stop():
            engine.control(LoadRecordControl("stop"))
            return JSONResponse({"recording": False})

        @app.api_route("/expert_load/dump", methods=["GET", "POST"])
        async def dump():
            return JSONResponse(recorder.dump(metadata={"model": engine.model_name}))

    return add


def run_single_process_server(ns: argparse.Namespace) -> int:
    from moe_serve.engine.args import EngineArgs
    from moe_serve.engine.async_engine import AsyncEngine, LocalStepper
    from moe_serve.engine.core import EngineCore
    from moe_serve.entrypoints.cli import resolve_model
    from moe_serve.entrypoints.openai.api_server import build_app, serve

    path, _ = resolve_model(ns.model)
    args = EngineArgs.from_cli(ns, path)
    cfg = args.create_engine_config()
    core = EngineCore(cfg, args.kv_cache_memory, args.memory_fraction,
                      physical_to_logical=load_placement_arg(ns.expert_placement, 1), show_progress=args.show_progress)
    recorder = core.enable_load_recording(ns.expert_load_window, start=bool(ns.expert_load_record))
    name = ns.served_model_name or ns.model or os.path.basename(os.path.normpath(path))
    engine = AsyncEngine(LocalStepper(core), core.tokenizer, name, ns.max_waiting_requests, ns.log_interval)
    app = build_app(engine, name, core.max_model_len, ns.api_key, [expert_load_routes(engine, recorder)])
    rc = serve(app, engine, ns.host, ns.port, ns.shutdown_grace)
    if ns.expert_load_record:
        recorder.dump(ns.expert_load_record, metadata={"model": name})
        log.info("expert load (%d windows) written to %s", recorder.num_windows, ns.expert_load_record)
    return rc
