"""EP=1: every expert is local, so dispatch and combine move nothing."""
from __future__ import annotations

import torch

from expert_parallel.runtime.dispatch.base import Dispatcher, DispatchOutput
from expert_parallel.runtime.step import NO_STEP, MoEStep


class LocalDispatcher(Dispatcher):
    name = "local"

    def __init__(self, num_slots: int, rank: int = 0, world_size: int = 1, group=None):
        if world_size != 1:
            raise ValueError(f"the local dispatcher serves an EP world of 1, not {world_size}")
        super().__init__(num_slots, 0, 1, None)

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK, step: MoEStep = NO_STEP) -> DispatchOutput:
        w = topk_weights_TK if topk_weights_TK.dtype == torch.float32 else topk_weights_TK.to(torch.float32)
        return DispatchOutput(x_TD, topk_ids_TK, w, None)

    def combine(self, y_RD: torch.Tensor, handle) -> torch.Tensor:
        return y_RD
