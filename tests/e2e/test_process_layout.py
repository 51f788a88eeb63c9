"""The process layout: an HTTP front end and an engine-core process talking over ZMQ.

Real processes only: a `moe-serve serve` server, a core process started by hand against a real
`CoreClient`, raw ZMQ sockets for the malformed messages.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import msgspec
import pytest
import zmq

from moe_serve import LLM, SamplingParams
from moe_serve.engine.args import EngineArgs
from moe_serve.engine.core_client import CoreClient
from moe_serve.protocol import CoreFatal, CoreInput, CoreOutputs, CoreReady, NewRequest, input_encoder
from tests.e2e.server import ServerProcess

PROMPT = [5, 77, 301, 42, 9, 8]


def _poll_health(url: str, stop: threading.Event, lat: list[float]) -> None:
    with httpx.Client(timeout=10) as h:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                h.get(url + "/health")
            except httpx.HTTPError:
                pass
            lat.append(time.monotonic() - t0)
            time.sleep(0.02)


def test_health_stays_fast_while_big_prompts_tokenize_and_16_streams_run(checkpoints):
    s = ServerProcess(["--model", checkpoints["qwen3_moe"], "--dtype", "float32", "--kv-cache-memory", str(8 << 20),
                       "--max-request-body-bytes", str(16 << 20)])
    try:
        lat: list[float] = []
        stop = threading.Event()
        poller = threading.Thread(target=_poll_health, args=(s.url, stop, lat))
        poller.start()
        # Eight long texts that fit max_model_len: each is really tokenized, in the pool, off the loop.
        words = "lorem ipsum dolor sit amet consectetur adipiscing elit".split()
        texts = [" ".join(words[(i + j) % len(words)] for j in range(180)) for i in range(8)]

        async def go():
            async with httpx.AsyncClient(timeout=180) as h:
                async def stream(i):
                    usage = None
                    async with h.stream("POST", s.url + "/v1/completions", json={
                            "prompt": [5, 6, 7 + i], "max_tokens": 160, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {") and '"usage":{' in line:
                                usage = json.loads(line[6:])["usage"]
                    return usage["completion_tokens"]

                async def huge():  # 4 MB: refused from its length alone, without tokenizing
                    t0 = time.monotonic()
                    r = await h.post(s.url + "/v1/completions", json={"prompt": "word " * 800_000, "max_tokens": 4})
                    return r.status_code, r.json(), time.monotonic() - t0

                async def many_long():
                    r = await h.post(s.url + "/v1/completions", json={"prompt": texts, "max_tokens": 1})
                    return r.status_code, r.json()

                return await asyncio.gather(huge(), many_long(), *[stream(i) for i in range(16)])

        (code, body, huge_s), (code2, body2), *chunks = asyncio.run(go())
        stop.set()
        poller.join(30)
        assert code == 400 and body["error"]["param"] == "prompt" and huge_s < 5, (body, huge_s)
        assert code2 == 200 and len(body2["choices"]) == 8 and body2["usage"]["prompt_tokens"] > 8 * 400, body2
        assert all(c == 160 for c in chunks), chunks
        assert len(lat) >= 5 and max(lat) < 1.0, (len(lat), max(lat), huge_s)
    finally:
        assert s.stop() == 0


def test_killed_engine_core_gives_503_and_the_server_exits_naming_it(checkpoints):
    s = ServerProcess(["--model", checkpoints["mixtral"], "--dtype", "float32", "--kv-cache-memory", str(4 << 20)])
    try:
        pid = int(re.search(r"engine core process started \(pid (\d+)\)", s.log()).group(1))
        got = {"lines": []}
        streaming = threading.Event()

        def long_stream():  # 900 tokens: about a second here, so the kill comes while it streams
            with httpx.stream("POST", s.url + "/v1/completions", timeout=60, json={
                    "prompt": [5, 6], "max_tokens": 900, "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line:
                        got["lines"].append(line)
                        streaming.set()

        t = threading.Thread(target=long_stream)
        t.start()
        assert streaming.wait(30)
        os.kill(pid, signal.SIGKILL)
        codes = []
        deadline = time.monotonic() + 10
        while s.proc.poll() is None and time.monotonic() < deadline:
            try:
                codes.append(httpx.get(s.url + "/health", timeout=2).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        t.join(30)
        assert 503 in codes, codes
        assert s.proc.wait(20) != 0
        assert f"engine core process (pid {pid}) exited" in s.log()
        # The stream in flight ended with an error event, not a hang.
        assert any('"error"' in line and "engine" in line for line in got["lines"]), got["lines"][-3:]
        assert got["lines"][-1] == "data: [DONE]"
    finally:
        s.stop()


def test_killed_front_end_leaves_no_engine_core_behind(checkpoints):
    """SIGKILL on the front end while the core streams a long request: the core notices within a
    few seconds and exits (it would otherwise hold its weights and KV cache forever, an orphan)."""
    s = ServerProcess(["--model", checkpoints["qwen3_moe"], "--dtype", "float32", "--kv-cache-memory", str(4 << 20)])
    pid = int(re.search(r"engine core process started \(pid (\d+)\)", s.log()).group(1))
    try:
        # As long as the model allows: about as many steps as the core's output queue holds (1000
        # messages), so a core that only looked up between requests would be stuck in send.
        max_len = httpx.get(s.url + "/v1/models").json()["data"][0]["max_model_len"]
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60, json={
                "prompt": [5, 6], "max_tokens": max_len - 2, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            next(r.iter_lines())
            s.proc.send_signal(signal.SIGKILL)
        s.proc.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.1)
        assert not _alive(pid), "the engine core outlived its front end"
        assert "the front-end process is gone" in s.log()
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        s.stop()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def _recv_until(client: CoreClient, pred, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = client.recv(200)
        if m is not None and pred(m):
            return m
    raise TimeoutError("no such message from the core")


def test_malformed_zmq_messages_are_logged_and_dropped(checkpoints, tmp_path, caplog):
    path = checkpoints["mixtral"]
    want = LLM(path, dtype="float32", kv_cache_memory=4 << 20, show_progress=False).generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids
    args = EngineArgs(model=path, dtype="float32", kv_cache_memory=4 << 20, show_progress=False)
    client = CoreClient(1)
    (in_addr,), out_addr = client.addresses()
    log = open(tmp_path / "core.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "moe_serve.engine.core_proc", "--engine-args",
                             msgspec.json.encode(args).decode(), "--in-addr", in_addr, "--out-addr", out_addr],
                            stdout=log, stderr=subprocess.STDOUT)
    rogue = zmq.Context().socket(zmq.PUSH)
    try:
        (ready,) = client.wait_ready(lambda: None if proc.poll() is None else f"core exited {proc.returncode}")
        assert isinstance(ready, CoreReady) and ready.max_model_len > 0
        # To the core: garbage, a truncated message, a well-formed message of the wrong type.
        good = input_encoder.encode(CoreInput([NewRequest("ok", PROMPT, SamplingParams(temperature=0, max_tokens=6))]))
        for bad in (b"\x00\xffgarbage", good[:-5], input_encoder.encode(CoreFatal(0, "not an input"))):
            client.in_socks[0].send(bad)
        client.send(0, msgspec.msgpack.decode(good, type=CoreInput))
        # To the front end: garbage on its output socket is dropped too.
        rogue.connect(out_addr)
        rogue.send(b"\x93\x01not-a-message")
        toks: list[int] = []
        done = False
        deadline = time.monotonic() + 60
        with caplog.at_level("ERROR", logger="moe_serve.core_client"):
            while not done and time.monotonic() < deadline:
                m = client.recv(200)
                if isinstance(m, CoreOutputs):
                    for o in m.outputs:
                        assert o.request_id == "ok"
                        toks += o.new_token_ids
                        done = done or o.finished
        assert toks == want
        assert "dropped a malformed message from an engine core" in caplog.text
        client.send(0, CoreInput(shutdown=True))
        last = _recv_until(client, lambda m: isinstance(m, CoreOutputs) and m.finished_shutdown)
        assert last.rank == 0
        assert proc.wait(30) == 0
        text = (tmp_path / "core.log").read_text()
        assert text.count("dropped a malformed message from the front end") == 3, text[-3000:]
    finally:
        rogue.close(0)
        if proc.poll() is None:
            proc.kill()
        client.close()
        log.close()


@pytest.mark.parametrize("module", ["moe_serve.scheduler", "moe_serve.protocol", "moe_serve.engine.output_processor",
                                    "moe_serve.sampling_params", "moe_serve"])
def test_front_end_modules_do_not_import_torch(module):
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
