"""Process groups for expert parallelism, initialised once per process from torchrun's environment.

torchrun (or the launcher, or a test) sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
We create:
  ep_group   the whole world, on the device backend: MoE dispatch/combine run here;
  cpu_group  a separate gloo group over the same ranks for control messages (batch sizes, stop
             flags, load statistics). It is separate even when the device backend is gloo, so control
             collectives never interleave with MoE collectives on one communicator: collectives on a
             group must be issued in the same order on every rank, and the two streams of calls come
             from different parts of the engine.
The backend is a parameter: moe_serve/platform.py decides it ("nccl" on CUDA, "gloo" on CPU) and logs
why. Nothing here is stored in module globals; callers pass the returned ProcessGroups along.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ProcessGroups:
    """rank, world_size: this process in the world. local_rank: its index on this node (the GPU it
    uses). ep_group: the EP process group (None when world_size is 1 and nothing was initialised).
    cpu_group: a gloo group for control messages (None likewise). device: where this rank's tensors
    live."""

    rank: int
    world_size: int
    local_rank: int
    ep_group: Any
    cpu_group: Any
    device: torch.device


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"{name} is not set; start the ranks with torchrun (or set RANK, "
                               "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"{name}={value!r} is not an integer") from None


def init_process_groups(backend: str | None, timeout_s: float = 600.0) -> ProcessGroups:
    """Initialise torch.distributed from torchrun's environment and create the EP and control groups.

    Args:
        backend: "nccl" (one CUDA device per rank, chosen by LOCAL_RANK), "gloo" (CPU tensors), or
            None for torch's default pairing (gloo for CPU tensors, plus nccl for CUDA tensors when
            CUDA is available; the device is then CUDA if available).
        timeout_s: how long any collective may wait for the other ranks before raising, so a rank
            that died or diverged turns into an error instead of a hang.
    Returns:
        ProcessGroups. With WORLD_SIZE unset or 1 and no process group yet, nothing is initialised
        and both groups are None: EP=1 uses the local dispatcher, which needs no group.
    """
    if backend not in (None, "nccl", "gloo"):
        raise ValueError(f"backend={backend!r} is not one of 'nccl', 'gloo' or None")
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    use_cuda = backend == "nccl" or (backend is None and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("backend='nccl' needs a CUDA device, and torch.cuda.is_available() is False")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        # Before any NCCL call: NCCL binds the communicator to the current device.
        torch.cuda.set_device(device)

    if world_size == 1 and not dist.is_initialized():
        return ProcessGroups(0, 1, local_rank, None, None, device)

    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        rank = _env_int("RANK")
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise RuntimeError(f"{name} is not set; start the ranks with torchrun")
        kwargs = {"device_id": device} if use_cuda else {}
        dist.init_process_group(backend=backend, init_method="env://", rank=rank,
                                world_size=world_size, timeout=timeout, **kwargs)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # The world group serves as the EP group: the whole world is one EP group (attention is data
    # parallel, every rank joins every MoE layer), so a second device communicator would only cost
    # memory. new_group is collective: every rank reaches this line in the same order.
    ep_group = dist.group.WORLD
    cpu_group = dist.new_group(ranks=list(range(world_size)), backend="gloo", timeout=timeout)
    return ProcessGroups(rank, world_size, local_rank, ep_group, cpu_group, device)


def group_timeout(group: Any = None) -> timedelta | None:
    """The collective timeout `group` (the world by default) was made with, or None where the backend
    does not say. A group made later from inside a running job takes it, not torch's 30-minute
    default: a rank lost while the group is being made then fails that within the job's timeout."""
    group = group or dist.group.WORLD
    kind = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
    try:
        return group._get_backend(kind).options._timeout
    except Exception:  # another backend, or a torch without these private fields: torch's default
        return None


def destroy_process_groups(groups: ProcessGroups) -> None:
    """Tear down what init_process_groups created (the control group, then the world)."""
    if not dist.is_initialized():
        return
    if groups.cpu_group is not None:
        dist.destroy_process_group(groups.cpu_group)
    dist.destroy_process_group()
