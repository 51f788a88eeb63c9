"""Expert placement: which logical expert each physical slot holds, its files, and the router's map.

Shape legend: L MoE layers, E logical experts, S physical slots, G GPUs, N nodes, W load windows,
T tokens, K top-k, M most replicas of any expert.

Slot s lives on GPU s // (S / G); GPU g belongs to node g // (G / N). Every logical expert holds at
least one slot; an expert with several slots has replicas with identical weights, so which replica
a token visits changes where it is computed, never what it computes.

Files (JSON objects; other tools read and write them, so keep the keys):
  placement: {"physical_to_logical": L lists of S logical ids, "gpus": G, "nodes": N,
              "num_logical_experts": E, "slots": S, ...any metadata}
  load:      {"expert_load": W windows (oldest first) of L lists of E token counts, ...metadata}
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
    return load, {k: v for k, v in obj.items() if k != "expert_load"}


def save_expert_load(path: str | Path, expert_load_WLE, metadata: dict[str, Any] | None = None) -> None:
    windows = np.asarray(expert_load_WLE, dtype=np.int64).tolist()
    obj = {**(metadata or {}), "expert_load": windows}
    check_expert_load(obj)
    Path(path).write_text(json.dumps(obj) + "\n")


# -------------------------------------------------------------------------------- router's map
class ReplicaMap:
    """Logical top-k expert ids -> physical slot ids for one MoE layer, on the router's device.

    Among an expert's replicas, the n-th occurrence of that expert in the batch (token-major order:
    token 0's k = 0..K-1, then token 1's, ...) takes replica (n + offset) % replicas. So each
    replica gets floor or ceil of its expert's tokens, the result depends only on the batch and
    offset (deterministic), and it is computed with a sort and a gather: no per-token Python.
    (A formula of (t, k) alone, such as (t * K + k) % replicas, can send every token to one
    replica, e.g. an expert always picked at k = 0 with K = 2 replicas.)
    """

    def __init__(self, physical_to_logical_S: "Sequence[int] | torch.Tensor | None", num_logical_experts: int,
                 device: "torch.device | str | None" = None, offset: int = 0):
        """
        Args:
            physical_to_logical_S: (S,) logical id of each slot; None for the identity (slot e = expert e).
            device: where the tables live (default: moved to the ids' device on the first call).
            offset: the default offset of __call__; give each data-parallel rank its own (its rank).
        """
        import torch

        self.num_logical_experts = E = num_logical_experts
        self.offset = offset
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
        self.num_slots = len(p2l)
        self.counts_E, self.table_EM = counts_E, table_EM
        if device is not None:
            self.to(device)

    @classmethod
    def identity(cls, num_logical_experts: int) -> "ReplicaMap":
        return cls(None, num_logical_experts)

    def to(self, device: "torch.device | str") -> "ReplicaMap":
        """Move the tables (a call also moves them to its ids' device the first time)."""
        if not self.is_identity:
            self.counts_E, self.table_EM = self.counts_E.to(device), self.table_EM.to(device)
        return self

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
        slots = self.table_EM[e, (nth + (self.offset if offset is None else offset)) % self.counts_E[e]]
        return torch.where(flat >= 0, slots, flat).reshape(topk_ids_TK.shape).to(topk_ids_TK.dtype)
