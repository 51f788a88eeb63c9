"""A guard for capturable code: fails on any op that reads a device value on the host or whose
output shape depends on data (what a CUDA graph or a fullgraph compile cannot hold)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# bincount: its output size is the largest value, read back to the host on CUDA (not on a CPU).
_FORBIDDEN = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
              "repeat_interleave", "argwhere", "nonzero_static_fallback", "bincount"}


class HostSyncError(AssertionError):
    pass


class NoHostSync(TorchDispatchMode):
    """Also fails on Tensor.tolist(), which reads the data without dispatching an op."""

    def __enter__(self):
        self._own_tolist = torch.Tensor.__dict__.get("tolist")

        def tolist(t, *args, **kwargs):
            raise HostSyncError("Tensor.tolist inside code that must be capturable")

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        if self._own_tolist is None:
            del torch.Tensor.tolist
        else:
            torch.Tensor.tolist = self._own_tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _FORBIDDEN:
            raise HostSyncError(f"aten.{name} inside code that must be capturable")
        return func(*args, **(kwargs or {}))
