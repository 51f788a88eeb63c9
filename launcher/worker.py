"""One rank of a multi-process job: process groups, this rank's engine (its KV cache, scheduler and
share of the experts), then the HTTP front end on global rank 0 or the follower loop elsewhere."""
from __future__ import annotations

import argparse
import logging
import os
import sys

log = logging.getLogger("moe_serve.launcher")


def parse(argv: list[str]) -> argparse.Namespace:
    from moe_serve.entrypoints.cli import add_serve_args

    p = argparse.ArgumentParser(prog="python -m launcher", description="one rank of a moe-serve job (use torchrun)")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve with experts sharded over all ranks")
    add_serve_args(s)
    s.add_argument("--dist-timeout", type=float, default=60.0,
                   help="seconds a rank may fall behind before the job stops with an error naming it")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    rank_env = os.environ.get("RANK", "0")
    logging.basicConfig(level=os.environ.get("MOE_SERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s [rank {rank_env}] %(name)s: %(message)s")
    ns = parse(sys.argv[1:] if argv is None else argv)
    try:
        rc = run(ns)
    except ValueError as e:
        print(f"moe-serve (rank {rank_env}): error: {e}", file=sys.stderr)
        rc = 2
    # Everything is shut down and flushed; skip interpreter teardown, where destructors of the
    # communication library's background threads can abort a process that finished cleanly.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def run(ns: argparse.Namespace) -> int:
    from expert_parallel.groups import destroy_process_groups, init_process_groups
    from launcher.watchdog import Watchdog
    from moe_serve import platform
    from moe_serve.engine.args import EngineArgs
    from moe_serve.engine.core import EngineCore
    from moe_serve.engine.dp import DistributedStepper, RankEngine, agree_max_model_len, worker_loop
    from moe_serve.entrypoints.cli import resolve_model
    from moe_serve.entrypoints.openai.launch import expert_load_routes, load_placement_arg

    dev = platform.resolve_device(ns.device)
    groups = init_process_groups("nccl" if dev.type == "cuda" else "gloo", timeout_s=max(ns.dist_timeout * 2, 120))
    rank, world = groups.rank, groups.world_size
    log.info("rank %d of %d (local rank %d, pid %d, device %s)", rank, world, groups.local_rank, os.getpid(),
             groups.device)
    watchdog = Watchdog(rank, world, ns.dist_timeout)
    # Every rank resolves the model itself (the default one is built under a lock, once per machine),
    # so nodes without a shared filesystem work too.
    path, _ = resolve_model(ns.model)
    ns.device = str(groups.device)
    args = EngineArgs.from_cli(ns, path)
    args.show_progress = rank == 0
    cfg = args.create_engine_config(rank, world)
    core = EngineCore(cfg, args.kv_cache_memory, args.memory_fraction, ep_group=groups.ep_group,
                      physical_to_logical=load_placement_arg(ns.expert_placement, world), show_progress=rank == 0)
    recorder = core.enable_load_recording(ns.expert_load_window, groups.ep_group, start=bool(ns.expert_load_record))
    max_len = agree_max_model_len(core, groups.cpu_group)
    re = RankEngine(core, rank, world, groups.cpu_group)
    re.on_turn = watchdog.beat
    watchdog.start()
    try:
        if rank != 0:
            return worker_loop(re)
        from moe_serve.engine.async_engine import AsyncEngine
        from moe_serve.entrypoints.openai.api_server import build_app, serve

        stepper = DistributedStepper(re)
        name = ns.served_model_name or ns.model or os.path.basename(os.path.normpath(path))
        engine = AsyncEngine(stepper, core.tokenizer, name, ns.max_waiting_requests, ns.log_interval)
        app = build_app(engine, name, max_len, ns.api_key, [expert_load_routes(engine, recorder)])
        log.info("data-parallel attention on %d ranks, experts sharded %d ways (%s dispatch)", world, world,
                 cfg.parallel.all2all_backend)
        rc = serve(app, engine, ns.host, ns.port, ns.shutdown_grace)
        if ns.expert_load_record:
            recorder.dump(ns.expert_load_record, metadata={"model": name})
        return rc
    finally:
        watchdog.stop()
        if clean_exit(groups):
            destroy_process_groups(groups)


def clean_exit(groups) -> bool:
    """Meet every rank before tearing the groups down: one rank destroying its communicator while
    another still uses it aborts the process. False when the others are not there to meet."""
    import torch.distributed as dist

    if groups.world_size == 1:
        return True
    try:
        dist.barrier(group=groups.cpu_group)
        return True
    except Exception:  # a peer is gone: leave teardown to process exit
        return False
