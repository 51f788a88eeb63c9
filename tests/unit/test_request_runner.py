"""The front end validates a request's prompt once, in the request runner: its token count against
the limits (max_model_len, the KV cache) and the engine's own check each run once per prompt, and the
AsyncEngine is told the prompt is checked. An engine stand-in counts the calls."""
import asyncio
from dataclasses import dataclass

import pytest

from moe_serve.entrypoints.openai import protocol as P
from moe_serve.entrypoints.openai.request_limits import BadRequest, PromptLimits
from moe_serve.entrypoints.openai.runner import RequestRunner
from moe_serve.entrypoints.openai.serving import OpenAIServing
from moe_serve.sampling_params import SamplingParams


@dataclass(frozen=True)
class CountingLimits(PromptLimits):
    calls: list = None

    def check_tokens(self, n, max_tokens, param="prompt", why=None):
        self.calls.append(n)
        return super().check_tokens(n, max_tokens, param, why)


class Tok:
    vocab_size, chat_template = 100, ""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)

    def apply_chat_template(self, msgs, add_generation_prompt=True, **kwargs):
        return "".join(m["content"] for m in msgs)


class Out:
    new_text, finished, finish_reason, stop_reason, logprobs, prompt_logprobs = "hi", True, "stop", None, None, None


class Stream:
    num_prompt_tokens, num_output_tokens, num_cached_tokens, weight_version = 3, 1, 0, "0"

    def __init__(self, k):
        self.k, self.prompt_logprobs = k, [None] * k

    async def __aiter__(self):
        for c in range(self.k):
            yield c, Out()

    async def aclose(self):
        pass


class Engine:
    tokenizer, dead, stopping, disaggregation_mode, max_waiting_requests = Tok(), None, None, None, 64

    def __init__(self):
        self.validated, self.submitted = [], []

    def validate(self, ids, params):
        self.validated.append(len(ids))
        if max(ids) >= self.tokenizer.vocab_size:
            raise ValueError(f"prompt_token_ids contains {max(ids)}, outside the vocabulary [0, 100)")

    def submit(self, rid, prompts, params, prefill=None, kv=None, validated=False):
        self.submitted.append(validated)
        return Stream(len(prompts) * params.n)


def serving(max_model_len=32):
    engine, calls = Engine(), []
    s = OpenAIServing(engine, "m", max_model_len, CountingLimits(max_model_len, None, 1, 1 << 20, calls))
    return s, engine, calls


@pytest.mark.parametrize("prompt", [[1, 2, 3], [[1, 2, 3], [4, 5]], "abc", ["abc", "de"]])
def test_completions_check_each_prompt_once(prompt):
    s, engine, calls = serving()
    out = asyncio.run(s.completions(P.CompletionRequest(prompt=prompt, max_tokens=4), "r"))
    k = 1 if isinstance(prompt, str) or isinstance(prompt[0], int) else len(prompt)
    assert len(out.choices) == k
    assert len(calls) == k  # the limits, once per prompt (on arrival for token ids, after tokenizing texts)
    assert len(engine.validated) == k  # the engine's own check, once per prompt
    assert engine.submitted == [True]  # and the engine does not check again


def test_chat_checks_the_rendered_prompt_once():
    s, engine, calls = serving()
    req = P.ChatCompletionRequest(messages=[P.ChatMessage("user", "hello")], max_tokens=4)
    asyncio.run(s.chat(req, "r"))
    assert (calls, engine.validated, engine.submitted) == ([5], [5], [True])


def test_refusals_keep_their_messages_and_fields():
    s, engine, calls = serving(max_model_len=8)
    with pytest.raises(BadRequest) as e:  # token ids: refused on arrival, before the engine sees them
        asyncio.run(s.completions(P.CompletionRequest(prompt=[1] * 8, max_tokens=1), "r"))
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")
    assert "max_model_len=8 leaves no room for output" in str(e.value)
    assert engine.validated == [] and engine.submitted == []
    with pytest.raises(BadRequest) as e:  # the engine's check: a token id outside the vocabulary
        asyncio.run(s.completions(P.CompletionRequest(prompt=[1, 200], max_tokens=1), "r"))
    assert (e.value.param, e.value.status) == ("prompt", 400) and engine.submitted == []


def test_a_stopped_engine_is_503_before_the_request_is_checked():
    engine = Engine()
    engine.dead = "core 0 exited"
    runner = RequestRunner(engine, "m", 32)
    with pytest.raises(BadRequest) as e:
        runner.submit("r", [[1, 200]], SamplingParams(max_tokens=1))
    assert (e.value.status, e.value.code, str(e.value)) == (503, "engine_dead", "the engine has stopped: core 0 exited")
    assert engine.validated == []
