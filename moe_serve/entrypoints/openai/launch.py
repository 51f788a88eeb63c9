"""Start the single-process server: build the engine, the app, and run until SIGTERM."""
from __future__ import annotations

import argparse
import logging

log = logging.getLogger("moe_serve.launch")


def run_single_process_server(ns: argparse.Namespace) -> int:
    from moe_serve.engine.args import EngineArgs
    from moe_serve.engine.async_engine import AsyncEngine, LocalStepper
    from moe_serve.engine.core import EngineCore
    from moe_serve.entrypoints.cli import resolve_model
    from moe_serve.entrypoints.openai.api_server import build_app, serve

    path, _ = resolve_model(ns.model)
    args = EngineArgs.from_cli(ns, path)
    cfg = args.create_engine_config()
    recorder = make_load_recorder(ns, cfg)
    core = EngineCore(cfg, args.kv_cache_memory, args.memory_fraction, show_progress=args.show_progress,
                      load_recorder=recorder.record if recorder else None)
    stepper = LocalStepper(core, recorder)
    name = ns.served_model_name or (ns.model or "moe-serve-default")
    engine = AsyncEngine(stepper, core.tokenizer, name, ns.max_waiting_requests, ns.log_interval)
    routes = [expert_load_routes(recorder)] if recorder else []
    app = build_app(engine, name, core.max_model_len, ns.api_key, routes)
    rc = serve(app, engine, ns.host, ns.port, ns.shutdown_grace)
    if recorder and ns.expert_load_record:
        recorder.dump(ns.expert_load_record)
        log.info("expert load written to %s", ns.expert_load_record)
    return rc


def make_load_recorder(ns: argparse.Namespace, cfg):
    """An expert-load recorder when --expert-load-record is given (recording from the start)."""
    return None


def expert_load_routes(recorder):
    def add(app):
        pass

    return add
