"""A short expert-load recording through a live server (`--expert-load-record`, /expert_load/*):
fewer steps than one window is not lost. A dump while recording shows the open window, /stop keeps
it, a clean shutdown writes it, and `moe-serve placement tune` accepts the file."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx

from tests.distributed.test_launcher import _complete_all
from tests.e2e.server import ServerProcess

TOP_K, MOE_LAYERS, EXPERTS = 3, 2, 8  # the tiny Qwen3-MoE checkpoint
MAX_TOKENS = 4


def _prompts(first: int, n: int) -> list[list[int]]:
    """n prompts of 12 tokens, each starting with its own token: no prefix-cache hits, so every
    prompt token is computed (and routed) once."""
    return [[first + i] + [(7 * i + j) % 400 + 50 for j in range(11)] for i in range(n)]


def _routed(prompts) -> int:
    """Token copies each MoE layer routes for these requests: every computed token (the prompt,
    then each generated token but the last) goes to TOP_K experts."""
    return TOP_K * sum(len(p) + MAX_TOKENS - 1 for p in prompts)


def _check(load: dict, copies: int) -> int:
    """One window, partial, holding `copies` routed copies per layer; returns its step count."""
    assert load["window_steps"] == 100 and len(load["expert_load"]) == 1, load
    (steps,) = load["window_step_counts"]
    assert 0 < steps < 100
    window = load["expert_load"][0]
    assert len(window) == MOE_LAYERS and all(len(layer) == EXPERTS for layer in window)
    assert [sum(layer) for layer in window] == [copies] * MOE_LAYERS
    return steps


def test_a_short_recording_is_kept_by_dump_stop_and_shutdown(checkpoints, tmp_path):
    record = tmp_path / "load.json"
    s = ServerProcess(["--model", checkpoints["qwen3_moe"], "--dtype", "float32", "--kv-cache-memory", str(4 << 20),
                       "--expert-load-record", str(record)])
    try:
        first, second, third, fourth = _prompts(10, 6), _prompts(20, 5), _prompts(30, 3), _prompts(40, 4)
        asyncio.run(_complete_all(s.url, first, MAX_TOKENS))
        dumped = httpx.get(s.url + "/expert_load/dump", timeout=30).json()
        steps_1 = _check(dumped, _routed(first))  # shown while recording, not closed
        asyncio.run(_complete_all(s.url, second, MAX_TOKENS))
        assert httpx.post(s.url + "/expert_load/stop", timeout=30).status_code == 200
        stopped = httpx.get(s.url + "/expert_load/dump", timeout=30).json()
        assert _check(stopped, _routed(first + second)) > steps_1
        asyncio.run(_complete_all(s.url, third, MAX_TOKENS))  # stopped: not counted
        assert httpx.get(s.url + "/expert_load/dump", timeout=30).json() == stopped
        # Started again, then a clean shutdown without /stop: the file holds the new partial window.
        assert httpx.post(s.url + "/expert_load/start", timeout=30).status_code == 200
        asyncio.run(_complete_all(s.url, fourth, MAX_TOKENS))
    finally:
        assert s.stop() == 0, s.log()
    written = json.loads(record.read_text())
    _check(written, _routed(fourth))
    stopped_path = tmp_path / "stopped.json"
    stopped_path.write_text(json.dumps(stopped))
    for path in (record, stopped_path):
        out = tmp_path / f"placement-{path.stem}.json"
        r = subprocess.run([sys.executable, "-m", "moe_serve.entrypoints.cli", "placement", "tune", "--load", str(path),
                            "--gpus", "2", "--nodes", "1", "--slots", "12", "--out", str(out)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        p = json.loads(out.read_text())
        assert all(len(layer) == 12 and set(layer) == set(range(EXPERTS)) for layer in p["physical_to_logical"])
