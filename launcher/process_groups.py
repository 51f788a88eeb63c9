"""The process groups of one elastic generation: formed over a store prefix of their own, their
collectives' timeout, ended from another thread when a member is lost, dropped to regroup.

torch.distributed has no public way to list every process group of a process (the engine makes
groups of its own: EPLB's transfers), to abort one device's backend of a group, or to read a
group's timeout back: the few private calls that does are in the functions at the end, each with
why.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket

log = logging.getLogger("moe_serve.elastic")


def form_groups(m, backend: str, device, timeout_s: float, build_timeout_s: float):
    """The world and control groups of m's generation (a membership.Membership), over a store prefix
    of their own. Every
    member is waiting for the member list, so they meet within timeout_s (a member lost after it
    was named fails the generation that soon); the groups' collectives then wait up to
    build_timeout_s while the cores are rebuilt."""
    import torch
    import torch.distributed as dist

    from expert_parallel.runtime.groups import ProcessGroups

    n, rank = len(m.members), m.members.index(m.rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    if n == 1:
        m.group_sockets = set()
        return ProcessGroups(0, 1, int(os.environ.get("LOCAL_RANK", "0")), None, None, device)
    store = dist.PrefixStore(m.k(f"g{m.generation}/pg"), m.store)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    before = socket_inodes()
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=n, timeout=timeout, **kwargs)
    cpu = dist.new_group(ranks=list(range(n)), backend="gloo", timeout=timeout)
    m.group_sockets = socket_inodes() - before  # the groups' connections (what interrupt_groups shuts)
    groups = ProcessGroups(rank, n, int(os.environ.get("LOCAL_RANK", "0")), dist.group.WORLD, cpu,
                         device if device.type == "cuda" else torch.device("cpu"))
    set_timeout(groups, build_timeout_s)
    return groups


def group_settings(groups) -> dict:
    """What this core's groups run with, read back from them: each group's backend and timeout,
    and the NCCL error handling in this process's environment (read when an NCCL group is made)."""
    import torch

    out = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")}
    if groups.world_size == 1:
        return out
    for name, g in (("ep_group", groups.ep_group), ("cpu_group", groups.cpu_group)):
        dev = torch.device("cuda") if name == "ep_group" and groups.device.type == "cuda" else torch.device("cpu")
        out[name] = _backend_settings(g, dev)
    return out


def socket_inodes() -> set[str]:
    """The socket inodes of this process's open descriptors ("socket:[N]")."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out.add(link)
    return out


def interrupt_groups(sockets: set[str], store_addr: tuple[str, int], store_sockets: set[str] = frozenset()) -> int:
    """End the collective this process waits in, from another thread, after a member was lost:
    NCCL communicators are aborted (ncclCommAbort makes their kernels return; with
    TORCH_NCCL_ASYNC_ERROR_HANDLING=2 the error reaches the caller), and the connections in
    `sockets` are shut down: gloo's abort does not end an operation in progress (torch 2.13),
    a closed connection does, as a dead peer's does. Connections to the job's store are left
    alone unless named in `store_sockets` (a rendezvous's wait during a build). Returns the number
    of connections shut down."""
    import torch

    if torch.cuda.is_available():
        for pg in _process_groups():
            _abort_backend(pg, "cuda")  # (a gloo group has no CUDA backend: nothing to abort)
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link not in sockets:
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and (link in store_sockets or s.getpeername()[1] != store_addr[1]):
                s.shutdown(socket.SHUT_RDWR)  # (the duplicate shares the connection)
                n += 1
        except OSError:  # a listening socket, or closed meanwhile
            pass
        finally:
            s.close()
    return n


def set_timeout(groups, timeout_s: float) -> None:
    """The collective timeout while serving: short, so a silent host is noticed within it."""
    if groups.world_size == 1:
        return
    for g in (groups.ep_group, groups.cpu_group):
        try:
            g.set_timeout(datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # a backend without it keeps its timeout
            log.warning("could not set the collective timeout to %gs: %s", timeout_s, e)


def drop_groups() -> None:
    """Abort and destroy every process group of this process (after a peer's loss, or to regroup)."""
    import torch.distributed as dist

    for pg in _process_groups():
        for dev in ("cpu", "cuda"):
            _abort_backend(pg, dev)
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as e:
        log.warning("destroying the old process groups: %s", e)


# --- torch.distributed privates, each where no public call does the same -------------------------
def _process_groups() -> list:
    """Every process group of this process: ours and the ones the engine made (EPLB's transfer
    groups), which must be aborted as well, or a survivor hangs in one. torch keeps the list
    private (distributed_c10d._world.pg_map, torch 2.13); ProcessGroups holds only ours."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return []
    from torch.distributed.distributed_c10d import _world

    return list(_world.pg_map)


def _abort_backend(pg, device: str) -> None:
    """Abort one device's backend of a group (NCCL's communicators, for "cuda"). Public
    ProcessGroup.abort() aborts every backend of the group, gloo's included, whose abort does not
    end an operation in progress (torch 2.13): interrupt_groups shuts gloo's connections instead."""
    import torch

    try:
        pg._get_backend(torch.device(device)).abort()
    except Exception:  # no backend for that device (a gloo group and "cuda")
        pass


def _backend_settings(group, device) -> dict:
    """A group's backend name and collective timeout, read back from the group for the log (no
    public getter for the timeout: ProcessGroup.set_timeout has no get_timeout)."""
    b = group._get_backend(device)
    return {"backend": b.name(), "timeout_s": b.options._timeout.total_seconds()}
