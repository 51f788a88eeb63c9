"""Expert rebalancing agrees a new placement with one collective: a real 2-rank gloo job runs
EplbManager on real MoE layers (all_to_all dispatch), feeds it the router's ids of skewed traffic
that differs per rank, and counts every torch.distributed collective issued from the rebalance's
start to its last switch (the core loop's own per-turn agreement, which runs every turn anyway, is
not counted; weight moves are point-to-point and counted apart). Checked against independent
computations: the placement is the tuner's on the sum of both ranks' recorded load, both ranks
switch to it at the same turns, and afterwards every token's MoE output equals a dense float64
reference over the logical experts' weights."""
from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
E, REDUNDANT, LAYERS, D, FF, K, WORLD = 8, 2, 3, 16, 8, 2, 2
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
               "all_to_all_single", "barrier", "gather", "gather_object", "scatter", "scatter_object_list")
P2P = ("isend", "irecv", "send", "recv", "batch_isend_irecv")


def worker(out_path: str) -> None:
    sys.path.insert(0, str(REPO))
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    result = {"error": None}
    try:
        dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
        rank = dist.get_rank()
        cpu_group = dist.new_group(backend="gloo")
        from expert_parallel.runtime.dispatch.all_to_all import AllToAllDispatcher
        from expert_parallel.rebalance.eplb import EplbManager
        from expert_parallel.rebalance.config import EplbConfig
        from expert_parallel.runtime.layer import MoE, MoEContext, default_physical_to_logical
        from expert_parallel.runtime.router import SoftmaxTopKRouter

        S = E + REDUNDANT
        torch.manual_seed(0)  # the same routers and weights on both ranks
        rows0 = [default_physical_to_logical(E, S) for _ in range(LAYERS)]
        ctx = MoEContext(AllToAllDispatcher(S, rank, WORLD, None), physical_to_logical=[list(r) for r in rows0])
        moes, weights = [], []
        for layer in range(LAYERS):
            router = SoftmaxTopKRouter(D, E, K, True).requires_grad_(False)
            router.weight.normal_()
            moe = MoE(D, FF, E, router, ctx, torch.float32, layer_index=layer).requires_grad_(False)
            w13, w2 = torch.randn(E, 2 * FF, D), torch.randn(E, D, FF)
            for e in range(E):
                moe.experts.load(e, "gate_up", w13[e])
                moe.experts.load(e, "down", w2[e])
            moes.append(moe)
            weights.append((w13, w2))
        mgr = EplbManager(moes, rows0, E, EplbConfig(window_size=8, step_interval=4, num_redundant_experts=REDUNDANT),
                          rank, WORLD, "cpu")

        counts = {"collective": [], "p2p": 0, "batches": []}
        counting = [False]
        originals = {}

        def wrap(name, kind):
            fn = originals[name] = getattr(dist, name)

            def counted(*args, **kwargs):
                if counting[0]:
                    if name == "batch_isend_irecv":  # what each op is, for the NCCL-order check
                        from torch.distributed import distributed_c10d as c10d

                        counts["batches"].append([("send" if op.op is c10d.isend else "recv", op.peer, op.tag)
                                                  for op in args[0]])
                    if kind == "p2p":
                        counts["p2p"] += 1
                    else:
                        counts["collective"].append(name)
                return fn(*args, **kwargs)
            setattr(dist, name, counted)

        for name in COLLECTIVES:
            if hasattr(dist, name):
                wrap(name, "collective")
        for name in P2P:
            if hasattr(dist, name):
                wrap(name, "p2p")

        # Skewed traffic, different on each rank: experts 5 and 6 hot here, 6 and 7 on the other rank.
        rng = np.random.default_rng(rank)
        p = np.ones(E)
        p[[5, 6] if rank == 0 else [6, 7]] = 12.0
        per_step = []  # (L, E) counts of each step before the rebalance starts
        turns, switch_turns = 0, []
        while mgr.rebalances == 0:
            turns += 1
            assert turns < 4000, "no rebalance finished"
            for layer in range(LAYERS):
                ids = torch.as_tensor(np.stack([rng.choice(E, K, replace=False, p=p / p.sum()) for _ in range(16)]))
                mgr.record(layer, ids)
                if layer == 0:
                    per_step.append(np.zeros((LAYERS, E), dtype=np.int64))
                per_step[-1][layer] += np.bincount(ids.reshape(-1).numpy(), minlength=E)
            mgr.end_step(0.0)
            # The core loop's per-turn agreement (flag, digest, -digest), MAX: not counted.
            flag, digest = mgr.local_state()
            agreed = torch.tensor([flag, digest, -digest], dtype=torch.int64)
            originals["all_reduce"](agreed, op=dist.ReduceOp.MAX, group=cpu_group)
            if mgr._due and not counting[0]:
                counting[0] = True  # the rebalance starts at this boundary, from the steps so far
                recorded = per_step[:]
            before = [list(r) for r in mgr.rows]
            mgr.boundary(int(agreed[0]), cpu_group, (int(agreed[1]), int(agreed[2])))
            if mgr.rows != before:
                switch_turns.append(turns)
            time.sleep(0.002)  # serving goes on while the tuning thread runs
        counting[0] = False
        # After the switch: every token's output equals the dense reference over logical experts,
        # with a batch big enough for the balanced replica split (ReplicaMap.min_copies).
        from expert_parallel.placement.map import BALANCED_MIN_COPIES

        T = BALANCED_MIN_COPIES // K
        max_err, balanced = 0.0, []
        for moe, (w13, w2) in zip(moes, weights):
            x = torch.randn(T, D, generator=torch.Generator().manual_seed(100 + rank))
            y = moe(x)
            balanced.append(moe.replica_map is not None and moe.replica_map.balanced)
            w, ids = moe.gate(x)
            ref = torch.zeros(T, D, dtype=torch.float64)
            for t in range(T):
                for k in range(K):
                    e = int(ids[t, k])
                    g, u = (w13[e].double() @ x[t].double()).chunk(2)
                    ref[t] += float(w[t, k]) * (w2[e].double() @ (F.silu(g) * u))
            max_err = max(max_err, float((y.double() - ref).abs().max()))
        result.update(collectives=counts["collective"], p2p=counts["p2p"], batches=counts["batches"], rows=mgr.rows,
                      rows0=rows0,
                      recorded=[x.tolist() for x in recorded], switch_turns=switch_turns, max_err=max_err,
                      local_logical=[m.experts.local_logical for m in moes], balanced=balanced)
        dist.barrier(group=cpu_group)
        mgr.close()
        dist.destroy_process_group()
    except BaseException:
        result["error"] = traceback.format_exc()
    Path(out_path).write_text(json.dumps(result))


