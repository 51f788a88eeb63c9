"""Real multi-process jobs for tests: torchrun on free ports, polled on /health, killed as a group."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.e2e.server import free_port

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


class TorchrunJob:
    def __init__(self, nproc: int, serve_args: list[str], nnodes: int = 1, node_rank: int = 0,
                 rdzv_port: int | None = None, port: int | None = None, wait: bool = True, timeout_s: float = 180):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/moe-serve-job-{self.port}-{node_rank}.log"
        if nnodes == 1:
            dist_args = ["--nproc-per-node", str(nproc), "--master-port", str(rdzv_port or free_port())]
        else:
            dist_args = ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--nproc-per-node", str(nproc),
                         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", "t"]
        cmd = TORCHRUN + dist_args + ["-m", "launcher", "serve", "--port", str(self.port), *serve_args]
        self._log = open(self.log_path, "w")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if wait:
            self.wait_healthy(timeout_s)

    def wait_healthy(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"job exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.kill()
        raise TimeoutError(f"job did not become healthy:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def rank_pid(self, rank: int) -> int:
        for line in self.log().splitlines():
            if f"rank {rank} of " in line and "pid" in line:
                return int(line.split("pid ")[1].split(",")[0])
        raise LookupError(f"rank {rank} has not logged its pid")

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            self._log.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        self._log.close()
