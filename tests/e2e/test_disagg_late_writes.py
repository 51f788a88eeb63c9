"""A KV write that is still in flight when the decode side gives up on it must not land in blocks
another request uses. Each test runs a prefill and a decode instance, the prefill side's writes
slowed down and held after their first piece (MOE_SERVE_TEST_KV_WRITE_PACE, test only), so that
the order of events is the test's to choose, not the clock's:

  request A's prompt -> the prefill side computes it and writes the first piece of its KV, then holds;
  the decode side stops waiting (its --disaggregation-timeout) and computes A itself;
  request B, computed on the decode side, would take A's reserved blocks if they had been given back
  (the pool is sized so: every block that is not A's is taken, and the free queue is LRU);
  the rest of A's write lands (and, in the first test, the prefill engine core is SIGKILLed midway);
  request C = B's prompt again reads B's cached blocks: it must give the same greedy tokens and
  logprobs as a colocated engine, and every block comes back on both sides.

A decode side that gave A's blocks back as soon as it gave up on the write fails both: C reads
KV of A's prompt where B's was."""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from moe_serve import LLM, SamplingParams
from tests.e2e.server import ServerProcess
from tests.e2e.test_disagg import AUTH, KEY, MODEL, blocks_back

BS = 16  # the default --block-size
NUM_BLOCKS = 12  # the decode side's pool
PIECES = 30
A_PROMPT = [300 + i % 97 for i in range(4 * BS)]  # A reserves 4 blocks (its last token is computed there)
B_PROMPT = [7 + (i * 7) % 251 for i in range((NUM_BLOCKS - 4) * BS)]  # every block but 4: full blocks only


def _written(p: ServerProcess) -> int:
    """How many pieces of A's write have landed (the prefill core logs each, test pacing only)."""
    with open(p.log_path) as f:
        got = re.findall(r"KV write pace \(test only\): request \S+: piece (\d+) of (\d+) written", f.read())
    return max((int(i) for i, _ in got), default=0)


def _wait(cond, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s  # a hang guard only: every wait is for an event
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def reference(checkpoints):
    """B's prompt on a colocated engine: greedy tokens and their logprobs."""
    path = checkpoints["mixtral"]
    llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20, show_progress=False)
    (o,) = llm.generate([{"prompt_token_ids": B_PROMPT}], SamplingParams(temperature=0, max_tokens=8, logprobs=0))
    out = o.outputs[0]
    return path, out.text, [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]


def _late_write(tmp_path, reference, kill_core: bool) -> None:
    path, want_text, want_lps = reference
    hold = tmp_path / "hold"
    hold.touch()  # the prefill side writes one piece of each write, then waits until this is gone
    pace = {"MOE_SERVE_TEST_KV_WRITE_PACE": f"{PIECES}:0.1:{hold}"}
    base = ["--model", path, "--dtype", "float32", "--api-key", KEY, "--served-model-name", MODEL]
    p = ServerProcess(base + ["--kv-cache-memory", str(8 << 20), "--disaggregation-mode", "prefill"], env=pace)
    d = None
    try:
        d = ServerProcess(base + ["--num-kv-blocks", str(NUM_BLOCKS), "--disaggregation-mode", "decode",
                                  "--disaggregation-timeout", "5"])
        c = openai.OpenAI(base_url=d.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        a_text = []
        a = threading.Thread(target=lambda: a_text.append(c.completions.create(
            model=MODEL, prompt=A_PROMPT, max_tokens=1, temperature=0,
            extra_body={"kv_transfer_params": {"prefill_url": p.url}}).choices[0].text))
        a.start()
        _wait(lambda: _written(p) >= 1, "the first piece of A's KV write")
        a.join(300)  # the decode side gave up on the write and computed A itself
        assert a_text and d.metrics()["moe_serve:kv_transfer_fallbacks_total"] == 1
        assert _written(p) == 1  # the rest of the write is still to come
        hits = d.metrics()["moe_serve:prefix_cache_hits_total"]
        b = c.completions.create(model=MODEL, prompt=B_PROMPT, max_tokens=1, temperature=0, logprobs=1)
        assert b.choices[0].logprobs.token_logprobs == pytest.approx(want_lps[:1], abs=1e-3)
        held_while_in_flight = d.metrics()["moe_serve:kv_blocks_in_use"]  # nothing runs now
        hold.unlink()  # the rest of A's write lands
        if kill_core:
            _wait(lambda: _written(p) >= PIECES // 2, "half of A's KV write")
            core_pid = httpx.get(p.url + "/ranks", headers=AUTH, timeout=10).json()["ranks"][0]["pid"]
            os.kill(core_pid, signal.SIGKILL)
            p.proc.wait(60)  # its front end stops with it
        else:
            _wait(lambda: _written(p) == PIECES, "the whole of A's KV write")
        # B's prompt again: its cached blocks are read back (all but the last).
        got = c.completions.create(model=MODEL, prompt=B_PROMPT, max_tokens=8, temperature=0, logprobs=1)
        assert d.metrics()["moe_serve:prefix_cache_hits_total"] - hits >= (len(B_PROMPT) // BS - 1) * BS
        assert got.choices[0].text == want_text
        assert got.choices[0].logprobs.token_logprobs == pytest.approx(want_lps, abs=1e-3)
        # A's reserved blocks were out of use while its write could land (B ran in the others).
        assert held_while_in_flight == 4
        blocks_back(d) if kill_core else blocks_back(p, d)
        if not kill_core:
            assert p.metrics()["moe_serve:kv_transfer_sent_requests_total"] == 1  # the write did end, and whole
    finally:
        for s in (p, d):
            if s is not None:
                s.stop(signal.SIGKILL)


def test_prefill_core_killed_mid_write_lands_nothing_in_reused_blocks(tmp_path, reference):
    """The prefill engine core SIGKILLed while its (slowed) write is posted, after the decode side
    gave up on it: its reserved blocks come back only once the prefill side says the writer is gone."""
    _late_write(tmp_path, reference, kill_core=True)


def test_decode_timeout_racing_a_write_in_flight_lands_nothing_in_reused_blocks(tmp_path, reference):
    """The decode side's wait times out while the write is in flight; the write then lands whole:
    into blocks still set aside, which come back when the prefill side answers."""
    _late_write(tmp_path, reference, kill_core=False)
