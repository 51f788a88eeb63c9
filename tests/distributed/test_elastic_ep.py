"""Elastic expert parallelism under torchrun: real processes over gloo, ranks killed with SIGKILL.

Every stream in flight when a rank dies completes with the single-process engine's greedy text
(its requests are resubmitted with the tokens already streamed), /health answers throughout, the
members regroup (GET /ranks, the metrics), a replacement joins back, a planned scale-down leaves
the job serving, and no survivor holds a KV block once the requests are done. A rank lost during
an expert-rebalancing transfer, and a second rank lost while the first loss is being recovered,
end in another regroup; losing rank 0 ends the job with an error naming it.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from moe_serve import LLM, SamplingParams
from tests.distributed.jobs import TorchrunJob
from tests.e2e.server import free_port

ARGS = ["--dtype", "float32", "--kv-cache-memory", str(4 << 20), "--max-num-batched-tokens", "16",
        "--enable-elastic-ep", "--dist-timeout", "20", "--elastic-timeout", "2", "--elastic-heartbeat-timeout", "2"]
PROMPTS = [[5 + i, 77, 301 + i, 42] for i in range(16)]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def want(checkpoints) -> list[str]:
    llm = LLM(checkpoints["qwen3_moe"], dtype="float32", kv_cache_memory=4 << 20, show_progress=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


def ranks(url: str) -> dict:
    return httpx.get(url + "/ranks", timeout=5).json()


def metric(url: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def kill_core(url: str, rank: int) -> int:
    pid = next(r["pid"] for r in ranks(url)["ranks"] if r["rank"] == rank)
    os.kill(pid, signal.SIGKILL)
    return pid


async def stream_all(url: str, kills=(), health: list | None = None) -> list[str]:
    """Stream every prompt at once; once every stream has its first tokens, run each (delay, fn)
    of `kills` in turn; poll /health (each answer's latency into `health`) until all are done."""
    started = asyncio.Event()
    first: set[int] = set()

    async def one(h, i, p):
        text = ""
        body = {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
        async with h.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    d = json.loads(line[6:])
                    assert "error" not in d, d
                    text += d["choices"][0]["text"]
                    first.add(i)
                    if len(first) == len(PROMPTS):
                        started.set()
        return text

    async with httpx.AsyncClient(timeout=120) as h:
        tasks = [asyncio.create_task(one(h, i, p)) for i, p in enumerate(PROMPTS)]
        if kills:
            await asyncio.wait_for(started.wait(), 60)
            for delay, fn in kills:
                await asyncio.sleep(delay)
                fn()
        while health is not None and not all(t.done() for t in tasks):
            t0 = time.monotonic()
            r = await h.get(url + "/health", timeout=5)
            health.append(time.monotonic() - t0)
            assert r.status_code == 200, r.text
            await asyncio.sleep(0.05)
        return await asyncio.gather(*tasks)


def no_blocks_held(url: str) -> bool:
    return metric(url, "moe_serve:kv_blocks_in_use") == 0 and metric(url, "moe_serve:num_requests_running") == 0


def test_lost_rank_recovers_then_a_replacement_joins(checkpoints, want, tmp_path):
    path, master_port = checkpoints["qwen3_moe"], free_port()
    job = TorchrunJob(4, ["--model", path, *ARGS], rdzv_port=master_port)
    joiner = None
    try:
        r = ranks(job.url)
        assert [x["rank"] for x in r["ranks"]] == [0, 1, 2, 3] and r["generation"] == 0
        assert all(x["expert_slots"] == 2 for x in r["ranks"])  # 8 experts over 4 ranks
        # Every core runs in a process of its own, which the torchrun worker supervises.
        assert len({x["pid"] for x in r["ranks"]}) == 4
        assert "elastic EP: the engine core runs in process" in job.log()

        health: list[float] = []
        got = asyncio.run(stream_all(job.url, [(0.0, lambda: kill_core(job.url, 2))], health))
        assert got == want
        assert max(health) < 1.0, max(health)
        r = ranks(job.url)
        assert r["world_size"] == 3 and [x["rank"] for x in r["ranks"]] == [0, 1, 3] and r["lost"] == [2]
        assert [x["ep_rank"] for x in r["ranks"]] == [0, 1, 2] and r["state"] == "serving"
        assert all(x["expert_slots"] == 3 for x in r["ranks"])  # ceil(8 / 3): one expert replicated
        assert metric(job.url, "moe_serve:ep_world_size") == 3
        assert metric(job.url, "moe_serve:elastic_recoveries_total") == 1
        assert metric(job.url, "moe_serve:elastic_recovery_seconds_count") == 1
        assert 0 < metric(job.url, "moe_serve:elastic_recovery_seconds_sum") < 10
        # The streams were mid-way: each was resubmitted with the tokens it had streamed.
        assert metric(job.url, "moe_serve:elastic_requests_resubmitted_total") >= 1
        assert no_blocks_held(job.url)
        assert "rank 2's engine core exited with signal 9; the other ranks go on without it" in job.log()

        # A replacement started with the launcher and --elastic-join takes the free id.
        log = open(tmp_path / "joiner.log", "w")
        joiner = subprocess.Popen([sys.executable, "-m", "moe_serve.entrypoints.cli", "launch", "--nproc-per-node", "1",
                                   "--", "--model", path, *ARGS, "--elastic-join", f"127.0.0.1:{master_port}"],
                                  stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                                  start_new_session=True)
        deadline = time.monotonic() + 90
        while ranks(job.url)["world_size"] != 4:
            assert time.monotonic() < deadline and joiner.poll() is None, (tmp_path / "joiner.log").read_text()[-3000:]
            time.sleep(0.2)
        r = ranks(job.url)
        assert [x["rank"] for x in r["ranks"]] == [0, 1, 2, 3] and r["lost"] == []
        core_pid = next(x["pid"] for x in r["ranks"] if x["rank"] == 2)
        with open(f"/proc/{core_pid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == joiner.pid  # the launcher's child
        # The replacement's core runs in its torchrun worker (torchrun exported 1 there): set in-process.
        assert group_settings((tmp_path / "joiner.log").read_text(), 2, r["generation"])[
            "TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
        before = job.log().count(" -> rank 2 ")
        assert asyncio.run(stream_all(job.url)) == want
        assert job.log().count(" -> rank 2 ") > before  # the replacement serves
        assert metric(job.url, "moe_serve:elastic_recoveries_total") == 1  # a join is not a recovery

        # Another loss: the replacement, which took a dead rank's id, is not taken for it.
        assert asyncio.run(stream_all(job.url, [(0.0, lambda: kill_core(job.url, 1))], [])) == want
        # (on a busy machine the streams can end before the survivors' next collective finds the loss)
        deadline = time.monotonic() + 90
        while [x["rank"] for x in ranks(job.url)["ranks"]] != [0, 2, 3]:
            assert time.monotonic() < deadline, ranks(job.url)
            time.sleep(0.2)

        # A planned scale-down (vLLM's shape): the highest ids leave at a step boundary.
        resp = httpx.post(job.url + "/scale_elastic_ep", json={"new_data_parallel_size": 2}, timeout=60)
        assert resp.status_code == 200, resp.text
        assert [x["rank"] for x in resp.json()["ranks"]] == [0, 2]
        bad = httpx.post(job.url + "/scale_elastic_ep", json={"new_data_parallel_size": 3}, timeout=10)
        assert bad.status_code == 400 and "--elastic-join" in bad.json()["error"]["message"]
        assert "rank 3 leaves the job (a planned scale-down to 2 ranks)" in job.log()
        assert asyncio.run(stream_all(job.url)) == want
        assert no_blocks_held(job.url)

        os.kill(ranks(job.url)["ranks"][0]["pid"], signal.SIGTERM)  # drains, then stops every rank
        assert job.wait(60) == 0, job.log()[-3000:]
        assert joiner.wait(30) == 0
    finally:
        if joiner is not None and joiner.poll() is None:
            os.killpg(joiner.pid, signal.SIGKILL)
        job.kill()


def test_loss_during_rebalance_then_two_losses_in_a_row(checkpoints, want, monkeypatch):
    # EP rank 3 SIGKILLs itself right after posting its part of the first rebalance's transfer
    # (expert_parallel/rebalance/eplb.py's test hook), its peers' receives pending.
    monkeypatch.setenv("MOE_SERVE_EPLB_KILL_DURING_TRANSFER", "3:0")
    # Rank 1 dies while generation 2 (after rank 2's loss) is built: rank 0 waits in the rendezvous
    # of a group the engine makes (a store wait), which only its loss being seen ends.
    monkeypatch.setenv("MOE_SERVE_ELASTIC_DIE_IN_BUILD", "1:2")
    job = TorchrunJob(4, ["--model", checkpoints["qwen3_moe"], *ARGS, "--enable-eplb", "--eplb-step-interval", "4",
                          "--eplb-window-size", "8", "--num-redundant-experts", "4"])
    try:
        assert asyncio.run(stream_all(job.url, health=[])) == want
        assert "killing itself during the transfer" in job.log()
        r = ranks(job.url)
        assert [x["rank"] for x in r["ranks"]] == [0, 1, 2] and r["lost"] == [3]
        assert all(x["expert_slots"] == 4 for x in r["ranks"])  # 8 + 4 redundant slots over 3 ranks
        assert no_blocks_held(job.url)

        # Rank 2, then rank 1 while the first loss is being recovered.
        got = asyncio.run(stream_all(job.url, [(0.0, lambda: kill_core(job.url, 2))], []))
        assert got == want
        log = job.log()
        assert "rank 1: dying while generation 2 is built" in log
        # Rank 0 ended its wait on seeing the loss, not at the store's timeout.
        assert "in this build (generation 2): rank 1 is lost" in log, log[-4000:]
        assert "failed to form" not in log or "timeout after" not in log.split("failed to form", 1)[1][:300]
        r = ranks(job.url)
        assert [x["rank"] for x in r["ranks"]] == [0] and sorted(r["lost"]) == [1, 2, 3]
        assert metric(job.url, "moe_serve:elastic_recoveries_total") >= 2
        assert no_blocks_held(job.url)
        assert asyncio.run(stream_all(job.url)) == want  # one rank holds every expert now
    finally:
        job.kill()


def test_slow_rank_is_waited_for_not_regrouped(checkpoints, want, monkeypatch):
    """Rank 1 sleeps inside a step for twice --elastic-timeout (a long prefill chunk), its heartbeat
    beating: rank 0 waits for it in the step's collectives, asks the membership once the step has
    lasted --elastic-timeout, finds every member alive, and goes on waiting. The job keeps its
    members and its generation, and every stream completes with the single-process text."""
    monkeypatch.setenv("MOE_SERVE_ELASTIC_STALL", "1:4")
    job = TorchrunJob(2, ["--model", checkpoints["qwen3_moe"], *ARGS])
    try:
        r = ranks(job.url)
        # What every core process was started with, and what its groups run with, read back.
        for x in r["ranks"]:
            with open(f"/proc/{x['pid']}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            assert env[b"TORCH_NCCL_ASYNC_ERROR_HANDLING"] == b"2", env.get(b"TORCH_NCCL_ASYNC_ERROR_HANDLING")
        for rank in (0, 1):
            settings = group_settings(job.log(), rank, 0)
            assert settings["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
            # Serving collectives wait --dist-timeout (20 s) for a peer alive, not --elastic-timeout.
            assert settings["cpu_group"] == {"backend": "gloo", "timeout_s": 20.0}
            assert settings["ep_group"] == {"backend": "gloo", "timeout_s": 20.0}
        assert asyncio.run(stream_all(job.url, health=[])) == want
        log = job.log()
        assert "rank 1: stalling 4.0s inside this step" in log
        r = ranks(job.url)
        assert r["generation"] == 0 and r["world_size"] == 2 and r["lost"] == [], r
        assert metric(job.url, "moe_serve:elastic_recoveries_total") == 0
        assert "regrouping" not in log and "ending the wait" not in log, log[-3000:]
        assert no_blocks_held(job.url)
    finally:
        job.kill()


@pytest.mark.gpu
def test_nccl_survivor_waits_for_a_slow_rank_then_regroups(checkpoints, monkeypatch):
    """The same over NCCL, one GPU per rank (NCCL refuses two ranks on one device, so 2 GPUs): the
    cores run with TORCH_NCCL_ASYNC_ERROR_HANDLING=2, a rank stalled for twice --elastic-timeout is
    waited for, and when rank 1's core is killed mid-stream rank 0's process survives (NCCL's
    watchdog does not tear it down), regroups alone and completes every stream."""
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < 2:
        pytest.skip(f"needs 2 CUDA devices for an NCCL job of 2 ranks, found {have}")
    path = checkpoints["qwen3_moe"]
    llm = LLM(path, dtype="float32", kv_cache_memory=4 << 20, show_progress=False, device="cuda")
    want_cuda = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    del llm
    monkeypatch.setenv("MOE_SERVE_ELASTIC_STALL", "1:4")
    job = TorchrunJob(2, ["--model", path, *ARGS, "--device", "cuda"])
    try:
        for rank in (0, 1):
            settings = group_settings(job.log(), rank, 0)
            assert settings["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
            assert settings["ep_group"] == {"backend": "nccl", "timeout_s": 20.0}
        assert asyncio.run(stream_all(job.url, health=[])) == want_cuda
        assert ranks(job.url)["generation"] == 0 and "rank 1: stalling 4.0s" in job.log()
        pid0 = next(x["pid"] for x in ranks(job.url)["ranks"] if x["rank"] == 0)
        assert asyncio.run(stream_all(job.url, [(0.0, lambda: kill_core(job.url, 1))], [])) == want_cuda
        r = ranks(job.url)
        assert [x["rank"] for x in r["ranks"]] == [0] and r["lost"] == [1] and r["ranks"][0]["pid"] == pid0, r
        assert no_blocks_held(job.url)
    finally:
        job.kill()


def group_settings(log: str, rank: int, generation: int) -> dict:
    mark = f"generation {generation}: rank {rank}'s groups: "
    line = next(x for x in log.splitlines() if mark in x)
    return json.loads(line.split(mark, 1)[1])


def test_rank0_loss_ends_the_job_naming_it(checkpoints):
    from tests.distributed.test_launcher import _children

    job = TorchrunJob(2, ["--model", checkpoints["qwen3_moe"], *ARGS])
    try:
        (frontend,) = _children(next(x["pid"] for x in ranks(job.url)["ranks"] if x["rank"] == 0))
        kill_core(job.url, 0)
        rc = job.wait(60)
        assert rc != 0
        assert "rank 0 hosts the front end, and an elastic job cannot lose it; the job ends" in job.log()
        # The core's front end, orphaned, died with it and was reaped before the job ended.
        assert not os.path.exists(f"/proc/{frontend}")
    finally:
        job.kill()


def test_elastic_flags_are_checked(checkpoints):
    from moe_serve.entrypoints.cli_args import check_elastic_args
    from launcher.worker import parse

    def err(*flags):
        with pytest.raises(ValueError) as e:
            check_elastic_args(parse(["serve", "--model", "m", *flags]))
        return str(e.value)

    assert "--elastic-join needs --enable-elastic-ep" in err("--elastic-join", "h:1")
    assert "--elastic-timeout" in err("--enable-elastic-ep", "--elastic-timeout", "0")
    assert "HOST:PORT" in err("--enable-elastic-ep", "--elastic-join", "nohost")
    assert "--disaggregation-mode" in err("--enable-elastic-ep", "--disaggregation-mode", "decode")
    # Outside torchrun there is no job store to hold the membership: refused, naming what to do.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "TORCHELASTIC_USE_AGENT_STORE")}
    p = subprocess.run([sys.executable, "-m", "launcher", "serve", "--model", checkpoints["qwen3_moe"], "--dtype",
                        "float32", "--enable-elastic-ep"], env=dict(env, MOE_SERVE_ELASTIC_CORE="1"),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "runs under torchrun" in p.stderr
