"""A request resubmitted with the tokens it already generated (elastic EP moves a lost rank's
requests to a survivor this way) continues exactly where it was: greedy and seeded sampling give
the uninterrupted request's remaining tokens, and a grammar resumes from those tokens (its output
validates with jsonschema and equals the uninterrupted one's)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from moe_serve import LLM, SamplingParams
from moe_serve.protocol import NewRequest
from moe_serve.sampling_params import child_params
from moe_serve.structured_output import StructuredOutputsParams as SO
from tests.unit.test_structured_output import SCHEMA


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(checkpoints["qwen3_moe"], dtype="float32", kv_cache_memory=8 << 20, show_progress=False)


def _resume(llm, rid: str, prompt: list[int], params: SamplingParams, done: list[int]) -> tuple[list[int], object]:
    """Submit a request with `done` as its output so far; run it to its end; returns the tokens it
    added and its last output."""
    core = llm.engine
    assert core.add_request(NewRequest(rid, prompt, params, None, list(done))) is None
    new, last = [], None
    while core.has_unfinished():
        for o in core.step():
            assert o.request_id == rid
            new += o.new_token_ids
            last = o
    return new, last


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                    SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_resumed_request_continues_its_tokens(llm, params):
    prompt = [5, 77, 301, 42, 9]
    full = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    assert len(full) == 24
    for k in (1, 10, 23):
        new, last = _resume(llm, f"r{k}", prompt, child_params(params, 0), full[:k])
        assert new == full[k:], k
        assert last.finished and last.finish_reason == "length"
    assert llm.engine.scheduler.kv.in_use == 0  # every block back


def test_resumed_request_resumes_its_grammar(llm):
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=SO(json=SCHEMA))
    prompt = llm.tokenizer.encode("JSON please")
    out = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    full = out.token_ids
    jsonschema.validate(json.loads(out.text), SCHEMA)
    k = len(full) // 2
    new, last = _resume(llm, "g", prompt, child_params(params, 0), full[:k])
    assert new == full[k:]
    assert last.finish_reason == "stop"
    jsonschema.validate(json.loads(llm.tokenizer.decode(full[:k] + new)), SCHEMA)


def test_resumed_request_without_tokens_left_is_refused(llm):
    params = SamplingParams(temperature=0, max_tokens=3)
    out = llm.engine.add_request(NewRequest("x", [5, 6], params, None, [1, 2, 3]))
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert "tokens left" in out.stop_reason
