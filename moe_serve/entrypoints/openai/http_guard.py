"""HTTP-level protection of the server: no single client can hold it up.

- `GuardedH11Protocol`: uvicorn's h11 protocol with a deadline for a request's headers (a client
  that trickles them, or never sends any, is cut off), a cap on open connections answered with a
  503 at once, and malformed HTTP answered in OpenAI's error shape.
- `read_body`: reads a request body with a byte limit (Content-Length checked before anything is
  read; a chunked upload counted as it streams) and a deadline for the whole body.

Every refusal is `{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

import asyncio
import logging

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from moe_serve.entrypoints.openai import protocol as P

log = logging.getLogger("moe_serve.http")


def error_json(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> bytes:
    return msgspec.json.encode(P.ErrorResponse(P.ErrorInfo(message, type_, param,
                                                           code if code is not None else status)))


class Refusal(Exception):
    """A request refused before it is parsed (body too large, too slow, server stopping)."""

    def __init__(self, status: int, message: str, code: str, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.code, self.type = status, code, type_


class ClientGone(Exception):
    """The client disconnected while its body was being read."""


async def read_body(receive, headers, max_bytes: int, timeout_s: float, stop: asyncio.Event | None = None) -> bytes:
    """The whole request body from the ASGI `receive`, or Refusal (413 too large, 408 too slow,
    400 bad Content-Length, 503 once `stop` is set). The body's bytes are counted as they arrive,
    so a chunked upload is refused as soon as it passes max_bytes, not after it is buffered."""
    cl = headers.get("content-length")
    if cl is not None:
        try:
            declared = int(cl)
        except ValueError:
            raise Refusal(400, f"Content-Length is not a number: {cl[:40]!r}", "invalid_content_length") from None
        if declared > max_bytes:
            raise Refusal(413, f"the request body is {declared} bytes; this server takes at most {max_bytes} "
                               "(--max-request-body-bytes)", "request_too_large")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    stopped = asyncio.ensure_future(stop.wait()) if stop is not None else None
    chunks: list[bytes] = []
    total = 0
    try:
        while True:
            nxt = asyncio.ensure_future(receive())
            done, _ = await asyncio.wait({nxt} if stopped is None else {nxt, stopped},
                                         timeout=max(deadline - loop.time(), 0.0),
                                         return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                nxt.cancel()
                if stopped is not None and stopped in done:
                    raise Refusal(503, "the server is shutting down", "server_shutting_down",
                                  "ServiceUnavailableError")
                raise Refusal(408, f"the request body did not arrive within {timeout_s:g}s (--http-body-timeout); "
                                   f"{total} bytes came", "request_timeout")
            msg = nxt.result()
            if msg["type"] == "http.disconnect":
                raise ClientGone()
            chunk = msg.get("body", b"")
            total += len(chunk)
            if total > max_bytes:
                raise Refusal(413, f"the request body is over {max_bytes} bytes (--max-request-body-bytes)",
                              "request_too_large")
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)
    finally:
        if stopped is not None:
            stopped.cancel()


def _raw_response(status: int, reason: str, body: bytes) -> bytes:
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode("ascii") + body


class GuardedH11Protocol(H11Protocol):
    """One HTTP/1.1 connection (uvicorn's h11 protocol) with the guards above.

    The header deadline runs from when the connection opens, and again from the end of each
    response until the next request's headers are complete; it also bounds how long the rest of
    a refused body is drained. (uvicorn's own keep-alive timer stops at a connection's first byte,
    so a client sending one byte every few seconds would otherwise hold the connection forever.)
    Set the class attributes before serving (see `configure`)."""

    header_timeout_s: float = 10.0
    max_connections: int | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_cycle = None
        # uvicorn answers an over-limit request in plain text; we answer it ourselves (see _guarded).
        self.limit_concurrency = None
        inner = self.app

        async def guarded(scope, receive, send):
            cap = self.max_connections
            if cap is not None and scope["type"] == "http" and len(self.connections) > cap:
                body = error_json(503, f"the server has more than {cap} open connections (--max-connections); "
                                       "retry later", "ServiceUnavailableError", None, "too_many_connections")
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
            await inner(scope, receive, send)

        self.app = guarded

    @classmethod
    def configure(cls, header_timeout_s: float, max_connections: int | None) -> type["GuardedH11Protocol"]:
        """A subclass with these settings (uvicorn takes a protocol class, not an instance)."""
        return type(cls.__name__, (cls,), {"header_timeout_s": header_timeout_s, "max_connections": max_connections})

    # --- the header deadline ----------------------------------------------------------------------
    def _arm(self) -> None:
        self._disarm()
        self._timer_cycle = self.cycle
        self._timer = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.transport.is_closing() or self.cycle is not self._timer_cycle:
            return
        pending, _ = self.conn.trailing_data
        if self.conn.their_state is h11.IDLE and pending:  # headers began but never finished
            log.info("closing a connection whose request headers did not arrive within %gs", self.header_timeout_s)
            self.transport.write(_raw_response(408, "Request Timeout", error_json(
                408, f"the request headers did not arrive within {self.header_timeout_s:g}s (--http-header-timeout)",
                code="request_timeout")))
        self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._timer is not None and self.cycle is not None and self.cycle is not self._timer_cycle:
            self._disarm()  # a new request's headers are complete

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """Malformed HTTP (uvicorn answers it in plain text)."""
        body = error_json(400, f"malformed HTTP request: {msg}", code="invalid_http")
        event = h11.Response(status_code=400, reason=b"Bad Request", headers=[
            (b"content-type", b"application/json"), (b"connection", b"close"),
            (b"content-length", str(len(body)).encode())])
        try:
            self.transport.write(self.conn.send(event))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:
            self.transport.write(_raw_response(400, "Bad Request", body))
        self.transport.close()
