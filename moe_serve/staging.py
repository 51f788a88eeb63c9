"""One host-to-device copy per step: a step's small host tensors packed into one pinned buffer.

The input batch builds everything a step needs (token ids, positions, slot mapping, block tables,
sampling parameters) as host tensors; `HostToDevice` moves them all with a single copy and hands
back device tensors of the original shapes and dtypes. On the CPU there is nothing to move and
the host tensors are returned as they are.

Every value travels as 64 bits: integers (and bools) as int64, floats bit-cast into the same
buffer as float64. That wastes a few bytes but keeps the buffer one dtype, so one copy suffices.
"""
from __future__ import annotations

import torch


class HostToDevice:
    """Packs host tensors into a reusable pinned buffer and copies them to `device` at once."""

    def __init__(self, device: torch.device | str, initial_numel: int = 1 << 16):
        self.device = torch.device(device)
        self.on_cpu = self.device.type == "cpu"
        self._buf = None if self.on_cpu else self._alloc(initial_numel)
        # Set after each non-blocking copy. The pinned buffer must not be rewritten before the
        # copy has read it; a step without sampling has no device->host read that would order it.
        self._copied: torch.cuda.Event | None = None

    def _alloc(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=torch.int64, pin_memory=self.device.type == "cuda")

    def __call__(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Device copies of `tensors` (host tensors of any shape; None passes through), in order."""
        if self.on_cpu:
            return tensors
        sizes = [0 if t is None else t.numel() for t in tensors]
        total = sum(sizes)
        if self._copied is not None:
            self._copied.synchronize()
        if total > self._buf.numel():
            self._buf = self._alloc(max(total, 2 * self._buf.numel()))
        off = 0
        for t, n in zip(tensors, sizes):
            if n:
                seg = self._buf[off:off + n]
                (seg.view(torch.float64) if t.is_floating_point() else seg).copy_(t.reshape(-1))
            off += n
        dev = self._buf[:total].to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        out: list[torch.Tensor | None] = []
        off = 0
        for t, n in zip(tensors, sizes):
            if t is None:
                out.append(None)
                continue
            seg = dev[off:off + n]
            seg = seg.view(torch.float64) if t.is_floating_point() else seg
            out.append(seg.to(t.dtype).view(t.shape))
            off += n
        return out
