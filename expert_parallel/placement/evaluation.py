"""Judging placements: GPU loads and balancedness on a window of load, the baselines the tuner is
measured against (no replicas; DeepSeek EPLB's replicate-then-pack greedy), and the held-out
comparison on drifting traces (fit on the windows up to t, judged on window t + 1).

Shape legend: W windows, L MoE layers, E logical experts, S physical slots, G GPUs, N nodes.
"""
from __future__ import annotations

import numpy as np

from expert_parallel.placement.packing import _layout, check_shape, replicate


# ------------------------------------------------------------------------------------ baselines
def no_replica_layout(num_layers: int, num_experts: int, slots: int) -> np.ndarray:
    """Baseline (a), load-blind: slot s holds expert s mod E. With slots == experts that is the
    checkpoint's expert order; extra slots replicate experts 0, 1, ... round-robin.
    Returns physical_to_logical_LS."""
    return np.tile(np.arange(slots) % num_experts, (num_layers, 1))


def _greedy_pack(weight_R: np.ndarray, num_bins: int) -> np.ndarray:
    """Heaviest item first into the least loaded bin that still has room (equal item counts)."""
    per_bin = len(weight_R) // num_bins
    load, n = np.zeros(num_bins), np.zeros(num_bins, dtype=np.int64)
    bin_R = np.empty(len(weight_R), dtype=np.int64)
    for i in np.argsort(-weight_R, kind="stable"):
        b = int(np.argmin(np.where(n < per_bin, load, np.inf)))
        bin_R[i] = b
        load[b] += weight_R[i]; n[b] += 1
    return bin_R


def greedy_layout(load_LE, gpus: int, nodes: int, slots: int, groups: int | None = None) -> np.ndarray:
    """Baseline (b), the replicate-then-pack heuristic of DeepSeek's EPLB, on the given load
    (use the plain sum of past windows): hierarchical (groups onto nodes, then per node) when the
    groups divide evenly over the nodes, global otherwise. Returns physical_to_logical_LS."""
    load = np.asarray(load_LE, dtype=np.float64)
    L, E = load.shape
    check_shape(E, slots, gpus, nodes, groups)
    if not groups or groups % nodes:
        groups, nodes = 1, 1
    per_group, spn, gpn = E // groups, slots // nodes, gpus // nodes
    out = []
    for w in load:
        node_K = _greedy_pack(w.reshape(groups, per_group).sum(1), nodes)
        e_parts, g_parts = [], []
        for n in range(nodes):
            experts = (np.flatnonzero(node_K == n)[:, None] * per_group + np.arange(per_group)).ravel()
            counts = replicate(w[experts], spn)
            e_R = np.repeat(experts, counts)
            g_R = _greedy_pack(w[e_R] / np.repeat(counts, counts), gpn) + n * gpn
            e_parts.append(e_R); g_parts.append(g_R)
        out.append(_layout(np.concatenate(e_parts), np.concatenate(g_parts)))
    return np.stack(out)


# -------------------------------------------------------------------------------------- metrics
# How the runtime shares a replicated expert's tokens among its replicas (MoEContext.replica_split,
# placement.ReplicaMap): from each rank's batch counts, evening out the GPUs. A window's load is
# judged by replaying it as such batches: its token copies dealt at random (seeded) into batches of
# about BATCH_COPIES (a rank's step: 512 tokens x top-8), batch b mapped as rank b % G would map it,
# with ReplicaMap's own code. "round_robin" is the even split (each replica 1/r of its expert).
RUNTIME_SPLIT = "balanced"
BATCH_COPIES = 4096


def slot_loads(load_E, physical_to_logical_S, gpus: int, split: str = "round_robin",
               batch_copies: int = BATCH_COPIES, seed: int = 0) -> np.ndarray:
    """(S,) tokens each slot computes over a window of load_E, under the given split."""
    p2l = np.asarray(physical_to_logical_S, dtype=np.int64)
    load = np.asarray(load_E, dtype=np.float64)
    replicas = np.bincount(p2l, minlength=len(load))
    if split == "round_robin" or (replicas <= 1).all() or gpus == 1:
        return load[p2l] / replicas[p2l]
    if split != "balanced":
        raise ValueError(f"split={split!r} must be 'balanced' or 'round_robin'")
    from expert_parallel.placement.map import ReplicaMap

    counts = np.rint(load).astype(np.int64)
    B = max(1, int(round(counts.sum() / batch_copies)))
    c_EB = np.random.default_rng(seed).multinomial(counts, np.full(B, 1.0 / B))  # each copy to a batch
    rmap = ReplicaMap(p2l, len(load), split="balanced", slots_per_gpu=len(p2l) // gpus)
    return rmap.slot_counts(c_EB.T, np.arange(B) % gpus).sum(0).numpy().astype(np.float64)


def gpu_loads(load_E, physical_to_logical_S, gpus: int, split: str = "round_robin", **kw) -> np.ndarray:
    """(G,) tokens each GPU computes (round_robin: every expert's tokens split evenly over its
    replicas; balanced: the runtime's per-batch split, see slot_loads)."""
    return slot_loads(load_E, physical_to_logical_S, gpus, split, **kw).reshape(gpus, -1).sum(1)


def evaluate(load_LE, physical_to_logical_LS, gpus: int, nodes: int, groups: int | None = None,
             split: str = "round_robin") -> dict:
    """Judge a placement on one window of load, its replicas' tokens shared as `split` says
    (RUNTIME_SPLIT is what serving does; round_robin, the even split, is the tuner's load model).

    Per layer (arrays of length L) and overall (floats, key prefixed "overall_"):
      balancedness  mean GPU load / max GPU load (1 = perfect). Overall: sum of means / sum of maxes,
                    i.e. the share of MoE time not spent waiting for the slowest GPU.
      max_load      tokens on the most loaded GPU. Overall: mean over layers.
      cross_node    share of token copies computed away from their group's home node. Expert
                    groups are contiguous id blocks (group-limited routers send a token to few
                    groups); a group's home is the node computing most of its tokens, and what its
                    other nodes compute is the traffic that placement added between nodes. Without
                    groups, one group per node (the checkpoint's own expert-to-node blocks).
    """
    load = np.asarray(load_LE, dtype=np.float64)
    p2l = np.asarray(physical_to_logical_LS, dtype=np.int64)
    L, E = load.shape
    S = p2l.shape[1]
    groups = groups or nodes
    node_S = np.arange(S) // (S // nodes)  # slot -> GPU -> node collapses to this
    mean_l, max_l, cross_l, total_l = (np.zeros(L) for _ in range(4))
    for l in range(L):
        per_slot = slot_loads(load[l], p2l[l], gpus, split, seed=l)
        g = per_slot.reshape(gpus, -1).sum(1)
        mean_l[l], max_l[l] = g.mean(), g.max()
        group_node = np.bincount(p2l[l] // (E // groups) * nodes + node_S, per_slot,
                                 minlength=groups * nodes).reshape(groups, nodes)
        total_l[l] = per_slot.sum()
        cross_l[l] = total_l[l] - group_node.max(1).sum()
    safe = lambda a, b: np.divide(a, b, out=np.ones_like(a), where=b > 0)  # idle layer: balanced
    return {
        "balancedness": safe(mean_l, max_l),
        "max_load": max_l,
        "cross_node": np.maximum(safe(cross_l, total_l) * (total_l > 0), 0.0),  # no -0.0 from rounding
        "overall_balancedness": float(mean_l.sum() / max_l.sum()) if max_l.sum() > 0 else 1.0,
        "overall_max_load": float(max_l.mean()),
        "overall_cross_node": max(float(cross_l.sum() / total_l.sum()), 0.0) if total_l.sum() > 0 else 0.0,
    }


# --------------------------------------------------------------------- held out, drifting traces
# The comparison the tuner is held to: (experts, gpus, nodes, slots, groups). Spare slots with and
# without expert groups, one and several nodes, and the case with no spare slot (experts == slots),
# where only the packing differs.
HELD_OUT_CASES = {
    "256e-32gpu-4node-288slot-8group": (256, 32, 4, 288, 8),
    "128e-16gpu-2node-160slot": (128, 16, 2, 160, None),
    "64e-8gpu-2node-80slot-8group": (64, 8, 2, 80, 8),
    "64e-8gpu-1node-72slot": (64, 8, 1, 72, None),
    "128e-16gpu-1node-144slot": (128, 16, 1, 144, None),
    "64e-8gpu-1node-64slot-nospare": (64, 8, 1, 64, None),
}


def held_out(case: str, tune_fn, seed: int = 0, windows: int = 8, layers: int = 4, copies: int = 200_000,
             skew: tuple[float, float] = (0.3, 0.6), min_history: int = 2, split: str = RUNTIME_SPLIT) -> dict:
    """Rolling held-out balancedness on a drifting trace (synthetic_load "drift").

    For every t >= min_history: the tuner (tune_fn(history_WLE, gpus, nodes, slots, groups) ->
    physical_to_logical_LS) and EPLB (greedy_layout on the plain sum of the same windows, as EPLB is
    fed) both see windows [0, t) and are judged on window t, served the same way (split: the
    runtime's by default). Returns the mean overall balancedness of each ("tuned", "eplb") and the
    per-t figures ("tuned_t", "eplb_t")."""
    from expert_parallel.placement.synthetic_load import synthetic_load

    E, G, N, S, K = HELD_OUT_CASES[case]
    load = synthetic_load("drift", seed, windows, layers, E, K, copies, skew)
    tuned, eplb = [], []
    for t in range(min_history, windows):
        fit, test = load[:t], load[t]
        tuned.append(evaluate(test, tune_fn(fit, G, N, S, K), G, N, K, split)["overall_balancedness"])
        eplb.append(evaluate(test, greedy_layout(fit.sum(0), G, N, S, K), G, N, K, split)["overall_balancedness"])
    return {"tuned": float(np.mean(tuned)), "eplb": float(np.mean(eplb)), "tuned_t": tuned, "eplb_t": eplb}