def test_one_collective_per_rebalance(tmp_path):
    from tests.distributed.jobs import run_rank_scripts

    res = run_rank_scripts(tmp_path, __file__, [], WORLD)
    from expert_parallel.placement import tuner

    # The placement is the tuner's on the load summed over both ranks: windows of steps_per_window
    # steps, the last max_windows of them (EplbConfig(window_size=8): one step each, eight kept).
    from expert_parallel.rebalance.config import EplbConfig

    cfg = EplbConfig(window_size=8, step_interval=4, num_redundant_experts=REDUNDANT)
    steps = np.sum([r["recorded"] for r in res], axis=0)  # (steps, L, E)
    n = len(steps) // cfg.steps_per_window * cfg.steps_per_window
    windows = steps[:n].reshape(-1, cfg.steps_per_window, LAYERS, E).sum(1)[-cfg.max_windows:]
    want = tuner.tune(windows, WORLD, 1, E + REDUNDANT)[0].tolist()
    for r in res:
        assert r["collectives"] == ["all_reduce"], r["collectives"]  # one collective agrees the placement
        assert r["rows"] == want and r["rows"] != r["rows0"]
        assert r["p2p"] > 0  # weights did move between the ranks
        assert r["max_err"] < 1e-4
        assert any(r["balanced"])  # the replicated layers' tokens went through the balanced split
    assert res[0]["switch_turns"] == res[1]["switch_turns"]  # the same boundaries on both ranks
    # Under NCCL's point-to-point order (no tags: each direction between two ranks matches sends and
    # receives in the order posted, a batch posted as one group), the moves complete and each send
    # meets the receive of the same piece; posted one by one, receives first, they would deadlock.
    batches = [r["batches"] for r in res]
    assert any(any(op[0] == "send" for op in b) for b in batches[0])
    assert any(any(op[0] == "send" for op in b) for b in batches[1])  # experts moved both ways
    assert nccl_order(batches) == "done"
    assert nccl_order([[[op] for b in rank for op in b] for rank in batches]) == "deadlock"
    # Each rank holds the tuner's slots: rank q the q-th run of slots_per_rank physical slots of every layer.
    s = (E + REDUNDANT) // WORLD
    assert [r["local_logical"] for r in res] == [[row[q * s:(q + 1) * s] for row in want] for q in range(WORLD)]


def nccl_order(groups_by_rank: list) -> str:
    """Run ranks' point-to-point groups as NCCL orders them: a rank's groups one after another; the
    i-th send from a to b is matched with the i-th receive on b from a (tags are not NCCL's); a group
    finishes once each of its ops' partners is posted (in a group the partner has reached). "done",
    or "deadlock" when no rank can finish its group. A mismatched pair (different tags: a piece
    received into another's buffer) fails the assertion."""
    n = len(groups_by_rank)
    index = {}  # (rank, group, op) -> the op's position in its direction's sequence
    seq = {}
    for r, groups in enumerate(groups_by_rank):
        for g, group in enumerate(groups):
            for o, (kind, peer, tag) in enumerate(group):
                key = (r, peer, kind)
                index[(r, g, o)] = len(seq.setdefault(key, []))
                seq[key].append((g, tag))
    at = [0] * n
    while any(at[r] < len(groups_by_rank[r]) for r in range(n)):
        moved = False
        for r in range(n):
            g = at[r]
            if g == len(groups_by_rank[r]):
                continue
            ready = True
            for o, (kind, peer, tag) in enumerate(groups_by_rank[r][g]):
                partner = seq.get((peer, r, "recv" if kind == "send" else "send"), [])
                i = index[(r, g, o)]
                if i >= len(partner) or partner[i][0] > at[peer]:
                    ready = False
                    break
                assert partner[i][1] == tag, (r, peer, kind, tag, partner[i][1])
            if ready:
                at[r] += 1
                moved = True
        if not moved:
            return "deadlock"
    return "done"


if __name__ == "__main__":
    worker(sys.argv[1])
