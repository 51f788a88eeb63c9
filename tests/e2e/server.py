"""A real `moe-serve serve` process on 127.0.0.1 and a free port, for tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free port below the kernel's ephemeral range: a port the OS hands out for binding to port 0
    can be handed out again, before the test's server binds it, to any socket that binds to port 0
    (seen: gloo's listeners in a 4-rank job took a test server's port). Below that range only an
    explicit bind can take it."""
    import random

    hi = _ephemeral_low() - 1
    for _ in range(200):
        port = random.randint(min(20000, hi // 2), hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


class ServerProcess:
    def __init__(self, args: list[str], timeout_s: float = 240.0, env: dict | None = None, command: str = "serve"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "moe_serve.entrypoints.cli", command, "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        self.log_path = f"/tmp/moe-serve-test-{self.port}.log"
        self._log = open(self.log_path, "w")
        e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=e, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"server did not become healthy:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-5000:]

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name.split("{")[0]] = float(value)
        return out

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode
