"""Expert placement tuner: replica counts and slot positions that balance the *next* window's load.

Pure, deterministic numpy functions (same input, same placement); placement_cli.py is a thin wrapper.

Shape legend: W recorded windows (oldest first), L MoE layers, E logical experts, S physical slots,
G GPUs, N nodes, K expert groups, R items being packed (replicas, or groups onto nodes).

Load model (it matches ReplicaMap, which round-robins tokens over replicas): an expert's tokens are
split evenly across its replicas, so GPU g carries sum over its slots s of load[e(s)] / replicas[e(s)].
A layer's step time follows its most loaded GPU, which is what every choice here minimises.

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
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Candidate decays for the backtest: 0 trusts only the newest window, 1 weighs all windows alike.
DECAY_CHOICES = (0.0, 0.3, 0.5, 0.7, 0.85, 0.95, 1.0)
# Weight per window of age when averaging backtest errors: recent errors describe the next one best.
_ERROR_DECAY = 0.8
# A swap must lower the worst GPU by this fraction: smaller gains are below the forecast's precision
# and only cost refinement steps.
_MIN_GAIN = 1e-4
# Traffic weights of the "spill" candidates: how many tokens a swap must take off the worst GPU for
# each token it moves off its home node (higher = more local).
SPILL_WEIGHTS = (8.0, 4.0, 2.0)


@dataclass(frozen=True)
class TuneConfig:
    decay: float | None = None        # None: chosen per layer by backtest among DECAY_CHOICES
    hedge: float = 1.0                # z of the upper quantile a GPU is scored by: mean + hedge * std
    locality_tolerance: float = 0.02  # balance (relative) we give up to keep groups in a node
    max_swaps: int = 4000             # bound on the refinement (it converges long before)

    def __post_init__(self):
        if self.decay is not None and not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"decay={self.decay} must be in [0, 1]")
        if self.hedge < 0:
            raise ValueError(f"hedge={self.hedge} must be >= 0")
        if self.locality_tolerance < 0:
            raise ValueError(f"locality_tolerance={self.locality_tolerance} must be >= 0")


# ----------------------------------------------------------------------------------------- forecast
def _decayed_forecasts(shares_WE: np.ndarray, decay: float) -> np.ndarray:
    """(W+1, E): row j is the decayed mean of windows < j (row 0, with no history, is uniform)."""
    W, E = shares_WE.shape
    out = np.empty((W + 1, E))
    out[0] = 1.0 / E
    num, den = np.zeros(E), 0.0
    for j in range(W):
        num, den = decay * num + shares_WE[j], decay * den + 1.0
        out[j + 1] = num / den
    return out


def forecast(history_WE, decay: float | None = None) -> tuple[np.ndarray, float, float]:
    """Predict one layer's next window from its history.

    Args:
        history_WE: (W, E) token counts per window, oldest first.
        decay: weight of a window relative to the next newer one (1 = plain mean); None picks it
            by backtest among DECAY_CHOICES.
    Returns:
        mean_E: forecast tokens per expert, scaled to the decayed mean window total.
        rel_err: the forecast's typical relative error per expert, sqrt(sum resid^2 / sum share^2)
            over the backtest (0 with fewer than two windows). One number per layer, not per expert:
            a past burst on one expert does not predict the next burst's expert, so per-expert
            errors would only move replicas to where the last surprise was.
        decay: the decay used.
    """
    h = np.asarray(history_WE, dtype=np.float64)
    E = h.shape[1]
    totals = h.sum(axis=1)
    h, totals = h[totals > 0], totals[totals > 0]  # an idle window says nothing about shares
    if len(h) == 0:
        return np.ones(E), 0.0, 1.0 if decay is None else decay
    shares = h / totals[:, None]
    W = len(shares)
    if decay is None:
        # Backtest: the forecast from windows < j against window j, for every j >= 1.
        errors = [((_decayed_forecasts(shares, d)[1:W] - shares[1:]) ** 2).sum() for d in DECAY_CHOICES]
        decay = DECAY_CHOICES[int(np.argmin(errors))] if W > 1 else 1.0
    fc = _decayed_forecasts(shares, decay)
    age_w = decay ** np.arange(W)[::-1]
    scale = float((age_w * totals).sum() / age_w.sum())
    rel_err = 0.0
    if W > 1:
        err_w = _ERROR_DECAY ** np.arange(W - 1)[::-1][:, None]
        rel_err = float(np.sqrt((err_w * (fc[1:W] - shares[1:]) ** 2).sum()
                                / (err_w * shares[1:] ** 2).sum()))
    return fc[W] * scale, rel_err, float(decay)


# ---------------------------------------------------------------------------------- replicate/pack
def replicate(weight_E: np.ndarray, num_slots: int, max_replicas: int | None = None) -> np.ndarray:
    """Replica count per expert: each extra slot goes to the highest weight-per-replica expert.

    This greedy order minimises the largest weight / replicas. max_replicas (the GPU count: more
    replicas would have to share a GPU) is soft: it is exceeded only when every expert is at it.
    Returns counts_E (int64), each >= 1, summing to num_slots.
    """
    E = len(weight_E)
    if num_slots < E:
        raise ValueError(f"slots={num_slots} is fewer than the {E} logical experts")
    counts = np.ones(E, dtype=np.int64)
    cap = max_replicas or num_slots
    w = np.asarray(weight_E, dtype=np.float64)
    for _ in range(num_slots - E):
        per = np.where(counts < cap, w / counts, -np.inf)
        if np.isneginf(per).all():
            per = w / counts
        counts[int(np.argmax(per))] += 1  # argmax takes the lowest id on ties: deterministic
    return counts


def _scores(m, v, hedge):
    return m + hedge * np.sqrt(np.maximum(v, 0.0))


@dataclass
class _Bins:
    """Packing state: each item's bin, and per bin the sums of mean and var and the label counts."""
    bin_R: np.ndarray
    m: np.ndarray
    v: np.ndarray
    holds: np.ndarray  # (bins, labels)

    @classmethod
    def of(cls, bin_R, mean_R, var_R, label_R, num_bins, num_labels) -> "_Bins":
        holds = np.zeros((num_bins, num_labels), dtype=np.int64)
        np.add.at(holds, (bin_R, label_R), 1)
        return cls(bin_R, np.bincount(bin_R, mean_R, num_bins), np.bincount(bin_R, var_R, num_bins), holds)

    def swap(self, i, j, mean_R, var_R, label_R) -> None:
        a, b = self.bin_R[i], self.bin_R[j]
        for item, src, dst in ((i, a, b), (j, b, a)):
            self.m[src] -= mean_R[item]; self.v[src] -= var_R[item]
            self.m[dst] += mean_R[item]; self.v[dst] += var_R[item]
            self.holds[src, label_R[item]] -= 1; self.holds[dst, label_R[item]] += 1
            self.bin_R[item] = dst


