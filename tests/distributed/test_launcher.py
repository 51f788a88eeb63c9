"""Expert-parallel serving under torchrun: real processes over gloo, one OpenAI endpoint on rank 0.

Greedy text through HTTP must equal the single-process engine's for every architecture at 2 and
4 ranks, with requests spread over the ranks (and some ranks idle in some steps). Faults: a killed
rank stops the whole job with an error naming it; SIGTERM on a follower rank stops it cleanly.
"""
from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from moe_serve import LLM, SamplingParams
from tests.distributed.jobs import TorchrunJob

PROMPTS = [[5, 77, 301, 42], [9, 8, 7, 6, 5, 4, 3, 200, 100], [450, 12], [33, 34, 35, 36, 37, 38], [100] * 20]
ARGS = ["--dtype", "float32", "--kv-cache-memory", str(4 << 20), "--max-num-batched-tokens", "16"]


def expected_texts(path: str, prompts, max_tokens: int) -> list[str]:
    llm = LLM(path, dtype="float32", kv_cache_memory=4 << 20, show_progress=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens))
    return [o.outputs[0].text for o in outs]


async def _complete_all(url: str, prompts, max_tokens: int) -> list[str]:
    async with httpx.AsyncClient(timeout=120) as h:
        async def one(p):
            r = await h.post(url + "/v1/completions", json={"prompt": p, "max_tokens": max_tokens, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        return await asyncio.gather(*[one(p) for p in prompts])


# EP 4 without overlap for DeepSeek-V3 here; the others at EP 4 in test_overlap_ep.py and
# test_eplb_serving.py (Qwen3-MoE EP 4 with rebalances; Mixtral at EP 2 there and at EP 4 with
# overlap in test_overlap_ep.py).
# DeepSeek-V3 at EP 2: test_eplb_serving.py, test_spec_decode_ep.py, test_decode_capturable_ep.py.
@pytest.mark.parametrize("arch, nproc", [("qwen3_moe", 2), ("deepseek_v3", 4)])
def test_ep_serving_matches_single_process(checkpoints, arch, nproc):
    path = checkpoints[arch]
    want = expected_texts(path, PROMPTS, 8)
    job = TorchrunJob(nproc, ["--model", path, *ARGS])
    try:
        # One request alone: every other rank runs empty forwards in lockstep.
        assert asyncio.run(_complete_all(job.url, PROMPTS[:1], 8)) == want[:1]
        # All at once: they spread over the ranks.
        assert asyncio.run(_complete_all(job.url, PROMPTS, 8)) == want
        ranks = {int(line.split(" -> rank ", 1)[1].split()[0]) for line in job.log().splitlines() if " -> rank " in line}
        assert ranks == set(range(nproc)) if nproc <= len(PROMPTS) else len(ranks) > 1
        for r in range(1, nproc):
            assert f"[rank {r}] moe_serve.model_runner: model" in job.log()
        import os

        os.kill(job.rank_pid(0), signal.SIGTERM)  # rank 0 drains, then tells every rank to stop
        assert job.wait(60) == 0
        assert "server stopped" in job.log()
    finally:
        job.kill()


def test_killed_rank_stops_job_with_named_error(checkpoints):
    job = TorchrunJob(2, ["--model", checkpoints["mixtral"], *ARGS, "--dist-timeout", "20"])
    try:
        pid1 = job.rank_pid(1)

        def long_request():
            try:
                httpx.post(job.url + "/v1/completions", timeout=90,
                           json={"prompt": [5, 6, 7], "max_tokens": 900, "ignore_eos": True})
            except httpx.HTTPError:
                pass

        import threading

        t = threading.Thread(target=long_request, daemon=True)
        t.start()
        time.sleep(2.0)
        import os

        os.kill(pid1, signal.SIGKILL)
        t0 = time.monotonic()
        rc = job.wait(60)
        assert time.monotonic() - t0 < 60
        assert rc != 0
        log = job.log()
        assert "rank: 1" in log or "rank 1 " in log, log[-3000:]
    finally:
        job.kill()


def _children(pid: int) -> list[int]:
    import os

    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _exists(pid: int) -> bool:
    import os

    return os.path.exists(f"/proc/{pid}")


def test_hung_rank_stops_rank0_with_its_front_end_reaped(checkpoints):
    """Rank 1 hangs (SIGSTOP): rank 0's watchdog ends rank 0 after --dist-timeout, and rank 0's
    front end (its child, which holds the HTTP port) is gone by the time rank 0's process is: torchrun
    signals only the workers still running, so a front end left to notice by itself would outlive
    the job. Clients of the request in flight hear why."""
    import os
    import threading

    job = TorchrunJob(2, ["--model", checkpoints["qwen3_moe"], *ARGS, "--dist-timeout", "4"])
    pid1 = None
    try:
        pid0, pid1 = job.rank_pid(0), job.rank_pid(1)
        (frontend,) = _children(pid0)
        streamed, first = [], threading.Event()

        def long_request():
            body = {"prompt": [5, 6, 7], "max_tokens": 900, "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", job.url + "/v1/completions", json=body, timeout=90) as r:
                    for line in r.iter_lines():
                        streamed.append(line)
                        first.set()
            except httpx.HTTPError as e:
                streamed.append(repr(e))
            first.set()

        t = threading.Thread(target=long_request, daemon=True)
        t.start()
        first.wait(60)
        assert t.is_alive(), streamed  # streaming
        os.kill(pid1, signal.SIGSTOP)
        while _exists(pid0) and open(f"/proc/{pid0}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)  # running until the watchdog ends it (a zombie once it has)
        assert not _exists(frontend), "rank 0 has ended, its front end still runs"
        log = job.log()
        assert "rank 0 waited" in log and "for rank 1 " in log and "dead or hung" in log, log[-3000:]
        t.join(30)
        assert any("dead or hung" in line for line in streamed), streamed[-5:]
    finally:
        if pid1 is not None:
            try:
                os.kill(pid1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.kill()


def test_sigterm_on_follower_rank_stops_job_cleanly(checkpoints):
    job = TorchrunJob(2, ["--model", checkpoints["deepseek_v3"], *ARGS])
    try:
        assert asyncio.run(_complete_all(job.url, PROMPTS[:2], 3))
        import os

        os.kill(job.rank_pid(1), signal.SIGTERM)
        assert job.wait(60) == 0
        assert "rank 1 asked to shut down" in job.log()
    finally:
        job.kill()


def test_moe_serve_launch_wrapper_with_allgather_dispatch(checkpoints, tmp_path):
    """`moe-serve launch --nproc-per-node 2 -- <serve flags>` is torchrun + `launcher serve`."""
    import os
    import subprocess
    import sys

    from tests.e2e.server import free_port

    path = checkpoints["deepseek_v3"]
    want = expected_texts(path, PROMPTS, 5)
    port = free_port()
    log = tmp_path / "launch.log"
    cmd = [sys.executable, "-m", "moe_serve.entrypoints.cli", "launch", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "--", "--model", path, "--port", str(port), "--all2all-backend", "allgather", *ARGS]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert asyncio.run(_complete_all(f"http://127.0.0.1:{port}", PROMPTS, 5)) == want
        assert "allgather dispatch" in log.read_text()
        pid0 = next(int(line.split("pid ")[1].split(",")[0]) for line in log.read_text().splitlines()
                    if "rank 0 of 2" in line)
        os.kill(pid0, signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
