"""Two hosts for real: network namespaces joined by a veth link, one torchrun (or `moe-serve launch`)
in each, the HTTP endpoint reached from the test's own namespace over another link.

The job forms across the boundary (each rank advertises the address of the interface that routes
to MASTER_ADDR, not the loopback its host name resolves to), greedy text through HTTP equals
transformers' own generate, a cut link ends the job within --dist-timeout naming the lost ranks, and
each start-up mistake a user makes on two hosts ends every process with an error that says what to
set, within the join timeout.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.distributed.hosts import TwoHosts, launch, read, torchrun
from tests.distributed.test_launcher import ARGS, PROMPTS, _complete_all
from tests.e2e.server import free_port


@pytest.fixture(scope="module")
def hosts():
    h = TwoHosts()
    why = h.create()
    if why is not None:
        pytest.skip(f"network namespaces cannot be made on this machine, so two hosts cannot be simulated: {why}")
    yield h
    h.destroy()


@pytest.fixture(autouse=True)
def _clean(hosts):
    yield
    hosts.kill_all()
    hosts.link(1, True)


def transformers_texts(path: str, prompts, n: int) -> list[str]:
    """Greedy continuations by transformers' own generate, decoded by the checkpoint's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    out = []
    with torch.no_grad():
        for p in prompts:
            g = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))
            out.append(tok.decode(g[0, len(p):].tolist(), skip_special_tokens=True))
    return out


def _wait(p: subprocess.Popen, timeout_s: float) -> int | None:
    try:
        return p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


def test_mla_two_hosts_torchrun_then_cut_link(hosts, checkpoints, tmp_path):
    """DeepSeek-V3 (MLA), 2 hosts x 2 ranks, one plain torchrun per host."""
    path = checkpoints["deepseek_v3"]
    want = transformers_texts(path, PROMPTS, 8)
    port, master_port, timeout = free_port(), free_port(), 6
    serve = ["--model", path, *ARGS, "--host", "0.0.0.0", "--port", str(port), "--dist-timeout", str(timeout)]
    logs = [str(tmp_path / "host0.log"), str(tmp_path / "host1.log")]
    procs = [hosts.run(n, torchrun(hosts, n, 2, master_port, serve), logs[n]) for n in (0, 1)]
    url = hosts.wait_healthy(port, procs, logs)
    assert asyncio.run(_complete_all(url, PROMPTS, 8)) == want
    log0, log1 = read(logs[0]), read(logs[1])
    # The address each rank uses, and why, is in its start-up log.
    for r in (0, 1):
        assert f"rank {r} reaches the other ranks from {hosts.addr[0]} on {hosts.ifname[0]}" in log0
    for r in (2, 3):
        assert (f"rank {r} reaches the other ranks from {hosts.addr[1]} on {hosts.ifname[1]}, because it routes to "
                f"MASTER_ADDR {hosts.addr[0]}") in log1
    assert f"rank 3: {hosts.addr[1]} on {hosts.ifname[1]} (node 1)" in log0  # rank 0's table of every rank
    assert f"front end sockets bound on {hosts.addr[0]}" in log0
    ranks = {int(line.split(" -> rank ", 1)[1].split()[0]) for line in log0.splitlines() if " -> rank " in line}
    assert ranks & {2, 3}, "no request reached host 1's ranks"

    # Cut host 1's link while a long request streams.
    def long_request():
        try:
            httpx.post(url + "/v1/completions", timeout=90,
                       json={"prompt": [5, 6, 7], "max_tokens": 900, "ignore_eos": True})
        except httpx.HTTPError:
            pass

    threading.Thread(target=long_request, daemon=True).start()
    time.sleep(2.0)
    hosts.link(1, False)
    t0 = time.monotonic()
    rc0 = _wait(procs[0], timeout + 20)
    took0 = time.monotonic() - t0
    assert rc0 is not None, "host 0's job still runs after its peers were cut off:\n" + read(logs[0])[-3000:]
    assert rc0 != 0
    log0 = read(logs[0])
    lost = [line for line in log0.splitlines() if "dead or hung; stopping the job" in line]
    assert lost and all("rank 2 " in line and "rank 3 " in line for line in lost), log0[-3000:]
    assert took0 < timeout + 15, took0
    # Host 1, cut off from node 0's store, stops too rather than waiting on TCP for many minutes.
    rc1 = _wait(procs[1], 2 * timeout + 20)
    assert rc1 is not None and rc1 != 0, read(logs[1])[-3000:]
    assert "has lost node 0" in read(logs[1])
    # Each host's job has ended, and with it every process it started (rank 0's front end, which
    # holds the HTTP port, included): no margin, the launcher reaps its children before it exits.
    assert hosts.pids(0) == [] and hosts.pids(1) == []