def pack(mean_R, var_R, label_R, num_bins: int, hedge: float, *, label_cap: int = 1, node_B=None,
         home_R=None, traffic_weight: float = 0.0, start_R=None, max_swaps: int = 4000) -> np.ndarray:
    """Put R items into num_bins bins of R / num_bins items each, minimising the worst bin score.

    A bin's score is sum(mean) + hedge * sqrt(sum(var)). At most label_cap items with one label
    (replicas of one expert) share a bin, unless the label has more items than that allows.
    Greedy start (heaviest first, into the bin whose score grows least; skipped given start_R),
    then swaps between the worst bin and any other while that lowers the worst by _MIN_GAIN.

    Locality, given node_B (node of each bin) and home_R (the node each item would like): an item
    off its home costs traffic_weight * its mean, in the same token units as the score. The greedy
    start adds that cost to each choice. Among swaps that lower the worst bin, the refinement takes
    the best one adding no off-home tokens; failing that, the one with the most gain per cost, and
    it stops when no swap gains as many tokens on the worst bin as it costs. traffic_weight 0
    ignores locality.
    Returns bin_R (int64).
    """
    mean_R, var_R = np.asarray(mean_R, np.float64), np.asarray(var_R, np.float64)
    label_R = np.asarray(label_R, np.int64)
    R, labels = len(mean_R), int(label_R.max()) + 1
    if home_R is None or traffic_weight == 0:
        node_B, home_R, traffic_weight = np.zeros(num_bins, np.int64), np.zeros(R, np.int64), 0.0
    off_cost = traffic_weight * mean_R  # what item i costs on any bin outside its home node
    if start_R is None:
        st = _Bins(np.empty(R, np.int64), np.zeros(num_bins), np.zeros(num_bins),
                   np.zeros((num_bins, labels), np.int64))
        n = np.zeros(num_bins, dtype=np.int64)
        for i in np.argsort(-_scores(mean_R, var_R, hedge), kind="stable"):
            room = n < R // num_bins
            free = room & (st.holds[:, label_R[i]] < label_cap)
            cand = np.flatnonzero(free if free.any() else room)
            cost = _scores(st.m[cand] + mean_R[i], st.v[cand] + var_R[i], hedge) \
                + off_cost[i] * (node_B[cand] != home_R[i])
            b = cand[np.argmin(cost)]
            st.bin_R[i] = b
            st.m[b] += mean_R[i]; st.v[b] += var_R[i]; n[b] += 1
            st.holds[b, label_R[i]] += 1
        st = _keep_labels_apart(st, mean_R, var_R, label_R, num_bins, hedge, label_cap)
    else:
        st = _Bins.of(np.array(start_R, dtype=np.int64), mean_R, var_R, label_R, num_bins, labels)
    for _ in range(max_swaps):
        score = _scores(st.m, st.v, hedge)
        a = int(np.argmax(score))
        ia, ib = np.flatnonzero(st.bin_R == a), np.flatnonzero(st.bin_R != a)
        b = st.bin_R[ib]
        dm = mean_R[ib][None, :] - mean_R[ia][:, None]  # (items on a) x (items elsewhere): j in, i out
        dv = var_R[ib][None, :] - var_R[ia][:, None]
        worst = np.maximum(_scores(st.m[a] + dm, st.v[a] + dv, hedge), _scores(st.m[b] - dm, st.v[b] - dv, hedge))
        ok = (label_R[ia][:, None] != label_R[ib][None, :]) \
            & (st.holds[b[None, :], label_R[ia][:, None]] < label_cap) \
            & (st.holds[a, label_R[ib]][None, :] < label_cap)
        # Strict improvement of the pair's max: the sorted score vector falls, so this terminates.
        ok &= worst < score[a] * (1 - _MIN_GAIN)
        if not ok.any():
            break
        na, nb, hi, hj = node_B[a], node_B[b][None, :], home_R[ia][:, None], home_R[ib][None, :]
        d_cost = off_cost[ia][:, None] * ((nb != hi).astype(float) - (na != hi)) \
            + off_cost[ib][None, :] * ((na != hj).astype(float) - (nb != hj))
        free = ok & (d_cost <= 0)
        if free.any():  # adds no off-home tokens: take the best
            k = int(np.argmin(np.where(free, worst, np.inf)))
        else:
            # The most gain per weighted off-home token, if at least 1 (both are tokens); among
            # those within 10% of the best ratio the biggest gain, so that the walk takes a few
            # useful steps rather than many tiny cheap ones.
            gain = np.where(ok, score[a] - worst, 0.0)
            ratio = gain / np.maximum(d_cost, 1e-12)
            if ratio.max() < 1.0:
                break
            k = int(np.argmax(np.where(ratio >= 0.9 * ratio.max(), gain, -1.0)))
        st.swap(ia[k // len(ib)], ib[k % len(ib)], mean_R, var_R, label_R)
    return st.bin_R


def _keep_labels_apart(st: _Bins, mean_R, var_R, label_R, num_bins, hedge, label_cap) -> _Bins:
    """Undo the greedy start's label surpluses (late items can find only bins holding their label)."""
    # One swap per surplus item, the one that leaves the pair's worst score lowest.
    for i in np.flatnonzero(st.holds[st.bin_R, label_R] > label_cap):
        a = st.bin_R[i]
        if st.holds[a, label_R[i]] <= label_cap:
            continue  # an earlier swap already took one of its twins away
        js = np.flatnonzero((st.holds[st.bin_R, label_R[i]] < label_cap) & (st.holds[a, label_R] < label_cap))
        if len(js):
            b = st.bin_R[js]
            worst = np.maximum(
                _scores(st.m[a] - mean_R[i] + mean_R[js], st.v[a] - var_R[i] + var_R[js], hedge),
                _scores(st.m[b] + mean_R[i] - mean_R[js], st.v[b] + var_R[i] - var_R[js], hedge))
            st.swap(i, js[np.argmin(worst)], mean_R, var_R, label_R)
    fits = np.bincount(label_R, minlength=st.holds.shape[1]) <= label_cap * num_bins
    if (st.holds[:, fits] > label_cap).any():
        # Rarely, single swaps do not do. Dealing the items out label by label cannot exceed the
        # cap for a label that fits; the refinement then restores balance (it keeps labels apart).
        bin_R = np.empty_like(st.bin_R)
        bin_R[np.lexsort((-mean_R, label_R))] = np.arange(len(label_R)) % num_bins
        st = _Bins.of(bin_R, mean_R, var_R, label_R, num_bins, st.holds.shape[1])
    return st


# ----------------------------------------------------------------------------------- one layer
def _layout(expert_R: np.ndarray, gpu_R: np.ndarray) -> np.ndarray:
    """Items -> physical_to_logical_S: GPU-major (slot s lives on GPU s // slots_per_gpu), experts
    ascending inside a GPU so equal placements serialise equally."""
    return expert_R[np.lexsort((expert_R, gpu_R))]


def _align_nodes(gpu_R, mean_R, home_R, gpus: int, nodes: int) -> np.ndarray:
    """Renumber GPUs so that replicas sit on their home node where possible.

    Which GPUs share a node changes no GPU's load, so this costs no balance and only cuts
    cross-node traffic. Greedy on affinity (the load a GPU holds for a node), highest first,
    G / N GPUs per node. Returns the new gpu_R.
    """
    gpn = gpus // nodes
    affinity = np.bincount(gpu_R * nodes + home_R, mean_R, minlength=gpus * nodes).reshape(gpus, nodes)
    new_id, filled = np.full(gpus, -1), np.zeros(nodes, dtype=np.int64)
    for k in np.argsort(-affinity.ravel(), kind="stable"):
        g, n = divmod(int(k), nodes)
        if new_id[g] < 0 and filled[n] < gpn:
            new_id[g] = n * gpn + filled[n]
            filled[n] += 1
    return new_id[gpu_R]


def check_shape(num_experts: int, slots: int, gpus: int, nodes: int, groups: int | None) -> None:
    if gpus <= 0 or nodes <= 0 or slots <= 0:
        raise ValueError(f"gpus={gpus}, nodes={nodes} and slots={slots} must be positive")
    if gpus % nodes:
        raise ValueError(f"gpus={gpus} is not divisible by nodes={nodes}")
    if slots % gpus:
        raise ValueError(f"slots={slots} is not divisible by gpus={gpus}")
    if slots < num_experts:
        raise ValueError(f"slots={slots} is fewer than num_logical_experts={num_experts}")
    if groups is not None and (groups <= 0 or num_experts % groups):
        raise ValueError(f"groups={groups} does not divide num_logical_experts={num_experts}")


def _candidates(mean, var, gpus, nodes, slots, groups, config):
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


def tune_layer(history_WE, gpus: int, nodes: int, slots: int, groups: int | None = None,
               config: TuneConfig = TuneConfig()) -> tuple[np.ndarray, dict]:
    """Placement of one layer from its load history.

    Args:
        history_WE: (W, E) token counts per window, oldest first.
        groups: expert groups (contiguous id blocks, as group-limited routers use); when they
            spread evenly over the nodes, the strictly hierarchical candidate is considered.
    Returns:
        physical_to_logical_S (int64) and info: mode (the chosen candidate), decay, and per
        candidate the predicted worst-GPU score and cross-node share on the forecast.
    """
    h = np.asarray(history_WE, dtype=np.float64)
    E = h.shape[1]
    check_shape(E, slots, gpus, nodes, groups)
    mean, rel_err, decay = forecast(h, config.decay)
    var = (rel_err * mean) ** 2
    layouts, predicted = {}, {}
    for name, e_R, g_R, m_R, v_R in _candidates(mean, var, gpus, nodes, slots, groups, config):
        layouts[name] = _layout(e_R, g_R)
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
         config: TuneConfig = TuneConfig()) -> tuple[np.ndarray, list[dict]]:
    """tune_layer for every layer. history_WLE: (W, L, E). Returns physical_to_logical_LS, infos."""
    h = np.asarray(history_WLE, dtype=np.float64)
    if h.ndim != 3 or h.shape[0] == 0:
        raise ValueError(f"expert_load must be windows x layers x experts, got shape {h.shape}")
    out = [tune_layer(h[:, l], gpus, nodes, slots, groups, config) for l in range(h.shape[1])]
    return np.stack([p for p, _ in out]), [info for _, info in out]


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
def gpu_loads(load_E, physical_to_logical_S, gpus: int) -> np.ndarray:
    """(G,) tokens each GPU computes when every expert's tokens split evenly over its replicas."""
    p2l = np.asarray(physical_to_logical_S, dtype=np.int64)
    load = np.asarray(load_E, dtype=np.float64)
    replicas = np.bincount(p2l, minlength=len(load))
    return (load[p2l] / replicas[p2l]).reshape(gpus, -1).sum(1)


def evaluate(load_LE, physical_to_logical_LS, gpus: int, nodes: int, groups: int | None = None) -> dict:
    """Judge a placement on one window of load.

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
        replicas = np.bincount(p2l[l], minlength=E)
        per_slot = load[l, p2l[l]] / replicas[p2l[l]]
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
