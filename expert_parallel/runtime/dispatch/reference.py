"""Slow but obvious dispatch/combine: every rank sees everything, then picks what it needs.

Shape legend: T tokens on this rank, K top-k, D hidden size, W EP world size, M the largest T over the
group, R rows received by this rank.

This exists to test the fast backends against. It favours being plainly correct over being cheap:
  dispatch: all_gather every rank's token count, then all_gather every rank's (padded) tokens, global
      slot ids and weights as separate tensors; loop over source ranks and keep, in the source's token
      order, each token with at least one slot this rank holds.
  combine: put this rank's partial sums back at (source rank, token) positions of a zero (W, M, D)
      tensor, all_gather that tensor from every rank, and sum over ranks the slice for this rank.
Only list-form all_gather and plain tensors are used, which every backend supports.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from expert_parallel.runtime.dispatch.base import Dispatcher, DispatchOutput
from expert_parallel.runtime.step import NO_STEP, MoEStep


@dataclass
class ReferenceHandle:
    """kept_per_src: for each source rank, (n_s,) int64 indices of its tokens this rank received, in
    the order they appear in x_RD. rows_per_rank: M. num_tokens: T on this rank."""

    kept_per_src: list[torch.Tensor]
    rows_per_rank: int
    num_tokens: int


def _all_gather_list(t: torch.Tensor, world_size: int, group) -> list[torch.Tensor]:
    """Every rank's `t` (same shape and dtype on all ranks), indexed by rank."""
    if world_size == 1:  # make_dispatcher allows "reference" at EP=1, with no process group
        return [t]
    out = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


class ReferenceDispatcher(Dispatcher):
    """Reference dispatch/combine for tests; same contract as every other backend.

    Args (constructor):
        num_slots: physical expert slots in the EP group; must be divisible by world_size.
        rank: this rank's index in `group`.
        world_size: W, the size of `group`.
        group: the torch.distributed process group of the EP ranks (None = the default group).
    """

    name = "reference"

    def dispatch(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                 step: MoEStep = NO_STEP) -> DispatchOutput:
        """Args: x_TD (T, D) any float dtype; topk_ids_TK (T, K) int global slot ids; topk_weights_TK
        (T, K) float. Returns x_RD (R, D), topk_ids_RK (R, K) int64 local ids or -1, topk_weights_RK
        (R, K) float32; rows ordered by source rank, then by the source's token order."""
        T, D = x_TD.shape
        K = topk_ids_TK.shape[1]
        W, dev = self.world_size, x_TD.device

        counts = _all_gather_list(torch.tensor([T], dtype=torch.int64, device=dev), W, self.group)
        counts = [int(c.item()) for c in counts]
        M = max(counts)

        def padded(t: torch.Tensor, fill) -> torch.Tensor:
            out = torch.full((M,) + tuple(t.shape[1:]), fill, dtype=t.dtype, device=dev)
            out[:T] = t
            return out

        all_x = _all_gather_list(padded(x_TD, 0), W, self.group)
        all_ids = _all_gather_list(padded(topk_ids_TK.to(torch.int64), -1), W, self.group)
        all_w = _all_gather_list(padded(topk_weights_TK.to(torch.float32), 0.0), W, self.group)

        xs, ids, ws, kept_per_src = [], [], [], []
        for src in range(W):
            n = counts[src]
            local_nK = self.to_local_ids(all_ids[src][:n])
            kept = torch.nonzero((local_nK >= 0).any(dim=1), as_tuple=True)[0]
            xs.append(all_x[src][:n][kept])
            ids.append(local_nK[kept])
            ws.append(all_w[src][:n][kept])
            kept_per_src.append(kept)
        x_RD = torch.cat(xs) if xs else x_TD.new_empty((0, D))
        ids_RK = torch.cat(ids) if ids else torch.empty((0, K), dtype=torch.int64, device=dev)
        w_RK = torch.cat(ws) if ws else torch.empty((0, K), dtype=torch.float32, device=dev)
        return DispatchOutput(x_RD, ids_RK, w_RK, ReferenceHandle(kept_per_src, M, T))

    def combine(self, y_RD: torch.Tensor, handle: ReferenceHandle) -> torch.Tensor:
        """Args: y_RD (R, D) partial sums in dispatch's row order. Returns (T, D) in y's dtype."""
        W, M, D = self.world_size, handle.rows_per_rank, y_RD.shape[1]
        # partial_WMD[src, t] = this rank's partial sum for token t of rank src (zero if not received).
        partial_WMD = torch.zeros(W, M, D, dtype=torch.float32, device=y_RD.device)
        start = 0
        for src, kept in enumerate(handle.kept_per_src):
            n = kept.numel()
            partial_WMD[src, kept] = y_RD[start:start + n].to(torch.float32)
            start += n
        from_every_rank = _all_gather_list(partial_WMD, W, self.group)
        out_MD = torch.stack([p[self.rank] for p in from_every_rank]).sum(dim=0)
        return out_MD[:handle.num_tokens].to(y_RD.dtype)