def test_gqa_two_hosts_launch_with_overlap(hosts, checkpoints, tmp_path):
    """Qwen3-MoE (GQA) with two-batch overlap, `moe-serve launch` on each host; a clean stop."""
    path = checkpoints["qwen3_moe"]
    want = transformers_texts(path, PROMPTS, 6)
    port, master_port = free_port(), free_port()
    serve = ["--model", path, *ARGS, "--host", "0.0.0.0", "--port", str(port), "--enable-overlap",
             "--overlap-min-tokens", "1"]
    logs = [str(tmp_path / "host0.log"), str(tmp_path / "host1.log")]
    procs = [hosts.run(n, launch(n, 2, hosts.addr[0], master_port, serve), logs[n]) for n in (0, 1)]
    url = hosts.wait_healthy(port, procs, logs)
    assert asyncio.run(_complete_all(url, PROMPTS[:1], 6)) == want[:1]
    assert asyncio.run(_complete_all(url, PROMPTS, 6)) == want
    assert f"node 1 reaches the job from {hosts.addr[1]} on {hosts.ifname[1]}" in read(logs[1])
    log0 = read(logs[0])
    pid0 = next(int(line.split("pid ")[1].split(",")[0]) for line in log0.splitlines() if "rank 0 of 4" in line)
    os.kill(pid0, signal.SIGTERM)  # rank 0 drains, then every rank of both hosts stops
    assert _wait(procs[0], 60) == 0, read(logs[0])[-3000:]
    assert _wait(procs[1], 60) == 0, read(logs[1])[-3000:]


def _ends(hosts: TwoHosts, runs: list[tuple[int, list[str], dict | None]], tmp_path, limit_s: float):
    """Start each (host, command, env); every process must end, non-zero, within limit_s. Returns
    their logs."""
    logs = [str(tmp_path / f"run{i}.log") for i in range(len(runs))]
    procs = [hosts.run(h, cmd, log, env) for (h, cmd, env), log in zip(runs, logs)]
    t0 = time.monotonic()
    for p, log in zip(procs, logs):
        rc = _wait(p, max(1.0, limit_s - (time.monotonic() - t0)))
        assert rc is not None, f"still running after {limit_s}s:\n{read(log)[-3000:]}"
        assert rc != 0, read(log)[-3000:]
    return [read(x) for x in logs]


def _no_trace(log: str) -> None:
    """The ranks stopped on a named error, not an unexpected exception or gloo's own failure."""
    import re

    assert not re.search(r"moe_serve\.launcher: rank \d+ failed", log) and "connectFullMesh" not in log, log[-3000:]


@pytest.fixture
def model(checkpoints):
    return checkpoints["qwen3_moe"]


def test_launch_wrong_master_addr(hosts, model, tmp_path):
    serve = ["--model", model, "--dist-join-timeout", "4"]
    # Node 1 given an address nobody has: it says what it tried from which interface.
    (log,) = _ends(hosts, [(1, launch(1, 2, hosts.unused, free_port(), serve), None)], tmp_path, 25)
    assert f"cannot reach the job's store at MASTER_ADDR {hosts.unused}" in log
    assert f"from {hosts.addr[1]} on {hosts.ifname[1]}" in log and "--master-addr" in log
    # Node 0 given another host's address: node 0 hosts the store, so that is a mistake at once.
    (log,) = _ends(hosts, [(0, launch(0, 2, hosts.addr[1], free_port(), serve), None)], tmp_path, 15)
    assert f"--master-addr {hosts.addr[1]} is not an address of this host" in log
    assert f"{hosts.ifname[0]} ({hosts.addr[0]})" in log


def test_launch_node_that_never_joins(hosts, model, tmp_path):
    (log,) = _ends(hosts, [(0, launch(0, 2, hosts.addr[0], free_port(), ["--model", model, "--dist-join-timeout",
                                                                             "4"]), None)], tmp_path, 30)
    assert "only 1 of 2 nodes joined within 4s (--dist-join-timeout)" in log


def test_launch_ports_taken(hosts, model, tmp_path):
    # Two ports held on host 0, picked there (a port free in this namespace may still be in use, or
    # in TIME_WAIT, in host 0's).
    holder = hosts.run(0, [sys.executable, "-c", """
import socket, time
held = []
for _ in range(2):
    s = socket.socket(); s.bind(("", 0)); s.listen(); held.append(s)
print("held", *(s.getsockname()[1] for s in held), flush=True); time.sleep(60)"""], str(tmp_path / "holder.log"))
    deadline = time.monotonic() + 60
    while "held" not in read(str(tmp_path / "holder.log")):
        assert holder.poll() is None and time.monotonic() < deadline, read(str(tmp_path / "holder.log"))
        time.sleep(0.1)
    store_port, http_port = (int(p) for p in read(str(tmp_path / "holder.log")).split()[1:3])
    serve = ["--model", model, "--port", str(http_port)]
    (log,) = _ends(hosts, [(0, launch(0, 2, hosts.addr[0], store_port, serve), None)], tmp_path, 15)
    assert f"port {store_port} on this host is taken" in log and "--master-port" in log
    (log,) = _ends(hosts, [(0, launch(0, 2, hosts.addr[0], free_port(), serve), None)], tmp_path, 15)
    assert f"--port {http_port} on this host is taken" in log


