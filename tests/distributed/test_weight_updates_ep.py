"""Weights replaced in place on an expert-parallel job: two ranks under torchrun (gloo, CPU), each
receiving the trainer's broadcast and keeping only its experts' slices. Rank 0's core hears the
calls and broadcasts them to the other rank (engine/features/weights_update.py); the trainer is
rank 0 of a group of 1 + 2 engine ranks.

The trainer pushes perturbed weights while two streamed requests run, one on each rank (paused,
updated, continued): each stream's tokens are transformers' with the old weights while its chunks
carry the old weight_version, then transformers' with the new weights over the KV cache the old
ones wrote (no later request may take that KV as a prefix hit). Afterwards new
requests, spread over both ranks, equal transformers on the new weights; a refused update changes
nothing; a checkpoint loaded from disk serves as transformers does on it."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import time

import httpx
import pytest

from tests.distributed.jobs import TorchrunJob
from tests.e2e.server import free_port
from tests.e2e.test_weight_updates import N, PROMPTS, Stream, _hf, _perturbed, _texts, _write, check_switched

ARGS = ["--dtype", "float32", "--kv-cache-memory", str(4 << 20), "--max-num-batched-tokens", "16"]
STREAM_PROMPTS = [[11, 45, 300, 7, 7, 91], [3, 250, 19, 88]]  # one stream on each rank
STREAM_TOKENS = 160


@pytest.fixture(scope="module")
def base(checkpoints):
    return checkpoints["qwen3_moe"]


@pytest.fixture(scope="module")
def job(base):
    j = TorchrunJob(2, ["--model", base, *ARGS])
    try:
        yield j
    finally:
        j.kill()


def _served(url: str) -> list[str]:
    """PROMPTS at once (they spread over both ranks), greedy, N tokens each."""
    async def run():
        async with httpx.AsyncClient(timeout=120) as h:
            async def one(q):
                r = await h.post(url + "/v1/completions", json={"prompt": q, "max_tokens": N, "temperature": 0,
                                                               "ignore_eos": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]
            return await asyncio.gather(*[one(q) for q in PROMPTS])
    return asyncio.run(run())


def _post(url: str, path: str, body: dict | None = None, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + path, json=body or {}, timeout=timeout)


def _wait_queued(url: str, n: int, timeout_s: float = 120.0) -> None:
    """Until the ranks hold n requests in all (waiting or running: /metrics sums the ranks)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = {}
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                m[name.split("{")[0]] = float(value)
        if m["moe_serve:num_requests_waiting"] + m["moe_serve:num_requests_running"] >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the ranks never held {n} requests: {m}")


def test_ep2_trainer_pushes_mid_stream(job, base, tmp_path):
    from moe_serve.weight_sync import broadcast_tensors, trainer_group

    url = job.url
    assert _served(url) == _texts(base, _hf(base))
    new = _perturbed(base, 1)
    names = sorted(new)
    spec = {"names": names, "dtypes": [str(new[n].dtype) for n in names], "shapes": [list(new[n].shape) for n in names]}
    streams = [Stream(url, p, STREAM_TOKENS) for p in STREAM_PROMPTS]
    # Held while they arrive, so both start in the same step: neither can finish its tokens while
    # the other is still connecting, however busy the machine.
    assert _post(url, "/pause_generation").status_code == 200
    for s in streams:
        s.start()
    with cf.ThreadPoolExecutor(2) as pool:
        try:
            _wait_queued(url, len(streams))
            assert _post(url, "/continue_generation").status_code == 200
            for s in streams:
                assert s.first.wait(120) and s.error is None, s.error
            seen = [len(s.tokens) for s in streams]
            assert _post(url, "/pause_generation").status_code == 200
            port = free_port()
            join = pool.submit(_post, url, "/init_weights_update_group",
                               {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                                "world_size": 3, "group_name": "rl-ep", "backend": "gloo"})
            group = trainer_group("127.0.0.1", port, 3, "rl-ep", "gloo", timeout_s=90)
            r = join.result(timeout=120)
            assert r.status_code == 200, r.text
            assert _post(url, "/update_weights_from_distributed", {**spec, "check_only": True}).status_code == 200
            push = pool.submit(_post, url, "/update_weights_from_distributed", {**spec, "weight_version": "ep-1"})
            broadcast_tensors(group, [new[n] for n in names])
            r = push.result(timeout=180)
            assert r.status_code == 200 and r.json()["weight_version"] == "ep-1", r.text
            assert all(s.is_alive() and s.finish is None for s in streams)  # held by the pause, not finished
            assert _post(url, "/continue_generation").status_code == 200
            for s in streams:
                s.join(120)
        finally:
            _post(url, "/continue_generation")
    ranks = {int(line.split(" -> rank ")[1].split()[0]) for line in job.log().splitlines()
             for s in streams if f"request {s.id}-0-0 -> rank " in line}
    assert ranks == {0, 1}
    pushed = _write(base, str(tmp_path / "pushed"), new)
    for s, n in zip(streams, seen):
        assert not s.is_alive() and s.error is None, s.error
        assert s.finish == "length" and len(s.tokens) == STREAM_TOKENS
        s.ids = check_switched(base, pushed, s, "0", "ep-1", n)
    want = _texts(base, _hf(pushed))
    assert _served(url) == want
    # The stream's blocks hold KV the old weights wrote (or attended over): no later request may
    # reuse them. Its first 32 tokens are two full blocks of 16, the first one a prefix hit if cached.
    prompt = streams[0].prompt + streams[0].ids[:32 - len(streams[0].prompt)]
    r = _post(url, "/v1/completions", {"prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True})
    assert r.json()["choices"][0]["text"] == _texts(base, _hf(pushed, [prompt]))[0]
    r = _post(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0})
    assert r.json()["weight_version"] == "ep-1"

    # A wrong name is refused before anything is broadcast, naming it; nothing changes.
    bad = {k: list(v) for k, v in spec.items()}
    bad["names"][2] = "model.layers.0.mlp.experts.no_such_proj"
    r = _post(url, "/update_weights_from_distributed", bad)
    assert r.status_code == 400 and "no_such_proj" in r.json()["message"], r.text
    assert r.json()["error"]["param"] == "names"
    assert _served(url) == want
    assert httpx.get(url + "/get_weight_version", timeout=10).json()["weight_version"] == "ep-1"
    assert _post(url, "/destroy_weights_update_group").status_code == 200


def test_ep2_update_from_disk(job, base, tmp_path):
    good = _write(base, str(tmp_path / "good"), _perturbed(base, 2))
    r = _post(url := job.url, "/update_weights_from_disk", {"model_path": good, "weight_version": "disk-2"})
    assert r.status_code == 200 and r.json()["weight_version"] == "disk-2", r.text
    assert _served(url) == _texts(base, _hf(good))
    assert _post(url, "/update_weights_from_disk", {"model_path": base}).status_code == 200
    assert _served(url) == _texts(base, _hf(base))
