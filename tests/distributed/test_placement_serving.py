"""Expert placement end to end: record expert load from a live server, tune a placement with
replicated hot experts from it, serve with it on 2 and 4 ranks: greedy outputs are unchanged."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from moe_serve import LLM, SamplingParams
from tests.distributed.jobs import TorchrunJob
from tests.distributed.test_launcher import ARGS, PROMPTS, _complete_all, expected_texts
from tests.e2e.server import ServerProcess

TOP_K = 3  # the tiny Qwen3-MoE checkpoint: 8 experts, top-3, MoE layers 0 and 2


@pytest.fixture(scope="module")
def recorded_load(checkpoints, tmp_path_factory):
    """Expert load recorded by a real server over HTTP (/expert_load/start, requests, /dump)."""
    s = ServerProcess(["--model", checkpoints["qwen3_moe"], "--dtype", "float32", "--kv-cache-memory", str(4 << 20),
                       "--expert-load-window", "2"])
    try:
        assert httpx.post(s.url + "/expert_load/start", timeout=10).status_code == 200
        asyncio.run(_complete_all(s.url, PROMPTS * 3, 8))
        load = httpx.get(s.url + "/expert_load/dump", timeout=10).json()
    finally:
        assert s.stop() == 0
    path = tmp_path_factory.mktemp("load") / "load.json"
    path.write_text(json.dumps(load))
    return load, str(path)


def test_recorded_load_is_consistent(recorded_load):
    load, _ = recorded_load
    windows = load["expert_load"]
    assert len(windows) >= 3 and all(len(w) == 2 and all(len(layer) == 8 for layer in w) for w in windows)
    for w in windows:
        # Every token of a step passes both MoE layers and picks TOP_K experts in each.
        assert sum(w[0]) == sum(w[1]) > 0 and sum(w[0]) % TOP_K == 0
    total_tokens = 3 * sum(len(p) + 8 - 1 for p in PROMPTS)
    assert sum(sum(w[0]) for w in windows) <= TOP_K * total_tokens


@pytest.fixture(scope="module")
def tuned_placement(recorded_load, tmp_path_factory):
    _, load_path = recorded_load
    out = tmp_path_factory.mktemp("placement") / "placement.json"
    r = subprocess.run([sys.executable, "-m", "moe_serve.entrypoints.cli", "placement", "tune", "--load", load_path,
                        "--gpus", "4", "--nodes", "2", "--slots", "12", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    p = json.loads(out.read_text())
    assert all(len(layer) == 12 and set(layer) == set(range(8)) for layer in p["physical_to_logical"])
    return str(out)


def test_placement_cli_errors_name_the_field(recorded_load, tmp_path):
    _, load_path = recorded_load
    r = subprocess.run([sys.executable, "-m", "moe_serve.entrypoints.cli", "placement", "tune", "--load", load_path,
                        "--gpus", "5", "--nodes", "1", "--slots", "12", "--out", str(tmp_path / "p.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "slots" in r.stderr


def test_single_process_with_placement_matches(checkpoints, tuned_placement):
    path = checkpoints["qwen3_moe"]
    want = expected_texts(path, PROMPTS, 8)
    llm = LLM(path, dtype="float32", kv_cache_memory=4 << 20, show_progress=False, expert_placement=tuned_placement)
    assert any(m.replica_map is not None for m in llm.engine.runner.model.modules() if hasattr(m, "replica_map"))
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=8))
    assert [o.outputs[0].text for o in got] == want


@pytest.mark.parametrize("nproc", [4])  # the placement's 4-way shards: replicas on several ranks
def test_ep_serving_with_tuned_placement_matches(checkpoints, tuned_placement, nproc):
    path = checkpoints["qwen3_moe"]
    want = expected_texts(path, PROMPTS, 8)
    job = TorchrunJob(nproc, ["--model", path, *ARGS, "--expert-placement", tuned_placement, "--expert-load-window", "2"])
    try:
        assert asyncio.run(_complete_all(job.url, PROMPTS, 8)) == want
        assert "expert placement" in job.log()
        # Recording across ranks: every window is summed over the ranks.
        httpx.post(job.url + "/expert_load/start", timeout=10)
        asyncio.run(_complete_all(job.url, PROMPTS, 8))
        load = httpx.get(job.url + "/expert_load/dump", timeout=10).json()["expert_load"]
        assert load and all(sum(w[0]) == sum(w[1]) > 0 for w in load)
        os.kill(job.rank_pid(0), signal.SIGTERM)
        assert job.wait(60) == 0
    finally:
        job.kill()
