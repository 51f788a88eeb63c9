"""Expert placement: which logical expert each physical slot holds, its files, and the router's map.

Shape legend: L MoE layers, E logical experts, S physical slots, G GPUs, N nodes, W load windows,
T tokens, K top-k, M most replicas of any expert.

Slot s lives on GPU s // (S / G); GPU g belongs to node g // (G / N). Every logical expert holds at
least one slot; an expert with several slots has replicas with identical weights, so which replica
a token visits changes where it is computed, never what it computes.

Files (JSON objects; other tools read and write them, so keep the keys):
  placement: {"physical_to_logical": L lists of S logical ids, "gpus": G, "nodes": N,
              "num_logical_experts": E, "slots": S, ...any metadata}
  load:      {"expert_load": W windows (oldest first) of L lists of E token counts,
              "window_steps": steps per full window, "window_step_counts": W step counts (optional:
              a recording stopped between boundaries ends with a partial window), ...metadata}
Every check raises PlacementError naming the offending field and value.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:  # the CLI reads and writes placements without paying for torch's import
    import torch


class PlacementError(ValueError):
    """A placement or load that does not fit its format or the model; the message names the field."""


@dataclass
class Placement:
    physical_to_logical: list[list[int]]  # L x S logical expert ids
    gpus: int
    nodes: int
    num_logical_experts: int
    metadata: dict[str, Any] = field(default_factory=dict)  # extra keys, kept on save

    @property
    def num_layers(self) -> int:
        return len(self.physical_to_logical)

    @property
    def slots(self) -> int:
        return len(self.physical_to_logical[0]) if self.physical_to_logical else 0

    @property
    def slots_per_gpu(self) -> int:
        return self.slots // self.gpus

    @classmethod
    def identity(cls, num_layers: int, num_logical_experts: int, gpus: int = 1, nodes: int = 1) -> "Placement":
        """No replicas: slot e holds expert e (the checkpoint's order)."""
        rows = [list(range(num_logical_experts)) for _ in range(num_layers)]
        return cls(rows, gpus, nodes, num_logical_experts).validate()

    def validate(self, num_layers: int | None = None) -> "Placement":
        """Check shapes, divisibility and coverage; num_layers: the model's MoE layer count."""
        for name in ("gpus", "nodes", "num_logical_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise PlacementError(f"{name}={value!r} must be a positive integer")
        p2l = self.physical_to_logical
        if not isinstance(p2l, list) or not p2l or not all(isinstance(row, list) for row in p2l):
            raise PlacementError("physical_to_logical must be a non-empty list (one per MoE layer) of lists")
        if num_layers is not None and len(p2l) != num_layers:
            raise PlacementError(f"physical_to_logical has {len(p2l)} layers but the model has {num_layers} MoE layers")
        S, E = len(p2l[0]), self.num_logical_experts
        for l, row in enumerate(p2l):
            if len(row) != S:
                raise PlacementError(f"physical_to_logical[{l}] has {len(row)} slots but physical_to_logical[0] has {S}")
        if self.gpus % self.nodes:
            raise PlacementError(f"gpus={self.gpus} is not divisible by nodes={self.nodes}")
        if S % self.gpus:
            raise PlacementError(f"slots={S} (physical_to_logical row length) is not divisible by gpus={self.gpus}")
        for l, row in enumerate(p2l):
            bad = next((s for s, e in enumerate(row)
                        if isinstance(e, bool) or not isinstance(e, (int, np.integer)) or not 0 <= e < E), None)
            if bad is not None:
                raise PlacementError(f"physical_to_logical[{l}][{bad}]={row[bad]!r} is not a logical expert id "
                                     f"in [0, num_logical_experts={E})")
            missing = np.flatnonzero(np.bincount(np.asarray(row, dtype=np.int64), minlength=E) == 0)
            if len(missing):
                raise PlacementError(f"physical_to_logical[{l}] gives no slot to logical expert {int(missing[0])}"
                                     f" ({len(missing)} experts without a slot)")
        return self

    def replica_map(self, layer: int, device: "torch.device | str | None" = None) -> "ReplicaMap":
        return ReplicaMap(self.physical_to_logical[layer], self.num_logical_experts, device)

    def to_json(self) -> dict[str, Any]:
        return {**self.metadata, "physical_to_logical": self.physical_to_logical, "gpus": self.gpus,
                "nodes": self.nodes, "num_logical_experts": self.num_logical_experts, "slots": self.slots}

    @classmethod
    def from_json(cls, obj: Any, num_layers: int | None = None) -> "Placement":
        if not isinstance(obj, dict):
            raise PlacementError("a placement file must hold a JSON object")
        for key in ("physical_to_logical", "gpus", "nodes"):
            if key not in obj:
                raise PlacementError(f"the placement has no {key!r} field")
        p2l = obj["physical_to_logical"]
        if not isinstance(p2l, list) or not all(isinstance(r, list) for r in p2l):
            raise PlacementError("physical_to_logical must be a list (one per MoE layer) of lists of expert ids")
        # Files from elsewhere may leave the expert count out; every expert has a slot, so it is max + 1.
        E = obj.get("num_logical_experts")
        if E is None:
            E = 1 + max((e for row in p2l for e in row if isinstance(e, int)), default=-1)
        meta = {k: v for k, v in obj.items()
                if k not in ("physical_to_logical", "gpus", "nodes", "num_logical_experts", "slots")}
        placement = cls(p2l, obj["gpus"], obj["nodes"], E, meta).validate(num_layers)
        if "slots" in obj and obj["slots"] != placement.slots:
            raise PlacementError(f"slots={obj['slots']!r} but physical_to_logical rows have {placement.slots} slots")
        return placement


# ------------------------------------------------------------------------------------------ files
def _read_json(path: str | Path, what: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise PlacementError(f"{what} file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise PlacementError(f"{what} file {str(path)!r} is not valid JSON ({e.msg} at line {e.lineno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PlacementError(f"{what} file {str(path)!r} cannot be read ({e})") from None


def load_placement(path: str | Path, num_layers: int | None = None) -> Placement:
    """Read and validate a placement file; num_layers: the model's MoE layer count, if known."""
    return Placement.from_json(_read_json(path, "placement"), num_layers)


def save_placement(placement: Placement, path: str | Path) -> None:
    placement.validate()
    Path(path).write_text(json.dumps(placement.to_json()) + "\n")


def check_expert_load(obj: Any, num_layers: int | None = None,
                      num_logical_experts: int | None = None) -> np.ndarray:
    """Validate a load object; returns expert_load_WLE (int64)."""
    if not isinstance(obj, dict) or "expert_load" not in obj:
        raise PlacementError("the load has no 'expert_load' field (a JSON object is expected)")
    windows = obj["expert_load"]
    if not isinstance(windows, list) or not windows:
        raise PlacementError("expert_load must be a non-empty list of windows")
    L = num_layers if num_layers is not None else (len(windows[0]) if isinstance(windows[0], list) else -1)
    try:  # fast path; the loops below only run to name what is wrong
        arr = np.asarray(windows)
        if (arr.ndim == 3 and arr.dtype.kind in "iu" and arr.shape[1] == L and arr.shape[2] > 0
                and arr.shape[2] == (num_logical_experts or arr.shape[2]) and arr.min() >= 0):
            return arr.astype(np.int64)
    except (ValueError, OverflowError):  # ragged or absurd values
        pass
    for w, window in enumerate(windows):
        if not isinstance(window, list) or len(window) != L:
            got = len(window) if isinstance(window, list) else type(window).__name__
            raise PlacementError(f"expert_load[{w}] has {got} layers, expected {L}"
                                 + (" (the model's MoE layer count)" if num_layers is not None else ""))
    E = num_logical_experts
    if E is None:
        E = len(windows[0][0]) if L > 0 and isinstance(windows[0][0], list) else -1
    for w, window in enumerate(windows):
        for l, row in enumerate(window):
            if not isinstance(row, list) or len(row) != E:
                got = len(row) if isinstance(row, list) else type(row).__name__
                raise PlacementError(f"expert_load[{w}][{l}] has {got} experts, expected {E}")
            bad = next((e for e, c in enumerate(row)
                        if isinstance(c, bool) or not isinstance(c, int) or c < 0), None)
            if bad is not None:
                raise PlacementError(f"expert_load[{w}][{l}][{bad}]={row[bad]!r} is not a token count "
                                     "(a non-negative integer)")
    if L <= 0 or E <= 0:
        raise PlacementError(f"expert_load needs at least one layer and one expert, got {L} x {E}")
    return np.asarray(windows, dtype=np.int64)


def load_expert_load(path: str | Path, num_layers: int | None = None,
                     num_logical_experts: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """Read a load file. Returns expert_load_WLE (int64, oldest window first) and its metadata."""
    obj = _read_json(path, "load")
    load = check_expert_load(obj, num_layers, num_logical_experts)
    meta = {k: v for k, v in obj.items() if k != "expert_load"}
    window_weights(meta, len(load))  # checks window_step_counts
    return load, meta


def window_weights(metadata: dict[str, Any], num_windows: int) -> np.ndarray | None:
    """Each window's steps over a full window's, from a load file's window_step_counts and
    window_steps (None when the file has no step counts: every window full)."""
    counts = metadata.get("window_step_counts")
    if counts is None:
        return None
    full = metadata.get("window_steps")
    if isinstance(full, bool) or not isinstance(full, int) or full <= 0:
        raise PlacementError(f"window_steps={full!r} must be a positive integer when window_step_counts is given")
    if not isinstance(counts, list) or len(counts) != num_windows:
        got = len(counts) if isinstance(counts, list) else type(counts).__name__
        raise PlacementError(f"window_step_counts has {got} entries, expected one per window ({num_windows})")
    bad = next((i for i, c in enumerate(counts)
                if isinstance(c, bool) or not isinstance(c, int) or not 0 < c <= full), None)
    if bad is not None:
        raise PlacementError(f"window_step_counts[{bad}]={counts[bad]!r} must be a step count in 1..{full} "
                             "(window_steps)")
    return np.asarray(counts, dtype=np.float64) / full


def save_expert_load(path: str | Path, expert_load_WLE, metadata: dict[str, Any] | None = None) -> None:
    windows = np.asarray(expert_load_WLE, dtype=np.int64).tolist()
    obj = {**(metadata or {}), "expert_load": windows}
    check_expert_load(obj)
    Path(path).write_text(json.dumps(obj) + "\n")


# -------------------------------------------------------------------------------- router's map
# Jacobi rounds of the balanced split: each round every replicated expert water-fills its tokens
# over its replicas' GPUs against the others' current shares (halfway, so that experts sharing GPUs
# do not all pour into the same one), and each batch keeps its best round. On the held-out traces
# (evaluation.HELD_OUT_CASES) 4 rounds give about 0.005 less balancedness than 8, at half the ops.
SPLIT_ROUNDS = 4
SPLITS = ("balanced", "round_robin")
# Batches with fewer (token, k) copies than this (a small decode step) are split round robin: the
# experts' cost there is reading their weights, which the split does not change, while the
# balanced split's ~100 small ops cost about 1.2 ms per MoE layer on a CPU core.
BALANCED_MIN_COPIES = 1024


class ReplicaMap:
    """Logical top-k expert ids -> physical slot ids for one MoE layer, on the router's device.

    How an expert's tokens in the batch are shared among its replicas (split):
      round_robin  the n-th occurrence of that expert in the batch (token-major order: token 0's
                   k = 0..K-1, then token 1's, ...) takes replica (n + offset) % replicas: each
                   replica gets floor or ceil of its expert's tokens.
      balanced     (needs slots_per_gpu; batches of at least min_copies (token, k) copies, padding
                   included, others round robin) shares chosen from this batch's own counts so that the
                   batch's tokens per GPU are as even as the replicas allow: every replicated expert
                   water-fills its tokens over its replicas' GPUs against the load the rest of the
                   batch puts there (SPLIT_ROUNDS Jacobi rounds, never worse than even shares), the
                   shares rounded cumulatively to whole tokens (replicas taken from the offset-th on,
                   so equal shares round differently on each rank), then the n-th occurrence takes
                   the replica whose cumulative quota first exceeds n. Replicas hold the same
                   weights, so this changes where a token is computed, never what.
    Either way the result depends only on the batch and offset (deterministic) and is computed with
    sorts, gathers and small per-expert tensors: no per-token Python. (A formula of (t, k) alone,
    such as (t * K + k) % replicas, can send every token to one replica, e.g. an expert always
    picked at k = 0 with K = 2 replicas.) slot_counts gives the same per-slot counts for many
    batches at once; the placement's evaluation (evaluation.py) judges placements with it.
    """

    def __init__(self, physical_to_logical_S: "Sequence[int] | torch.Tensor | None", num_logical_experts: int,
                 device: "torch.device | str | None" = None, offset: int = 0, split: str = "round_robin",
                 slots_per_gpu: int | None = None, min_copies: int = BALANCED_MIN_COPIES):
        """
        Args:
            physical_to_logical_S: (S,) logical id of each slot; None for the identity (slot e = expert e).
            device: where the tables live (default: moved to the ids' device on the first call).
            offset: the default offset of __call__; give each data-parallel rank its own (its rank).
            split: "round_robin" or "balanced" (see the class); balanced with one GPU (or without
                slots_per_gpu) is round_robin: there is nothing to balance.
            slots_per_gpu: slots per GPU (EP rank): slot s lives on GPU s // slots_per_gpu.
            min_copies: the smallest batch (T * K) split balanced; smaller ones go round robin.
        """
        import torch

        if split not in SPLITS:
            raise PlacementError(f"replica split={split!r} must be one of {list(SPLITS)}")
        self.num_logical_experts = E = num_logical_experts
        self.offset, self.min_copies = offset, min_copies
        self.is_identity = physical_to_logical_S is None
        if self.is_identity:
            self.num_slots = E
            return
        # Built on the CPU whatever the default device (models are built under `with torch.device`).
        p2l = torch.as_tensor(physical_to_logical_S, dtype=torch.int64, device="cpu")
        if p2l.ndim != 1 or ((p2l < 0) | (p2l >= E)).any():
            raise PlacementError(f"physical_to_logical must be one layer's slots with ids in [0, {E})")
        counts_E = torch.bincount(p2l, minlength=E)
        if (counts_E == 0).any():
            raise PlacementError(f"physical_to_logical gives no slot to logical expert "
                                 f"{int((counts_E == 0).nonzero()[0])}")
        # table_EM[e, i] = slot of e's i-th replica (slots ascending); padding is never read.
        order = torch.sort(p2l, stable=True).indices
        first = torch.cumsum(counts_E, 0) - counts_E
        rank = torch.arange(len(p2l), device="cpu") - first[p2l[order]]
        table_EM = torch.zeros(E, int(counts_E.max()), dtype=torch.int64, device="cpu")
        table_EM[p2l[order], rank] = order
        self.num_slots = S = len(p2l)
        self.counts_E, self.table_EM = counts_E, table_EM
        if slots_per_gpu is not None and (slots_per_gpu <= 0 or S % slots_per_gpu):
            raise PlacementError(f"slots_per_gpu={slots_per_gpu} does not divide the {S} slots")
        self.balanced = split == "balanced" and slots_per_gpu is not None and slots_per_gpu < S \
            and bool((counts_E > 1).any())
        self.valid_EM = torch.arange(table_EM.shape[1], device="cpu")[None, :] < counts_E[:, None]  # real replicas
        if self.balanced:
            self.num_gpus = S // slots_per_gpu
            self.gpu_EM = table_EM // slots_per_gpu
            self.single_E = (counts_E == 1).to(torch.float32)
            self.multi_idx = torch.nonzero(counts_E > 1).flatten()
        if device is not None:
            self.to(device)

    @classmethod
    def identity(cls, num_logical_experts: int) -> "ReplicaMap":
        return cls(None, num_logical_experts)

    def to(self, device: "torch.device | str") -> "ReplicaMap":
        """Move the tables (a call also moves them to its ids' device the first time)."""
        if not self.is_identity:
            self.counts_E, self.table_EM = self.counts_E.to(device), self.table_EM.to(device)
            self.valid_EM = self.valid_EM.to(device)
            if self.balanced:
                self.gpu_EM, self.single_E = self.gpu_EM.to(device), self.single_E.to(device)
                self.multi_idx = self.multi_idx.to(device)
        return self

    def _shares(self, c_BE: "torch.Tensor") -> "torch.Tensor":
        """(B, E) token counts -> (B, Em, M) float32 tokens per replica of the Em replicated experts
        (multi_idx; the balanced split, before rounding); padding columns (i >= replicas) are 0."""
        import torch

        B, M, G = c_BE.shape[0], self.table_EM.shape[1], self.num_gpus
        c_all = c_BE.to(torch.float32)
        # Experts with one replica put all their tokens on its GPU: a fixed base. Only the
        # replicated ones (at most slots - experts of them) are iterated on.
        base = torch.zeros(B, G, device=c_all.device).index_add_(1, self.gpu_EM[:, 0], c_all * self.single_E)
        gpu_m, valid = self.gpu_EM[self.multi_idx], self.valid_EM[self.multi_idx]  # (Em, M)
        c = c_all[:, self.multi_idx, None]  # (B, Em, 1)
        gpu = gpu_m.reshape(-1)

        def gpu_load(y):  # (B, G)
            return base.index_add(1, gpu, y.reshape(B, -1))

        x = best = c / self.counts_E[self.multi_idx, None] * valid  # even shares, (B, Em, M)
        load = gpu_load(x)
        best_max = load.amax(1)
        k = torch.arange(1, M + 1, device=c.device, dtype=torch.float32)
        for _ in range(SPLIT_ROUNDS):
            other = load[:, gpu_m] - x  # what the rest of the batch puts on each replica's GPU
            low, _ = torch.sort(other.masked_fill(~valid, float("inf")), dim=2)
            # Water level: the replicas' GPUs below it are filled up to it with the expert's c tokens.
            # With the k lowest filled, the level is (c + their sum) / k; the right k is the largest
            # whose k-th lowest lies below its level (a prefix of the sorted replicas).
            level = (c + torch.cumsum(low.masked_fill(~valid, 0.0), 2)) / k
            n = ((low <= level) & valid).sum(2, keepdim=True).clamp(min=1)
            fill = (level.gather(2, n - 1) - other).clamp(min=0.0) * valid
            x = 0.5 * (x + fill)
            load = gpu_load(x)
            # Rounds need not improve monotonically (experts sharing GPUs): keep each batch's best.
            m = load.amax(1)
            best = torch.where((m < best_max)[:, None, None], x, best)
            best_max = torch.minimum(m, best_max)
        return best

    def _quotas(self, c_BE: "torch.Tensor", offset_B: "torch.Tensor") -> "torch.Tensor":
        """(B, Em, M) int64 cumulative whole-token quotas of the replicated experts over their
        replicas taken from the offset-th on (column j is replica (j + offset) % replicas): the
        n-th occurrence of an expert takes the first column whose quota exceeds n. The last
        column is the count."""
        import torch

        M = self.table_EM.shape[1]
        x = self._shares(c_BE)
        j = torch.arange(M, device=x.device)
        r = self.counts_E[self.multi_idx][None, :, None]
        rot = torch.where(self.valid_EM[self.multi_idx][None], (j + offset_B[:, None, None]) % r, j)
        return torch.floor(torch.cumsum(x.gather(2, rot), 2) + 0.5).to(torch.int64)

    def slot_counts(self, c_BE, offset_B=None) -> "torch.Tensor":
        """(B, S) int64 tokens each slot gets for B batches of (B, E) per-expert counts, exactly as
        __call__ assigns them to batches without padding (offset_B: each batch's offset, default
        self.offset)."""
        import torch

        c = torch.as_tensor(c_BE, dtype=torch.int64, device=self.counts_E.device)
        B, E = c.shape
        off = torch.full((B,), self.offset, dtype=torch.int64, device=c.device) if offset_B is None \
            else torch.as_tensor(offset_B, dtype=torch.int64, device=c.device)
        out = torch.zeros(B, self.num_slots, dtype=torch.int64, device=c.device)
        idx = torch.nonzero(self.counts_E > 1).flatten()
        single = self.counts_E == 1
        out[:, self.table_EM[single, 0]] = c[:, single]
        M = self.table_EM.shape[1]
        j = torch.arange(M, device=c.device)
        r = self.counts_E[idx][None, :, None]
        # Round robin: column j (from the offset-th replica on) gets ceil((c - j) / r) tokens.
        per_col = torch.where(j < r, (c[:, idx, None] - j + r - 1) // r, 0)
        if self.balanced:
            q = self._quotas(c, off)
            big = (c.sum(1) >= self.min_copies)[:, None, None]
            per_col = torch.where(big, torch.diff(q, dim=2, prepend=torch.zeros_like(q[:, :, :1])), per_col)
        rot = (j + off[:, None, None]) % r  # column j -> replica (j + offset) % r
        slot = self.table_EM[idx][None].expand(B, -1, M).gather(2, rot)
        valid = self.valid_EM[idx][None].expand(B, -1, M)
        return out.scatter_add_(1, slot[valid].reshape(B, -1), per_col[valid].reshape(B, -1))

    def __call__(self, topk_ids_TK: "torch.Tensor", offset: int | None = None) -> "torch.Tensor":
        """Slots for logical ids.

        Args:
            topk_ids_TK: (T, K) integer logical expert ids; negative ids (padding) pass unchanged.
            offset: rotates every expert's first replica (default: the one given at construction).
                It should differ between data-parallel ranks (use the rank): each rank maps its
                own batch, and with small decode batches one offset everywhere would send most
                tokens to every expert's first replica.
        Returns:
            (T, K) slot ids, same dtype and device as topk_ids_TK (the input itself for the identity).
        """
        import torch

        if self.is_identity:
            return topk_ids_TK
        E = self.num_logical_experts
        if self.table_EM.device != topk_ids_TK.device:
            self.to(topk_ids_TK.device)
        flat = topk_ids_TK.reshape(-1).to(torch.int64)
        e = torch.where(flat >= 0, flat, E)  # padding sorts into its own bucket E, after the experts
        order = torch.sort(e, stable=True).indices  # stable: ties keep token-major order
        # index_add_ rather than bincount: bincount on CUDA reads the max back to the host.
        counts = torch.zeros(E + 1, dtype=torch.int64, device=e.device).index_add_(0, e, torch.ones_like(e))
        first = torch.cumsum(counts, 0) - counts
        nth = torch.empty_like(e)
        nth[order] = torch.arange(e.numel(), device=e.device) - first[e[order]]
        e = e.clamp(max=E - 1)  # padding rows gather something harmless and are put back below
        off = self.offset if offset is None else offset
        if self.balanced and flat.numel() >= self.min_copies:
            q = counts[:E, None].repeat(1, self.table_EM.shape[1])  # one replica: always column 0
            q[self.multi_idx] = self._quotas(counts[None, :E], torch.full((1,), off, dtype=torch.int64,
                                                                          device=e.device))[0]
            nth = (nth[:, None] >= q[e]).sum(1)  # the column (replica from the offset-th on) it falls in
        slots = self.table_EM[e, (nth + off) % self.counts_E[e]]
        return torch.where(flat >= 0, slots, flat).reshape(topk_ids_TK.shape).to(topk_ids_TK.dtype)
