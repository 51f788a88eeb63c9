"""Replica counts and bin packing for expert placement (pure, deterministic numpy).

Shape legend: E logical experts, S physical slots, G GPUs, N nodes, K expert groups, R items being
packed (replicas, or groups onto nodes).

A replica of an expert with r replicas carries 1/r of its tokens (the even split; see tuner.py), so its
forecast mean scales by 1/r and its variance by 1/r^2. A bin (GPU or node) is scored by the sum of
its items' means plus hedge * the square root of the sum of their variances: the upper quantile of
its next-window load when the forecast errs independently per expert.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# A swap must lower the worst GPU by this fraction: smaller gains are below the forecast's precision
# and only cost refinement steps.
_MIN_GAIN = 1e-4


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
