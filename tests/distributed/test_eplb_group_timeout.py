"""A rank lost while the expert rebalancer makes its point-to-point group fails that group within
the job's collective timeout, not torch's 30-minute default. An elastic job forms its next
generation, names a rank that dies a moment later, and the survivors are building their engines
(EplbManager makes its group there): they must fail the build and regroup, not wait half an hour.

A real 2-rank gloo job: rank 1 leaves right after both ranks met; rank 0 then builds an EplbManager
over a real MoE layer."""
from __future__ import annotations

import datetime
import json
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 4


def worker(out_path: str) -> None:
    sys.path.insert(0, str(REPO))
    import torch
    import torch.distributed as dist

    result = {"error": None}
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    dist.barrier()
    if rank == 1:  # gone before the rebalancer's group is made
        Path(out_path).write_text(json.dumps(result))
        sys.stdout.flush()
        import os
        os._exit(0)
    try:
        from expert_parallel.rebalance.config import EplbConfig
        from expert_parallel.rebalance.eplb import EplbManager
        from expert_parallel.runtime.dispatch.all_to_all import AllToAllDispatcher
        from expert_parallel.runtime.groups import group_timeout
        from expert_parallel.runtime.layer import MoE, MoEContext, default_physical_to_logical
        from expert_parallel.runtime.router import SoftmaxTopKRouter

        result["world_timeout_s"] = group_timeout().total_seconds()
        E, S = 4, 6
        rows = [default_physical_to_logical(E, S)]
        ctx = MoEContext(AllToAllDispatcher(S, rank, 2, None), physical_to_logical=[list(r) for r in rows])
        moe = MoE(8, 4, E, SoftmaxTopKRouter(8, E, 2, True), ctx, torch.float32, layer_index=0)
        t0 = time.monotonic()
        try:
            EplbManager([moe], rows, E, EplbConfig(window_size=8, step_interval=4, num_redundant_experts=2),
                        rank, 2, "cpu")
            result["raised"] = None
        except Exception as e:  # what the elastic loop sees and turns into a regroup
            result["raised"] = f"{type(e).__name__}: {e}"
        result["seconds"] = time.monotonic() - t0
    except Exception:
        result["error"] = traceback.format_exc()
    Path(out_path).write_text(json.dumps(result))


def test_rebalancer_group_fails_within_the_world_timeout_when_a_rank_is_gone(tmp_path):
    from tests.distributed.jobs import run_rank_scripts

    # Before the fix rank 0 waited torch's default 30 minutes here and the job was killed at 120 s.
    res = run_rank_scripts(tmp_path, __file__, [], 2, timeout_s=120)
    r0 = res[0]
    assert r0["world_timeout_s"] == TIMEOUT_S
    assert r0["raised"] is not None and "timeout" in r0["raised"].lower(), r0


if __name__ == "__main__":
    worker(sys.argv[1])
