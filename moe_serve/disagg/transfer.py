"""Bulk KV moves between instances through an existing transfer engine, behind one small interface.

A side registers its KV cache memory once (`register`), publishes `metadata()` (how a peer reaches
it), and a writer that has `connect`ed to a peer posts one-sided writes of byte ranges of its own
registered memory into the peer's (`write`, then `poll` until "DONE" or "ERR"). Both sides speak
in (address, length) pairs of host or device memory: a paged cache's blocks are such ranges, so
one write moves a request's scattered blocks in one request to the engine. Completion reaches the
reader over the control channel (ZMQ/msgspec), not through the engine, so both engines look alike.

Engines:
- `nixl` (NVIDIA's NIXL over its UCX backend; `pip install nixl-cu12`): registers DRAM and VRAM
  alike, UCX picks shared memory, TCP or RDMA; the default.
- `mooncake` (Mooncake's transfer engine, `pip install mooncake-transfer-engine-non-cuda` for the
  CPU build, which needs libibverbs installed): peer-to-peer handshake, TCP or RDMA.
bench/kv_transfer.py measures both between two processes.
"""
from __future__ import annotations

import logging
import os
import socket
import uuid

log = logging.getLogger("moe_serve.disagg")

ENGINES = ("nixl", "mooncake")
PROGRESS_PAUSE_US = 100  # NIXL's progress thread: pause between polls (0 would take a core; 100 us: ~4%)


class TransferError(RuntimeError):
    """A transfer engine refused or failed a request (the message names the engine and the peer)."""


class KVTransfer:
    name = "base"

    def register(self, regions: list[tuple[int, int]], device: str = "cpu") -> None:
        raise NotImplementedError

    def metadata(self) -> bytes:
        raise NotImplementedError

    def connect(self, peer_metadata: bytes) -> str:
        raise NotImplementedError

    def write(self, peer: str, local: list[tuple[int, int]], remote: list[tuple[int, int]]):
        raise NotImplementedError

    def poll(self, handle) -> str:
        raise NotImplementedError

    def release(self, handle) -> None:
        pass

    def close(self) -> None:
        pass


def _route_address() -> str:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only asks for the route's source
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _no_rdma_here() -> bool:
    try:
        return not os.listdir("/sys/class/infiniband")
    except OSError:
        return True


class NixlTransfer(KVTransfer):
    name = "nixl"

    def __init__(self, agent_name: str | None = None):
        # UCX's InfiniBand modules load wherever libibverbs is installed, RDMA device or not, and the
        # libnl they bring crashes the process in its exit handlers (exit code 139 after a clean
        # shutdown). Without an RDMA device they have nothing to drive: leave them out (unless the
        # user set UCX_MODULES). UCX reads this when the agent's backend loads it, below.
        if "UCX_MODULES" not in os.environ and _no_rdma_here():
            os.environ["UCX_MODULES"] = "^ib"
            log.info("nixl: no RDMA device here: UCX's InfiniBand modules left out (UCX_MODULES=^ib)")
        try:
            from nixl_cu12 import _api
        except ImportError:
            try:
                from nixl import _api
            except ImportError as e:
                raise TransferError(f"the nixl transfer engine is not installed (pip install nixl-cu12): {e}") from None
        logging.getLogger("nixl").setLevel(logging.WARNING)
        # Unique across hosts (pids are not): a peer keys its connections by this name.
        self.agent_name = agent_name or f"moe-serve-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # The agent's progress thread (it lands incoming writes over TCP) polls with no pause unless
        # told otherwise: a whole core, which an engine core pinned beside it loses (decode at half
        # speed, measured). The Python wrapper fixes the pause at 0; it is set here as the agent is made.
        real = _api.nixlBind.nixlAgent

        def make(name, config):
            config.pthrDelay = PROGRESS_PAUSE_US
            return real(name, config)

        _api.nixlBind.nixlAgent = make
        try:
            self.agent = _api.nixl_agent(self.agent_name, _api.nixl_agent_config(backends=["UCX"]))
        finally:
            _api.nixlBind.nixlAgent = real
        self.mem_type = "DRAM"
        self._reg = []

    def register(self, regions, device="cpu"):
        self.mem_type = "DRAM" if device == "cpu" else "VRAM"
        dev = 0 if device == "cpu" else int(device.split(":")[1]) if ":" in device else 0
        self._reg.append(self.agent.register_memory([(a, n, dev, "") for a, n in regions], self.mem_type))

    def metadata(self):
        return self.agent.get_agent_metadata()

    def connect(self, peer_metadata):
        name = self.agent.add_remote_agent(peer_metadata)
        return name.decode() if isinstance(name, bytes) else name

    def _descs(self, ranges):
        return self.agent.get_xfer_descs([(a, n, 0) for a, n in ranges], self.mem_type)

    def write(self, peer, local, remote):
        try:
            h = self.agent.initialize_xfer("WRITE", self._descs(local), self._descs(remote), peer)
            state = self.agent.transfer(h)
        except Exception as e:  # NIXL raises its own status errors
            raise TransferError(f"nixl: a write to {peer} was refused: {e}") from None
        if state == "ERR":
            raise TransferError(f"nixl: a write to {peer} failed to start")
        return h

    def poll(self, handle):
        try:
            return self.agent.check_xfer_state(handle)
        except Exception as e:
            log.warning("nixl: transfer state unknown (%s)", e)
            return "ERR"

    def release(self, handle):
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:
            pass

    def close(self):
        for r in self._reg:
            try:
                self.agent.deregister_memory(r)
            except Exception:
                pass
        self._reg = []


class MooncakeTransfer(KVTransfer):
    name = "mooncake"

    def __init__(self, host: str | None = None, protocol: str = "tcp"):
        # Peers reach this engine at the address it registers: MOE_SERVE_KV_HOST, else the address
        # this host's default route leaves from (a single host: loopback).
        host = host or os.environ.get("MOE_SERVE_KV_HOST") or _route_address()
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise TransferError("the mooncake transfer engine is not installed (pip install "
                                f"mooncake-transfer-engine-non-cuda; it needs libibverbs): {e}") from None
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise TransferError(f"mooncake: the transfer engine did not start on {host} ({protocol}): code {rc}")
        self.address = f"{host}:{self.engine.get_rpc_port()}"
        self._reg: list[int] = []

    def register(self, regions, device="cpu"):
        for a, n in regions:
            if self.engine.register_memory(a, n) != 0:
                raise TransferError(f"mooncake: could not register {n} bytes at {a:#x}")
            self._reg.append(a)

    def metadata(self):
        return self.address.encode()

    def connect(self, peer_metadata):
        return peer_metadata.decode()

    def write(self, peer, local, remote):
        bid = self.engine.batch_transfer_async_write(peer, [a for a, _ in local], [a for a, _ in remote],
                                                     [n for _, n in local])
        if bid == 0 or bid is None or (isinstance(bid, int) and bid < 0):
            raise TransferError(f"mooncake: a write to {peer} was refused (code {bid})")
        return bid

    def poll(self, handle):
        st = self.engine.get_batch_transfer_status([handle])
        return "DONE" if st == 0 else ("PROC" if st == 1 else "ERR")

    def close(self):
        for a in self._reg:
            self.engine.unregister_memory(a)
        self._reg = []


def make_transfer(engine: str = "nixl", **kw) -> KVTransfer:
    if engine == "nixl":
        return NixlTransfer(**kw)
    if engine == "mooncake":
        return MooncakeTransfer(**kw)
    raise ValueError(f"KV transfer engine {engine!r} is not one of {', '.join(ENGINES)}")
