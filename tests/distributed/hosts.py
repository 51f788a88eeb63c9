"""Two test hosts on one machine: network namespaces joined by a veth link, each with its own
loopback, addresses and routes, so a job started in each crosses a real network boundary (what a
rank advertises on loopback, the other host cannot reach). A second link joins host 0 to the test
process's namespace, so the test talks to the HTTP endpoint as a client on another host would."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class TwoHosts:
    """host 0 = self.ns[0] at self.addr[0] on self.ifname[0]; host 1 likewise; the test reaches
    host 0 at self.client_addr."""

    def __init__(self):
        pid = os.getpid()
        tag = f"ms{pid % 100000}"
        self.ns = [f"{tag}h0", f"{tag}h1"]
        self.ifname = [f"{tag}a", f"{tag}b"]
        self.client_if = [f"{tag}c", f"{tag}d"]  # test side, host 0 side
        a, b = 100 + pid % 100, (pid // 100) % 250
        self.addr = [f"10.{a}.{b}.1", f"10.{a}.{b}.2"]
        self.unused = f"10.{a}.{b}.9"  # in the hosts' subnet, owned by nobody
        self.client_addr = f"10.{a}.{b}.130"
        self._procs: list[subprocess.Popen] = []

    def create(self) -> str | None:
        """Make the hosts; returns why they cannot be made here, or None."""
        try:
            r = _ip("netns", "add", self.ns[0], check=False)
        except FileNotFoundError:
            return "the `ip` command (iproute2) is not installed"
        if r.returncode != 0:
            return f"`ip netns add` failed: {r.stderr.strip()}"
        steps = [("netns", "add", self.ns[1]),
                 ("link", "add", self.ifname[0], "type", "veth", "peer", "name", self.ifname[1]),
                 ("link", "set", self.ifname[0], "netns", self.ns[0]),
                 ("link", "set", self.ifname[1], "netns", self.ns[1]),
                 ("-n", self.ns[0], "addr", "add", f"{self.addr[0]}/25", "dev", self.ifname[0]),
                 ("-n", self.ns[1], "addr", "add", f"{self.addr[1]}/25", "dev", self.ifname[1]),
                 ("link", "add", self.client_if[0], "type", "veth", "peer", "name", self.client_if[1]),
                 ("link", "set", self.client_if[1], "netns", self.ns[0]),
                 ("addr", "add", self.client_addr.rsplit(".", 1)[0] + ".129/25", "dev", self.client_if[0]),
                 ("-n", self.ns[0], "addr", "add", f"{self.client_addr}/25", "dev", self.client_if[1]),
                 ("link", "set", self.client_if[0], "up")]
        for n in (0, 1):
            steps += [("-n", self.ns[n], "link", "set", "lo", "up"), ("-n", self.ns[n], "link", "set", self.ifname[n], "up")]
        steps.append(("-n", self.ns[0], "link", "set", self.client_if[1], "up"))
        for s in steps:
            r = _ip(*s, check=False)
            if r.returncode != 0:
                self.destroy()
                return f"`ip {' '.join(s)}` failed: {r.stderr.strip()}"
        return None

    def run(self, host: int, cmd: list[str], log_path: str, env: dict | None = None) -> subprocess.Popen:
        """Start cmd inside host `host`'s namespace, in its own session, output to log_path."""
        e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
        with open(log_path, "w") as log:
            p = subprocess.Popen(["ip", "netns", "exec", self.ns[host], *cmd], stdout=log, stderr=subprocess.STDOUT,
                                 env=e, start_new_session=True)
        self._procs.append(p)
        return p

    def pids(self, host: int) -> list[int]:
        r = _ip("netns", "pids", self.ns[host], check=False)
        return [int(x) for x in r.stdout.split()]

    def link(self, host: int, up: bool) -> None:
        _ip("-n", self.ns[host], "link", "set", self.ifname[host], "up" if up else "down")

    def wait_healthy(self, port: int, procs: list[subprocess.Popen], logs: list[str], timeout_s: float = 240) -> str:
        url = f"http://{self.client_addr}:{port}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p, log in zip(procs, logs):
                if p.poll() is not None:
                    raise RuntimeError(f"a host's job exited with {p.returncode}:\n{read(log)[-4000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("the two-host job did not become healthy:\n" + "\n".join(read(x)[-3000:] for x in logs))

    def kill_all(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)
        for n in (0, 1):
            for pid in self.pids(n):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def destroy(self) -> None:
        self.kill_all()
        for n in self.ns:
            _ip("netns", "del", n, check=False)
        _ip("link", "del", self.client_if[0], check=False)


def read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def torchrun(hosts: TwoHosts, node: int, nproc: int, master_port: int, serve_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
            "--nproc-per-node", str(nproc), "--master-addr", hosts.addr[0], "--master-port", str(master_port),
            "-m", "launcher", "serve", *serve_args]


def launch(node: int, nproc: int, master_addr: str, master_port: int, serve_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "moe_serve.entrypoints.cli", "launch", "--nnodes", "2", "--node-rank", str(node),
            "--nproc-per-node", str(nproc), "--master-addr", master_addr, "--master-port", str(master_port), "--",
            *serve_args]
