"""The placement tuner: invariants on random input, metrics by hand, and held-out balance against the
greedy (EPLB-style) baseline on synthetic drifting, skewed loads."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from expert_parallel.placement import tuner
from expert_parallel.placement.map import Placement
from expert_parallel.placement.synthetic_load import synthetic_load as make_load

# ---- synthetic load ------------------------------------------------------------------------------
SCENARIOS = ("zipf", "drift", "shift", "bursty")


def synthetic_load(scenario: str, seed: int, windows: int = 10, layers: int = 8, experts: int = 64,
                   groups: int = 8, copies: int = 100_000) -> np.ndarray:
    """(W, L, E) drifting, skewed token counts (expert_parallel/placement/synthetic_load.py)."""
    return make_load(scenario, seed, windows, layers, experts, groups, copies, skew=(0.6, 1.2))


# ---- held-out balance ----------------------------------------------------------------------------
GPUS, NODES, SLOTS, GROUPS = 8, 2, 80, 8


def _held_out(scenario: str, seed: int) -> tuple[float, float, float, float]:
    load = synthetic_load(scenario, seed)
    fit, test = load[:-1], load[-1]
    ours, _ = tuner.tune(fit, GPUS, NODES, SLOTS, GROUPS)
    greedy = tuner.greedy_layout(fit.sum(0), GPUS, NODES, SLOTS, GROUPS)
    blind = tuner.no_replica_layout(load.shape[1], load.shape[2], SLOTS)
    ev = [tuner.evaluate(test, p, GPUS, NODES, GROUPS) for p in (ours, greedy, blind)]
    return (ev[0]["overall_balancedness"], ev[1]["overall_balancedness"], ev[2]["overall_balancedness"],
            ev[0]["overall_cross_node"])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_held_out_balance_beats_greedy_on_every_seed(scenario):
    results = np.array([_held_out(scenario, seed) for seed in range(3)])
    ours, greedy, blind = results[:, 0], results[:, 1], results[:, 2]
    assert (ours >= greedy).all(), f"{scenario}: ours {ours} vs greedy {greedy}"
    assert (greedy > blind).all()
    # Clearly better on average, not by a hair (the margins seen are 0.03 to 0.2).
    assert ours.mean() >= greedy.mean() + 0.02, f"{scenario}: {ours.mean():.3f} vs {greedy.mean():.3f}"
    assert results[:, 3].max() < 0.5  # groups mostly stay home


def test_balanced_groups_stay_inside_their_node():
    # 8 groups of 4 experts, every group carrying the same load: keeping groups home costs no
    # balance, so the tuner must send nothing across nodes.
    base = np.tile([400, 300, 200, 100], 8)
    load = np.stack([base, base])[:, None, :]  # 2 windows, 1 layer, 32 experts
    p2l, infos = tuner.tune(load, gpus=4, nodes=2, slots=40, groups=8)
    assert infos[0]["mode"] == "hierarchical"
    m = tuner.evaluate(load[-1], p2l, 4, 2, 8)
    assert m["overall_cross_node"] == 0.0 and m["overall_balancedness"] > 0.99


# ---- invariants on random input ------------------------------------------------------------------
@st.composite
def problems(draw):
    nodes = draw(st.sampled_from([1, 2, 4]))
    gpus = nodes * draw(st.integers(1, 3))
    groups = draw(st.sampled_from([None, 1, 2, 4, 8]))
    experts = draw(st.sampled_from([8, 16, 24]))
    if groups and experts % groups:
        groups = None
    per_gpu = draw(st.integers(-(-experts // gpus), -(-experts // gpus) + 3))
    windows = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    skew = rng.pareto(1.0, size=(windows, 2, experts))
    load = (skew * rng.uniform(0, 500) * (rng.random((windows, 2, experts)) > 0.2)).astype(np.int64)
    return load, gpus, nodes, per_gpu * gpus, groups


@settings(max_examples=40, deadline=None)
@given(problems())
def test_tune_gives_valid_deterministic_placements(problem):
    load, gpus, nodes, slots, groups = problem
    p2l, infos = tuner.tune(load, gpus, nodes, slots, groups)
    L, E = load.shape[1:]
    assert p2l.shape == (L, slots)
    Placement(p2l.tolist(), gpus, nodes, E).validate(num_layers=L)  # every expert has a slot, ids in range
    per_gpu = slots // gpus
    for row in p2l:
        counts = np.bincount(row, minlength=E)
        # No expert on one GPU twice while it has fewer replicas than GPUs.
        for g in range(gpus):
            held = row[g * per_gpu:(g + 1) * per_gpu]
            dup = np.bincount(held, minlength=E) > 1
            assert not (dup & (counts <= gpus)).any()
    again, _ = tuner.tune(load, gpus, nodes, slots, groups)
    assert np.array_equal(p2l, again)
    # The load model: GPU loads add up to the layer's tokens.
    for l in range(L):
        assert np.isclose(tuner.gpu_loads(load[-1, l], p2l[l], gpus).sum(), load[-1, l].sum())


@settings(max_examples=40, deadline=None)
@given(problems())
def test_greedy_and_blind_baselines_are_valid(problem):
    load, gpus, nodes, slots, groups = problem
    L, E = load.shape[1:]
    for p2l in (tuner.greedy_layout(load.sum(0), gpus, nodes, slots, groups), tuner.no_replica_layout(L, E, slots)):
        assert p2l.shape == (L, slots)
        Placement(p2l.tolist(), gpus, nodes, E).validate(num_layers=L)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=12), st.integers(0, 12))
def test_replicate_minimises_the_largest_load_per_replica(weights, extra):
    w = np.array(weights, dtype=float)
    counts = tuner.replicate(w, len(w) + extra)
    assert counts.sum() == len(w) + extra and (counts >= 1).all()
    worst = (w / counts).max()
    # No single move of a replica from one expert to another lowers the worst.
    for a in np.flatnonzero(counts > 1):
        for b in range(len(w)):
            c = counts.copy()
            c[a] -= 1
            c[b] += 1
            assert (w / c).max() >= worst - 1e-9


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**31), st.floats(0, 3))
def test_pack_fills_bins_equally_and_keeps_replicas_apart(bins, per_bin, seed, hedge):
    rng = np.random.default_rng(seed)
    R = bins * per_bin
    labels = rng.integers(0, max(1, R // 2), R)
    mean = rng.pareto(1.0, R)
    bin_R = tuner.pack(mean, (0.1 * mean) ** 2, labels, bins, hedge)
    assert np.array_equal(np.bincount(bin_R, minlength=bins), np.full(bins, per_bin))
    for lab in np.unique(labels):
        n = (labels == lab).sum()
        if n <= bins:
            assert len(np.unique(bin_R[labels == lab])) == n
    assert np.array_equal(bin_R, tuner.pack(mean, (0.1 * mean) ** 2, labels, bins, hedge))


# ---- forecast ------------------------------------------------------------------------------------
def test_forecast_memory_follows_the_data():
    rng = np.random.default_rng(1)
    walk = np.exp(np.cumsum(rng.normal(0, 0.4, (12, 32)), axis=0)) * 1000
    noisy = np.exp(rng.normal(0, 0.4, (12, 32))) * 1000
    assert tuner.forecast(walk)[2] <= 0.5  # drift: trust recent windows
    assert tuner.forecast(noisy)[2] >= 0.85  # noise around a fixed profile: average many
    mean, rel_err, decay = tuner.forecast(noisy, decay=0.0)
    assert decay == 0.0 and np.allclose(mean, noisy[-1]) and rel_err > 0
    mean, rel_err, _ = tuner.forecast(np.zeros((3, 4)))  # no load at all: uniform, no error
    assert np.allclose(mean, 1.0) and rel_err == 0.0


def test_forecast_weighs_a_partial_window_by_its_steps():
    """A last window of half the steps: its shares weigh half in the decayed mean, and its total
    counts at its rate (twice its tokens), by hand with decay 1 (a plain weighted mean)."""
    full = np.array([300.0, 100.0, 0.0, 0.0])  # 400 tokens over a full window
    half = np.array([0.0, 0.0, 50.0, 50.0])  # 100 tokens over half a window (200 at that rate)
    mean, _, decay = tuner.forecast(np.stack([full, half]), decay=1.0, weights_W=[1.0, 0.5])
    shares = (1.0 * full / 400 + 0.5 * half / 100) / 1.5
    scale = (1.0 * 400 + 0.5 * 200) / 1.5
    assert decay == 1.0 and np.allclose(mean, shares * scale)
    # Weights of 1 are the unweighted forecast; a weight outside (0, 1] is refused, naming it.
    assert np.allclose(tuner.forecast(np.stack([full, half]), 0.5, [1.0, 1.0])[0],
                       tuner.forecast(np.stack([full, half]), 0.5)[0])
    with pytest.raises(ValueError, match="window weights"):
        tuner.forecast(np.stack([full, half]), 1.0, [1.0, 0.0])


# ---- metrics by hand -----------------------------------------------------------------------------
def test_evaluate_by_hand():
    # 4 experts in 2 groups, 6 slots on 2 GPUs of 3 slots, one GPU per node.
    load = np.array([[60, 20, 10, 10]])
    p2l = np.array([[0, 1, 0, 2, 3, 0]])  # expert 0 has 3 replicas (20 each); GPUs: [0,1,0] [2,3,0]
    m = tuner.evaluate(load, p2l, gpus=2, nodes=2, groups=2)
    # GPU0 = 20 + 20 + 20 = 60, GPU1 = 10 + 10 + 20 = 40.
    assert m["max_load"][0] == 60 and np.isclose(m["balancedness"][0], 50 / 60)
    # Group 0 = experts {0, 1}: 60 on node 0, 20 on node 1 -> 20 off home; group 1 all on node 1.
    assert np.isclose(m["cross_node"][0], 20 / 100)
    assert np.isclose(m["overall_balancedness"], 50 / 60) and np.isclose(m["overall_max_load"], 60)


def test_greedy_layout_follows_replicate_then_pack():
    # Extra slots: 80/1 is the worst per replica, then 80/2 ties 40/1 and the lower id wins: 3 replicas
    # of 26.7. Packing heaviest first into the lighter GPU with room: 40 | 26.7, 26.7 | ... gives
    # GPU loads 40 + 26.7 + 10 = 76.7 and 26.7 + 26.7 + 20 = 73.3.
    p2l = tuner.greedy_layout(np.array([[80, 40, 20, 10]]), gpus=2, nodes=1, slots=6)
    assert np.bincount(p2l[0], minlength=4).tolist() == [3, 1, 1, 1]
    loads = tuner.gpu_loads([80, 40, 20, 10], p2l[0], 2)
    assert np.allclose(sorted(loads), [220 / 3, 230 / 3])


def test_no_replica_layout_is_expert_order():
    assert tuner.no_replica_layout(2, 4, 6).tolist() == [[0, 1, 2, 3, 0, 1]] * 2


@pytest.mark.parametrize("kwargs, field", [
    (dict(gpus=3, nodes=2, slots=6), "gpus=3"),
    (dict(gpus=4, nodes=2, slots=10), "slots=10"),
    (dict(gpus=4, nodes=2, slots=4), "slots=4"),
    (dict(gpus=4, nodes=2, slots=8, groups=4), "groups=4"),
])
def test_shape_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        tuner.tune(np.ones((2, 1, 6), dtype=np.int64), **kwargs)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="decay=2"):
        tuner.TuneConfig(decay=2)
    with pytest.raises(ValueError, match="hedge=-1"):
        tuner.TuneConfig(hedge=-1)


# ---- never worse than EPLB -----------------------------------------------------------------------
from expert_parallel.placement import evaluation  # noqa: E402
from expert_parallel.runtime.dispatch.local import LocalDispatcher  # noqa: E402
from expert_parallel.runtime.layer import MoEContext  # noqa: E402


def _tune(fit, G, N, S, K):
    return tuner.tune(fit, G, N, S, K)[0]


def test_held_out_never_below_eplb_on_any_case():
    # Six shapes, drifting traces, fit on windows < t and judged on t (evaluation.held_out, 4
    # layers, 5 judged windows: the bench runs 16 layers and 10), both placements served as the
    # runtime serves them (replicas' tokens split by each batch's counts, ReplicaMap's own code):
    # the tuner is at least DeepSeek EPLB on every case, no-spare-slot included, and averages 0.90.
    assert evaluation.RUNTIME_SPLIT == "balanced" and MoEContext(LocalDispatcher(1)).replica_split == "balanced"
    res = {case: evaluation.held_out(case, _tune, windows=7) for case in evaluation.HELD_OUT_CASES}
    for case, r in res.items():
        assert r["tuned"] >= r["eplb"], f"{case}: tuned {r['tuned']:.4f} < EPLB {r['eplb']:.4f}"
    tuned = np.mean([r["tuned"] for r in res.values()])
    eplb = np.mean([r["eplb"] for r in res.values()])
    assert tuned >= 0.90 and tuned >= eplb + 0.02, (tuned, eplb)


def test_held_out_never_below_eplb_with_even_replica_split():
    # The same comparison served with every replica taking 1/r of its expert's tokens
    # (--replica-split round_robin, which the tuner is then told): still never below EPLB.
    cfg = tuner.TuneConfig(split="round_robin")
    res = {case: evaluation.held_out(case, lambda f, G, N, S, K: tuner.tune(f, G, N, S, K, cfg)[0], windows=7,
                                     split="round_robin") for case in evaluation.HELD_OUT_CASES}
    for case, r in res.items():
        assert r["tuned"] >= r["eplb"], f"{case}: tuned {r['tuned']:.4f} < EPLB {r['eplb']:.4f}"


@settings(max_examples=30, deadline=None)
@given(problems())
def test_predicted_worst_gpu_never_above_eplbs(problem):
    # Without expert groups only balance counts, so the chosen candidate's hedged worst GPU on the
    # forecast is the lowest, and EPLB's own placement (refined by swaps) is among the candidates.
    # (scenarios=0: the hedged score alone; the default also judges by the served split, below.)
    load, gpus, nodes, slots, _ = problem
    cfg = tuner.TuneConfig(scenarios=0)
    for l in range(load.shape[1]):
        h = load[:, l].astype(np.float64)
        p2l, info = tuner.tune_layer(h, gpus, nodes, slots, None, cfg)
        mean, rel_err, _ = tuner.forecast(h, cfg.decay)
        var = (rel_err * mean) ** 2

        def predicted(row):
            r = np.bincount(row, minlength=len(mean))[row]
            g = np.arange(slots) // (slots // gpus)
            return tuner._scores(np.bincount(g, mean[row] / r, minlength=gpus),
                                 np.bincount(g, var[row] / r**2, minlength=gpus), cfg.hedge).max()

        eplb = tuner.greedy_layout(h.sum(0)[None], gpus, nodes, slots, None)[0]
        assert "eplb+swaps" in info["predicted"]
        per_gpu = eplb.reshape(gpus, -1)
        if any(len(set(row)) < len(row) for row in per_gpu):
            continue  # EPLB doubled an expert on a GPU: the tuner separates them first, no bound
        assert predicted(p2l) <= predicted(eplb) * (1 + 1e-9) + 1e-9


@settings(max_examples=30, deadline=None)
@given(problems())
def test_served_worst_gpu_never_above_eplbs(problem):
    # With replicas on several GPUs the default config scores candidates by the mean worst GPU over
    # bootstrap next windows, each split as ReplicaMap's balanced split would split it: the chosen
    # placement is never above EPLB's own (twins on one GPU separated) on those windows.
    from expert_parallel.placement.map import ReplicaMap

    load, gpus, nodes, slots, _ = problem
    cfg = tuner.TuneConfig()
    E = load.shape[2]
    for l in range(load.shape[1]):
        h = load[:, l].astype(np.float64)
        p2l, info = tuner.tune_layer(h, gpus, nodes, slots, None, cfg)
        if slots == E or gpus == 1:
            assert "eplb" not in info["predicted"]  # the hedged score decides
            continue
        X = np.rint(tuner.scenarios(h, cfg.scenarios, info["decay"])).astype(np.int64)

        def served(row):
            rmap = ReplicaMap(row, E, split="balanced", slots_per_gpu=slots // gpus)
            return rmap.slot_counts(X, np.arange(len(X)) % gpus).numpy().reshape(len(X), gpus, -1).sum(2).max(1).mean()

        assert np.isclose(served(p2l), info["predicted"][info["mode"]][0])
        assert served(p2l) <= info["predicted"]["eplb"][0] + 1e-9
        assert all(served(p2l) <= w + 1e-9 for w, _ in info["predicted"].values())
