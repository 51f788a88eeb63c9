"""One rank of a multi-process job (`python -m launcher serve`, under torchrun): process groups,
this rank's engine core (its KV cache, scheduler and share of the experts) running the core loop;
global rank 0 also starts the front-end process (HTTP, tokenization, output processing) that every
rank's core talks to over ZMQ. The path itself is launcher/rank.py, one for a plain run and for
elastic EP (launcher/elastic.py), whose torchrun worker supervises the process that runs it."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from launcher.network import DistNetworkError

log = logging.getLogger("moe_serve.launcher")


def parse(argv: list[str]) -> argparse.Namespace:
    from moe_serve.entrypoints.cli_args import add_rank_args

    p = argparse.ArgumentParser(prog="python -m launcher", description="one rank of a moe-serve job (use torchrun)")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve with experts sharded over all ranks")
    add_rank_args(s)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank_env = "joining" if "--elastic-join" in argv else os.environ.get("RANK", "0")
    logging.basicConfig(level=os.environ.get("MOE_SERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s [rank {rank_env}] %(name)s: %(message)s")
    ns = parse(argv)
    try:
        rc = run(ns, argv[1:], argv)  # what follows "serve" goes to the front end as it is
    except ValueError as e:
        print(f"moe-serve (rank {rank_env}): error: {e}", file=sys.stderr)
        rc = 2
    except DistNetworkError as e:
        log.error("%s", e)
        print(f"moe-serve (rank {rank_env}): error: {e}", file=sys.stderr)
        rc = 1
    except Exception as e:
        log.exception("rank %s failed", rank_env)
        print(f"moe-serve (rank {rank_env}): error: {type(e).__name__}: {e}", file=sys.stderr)
        rc = 1
    # Everything is shut down and flushed; skip interpreter teardown, where destructors of the
    # communication library's background threads can abort a process that finished cleanly.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def run(ns: argparse.Namespace, serve_argv: list[str], argv: list[str] | None = None) -> int:
    """This rank's engine core (a plain run: one fixed generation), or under elastic EP the
    supervisor of the process that runs it; serve_argv goes to rank 0's front end."""
    from launcher import elastic
    from launcher.rank import Generations, run_rank
    from moe_serve.entrypoints.cli_args import check_elastic_args

    check_elastic_args(ns)
    if not ns.enable_elastic_ep:
        return run_rank(ns, serve_argv, Generations(ns))
    if ns.elastic_join or os.environ.get(elastic.ENV_CORE):
        return run_rank(ns, serve_argv, elastic.ElasticGenerations(ns))
    return elastic.supervise(argv if argv is not None else ["serve", *serve_argv])
