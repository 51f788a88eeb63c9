"""What the MoE layers need to know about one step, in one object the model runner builds before
the forward and passes into `model.forward` next to the attention metadata.

Nothing per step is stored on the dispatchers or on the layers' shared context: a dispatcher reads
the step it is given, so a forward's behaviour depends only on its arguments (and a captured decode
graph holds the step it was captured with).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch


@dataclass(frozen=True)
class MoEStep:
    """max_tokens_any_rank: the most tokens any rank of the EP group runs in this step (agreed once
    per step by the core loop), or None when not agreed (then a backend that needs it agrees
    itself, e.g. DeepEP's normal vs low-latency choice).
    static_rows: a padded decode step, every rank running exactly this many rows in every MoE layer
    (the fixed-shape exchange a CUDA graph can hold), or None.
    load_recorder: called with (MoE layer index, logical top-k ids) when expert load is counted.
    split: whether the step runs as two overlapped micro-batches; microbatch: which one this is."""

    max_tokens_any_rank: int | None = None
    static_rows: int | None = None
    load_recorder: Callable[[int, torch.Tensor], None] | None = None
    split: bool = False
    microbatch: int = 0

    def for_microbatch(self, mb: int) -> "MoEStep":
        return replace(self, microbatch=mb)


NO_STEP = MoEStep()  # a forward outside the engine's steps (tests, benchmarks): every rank agrees itself
