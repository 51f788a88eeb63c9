"""Expert rebalancing while serving: settings, the transfer plan on simulated ranks, and the map switch
of a real MoE layer through any sequence of placements, against a dense float64 reference computed
from the logical experts' weights."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from expert_parallel.runtime.step import MoEStep
from expert_parallel.runtime.dispatch.local import LocalDispatcher
from expert_parallel.rebalance.eplb import EplbManager
from expert_parallel.rebalance.config import EplbConfig, resolve_eplb
from expert_parallel.runtime.layer import MoE, MoEContext, default_physical_to_logical
from expert_parallel.rebalance.plan import LayerPlan, plan_layer
from expert_parallel.runtime.router import SoftmaxTopKRouter


# ---- settings ------------------------------------------------------------------------------------
def test_flags_and_json_resolve_like_vllm():
    assert resolve_eplb(False, None, None, None, None) is None
    assert resolve_eplb(True, None, None, None, None) == EplbConfig(1000, 3000, 0)
    c = resolve_eplb(True, 4, 50, 10, '{"step_interval": 7}')
    assert (c.window_size, c.step_interval, c.num_redundant_experts) == (50, 7, 4)  # JSON wins


@pytest.mark.parametrize("args, field", [
    ((False, 2, None, None, None), "num_redundant_experts"),
    ((False, None, None, None, '{"window_size": 3}'), "eplb_config"),
    ((True, None, None, None, '{"window": 3}'), "'window'"),
    ((True, None, None, None, "[1]"), "eplb_config"),
    ((True, None, None, None, "{"), "eplb_config"),
    ((True, -1, None, None, None), "num_redundant_experts=-1"),
    ((True, None, 0, None, None), "window_size=0"),
    ((True, None, None, 0, None), "step_interval=0"),
])
def test_bad_settings_name_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        resolve_eplb(*args)


# ---- the transfer plan on simulated ranks ----------------------------------------------------------
@st.composite
def placement_sequences(draw):
    world = draw(st.integers(1, 4))
    experts = draw(st.integers(2, 9))
    slots = world * draw(st.integers(-(-experts // world), -(-experts // world) + 2))
    rows = []
    for _ in range(draw(st.integers(2, 5))):
        extra = draw(st.lists(st.integers(0, experts - 1), min_size=slots - experts, max_size=slots - experts))
        perm = draw(st.permutations(list(range(experts)) + extra))
        rows.append(list(perm))
    return world, experts, rows


@settings(max_examples=80, deadline=None)
@given(placement_sequences())
def test_plan_moves_exactly_what_each_rank_lacks(problem):
    world, experts, rows = problem
    s = len(rows[0]) // world
    local = [rows[0][r * s:(r + 1) * s] for r in range(world)]  # what each rank's slots hold
    for layer, new in enumerate(rows[1:]):
        plans = [plan_layer(layer, [e for lo in local for e in lo], new, world, r) for r in range(world)]
        sends = {(q, dst, e): i for q, p in enumerate(plans) for i, dst, e in p.sends}
        nxt = []
        for r, p in enumerate(plans):
            buf = [None] * s
            for j, i in p.copies:
                assert local[r][i] == new[r * s + j]
                buf[j] = local[r][i]
            for j, q, e in p.recvs:
                assert q != r and e not in local[r]
                i = sends.pop((q, r, e))  # every receive has exactly one matching send
                buf[j] = local[q][i]
            for j, j0 in p.dups:
                buf[j] = buf[j0]
            assert buf == new[r * s:(r + 1) * s]
            nxt.append(buf)
        assert not sends  # and no send is left without a receive
        local = nxt


# ---- the switch of a real MoE layer ---------------------------------------------------------------
D, FF, K = 16, 8, 2


def _reference(x, w13_E, w2_E, router):
    """Dense float64: every token's weighted sum over its logical top-k experts."""
    w, ids = router(x)
    y = torch.zeros(x.shape[0], D, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(K):
            e = int(ids[t, k])
            g, u = (w13_E[e].double() @ x[t].double()).chunk(2)
            y[t] += float(w[t, k]) * (w2_E[e].double() @ (F.silu(g) * u))
    return y


@settings(max_examples=12, deadline=None)
@given(st.integers(3, 6), st.integers(0, 3), st.integers(0, 2**31), st.integers(2, 4))
def test_map_switch_serves_every_expert_by_exactly_its_replicas(experts, redundant, seed, rebalances):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    slots = experts + redundant
    router = SoftmaxTopKRouter(D, experts, K, True).requires_grad_(False)
    for prm in router.parameters():  # built uninitialised, like every module before loading
        prm.normal_()
    moe = MoE(D, FF, experts, router, MoEContext(LocalDispatcher(slots)), torch.float32,
              layer_index=0).requires_grad_(False)
    w13_E, w2_E = torch.randn(experts, 2 * FF, D), torch.randn(experts, D, FF)
    for e in range(experts):
        moe.experts.load(e, "gate_up", w13_E[e])
        moe.experts.load(e, "down", w2_E[e])
    # Placements the "tuner" returns, one per rebalance: random replicas, random order.
    plans, prev = [], default_physical_to_logical(experts, slots)
    while len(plans) < rebalances:
        p = np.concatenate([rng.permutation(experts), rng.integers(0, experts, redundant)])[rng.permutation(slots)]
        if list(p) != list(prev):  # each rebalance changes something
            plans.append(p)
            prev = p
    served = iter(plans)
    mgr = EplbManager([moe], [default_physical_to_logical(experts, slots)], experts,
                      EplbConfig(window_size=2, step_interval=1, num_redundant_experts=redundant), 0, 1, "cpu",
                      tune_fn=lambda h, gpus, S: next(served)[None])
    moe_step = MoEStep(load_recorder=mgr.record)  # as the model runner passes EngineCore's hooks
    row = default_physical_to_logical(experts, slots)
    switched = 0
    for step in range(60):
        x = torch.randn(12, D)
        y = moe(x, moe_step)
        # Each (token, k) goes to a slot of its logical expert, and every replica of a busy expert gets work.
        w, ids = router(x)
        slots_TK = moe.replica_map(ids) if moe.replica_map is not None else ids
        assert (torch.as_tensor(row)[slots_TK] == ids).all()
        assert moe.experts.local_logical == list(row)
        torch.testing.assert_close(y.double(), _reference(x, w13_E, w2_E, router), rtol=1e-4, atol=1e-4)
        mgr.end_step(0.0)
        mgr.boundary(mgr.local_flag())
        if mgr.rows[0] != list(row):
            row = mgr.rows[0]
            switched += 1
            assert row == list(map(int, plans[switched - 1]))
        if switched == rebalances and not mgr._queue:
            break
    assert switched == rebalances and mgr.rebalances == rebalances
    mgr.close()


def test_ranks_that_tuned_different_placements_stop_with_an_error():
    # Every rank tunes the same summed load and must get the same placement; the per-turn
    # agreement carries each rank's placement digest as (MAX d, MAX -d), equal up to sign only
    # when all ranks agree. A mismatch is an error, not a rank serving a different map.
    from expert_parallel.rebalance.eplb import placement_digest

    experts, slots = 3, 4
    router = SoftmaxTopKRouter(D, experts, K, True).requires_grad_(False)
    moe = MoE(D, FF, experts, router, MoEContext(LocalDispatcher(slots)), torch.float32,
              layer_index=0).requires_grad_(False)
    new = [2, 0, 1, 2]

    def make():
        return EplbManager([moe], [default_physical_to_logical(experts, slots)], experts,
                           EplbConfig(window_size=2, step_interval=1, num_redundant_experts=1), 0, 1, "cpu",
                           tune_fn=lambda h, gpus, S: np.array([new]))

    for agree in (True, False):
        mgr = make()
        mgr.record(0, torch.tensor([[0, 1], [2, 1]]))
        mgr.end_step(0.0)
        mgr.boundary(0)  # starts the tuning
        for _ in range(500):
            flag, digest = mgr.local_state()
            if flag == 0:
                break
            time.sleep(0.01)
        assert (flag, digest) == (0, placement_digest([new])) and digest > 0
        other = digest if agree else placement_digest([[2, 1, 0, 2]])
        digests = (max(digest, other), max(-digest, -other))
        if agree:
            mgr.boundary(0, None, digests)
            assert isinstance(mgr._queue[0], LayerPlan) or hasattr(mgr._queue[0], "plan")
        else:
            with pytest.raises(RuntimeError, match="different placements"):
                mgr.boundary(0, None, digests)
        mgr.close()
