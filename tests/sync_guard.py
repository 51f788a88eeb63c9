"""A guard for capturable code: fails on any op that reads a device value on the host or whose
output shape depends on data (what a CUDA graph or a fullgraph compile cannot hold)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_FORBIDDEN = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
              "repeat_interleave", "argwhere", "nonzero_static_fallback"}


class HostSyncError(AssertionError):
    pass


class NoHostSync(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _FORBIDDEN:
            raise HostSyncError(f"aten.{name} inside code that must be capturable")
        return func(*args, **(kwargs or {}))
