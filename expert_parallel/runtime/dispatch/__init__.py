"""Dispatch/combine backends behind one interface; `make_dispatcher` picks one by name (lazy imports)."""
from __future__ import annotations

from expert_parallel.runtime.dispatch.base import Dispatcher, DispatchOutput

BACKENDS = ("local", "all_to_all", "allgather", "deepep", "reference")


def make_dispatcher(name: str, num_slots: int, rank: int = 0, world_size: int = 1, group=None,
                    **options) -> Dispatcher:
    """Build the named backend. With world_size 1 every name but "reference" resolves to "local".
    `options` go to the DeepEP dispatcher only (e.g. mode="normal")."""
    if name not in BACKENDS:
        raise ValueError(f"all2all_backend={name!r} is not one of {BACKENDS}")
    if world_size == 1 and name != "reference":
        name = "local"
    if name == "local":
        from expert_parallel.runtime.dispatch.local import LocalDispatcher as cls
    elif name == "all_to_all":
        from expert_parallel.runtime.dispatch.all_to_all import AllToAllDispatcher as cls
    elif name == "allgather":
        from expert_parallel.runtime.dispatch.allgather import AllGatherDispatcher as cls
    elif name == "deepep":
        from expert_parallel.runtime.dispatch.deepep import DeepEPDispatcher

        return DeepEPDispatcher(num_slots, rank, world_size, group, **options)
    else:
        from expert_parallel.runtime.dispatch.reference import ReferenceDispatcher as cls
    return cls(num_slots, rank, world_size, group)


__all__ = ["Dispatcher", "DispatchOutput", "make_dispatcher", "BACKENDS"]
