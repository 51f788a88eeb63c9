"""Dispatch/combine with two uneven all-to-alls over torch.distributed (gloo on CPU, NCCL on CUDA).

Shape legend: T tokens on this rank, K top-k, D hidden size, W EP world size, S (token, rank) pairs this
rank sends, R tokens this rank receives, B bytes of one packed row.

dispatch, in three steps:
  1. layout: for every token, the set of ranks holding at least one of its slots (a token goes at most
     once to each such rank); the send buffer is rank-major, tokens in original order inside a rank;
  2. one small all_to_all_single of the int64 per-rank counts, so every rank knows what it receives;
  3. one all_to_all_single of packed rows [x bytes | local ids int32 | weights float32] with uneven
     splits. Packing into one uint8 row keeps the payload to one collective (one launch, one
     rendezvous) instead of three, which is what matters at decode-sized batches.
combine sends the partial sums back with the splits swapped and adds them into original order with
index_add_ in float32, so a token's sum over ranks does not round after each rank.

Host syncs: one .tolist() of the counts in dispatch (all_to_all_single takes the splits as Python
lists and the output size must be known); the send layout is built after it with nonzero_static, so
no second sync. combine has none. A padded decode step (`MoEStep.static_rows`: the same row count on
every rank) has neither: it takes the all-gather backend's fixed-shape exchange, which a CUDA graph
can capture (at decode sizes the all-gather is the cheaper exchange anyway).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from expert_parallel.runtime.dispatch.allgather import AllGatherDispatcher, AllGatherHandle
from expert_parallel.runtime.dispatch.base import Dispatcher, DispatchOutput, Pending, done, pack_rows, unpack_rows  # noqa: F401
from expert_parallel.runtime.step import NO_STEP, MoEStep


@dataclass
class AllToAllHandle:
    """What combine needs to send partial sums home.

    src_token_S: (S,) int64, the original token index of each sent row, rank-major.
    send_splits: rows sent to each rank (length W); combine receives this many back from each.
    recv_splits: rows received from each rank (length W); combine sends this many back to each.
    num_tokens: T, the number of tokens dispatch was called with.
    """

    src_token_S: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int


class AllToAllDispatcher(Dispatcher):
    """Uneven all-to-all dispatch/combine; each token crosses the wire once per destination rank.

    Args (constructor):
        num_slots: physical expert slots in the EP group; must be divisible by world_size.
        rank: this rank's index in `group`.
        world_size: W, the size of `group`.
        group: the torch.distributed process group of the EP ranks (None = the default group).
    """

    name = "all_to_all"
    has_fixed_shape_exchange = True

    def __init__(self, num_slots: int, rank: int = 0, world_size: int = 1, group=None):
        super().__init__(num_slots, rank, world_size, group)
        self._fixed = AllGatherDispatcher(num_slots, rank, world_size, group)  # padded decode steps

    def dispatch(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                 step: MoEStep = NO_STEP) -> DispatchOutput:
        return self.dispatch_async(x_TD, topk_ids_TK, topk_weights_TK, step).wait()

    def combine(self, y_RD: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
        return self.combine_async(y_RD, handle).wait()

    def dispatch_async(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                       step: MoEStep = NO_STEP) -> Pending:
        """Send each token once to every rank holding one of its slots. The count exchange is
        synchronous (the sizes are needed); the payload all-to-all runs in the background until
        `.wait()` (async_op: gloo's worker threads on CPU, NCCL's own stream on CUDA).

        Args:
            x_TD: (T, D) tokens, any float dtype; T may be 0.
            topk_ids_TK: (T, K) int global slot ids in [0, num_slots); -1 entries are ignored.
            topk_weights_TK: (T, K) routing weights, any float dtype.
        Returns:
            Pending whose wait() gives a DispatchOutput with x_RD (R, D) in x's dtype, topk_ids_RK
            (R, K) int64 local ids or -1, topk_weights_RK (R, K) float32, and an AllToAllHandle.
            Received rows are ordered by source rank, then by the source's token order.
        """
        T, D = x_TD.shape
        if self.is_static(T, step):
            return done(self._fixed.dispatch(x_TD, topk_ids_TK, topk_weights_TK, step))
        K = topk_ids_TK.shape[1]
        W, spr, dev = self.world_size, self.slots_per_rank, x_TD.device
        ids_TK = topk_ids_TK.to(torch.int64)

        # Destination ranks of every token; -1 ids map to rank -1 and match no rank.
        dest_TK = torch.where(ids_TK >= 0, ids_TK // spr, torch.full_like(ids_TK, -1))
        in_rank_TW = (dest_TK.unsqueeze(2) == torch.arange(W, device=dev)).any(dim=1)
        send_counts_W = in_rank_TW.sum(dim=0).to(torch.int64)
        recv_counts_W = torch.empty_like(send_counts_W)
        dist.all_to_all_single(recv_counts_W, send_counts_W, group=self.group)
        counts = torch.cat([send_counts_W, recv_counts_W]).tolist()  # the one host sync
        send_splits, recv_splits = counts[:W], counts[W:]

        # Nonzero on the (W, T) mask yields pairs sorted by rank, then token: the send layout. The
        # static form with the now-known size avoids the second host sync plain nonzero has on CUDA.
        pairs_S2 = torch.nonzero_static(in_rank_TW.t(), size=sum(send_splits))
        dest_S, src_token_S = pairs_S2[:, 0], pairs_S2[:, 1]
        # The receiving rank's local ids: slot - first slot of the destination, -1 where not held.
        local_SK = ids_TK[src_token_S] - (dest_S * spr).unsqueeze(1)
        held_SK = (local_SK >= 0) & (local_SK < spr)
        local_SK = torch.where(held_SK, local_SK, torch.full_like(local_SK, -1))
        send_rows_SB = pack_rows(x_TD[src_token_S], local_SK, topk_weights_TK[src_token_S])

        recv_rows_RB = send_rows_SB.new_empty((sum(recv_splits), send_rows_SB.shape[1]))
        work = dist.all_to_all_single(recv_rows_RB, send_rows_SB, output_split_sizes=recv_splits,
                                      input_split_sizes=send_splits, group=self.group, async_op=True)
        handle = AllToAllHandle(src_token_S, send_splits, recv_splits, T)

        def finish() -> DispatchOutput:
            work.wait()
            x_RD, ids_RK, weights_RK = unpack_rows(recv_rows_RB, D, K, x_TD.dtype)
            return DispatchOutput(x_RD, ids_RK, weights_RK, handle)

        return Pending(finish)

    def combine_async(self, y_RD: torch.Tensor, handle: AllToAllHandle) -> Pending:
        """Send partial sums home; `.wait()` adds them up in original token order.

        Args:
            y_RD: (R, D) each received token's weighted sum over this rank's experts, rows in the order
                dispatch returned them.
            handle: the AllToAllHandle from the matching dispatch.
        Returns:
            Pending whose wait() gives (T, D) in y's dtype: for each original token, the sum over
            ranks of their partial sums.
        """
        if isinstance(handle, AllGatherHandle):  # a padded decode step's fixed-shape exchange
            return done(self._fixed.combine(y_RD, handle))
        D = y_RD.shape[1]
        back_SD = y_RD.new_empty((sum(handle.send_splits), D))
        work = dist.all_to_all_single(back_SD, y_RD.contiguous(), output_split_sizes=handle.send_splits,
                                      input_split_sizes=handle.recv_splits, group=self.group, async_op=True)

        def finish() -> torch.Tensor:
            work.wait()
            out_TD = torch.zeros(handle.num_tokens, D, dtype=torch.float32, device=y_RD.device)
            out_TD.index_add_(0, handle.src_token_S, back_SD.to(torch.float32))
            return out_TD.to(y_RD.dtype)

        return Pending(finish)