def test_wrong_interface(hosts, model, tmp_path):
    serve = ["--model", model, "--dist-join-timeout", "6"]
    # No such interface: named, with the ones there are.
    (log,) = _ends(hosts, [(1, launch(1, 2, hosts.addr[0], free_port(), serve + ["--dist-interface", "eth9"]),
                            None)], tmp_path, 15)
    assert "--dist-interface=eth9: this host has no interface of that name" in log and hosts.ifname[1] in log
    # Plain torchrun on both hosts, host 1 told to use loopback: its ranks say their interface does
    # not reach node 0; host 0's ranks name the ranks that never joined. Nobody hangs.
    port = free_port()
    log0, log1 = _ends(hosts, [(0, torchrun(hosts, 0, 2, port, serve), None),
                               (1, torchrun(hosts, 1, 2, port, serve), {"GLOO_SOCKET_IFNAME": "lo"})], tmp_path, 45)
    assert "lo's address 127.0.0.1 cannot send to" in log1 and "GLOO_SOCKET_IFNAME (set by the user)" in log1
    assert "ranks 2, 3 did not join within 6s" in log0
    _no_trace(log0)
    _no_trace(log1)


def test_loopback_advertised_across_hosts(hosts, model, tmp_path):
    """Host 0 forced onto loopback (the failure the host name used to cause): it can still reach its
    own store, but every rank refuses to form a job in which host 1 would be told to connect to
    127.0.0.1, and says which ranks and what to set."""
    port = free_port()
    serve = ["--model", model, "--dist-join-timeout", "20"]
    log0, log1 = _ends(hosts, [(0, torchrun(hosts, 0, 2, port, serve), {"GLOO_SOCKET_IFNAME": "lo"}),
                               (1, torchrun(hosts, 1, 2, port, serve), None)], tmp_path, 60)
    for log in (log0, log1):
        assert "ranks 0, 1 would advertise a loopback address (127.0.0.1 on lo)" in log, log[-3000:]
        assert "--dist-interface" in log
        _no_trace(log)


def test_elastic_two_hosts_link_cut_keeps_serving(hosts, checkpoints, tmp_path):
    """Elastic EP, 2 hosts x 2 ranks: host 1's link is cut while 16 streams run; host 0's ranks
    regroup within the collective and heartbeat timeouts and every stream finishes with the
    single-process engine's text; host 1's cores, cut off from node 0's store, stop."""
    from moe_serve import LLM, SamplingParams
    from tests.distributed import test_elastic_ep as el

    path = checkpoints["qwen3_moe"]
    llm = LLM(path, dtype="float32", kv_cache_memory=4 << 20, show_progress=False)
    want = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in el.PROMPTS], SamplingParams(
        temperature=0, max_tokens=el.MAX_TOKENS, ignore_eos=True))]
    port, master_port = free_port(), free_port()
    serve = ["--model", path, *el.ARGS, "--host", "0.0.0.0", "--port", str(port), "--elastic-timeout", "3",
             "--elastic-heartbeat-timeout", "2"]
    logs = [str(tmp_path / "host0.log"), str(tmp_path / "host1.log")]
    procs = [hosts.run(n, torchrun(hosts, n, 2, master_port, serve), logs[n]) for n in (0, 1)]
    url = hosts.wait_healthy(port, procs, logs)
    assert len(el.ranks(url)["ranks"]) == 4
    health: list[float] = []
    got = asyncio.run(el.stream_all(url, [(0.0, lambda: hosts.link(1, False))], health))
    assert got == want
    assert max(health) < 1.0, max(health)
    r = el.ranks(url)
    assert [x["rank"] for x in r["ranks"]] == [0, 1] and r["lost"] == [2, 3], r
    assert el.metric(url, "moe_serve:elastic_recoveries_total") == 1
    seconds = el.metric(url, "moe_serve:elastic_recovery_seconds_sum")
    assert 0 < seconds < 15, seconds  # the collective timeout (3 s) and the heartbeat's (2 s), not minutes
    assert el.no_blocks_held(url)
    assert asyncio.run(el.stream_all(url)) == want  # and it goes on serving
    deadline = time.monotonic() + 30
    while "has lost node 0" not in read(logs[1]):
        assert time.monotonic() < deadline, read(logs[1])[-3000:]
        time.sleep(0.5)
