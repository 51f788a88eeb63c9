"""The front end's ZMQ link to its engine-core processes (one per data-parallel rank).

The front end binds every socket and the cores connect, so cores on other nodes need only the
front end's address: one PUSH socket per rank (its `CoreInput`s) and one PULL socket that every
rank's outputs arrive on. ZMQ sockets are not thread-safe: the PUSH sockets are used only by the
sender thread, the PULL socket only by the receiver thread (see AsyncEngine).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import msgspec
import zmq

from moe_serve.protocol import CoreFatal, CoreInput, CoreMessage, CoreReady, input_encoder, message_decoder

log = logging.getLogger("moe_serve.core_client")


class CoreClient:
    def __init__(self, world_size: int, bind_host: str = "127.0.0.1"):
        self.world_size = world_size
        self.ctx = zmq.Context()
        if ":" in bind_host:  # an IPv6 address: ZMQ wants it in brackets, and IPv6 switched on
            self.ctx.setsockopt(zmq.IPV6, 1)
        where = f"tcp://[{bind_host}]" if ":" in bind_host else f"tcp://{bind_host}"
        self.out_sock = self.ctx.socket(zmq.PULL)
        self.out_port = self.out_sock.bind_to_random_port(where)
        self.in_socks, self.in_ports = [], []
        for _ in range(world_size):
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 1000)
            self.in_ports.append(s.bind_to_random_port(where))
            self.in_socks.append(s)
        self.bind_host = bind_host

    def addresses(self, host: str | None = None) -> tuple[list[str], str]:
        """(per-rank input addresses, output address) as the cores should connect to them."""
        h = host or self.bind_host
        h = f"[{h}]" if ":" in h else h
        return [f"tcp://{h}:{p}" for p in self.in_ports], f"tcp://{h}:{self.out_port}"

    def send(self, rank: int, msg: CoreInput, block: bool = True) -> bool:
        """Queue msg for a rank's core. block False (elastic EP): a rank that takes nothing for a
        second (its core is gone, so its socket has no peer) gets nothing; returns False then."""
        data = input_encoder.encode(msg)
        if block:
            self.in_socks[rank].send(data, copy=False)
            return True
        for _ in range(20):
            try:
                self.in_socks[rank].send(data, zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                time.sleep(0.05)
        return False

    def recv(self, timeout_ms: int) -> CoreMessage | None:
        """The next message from any core, None on timeout or a malformed message (logged)."""
        if not self.out_sock.poll(timeout_ms):
            return None
        frame = self.out_sock.recv(copy=False)
        try:
            return message_decoder.decode(frame.buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.error("dropped a malformed message from an engine core (%d bytes): %s", len(frame.buffer), e)
            return None

    def wait_ready(self, check_alive: Callable[[], str | None], progress_s: float = 30.0) -> list[CoreReady]:
        """Block until every rank's core has said it is ready (model loaded, KV cache sized);
        raise RuntimeError if one fails or its process goes away meanwhile."""
        ready: dict[int, CoreReady] = {}
        t0 = last = time.monotonic()
        while len(ready) < self.world_size:
            msg = self.recv(200)
            if isinstance(msg, CoreReady):
                ready[msg.rank] = msg
            elif isinstance(msg, CoreFatal):
                raise RuntimeError(f"engine core (rank {msg.rank}) failed to start: {msg.error}")
            dead = check_alive()
            if dead:
                raise RuntimeError(dead)
            if time.monotonic() - last > progress_s:
                last = time.monotonic()
                log.info("waiting for engine cores to load: %d of %d ready after %.0fs", len(ready), self.world_size,
                         last - t0)
        return [ready[r] for r in range(self.world_size)]

    def close(self, term_timeout_s: float = 2.0) -> None:
        """Close every socket (inputs still queued for a core get half a second: a live core
        receives its shutdown) and terminate the context, waiting at most term_timeout_s: after a
        core was killed, libzmq's termination was seen to block forever (with linger 0 too), which
        kept the front end from exiting."""
        for s in self.in_socks:
            s.close(500)
        self.out_sock.close(0)
        t = threading.Thread(target=self.ctx.term, name="zmq-term", daemon=True)
        t.start()
        t.join(term_timeout_s)
        if t.is_alive():
            log.warning("ZMQ context did not terminate within %.0fs (a core is gone); exiting without it", term_timeout_s)
