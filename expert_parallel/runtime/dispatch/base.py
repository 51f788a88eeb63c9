"""The dispatch/combine interface every communication backend implements.

Shape legend: T tokens on this rank, R tokens received by this rank, K top-k, D hidden size.

Experts live in *physical slots*: slot s is held by rank s // slots_per_rank and is local expert
s % slots_per_rank there. With no placement file, slots are the logical experts themselves.

dispatch(x_TD, topk_ids_TK, topk_weights_TK) sends every token to each rank that holds at least one
of its top-k slots (a token goes at most once to a rank) and returns what this rank received:
    x_RD              the received tokens,
    topk_ids_RK       each received token's slots as *local* expert ids, or -1 for slots held elsewhere,
    topk_weights_RK   the matching routing weights (float32),
    handle            whatever combine needs to send the results home.
The grouped GEMM on (x_RD, topk_ids_RK, topk_weights_RK) yields y_RD, each row the weighted sum of its
local experts' outputs. combine(y_RD, handle) returns y_TD: for every original token, the sum over ranks
of those partial sums, in the original order. Every rank calls dispatch and combine for every MoE layer
of every step, with T = 0 where it has no tokens (lockstep).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from expert_parallel.runtime.step import NO_STEP, MoEStep


@dataclass
class DispatchOutput:
    """expert_major: (x_ECD, count_E) when the backend received an expert-major layout (DeepEP's
    low-latency mode: count_E[e] valid rows of x_ECD[e] for local expert e, x_RD its (E*C, D) view);
    the MoE layer then runs the masked grouped GEMM on it (moe_serve/kernels/grouped_gemm/masked.py) and
    returns y_RD in the same layout, unweighted. None for every other backend."""
    x_RD: torch.Tensor
    topk_ids_RK: torch.Tensor
    topk_weights_RK: torch.Tensor
    handle: Any
    expert_major: tuple[torch.Tensor, torch.Tensor] | None = None


def pack_rows(x_ND: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
    """(N, D) any dtype, (N, K) int ids, (N, K) weights -> (N, B) uint8 rows, B = D*elt + 8K."""
    parts = [x_ND.contiguous().view(torch.uint8),
             ids_NK.to(torch.int32).contiguous().view(torch.uint8),
             weights_NK.to(torch.float32).contiguous().view(torch.uint8)]
    return torch.cat(parts, dim=1)


def unpack_rows(rows_NB: torch.Tensor, D: int, K: int, dtype: torch.dtype):
    """Inverse of pack_rows: -> x (N, D) dtype, ids (N, K) int64, weights (N, K) float32."""
    x_bytes = D * torch.empty((), dtype=dtype).element_size()
    # Column slices are strided; .contiguous() gives each piece its own dense storage to view.
    x_ND = rows_NB[:, :x_bytes].contiguous().view(dtype)
    ids_NK = rows_NB[:, x_bytes:x_bytes + 4 * K].contiguous().view(torch.int32).to(torch.int64)
    weights_NK = rows_NB[:, x_bytes + 4 * K:].contiguous().view(torch.float32)
    return x_ND, ids_NK, weights_NK


class Pending:
    """A communication in flight. `wait()` blocks until it is done and returns its result (once;
    later calls return the same result). Between the start and `wait()` the caller computes
    something else: that is the overlap."""

    def __init__(self, finish: Callable[[], Any]):
        self._finish = finish
        self._done = False
        self._result = None

    def wait(self):
        if not self._done:
            self._result, self._done = self._finish(), True
            self._finish = None
        return self._result


def done(result) -> Pending:
    """An already finished communication (backends without asynchronous collectives)."""
    p = Pending(lambda: result)
    p.wait()
    return p


class Dispatcher(ABC):
    """One backend's dispatch and combine for an expert-parallel group."""

    name: str = "base"

    def __init__(self, num_slots: int, rank: int = 0, world_size: int = 1, group: Any = None):
        if num_slots % world_size != 0:
            raise ValueError(f"num_slots={num_slots} is not divisible by the EP world size {world_size}")
        self.num_slots = num_slots
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.slots_per_rank = num_slots // world_size

    def to_local_ids(self, topk_ids_TK: torch.Tensor) -> torch.Tensor:
        """Global slot ids -> local expert ids on this rank, -1 where the slot lives elsewhere."""
        lo = self.rank * self.slots_per_rank
        local = topk_ids_TK - lo
        held = (local >= 0) & (local < self.slots_per_rank)
        return torch.where(held, local, torch.full_like(local, -1))

    @abstractmethod
    def dispatch(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                 step: MoEStep = NO_STEP) -> DispatchOutput:
        """step: what this step's MoE layers know (runtime/step.py): a padded decode step's rows
        (`static_rows`), the agreed most tokens any rank runs."""

    @abstractmethod
    def combine(self, y_RD: torch.Tensor, handle: Any) -> torch.Tensor: ...

    # Asynchronous forms, used to overlap one micro-batch's communication with the other's compute.
    # Backends with asynchronous collectives override them; these defaults finish at once.
    def dispatch_async(self, x_TD, topk_ids_TK, topk_weights_TK, step: MoEStep = NO_STEP) -> Pending:
        """Start dispatch; `.wait()` gives the DispatchOutput."""
        return done(self.dispatch(x_TD, topk_ids_TK, topk_weights_TK, step))

    def combine_async(self, y_RD: torch.Tensor, handle: Any) -> Pending:
        """Start combine; `.wait()` gives y_TD."""
        return done(self.combine(y_RD, handle))

    has_fixed_shape_exchange = False  # backends with a fixed-shape form for padded decode steps

    def captures_decode(self) -> bool:
        """Whether a CUDA graph can hold this backend's padded decode step: one rank (nothing to
        exchange), or a fixed-shape exchange (`is_static`) over NCCL."""
        return self.world_size == 1 or (self.has_fixed_shape_exchange and dist.get_backend(self.group) == "nccl")

    def is_static(self, num_tokens: int, step: MoEStep) -> bool:
        """Whether a dispatch of num_tokens rows takes the fixed-shape exchange: a padded decode step
        (every rank of the EP group runs exactly step.static_rows rows in every MoE layer, agreed by
        the core loop's per-step all-reduce). Backends that size their exchange from the data
        (counts read back on the host, kept rows selected) switch for such a step to an exchange of
        fixed shapes, with no host read and no data-dependent shape: what a CUDA graph holds."""
        return self.world_size > 1 and step.static_rows is not None and num_tokens == step.static_rows

    def agree_max(self, n: int) -> int:
        """The largest n over the EP group (one small collective), so that every rank takes the same
        decisions that change the order of collectives (e.g. whether to split into micro-batches)."""
        if self.world_size == 1:
            return n
        on_gpu = dist.get_backend(self.group) == "nccl"
        t = torch.tensor([n], dtype=torch.int64, device="cuda" if on_gpu else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())
