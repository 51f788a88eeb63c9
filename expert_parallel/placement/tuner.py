"""Expert placement tuner: replica counts and slot positions that balance the *next* window's load.

Pure, deterministic numpy functions (same input, same placement); placement_cli.py is a thin wrapper.

Shape legend: W recorded windows (oldest first), L MoE layers, E logical experts, S physical slots,
G GPUs, N nodes, K expert groups, R items being packed (replicas, or groups onto nodes).

Load model: an expert's tokens are split evenly across its replicas (ReplicaMap's round_robin), so
GPU g carries sum over its slots s of load[e(s)] / replicas[e(s)]. A layer's step time follows its
most loaded GPU, which is what every choice here minimises. The runtime's default split (balanced)
re-divides each batch's tokens among replicas to even out the GPUs, never worse than even shares
on a batch (up to rounding), so it mends part of what the forecast misses; placements are judged
under the split the runtime uses (evaluation.held_out).

How a layer is tuned:
1. Forecast. Each window becomes shares (busy and quiet windows weigh alike); the forecast is their
   exponentially decayed mean, with the decay picked per layer by backtest: the one whose forecasts
   would best have predicted the past windows (drift -> short memory, noise -> long memory).
2. Replicate. Extra slots go, one at a time, to the expert with the most forecast load per replica.
3. Pack, hedged. The backtest also gives the layer's relative forecast error c; the next window's
   load of a replica is treated as mean +- c * mean, independently per expert, and a GPU is scored
   by mean + hedge * std of its sum. Equal means, the score prefers GPUs holding many small replicas
   over a few big ones, whose drift would not average out. Heaviest replica first into the GPU whose
   score grows least (never two replicas of one expert on a GPU), then swaps between the worst GPU
   and any other while that lowers the worst.
4. Locality. Candidates from most to least local: expert groups kept inside nodes (hierarchical,
   when the groups divide evenly over nodes); "spill" packings where a replica off its group's home
   node costs a traffic weight (SPILL_WEIGHTS) in the greedy start and the swaps; global packing
   (GPUs then renumbered so replicas sit near home, which changes no GPU's load). Among candidates
   whose predicted worst GPU is within locality_tolerance of the best, the one with the least
   predicted cross-node share wins. Without expert groups only balance counts: a router free to
   pick any expert sends a token's copies to every node whatever the placement.
5. Never worse than EPLB on the forecast. DeepSeek EPLB's own placement of the plain sum of the
   history (evaluation.greedy_layout) is one more candidate, refined by the same swaps under the
   hedged score; the swaps only lower its worst GPU, so the chosen candidate's predicted worst is
   never above EPLB's. Without spare slots (experts == slots) this is what usually wins: the
   packing is all there is, and EPLB's greedy start plus swaps beats either alone on some layers.
6. Judged as served. With replicas on several GPUs and the runtime's balanced split (each batch's
   tokens re-divided among replicas, placement.ReplicaMap), how well a placement holds up depends
   on where replicas give the split room to move load, which the even-split score above does not
   see. So candidates are then scored by the mean, over `scenarios` bootstrap next windows
   (forecast.scenarios: the forecast times errors the backtest has seen), of the worst GPU when
   each window is split as ReplicaMap splits a batch; EPLB's unrefined placement (twins on one
   GPU separated) is a candidate too, so the choice is never worse than it on those scenarios. Seeded: every rank that
   tunes the same load gets the same placement.

Module map: forecast.py (step 1), packing.py (steps 2-3, shape checks), evaluation.py (metrics, the
baselines and the held-out comparison); this file composes them per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from expert_parallel.placement.evaluation import evaluate, gpu_loads, greedy_layout, no_replica_layout  # noqa: F401
from expert_parallel.placement.forecast import DECAY_CHOICES, forecast, scenarios  # noqa: F401
from expert_parallel.placement.packing import (_align_nodes, _Bins, _keep_labels_apart, _layout, _scores,  # noqa: F401
                                     check_shape, pack, replicate)

# Traffic weights of the "spill" candidates: how many tokens a swap must take off the worst GPU for
# each token it moves off its home node (higher = more local).
SPILL_WEIGHTS = (8.0, 4.0, 2.0)


@dataclass(frozen=True)
class TuneConfig:
    decay: float | None = None        # None: chosen per layer by backtest among DECAY_CHOICES
    hedge: float = 1.0                # z of the upper quantile a GPU is scored by: mean + hedge * std
    locality_tolerance: float = 0.02  # balance (relative) we give up to keep groups in a node
    max_swaps: int = 4000             # bound on the refinement (it converges long before)
    split: str = "balanced"           # the runtime's replica split (placement.ReplicaMap) judged by
    scenarios: int = 16               # bootstrap next windows for step 6 (0: the hedged score only)

    def __post_init__(self):
        if self.decay is not None and not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"decay={self.decay} must be in [0, 1]")
        if self.hedge < 0:
            raise ValueError(f"hedge={self.hedge} must be >= 0")
        if self.locality_tolerance < 0:
            raise ValueError(f"locality_tolerance={self.locality_tolerance} must be >= 0")
        if self.split not in ("balanced", "round_robin"):
            raise ValueError(f"split={self.split!r} must be 'balanced' or 'round_robin'")
        if self.scenarios < 0:
            raise ValueError(f"scenarios={self.scenarios} must be >= 0")


# ----------------------------------------------------------------------------------- one layer
def _candidates(mean, var, gpus, nodes, slots, groups, config, eplb_load=None):
    """Yield (name, expert_R, gpu_R, mean_R, var_R), most local first."""
    E, z, swaps = len(mean), config.hedge, config.max_swaps
    gpn, node_B = gpus // nodes, np.arange(gpus) // (gpus // nodes)
    # Each expert's home node: its group's node in the hierarchical split when there is one, else
    # the checkpoint's block of experts per node (the no-replica layout's).
    home_E = np.arange(E) * nodes // E
    # Hierarchical when groups split evenly over nodes and a node's slots fit its experts without
    # putting one expert on a GPU twice (which would waste the slot).
    if groups and nodes > 1 and groups % nodes == 0 and slots // nodes <= E // nodes * gpn:
        # Groups onto nodes first (equal group count per node), then each node on its own.
        per_group, spn = E // groups, slots // nodes
        g_mean, g_var = mean.reshape(groups, per_group).sum(1), var.reshape(groups, per_group).sum(1)
        home_E = np.repeat(pack(g_mean, g_var, np.arange(groups), nodes, z, max_swaps=swaps), per_group)
        parts = []
        for n in range(nodes):
            experts = np.flatnonzero(home_E == n)
            counts = replicate(mean[experts], spn, max_replicas=gpn)
            e_R, r = np.repeat(experts, counts), np.repeat(counts, counts).astype(np.float64)
            m_R, v_R = mean[e_R] / r, var[e_R] / r**2
            parts.append((e_R, pack(m_R, v_R, e_R, gpn, z, max_swaps=swaps) + n * gpn, m_R, v_R))
        yield ("hierarchical", *(np.concatenate(p) for p in zip(*parts)))
    # One replica set for the rest: a replica carries 1/r of its expert's tokens, so its mean
    # scales by 1/r and its variance by 1/r^2.
    counts = replicate(mean, slots, max_replicas=gpus)
    e_R, r = np.repeat(np.arange(E), counts), np.repeat(counts, counts).astype(np.float64)
    m_R, v_R = mean[e_R] / r, var[e_R] / r**2
    if nodes > 1:
        for w in SPILL_WEIGHTS:
            # Nodes first, trading balance against off-home tokens at weight w; an expert may put
            # one replica on each GPU of a node, and the per-node pack then spreads them.
            node_R = pack(m_R, v_R, e_R, nodes, z, label_cap=gpn, node_B=np.arange(nodes),
                          home_R=home_E[e_R], traffic_weight=w, max_swaps=swaps)
            g_R = np.empty_like(e_R)
            for n in range(nodes):
                on = np.flatnonzero(node_R == n)
                g_R[on] = pack(m_R[on], v_R[on], e_R[on], gpn, z, max_swaps=swaps) + n * gpn
            # Node totals balance, but a node's big replicas may not split evenly over its GPUs:
            # a last round of swaps across all GPUs, at the same traffic weight.
            g_R = pack(m_R, v_R, e_R, gpus, z, node_B=node_B, home_R=home_E[e_R], traffic_weight=w,
                       start_R=g_R, max_swaps=swaps)
            yield f"spill:{w:g}", e_R, g_R, m_R, v_R
    g_R = pack(m_R, v_R, e_R, gpus, z, max_swaps=swaps)
    yield "global", e_R, _align_nodes(g_R, m_R, home_E[e_R], gpus, nodes) if nodes > 1 else g_R, m_R, v_R
    if eplb_load is not None:
        # EPLB's placement of the plain load sum, then swaps under the hedged forecast score.
        e_R = greedy_layout(eplb_load[None], gpus, nodes, slots, groups)[0]
        r = np.bincount(e_R, minlength=E)[e_R].astype(np.float64)
        m_R, v_R = mean[e_R] / r, var[e_R] / r**2
        # EPLB's packing may put two replicas of an expert on one GPU; separate them first (the
        # tuner's invariant), then swap.
        st = _Bins.of(np.arange(slots) // (slots // gpus), m_R, v_R, e_R, gpus, E)
        start = _keep_labels_apart(st, m_R, v_R, e_R, gpus, z, 1).bin_R
        g_R = pack(m_R, v_R, e_R, gpus, z, start_R=start, max_swaps=swaps)
        yield "eplb+swaps", e_R, _align_nodes(g_R, m_R, home_E[e_R], gpus, nodes) if nodes > 1 else g_R, m_R, v_R
        yield "eplb", e_R, start, m_R, v_R  # as EPLB placed it, twins on one GPU separated


def tune_layer(history_WE, gpus: int, nodes: int, slots: int, groups: int | None = None,
               config: TuneConfig = TuneConfig(), weights_W=None) -> tuple[np.ndarray, dict]:
    """Placement of one layer from its load history.

    Args:
        history_WE: (W, E) token counts per window, oldest first.
        groups: expert groups (contiguous id blocks, as group-limited routers use); when they
            spread evenly over the nodes, the strictly hierarchical candidate is considered.
        weights_W: each window's steps over a full window's (forecast.forecast); None: all full.
    Returns:
        physical_to_logical_S (int64) and info: mode (the chosen candidate), decay, and per
        candidate the predicted worst GPU (step 6's scenario mean where it applies, else the
        hedged score) and cross-node share on the forecast.
    """
    h = np.asarray(history_WE, dtype=np.float64)
    E = h.shape[1]
    check_shape(E, slots, gpus, nodes, groups)
    mean, rel_err, decay = forecast(h, config.decay, weights_W)
    var = (rel_err * mean) ** 2
    # Step 6 applies where the runtime's split has replicas on several GPUs to work with.
    served = config.split == "balanced" and config.scenarios > 0 and slots > E and gpus > 1
    if served:
        from expert_parallel.placement.map import ReplicaMap

        X = np.rint(scenarios(h, config.scenarios, decay, weights_W=weights_W)).astype(np.int64)  # (scenarios, E)
    layouts, predicted = {}, {}
    for name, e_R, g_R, m_R, v_R in _candidates(mean, var, gpus, nodes, slots, groups, config, h.sum(0)):
        if name == "eplb" and not served:
            continue  # eplb+swaps is never worse under the hedged score
        layouts[name] = _layout(e_R, g_R)
        if served:  # each scenario as one batch through ReplicaMap (offsets as ranks would have them)
            rmap = ReplicaMap(layouts[name], E, split="balanced", slots_per_gpu=slots // gpus)
            per_gpu = rmap.slot_counts(X, np.arange(len(X)) % gpus).numpy().reshape(len(X), gpus, -1).sum(2)
            worst = per_gpu.max(1).mean()
        else:
            worst = _scores(np.bincount(g_R, m_R, minlength=gpus), np.bincount(g_R, v_R, minlength=gpus),
                            config.hedge).max()
        cross = evaluate(mean[None], layouts[name][None], gpus, nodes, groups)["overall_cross_node"]
        predicted[name] = (float(worst), cross)
    best = min(w for w, _ in predicted.values())
    # Least cross-node traffic among those close enough to the best balance; ties: most local first.
    # Without groups the router may send a token to any expert, so no placement keeps its copies
    # on one node: only balance counts.
    tolerance = config.locality_tolerance if groups else 0.0
    close = [n for n, (w, _) in predicted.items() if w <= best * (1 + tolerance)]
    mode = min(close, key=lambda n: predicted[n][1])
    return layouts[mode], {"mode": mode, "decay": decay, "predicted": predicted}


def tune(history_WLE, gpus: int, nodes: int, slots: int, groups: int | None = None,
         config: TuneConfig = TuneConfig(), weights_W=None) -> tuple[np.ndarray, list[dict]]:
    """tune_layer for every layer. history_WLE: (W, L, E); weights_W: (W,) each window's steps over
    a full window's (None: all full). Returns physical_to_logical_LS, infos."""
    h = np.asarray(history_WLE, dtype=np.float64)
    if h.ndim != 3 or h.shape[0] == 0:
        raise ValueError(f"expert_load must be windows x layers x experts, got shape {h.shape}")
    out = [tune_layer(h[:, l], gpus, nodes, slots, groups, config, weights_W) for l in range(h.shape[1])]
    return np.stack([p for p, _ in out]), [info for _, info in out]
