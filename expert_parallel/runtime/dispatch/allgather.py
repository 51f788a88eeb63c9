"""Dispatch by all-gather, combine by reduce-scatter: cheap at small (decode-sized) batches.

Shape legend: T tokens on this rank, K top-k, D hidden size, W EP world size, M the largest T over the
group, G = W * M gathered rows, R rows kept on this rank, B bytes of one packed row.

Every rank pads its tokens to M rows (M agreed with one small all_reduce MAX), packs them with their
global slot ids and weights into uint8 rows, and all-gathers. Each rank keeps the gathered rows with
at least one slot it holds, so its grouped GEMM sees exactly the tokens routed here. combine scatters
the partial sums back into the (G, D) gathered layout (zeros elsewhere) and reduce-scatters, so rank
r receives the sum over ranks of rows [r*M, (r+1)*M) and keeps the first T.

Compared with all_to_all this sends every token to every rank (W-1 copies instead of at most
min(K, W-1)) and needs no per-rank counts exchange; with tiny T the fixed latency of the collectives,
not bytes, is the cost. Host syncs: the agreed M (.item()) and the kept-row selection (nonzero).

A padded decode step (`MoEStep.static_rows`: every rank runs the same M rows, agreed before the step)
skips both: M is known, and every gathered row is kept (rows with no slot here carry only -1 ids, so
the grouped GEMM skips them), and combine reduce-scatters the partial sums as they are. No host read,
no data-dependent shape: the exchange a CUDA graph captures, for this backend and for all_to_all.

reduce-scatter: torch >= 2.13 gloo implements it, older gloo builds raise "not supported". The first
combine tries it and, if the backend refuses before any data moves (identical on every rank, since it
is a property of the backend), falls back to all_reduce + slice for the rest of the process.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from expert_parallel.runtime.dispatch.base import Dispatcher, DispatchOutput, pack_rows, unpack_rows
from expert_parallel.runtime.step import NO_STEP, MoEStep


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    # torch 2.13 renamed the tensor forms (the old names warn); looked up per call so wrappers
    # installed on torch.distributed (the byte counter in bench/dispatch.py) see the call.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


@dataclass
class AllGatherHandle:
    """What combine needs.

    kept_R: (R,) int64 indices of this rank's kept rows in the gathered (G, D) layout; None when
        every gathered row was kept (a fixed-shape step).
    rows_per_rank: M, the padded per-rank row count every rank used.
    num_tokens: T on this rank.
    """

    kept_R: torch.Tensor | None
    rows_per_rank: int
    num_tokens: int


class AllGatherDispatcher(Dispatcher):
    """All-gather dispatch, reduce-scatter combine.

    Args (constructor):
        num_slots: physical expert slots in the EP group; must be divisible by world_size.
        rank: this rank's index in `group`.
        world_size: W, the size of `group`.
        group: the torch.distributed process group of the EP ranks (None = the default group).
    """

    name = "allgather"
    has_fixed_shape_exchange = True

    def __init__(self, num_slots: int, rank: int = 0, world_size: int = 1, group=None):
        super().__init__(num_slots, rank, world_size, group)
        self._reduce_scatter_ok: bool | None = None  # None until the first combine finds out

    def dispatch(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                 step: MoEStep = NO_STEP) -> DispatchOutput:
        """Gather every rank's tokens and keep those routed to a slot held here.

        Args:
            x_TD: (T, D) tokens, any float dtype; T may be 0.
            topk_ids_TK: (T, K) int global slot ids in [0, num_slots); -1 entries are ignored.
            topk_weights_TK: (T, K) routing weights, any float dtype.
        Returns:
            DispatchOutput with x_RD (R, D) in x's dtype, topk_ids_RK (R, K) int64 local ids or -1,
            topk_weights_RK (R, K) float32, and an AllGatherHandle. Rows are ordered by source rank,
            then by the source's token order.
        """
        T, D = x_TD.shape
        K = topk_ids_TK.shape[1]
        W, dev = self.world_size, x_TD.device

        static = self.is_static(T, step)
        if static:
            M = T
        else:
            max_T = torch.tensor([T], dtype=torch.int64, device=dev)
            dist.all_reduce(max_T, op=dist.ReduceOp.MAX, group=self.group)
            M = int(max_T.item())

        rows_TB = pack_rows(x_TD, topk_ids_TK, topk_weights_TK)
        # Padding rows carry id -1 everywhere, so no rank keeps them. pack_rows stores ids as int32,
        # so -1 is the byte pattern 0xff in each of the 4 id bytes.
        padded_MB = torch.zeros(M, rows_TB.shape[1], dtype=torch.uint8, device=dev)
        x_bytes = rows_TB.shape[1] - 8 * K
        padded_MB[:, x_bytes:x_bytes + 4 * K] = 0xFF
        padded_MB[:T] = rows_TB
        gathered_GB = padded_MB.new_empty((W * M, padded_MB.shape[1]))
        _all_gather_single(gathered_GB, padded_MB, group=self.group)

        x_GD, ids_GK, weights_GK = unpack_rows(gathered_GB, D, K, x_TD.dtype)
        local_GK = self.to_local_ids(ids_GK)
        if static:
            return DispatchOutput(x_GD, local_GK, weights_GK, AllGatherHandle(None, M, T))
        kept_R = torch.nonzero((local_GK >= 0).any(dim=1), as_tuple=True)[0]
        handle = AllGatherHandle(kept_R, M, T)
        return DispatchOutput(x_GD[kept_R], local_GK[kept_R], weights_GK[kept_R], handle)

    def combine(self, y_RD: torch.Tensor, handle: AllGatherHandle) -> torch.Tensor:
        """Reduce partial sums over ranks and return this rank's tokens.

        Args:
            y_RD: (R, D) each kept row's weighted sum over this rank's experts, in dispatch's order.
            handle: the AllGatherHandle from the matching dispatch.
        Returns:
            (T, D) in y's dtype: for each original token, the sum over ranks of their partial sums.
        """
        W, M, D = self.world_size, handle.rows_per_rank, y_RD.shape[1]
        # Reduce in float32 where y is narrower: W bf16 additions would round after each one.
        if handle.kept_R is None:  # every gathered row was kept: y is already in the gathered layout
            full_GD = y_RD.to(torch.float32).contiguous()
        else:
            full_GD = torch.zeros(W * M, D, dtype=torch.float32, device=y_RD.device)
            full_GD[handle.kept_R] = y_RD.to(torch.float32)
        mine_MD = full_GD.new_empty((M, D))
        if self._reduce_scatter_ok is not False:
            try:
                _reduce_scatter_single(mine_MD, full_GD, group=self.group)
                self._reduce_scatter_ok = True
            except (RuntimeError, NotImplementedError):
                if self._reduce_scatter_ok:  # it worked before: this is a real failure
                    raise
                self._reduce_scatter_ok = False
        if self._reduce_scatter_ok is False:
            dist.all_reduce(full_GD, group=self.group)
            mine_MD = full_GD[self.rank * M:(self.rank + 1) * M]
        return mine_MD[:handle.num_tokens].to(y_RD.dtype)
