"""Decode-graph capture under expert parallelism: the ranks keep their graphs or run eagerly
together. A real 2-rank gloo job runs `cuda_graph.capture_ladder` with the engine's agreement
(`capture_agreement`: one MAX all-reduce over the dispatcher's group per size) and a stand-in for
the per-size CUDA capture (the only CUDA part; it records the sizes tried and can fail on one rank
at one size, with any kind of exception). Checked: with no failure every rank keeps every size;
when one rank fails, every rank raises at that same size, saying which rank failed, and none goes
on to a smaller size (a rank that did would wait in a collective the others never enter)."""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SIZES = [1, 2, 4, 8, 16]


def worker(fail_rank: int, fail_size: int, kind: str, out_path: str) -> None:
    sys.path.insert(0, str(REPO))
    import torch.distributed as dist

    result = {"error": None}
    try:
        dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
        rank = dist.get_rank()
        from expert_parallel.runtime.dispatch.all_to_all import AllToAllDispatcher
        from moe_serve.cuda_graph import capture_agreement, capture_ladder, decode_step

        d = AllToAllDispatcher(4, rank, 2, None)
        told = []

        def capture_one(B):
            s = decode_step(B)  # what DecodeGraphs passes the model for this size
            told.append([B, s.static_rows, s.max_tokens_any_rank])
            if rank == fail_rank and B == fail_size:
                raise {"runtime": RuntimeError, "value": ValueError}[kind](f"cannot capture {B}")
            return f"graph {B}"

        try:
            graphs = capture_ladder(SIZES, capture_one, capture_agreement(d))
            result.update(graphs=sorted(graphs), raised=None)
        except Exception as e:  # noqa: BLE001 - the outcome under test
            result.update(graphs=None, raised=[type(e).__name__, str(e)])
        result.update(told=told, agree_none_alone=capture_agreement(
            AllToAllDispatcher(4, 0, 1, None)) is None)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        result["error"] = traceback.format_exc()
    Path(out_path).write_text(json.dumps(result))


@pytest.mark.parametrize("fail_rank, fail_size, kind", [(-1, 0, "runtime"), (1, 4, "runtime"), (0, 16, "value")],
                         ids=["none fails", "rank 1 at 4", "rank 0 at 16, not a RuntimeError"])
def test_ranks_keep_graphs_or_run_eagerly_together(tmp_path, fail_rank, fail_size, kind):
    from tests.distributed.jobs import run_rank_scripts

    res = run_rank_scripts(tmp_path, __file__, [str(fail_rank), str(fail_size), kind], world=2)
    for rank, r in enumerate(res):
        assert r["agree_none_alone"] is True
        # Largest first, each size told to the dispatcher as a padded step of B rows on every rank.
        attempted = [b for b, _, _ in r["told"]]
        assert all(rows == B and most == B for B, rows, most in r["told"])
        if fail_rank < 0:
            assert r["raised"] is None and r["graphs"] == SIZES and attempted == SIZES[::-1]
            continue
        # Every rank stops at the failing size: none captures a smaller one.
        assert attempted == [s for s in SIZES[::-1] if s >= fail_size]
        assert r["graphs"] is None and r["raised"][0] == "RuntimeError"
        where = "this rank" if rank == fail_rank else "another rank"
        assert f"decode graph capture of batch {fail_size} failed on {where}" in r["raised"][1]


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
