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
            time.sleep(0.1)
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


def run_rank_scripts(tmp_path, script: str, args: list[str], world: int, timeout_s: float = 150) -> list[dict]:
    """Run `python script *args OUT_JSON` as ranks 0..world-1 of a gloo job on 127.0.0.1 (one thread
    each, its own session), wait for all, and return each rank's JSON result. A rank that wrote
    none fails with the tail of its log; one whose result has an "error" fails with it."""
    import json

    from tests.distributed.test_dispatch import kill_tree

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    port = free_port()
    procs, outs = [], []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                   PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
        outs.append(tmp_path / f"rank{rank}.json")
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, script, *args, str(outs[-1])], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
                p.wait(10)
    res = []
    for rank, out in enumerate(outs):
        assert out.exists(), (tmp_path / f"rank{rank}.log").read_text()[-3000:]
        res.append(json.loads(out.read_text()))
        assert res[-1]["error"] is None, res[-1]["error"]
    return res
