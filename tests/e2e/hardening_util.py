"""Helpers for the hardening tests: /health latency measured while something runs, raw sockets."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx


class HealthProbe:
    """Polls /health every 50 ms in a thread; `max_s` is the slowest answer (a failure counts as 10 s)."""

    def __init__(self, url: str):
        self.url, self.lat = url, []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as h:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    ok = h.get(self.url + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.lat.append(time.monotonic() - t0 if ok else 10.0)
                self._stop.wait(0.05)

    def __enter__(self) -> "HealthProbe":
        self._t.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(15)

    @property
    def max_s(self) -> float:
        return max(self.lat, default=10.0)


@contextlib.contextmanager
def timed():
    """`with timed() as t: ...` then t() is the seconds it took."""
    t0 = time.monotonic()
    end = []
    yield lambda: (end[0] if end else time.monotonic()) - t0
    end.append(time.monotonic())


def raw_socket(url: str, timeout_s: float = 10.0) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=timeout_s)
    return s


def read_response(s: socket.socket, timeout_s: float = 10.0) -> tuple[int | None, bytes]:
    """Status and body of one HTTP/1.1 response on a raw socket (None if the server closed
    without one)."""
    s.settimeout(timeout_s)
    data = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep:
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), None)
                if length is not None and len(body) >= length:
                    break
    except (ConnectionResetError, socket.timeout):
        pass
    if not data.startswith(b"HTTP/1.1 "):
        return None, data
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def assert_openai_error(body: bytes | dict, param: str | None = "?") -> dict:
    """The error object of an OpenAI-shaped error body (and its param, unless "?")."""
    obj = json.loads(body) if isinstance(body, (bytes, str)) else body
    assert set(obj) == {"error"}, obj
    err = obj["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"], err
    if param != "?":
        assert err["param"] == param, err
    return err


def from_json_schema(schema: dict):
    """A hypothesis strategy for the JSON values a JSON schema allows: the subset that
    `msgspec.json.schema` writes (type, anyOf, enum, properties/required, items,
    additionalProperties; $refs already inlined). Integers and strings are unbounded where the
    schema leaves them so, which is the point. (hypothesis-jsonschema does this in general, but
    its object strategy uses Hypothesis internals that newer Hypothesis releases removed.)"""
    from hypothesis import strategies as st

    any_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                            max_leaves=8)
    if "anyOf" in schema:
        return st.one_of([from_json_schema(s) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    t = schema.get("type")
    if isinstance(t, list):
        return st.one_of([from_json_schema({**schema, "type": x}) for x in t])
    if t == "string":
        return st.text(max_size=40)
    if t == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if t == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False, allow_infinity=False)
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    if t == "array":
        return st.lists(from_json_schema(schema.get("items", {})), max_size=4)
    if t == "object":
        props = schema.get("properties")
        if props is None:
            return st.dictionaries(st.text(max_size=10), any_json, max_size=3)
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries({k: from_json_schema(v) for k, v in props.items() if k in required},
                                     optional={k: from_json_schema(v) for k, v in props.items() if k not in required})
    return any_json  # {}: any JSON value
