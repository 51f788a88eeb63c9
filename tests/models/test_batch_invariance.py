"""--batch-invariant: a request's token ids and logprobs are bitwise the same alone and in company.

Over random batch mixes (how many other requests, their prompt and output lengths, where the target
sits), token budgets (prefill chunk boundaries) and a KV pool small enough to preempt requests (a
token then recomputed inside a prefill rather than decoded), on our C kernels and on the torch
backends, float32 and bfloat16. Hypothesis runs derandomized with a bounded number of examples.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from moe_serve import LLM, SamplingParams

TARGET = [random.Random(7).randrange(10, 400) for _ in range(29)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
# (arch, backend, dtype): our C kernels run a bf16 model in float32 activations, torch in bf16
CASES = [("qwen3_moe", "cpu_c", "float32"), ("deepseek_v3", "cpu_c", "float32"),
         ("qwen3_moe", "torch", "bfloat16"), ("deepseek_v3", "torch", "bfloat16")]


def _engine(path: str, backend: str, dtype: str, **kw) -> LLM:
    return LLM(path, dtype=dtype, batch_invariant=True, moe_backend=backend, attention_backend=backend,
               linear_backend=backend, norm_backend=backend, show_progress=False, max_num_seqs=16, **kw)


def _result(out) -> tuple[list[int], list]:
    o = out.outputs[0]
    return list(o.token_ids), [sorted((t, lp.logprob if hasattr(lp, "logprob") else lp) for t, lp in d.items())
                               if isinstance(d, dict) else d for d in o.logprobs]


def _count_preemptions(llm: LLM) -> list[int]:
    """A counter of the scheduler's preemptions, kept as the engine steps."""
    count = [0]
    sched = llm.engine.scheduler
    inner = sched.schedule

    def schedule():
        out = inner()
        count[0] += out.num_preempted
        return out

    sched.schedule = schedule
    return count


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def engines(request, checkpoints):
    """A roomy engine and one with a 16-token budget and a small KV pool (chunks and preemption),
    and the target's result alone on the roomy one."""
    arch, backend, dtype = request.param
    roomy = _engine(checkpoints[arch], backend, dtype, kv_cache_memory=16 << 20)
    tight = _engine(checkpoints[arch], backend, dtype, num_kv_blocks=24, block_size=4, max_num_batched_tokens=16,
                    enable_prefix_caching=False)
    alone = _result(roomy.generate({"prompt_token_ids": TARGET}, PARAMS)[0])
    return roomy, tight, alone, _count_preemptions(tight)


@settings(max_examples=4, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def _check_mixes(engines, data):
    roomy, tight, alone, _ = engines
    n = data.draw(st.integers(0, 6), label="others")
    lens = data.draw(st.lists(st.integers(1, 60), min_size=n, max_size=n), label="prompt lengths")
    outs = data.draw(st.lists(st.integers(1, 16), min_size=n, max_size=n), label="output lengths")
    at = data.draw(st.integers(0, n), label="target position")
    llm = data.draw(st.sampled_from([roomy, tight]), label="engine")
    rng = random.Random(sum(lens) + 31 * n)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 400) for _ in range(k)]} for k in lens]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2) for m in outs]
    prompts.insert(at, {"prompt_token_ids": TARGET})
    params.insert(at, PARAMS)
    got = _result(llm.generate(prompts, params)[at])
    assert got == alone


def test_bitwise_equal_alone_and_in_company(engines):
    _check_mixes(engines)


def test_chunks_and_preemption_match_alone(engines):
    """The 16-token budget cuts the target's prompt in two chunks; six long companions in a 96-slot
    pool preempt requests (the count proves it) and the target still matches itself alone."""
    roomy, tight, alone, preempted = engines
    assert _result(tight.generate({"prompt_token_ids": TARGET}, PARAMS)[0]) == alone
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 400) for _ in range(40)]} for _ in range(6)]
    prompts.insert(2, {"prompt_token_ids": TARGET})
    before = preempted[0]
    got = tight.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
    assert preempted[0] > before
    assert _result(got[2]) == alone


def test_refused_where_no_invariant_form():
    """Every experts, attention and linear backend has an invariant form (the Triton ones:
    tests/kernels/test_batch_invariant_triton.py); a layer kind without one is refused at bind."""
    from torch import nn

    from moe_serve import platform

    choice = platform.choose("cpu", moe_backend="triton", attention_backend="triton", linear_backend="triton",
                             norm_backend="torch", batch_invariant=True)
    ops = platform.resolve_ops(choice.device, "triton", "triton", "triton", "torch", "torch", batch_invariant=True)
    assert {ops.experts.name, ops.attention.name, ops.linear.name} == {"triton+bi"}

    class GatedDeltaStandIn(nn.Module):
        op_kind = "linear_attention"

    with pytest.raises(ValueError, match=r"--batch-invariant: GatedDeltaStandIn runs linear attention"):
        platform.bind_ops(GatedDeltaStandIn(), ops)
