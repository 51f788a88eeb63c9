"""Records how many token copies each logical expert receives, in windows of engine steps.

Shape legend: L MoE layers, E logical experts, T tokens, K top-k.

The engine calls record(layer, topk_ids_TK) in every MoE layer with the router's *logical* ids
(before ReplicaMap turns them into slots) and end_step() once per engine step. Every window_steps
steps the counts close into a window, optionally reduced over ranks by reduce_fn (an all_reduce
sum, so every rank holds the global load). dump() returns the load file format (map.py):
{"expert_load": windows oldest first, each L lists of E counts, "window_step_counts": the steps
each window holds, plus metadata}, which `placement tune` reads.

A recording that ends between two window boundaries keeps its last, partial window: stop()
closes it with its step count (so a short recording is not lost, and the tuner weighs the window
by the steps it saw), and dump() of a running recording shows it as it stands without closing it.

A server exposes this as POST /expert_load/start, /stop and /dump; the engine applies those between
steps. When reduce_fn is a collective, every rank must start, stop and dump at the same step (the
control message reaches all ranks for the same turn), since each closed window, and a dump's
partial one, calls it on every rank.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch


class ExpertLoadRecorder:
    """Counts per (layer, logical expert) with no host sync per record; cheap enough to leave on."""

    def __init__(self, num_layers: int, num_logical_experts: int, window_steps: int,
                 reduce_fn: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                 device: torch.device | str | None = None, max_windows: int | None = None):
        """
        Args:
            window_steps: engine steps per window (the tuner forecasts window by window).
            reduce_fn: applied to each closed window's (L, E) int64 counts before it is kept; may
                work in place and return None (as torch.distributed.all_reduce does) or return
                the reduced tensor.
            device: where counts accumulate: the device the router's ids live on.
            max_windows: keep only the newest windows (None: all).
        """
        for name, value in (("num_layers", num_layers), ("num_logical_experts", num_logical_experts),
                            ("window_steps", window_steps)):
            if value <= 0:
                raise ValueError(f"{name}={value} must be positive")
        if max_windows is not None and max_windows <= 0:
            raise ValueError(f"max_windows={max_windows} must be positive or None")
        self.num_layers, self.num_logical_experts = num_layers, num_logical_experts
        self.window_steps, self.reduce_fn, self.max_windows = window_steps, reduce_fn, max_windows
        # Column 0 collects negative ids (padding, masked routes) so record() needs no filtering,
        # which would make the shape data-dependent and sync with the host.
        self._counts_LE1 = torch.zeros(num_layers, num_logical_experts + 1, dtype=torch.int64, device=device)
        self._windows: list[torch.Tensor] = []  # (L, E) int64 on the CPU
        self._window_steps: list[int] = []  # the steps each kept window holds (window_steps but the last)
        self._steps = 0
        self.active = False

    def start(self) -> None:
        """Forget everything recorded so far and start counting at the next step."""
        self._counts_LE1.zero_()
        self._windows.clear()
        self._window_steps.clear()
        self._steps = 0
        self.active = True

    def stop(self) -> None:
        """Stop counting. A partly filled window is kept, with its step count (collective: on every
        rank at the same step when reduce_fn is one)."""
        if self.active and self.partial_steps:
            self._keep(self._reduced(), self.partial_steps)
        self.active = False
        self._counts_LE1.zero_()
        self._steps = 0

    @property
    def partial_steps(self) -> int:
        """Steps counted into the open window so far (0 right after a window closed)."""
        return self._steps % self.window_steps

    def _reduced(self) -> torch.Tensor:
        """The open window's counts, reduced over ranks: a new (L, E) tensor."""
        window = self._counts_LE1[:, 1:].clone()
        if self.reduce_fn is not None:
            reduced = self.reduce_fn(window)
            window = window if reduced is None else reduced
        return window

    def _keep(self, window: torch.Tensor, steps: int) -> None:
        self._windows.append(window.to("cpu", torch.int64))
        self._window_steps.append(steps)
        if self.max_windows is not None and len(self._windows) > self.max_windows:
            del self._windows[0], self._window_steps[0]

    def record(self, layer: int, topk_ids_TK: torch.Tensor) -> None:
        """Add one layer's routing: topk_ids_TK (T, K) logical expert ids, negative ids ignored."""
        if not self.active:
            return
        # scatter_add_ into a fixed buffer, not torch.bincount: bincount on CUDA reads the max id
        # back to the host, a sync per layer per step.
        ids = topk_ids_TK.reshape(-1).to(device=self._counts_LE1.device, dtype=torch.int64).clamp(min=-1) + 1
        self._counts_LE1[layer].scatter_add_(0, ids, torch.ones_like(ids))

    def end_step(self) -> None:
        """Call once per engine step, after every layer recorded (on every rank, in lockstep)."""
        if not self.active:
            return
        self._steps += 1
        if self._steps % self.window_steps == 0:
            self._keep(self._reduced(), self.window_steps)
            self._counts_LE1.zero_()

    @property
    def num_windows(self) -> int:
        return len(self._windows)

    def windows(self) -> torch.Tensor:
        """(W, L, E) int64: every closed window, oldest first."""
        if not self._windows:
            return torch.zeros(0, self.num_layers, self.num_logical_experts, dtype=torch.int64)
        return torch.stack(self._windows)

    def window_step_counts(self) -> list[int]:
        """The steps each closed window holds, oldest first (window_steps but a stopped one's last)."""
        return list(self._window_steps)

    def dump(self, path: str | Path | None = None, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
        """The kept windows in the load file format, and while recording the open window as it
        stands (not closed: recording goes on); written to path as JSON when given. Collective
        when recording with a reduce_fn: every rank dumps at the same step."""
        windows, steps = self.windows(), self.window_step_counts()
        if self.active and self.partial_steps:
            windows = torch.cat([windows, self._reduced().to("cpu", torch.int64)[None]])
            steps.append(self.partial_steps)
        obj = {**(metadata or {}), "window_steps": self.window_steps, "num_layers": self.num_layers,
               "num_logical_experts": self.num_logical_experts, "window_step_counts": steps,
               "expert_load": windows.tolist()}
        if path is not None:
            Path(path).write_text(json.dumps(obj) + "\n")
        return obj
