"""Prompt logprobs (SamplingParams.prompt_logprobs) through the offline `LLM`, against transformers'
own float32 forward on the same tiny checkpoint: every prompt token after the first gets its
log-softmax value, its rank and the top-n, under chunked prefill (prompts longer than the step's
token budget), preemption in the middle of a prompt, and a repeat of a cached prompt (a would-be
prefix-cache hit: a request asking for prompt logprobs computes every position). The LM head's
slicing is checked against a float64 reference with a budget small enough to cut every row apart.
"""
from __future__ import annotations

import random

import pytest
import torch

from moe_serve import LLM, SamplingParams
from moe_serve.sampler import prompt_logprobs

TOL = 1e-4


@pytest.fixture(scope="module")
def mixtral(checkpoints):
    from transformers import AutoModelForCausalLM

    path = checkpoints["mixtral"]
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def reference(model, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the vocabulary at every prompt position (row j predicts token j + 1)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def check_against_reference(model, prompt: list[int], got, n_top: int) -> None:
    """got: a RequestOutput.prompt_logprobs, as vLLM shapes it."""
    ref = reference(model, prompt)
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for j in range(1, len(prompt)):
        row, tok, d = ref[j - 1], prompt[j], got[j]
        assert tok in d, f"position {j}: the prompt token {tok} is missing from {sorted(d)}"
        lp = d[tok].logprob
        assert abs(lp - row[tok].item()) < TOL, (j, lp, row[tok].item())
        # Its rank: 1 + the tokens more likely (a token within TOL of it may fall either side).
        lo, hi = int((row > row[tok] + TOL).sum()) + 1, int((row > row[tok] - TOL).sum()) + 1
        assert lo <= d[tok].rank <= hi, (j, d[tok].rank, lo, hi)
        assert len(d) == n_top + (tok not in torch.topk(row, n_top).indices.tolist()) or \
            len(d) in (n_top, n_top + 1) and lo != hi  # the token at the edge of the top n: a near-tie
        kth = torch.topk(row, n_top).values[-1].item() if n_top else float("inf")
        for t, v in d.items():
            assert abs(v.logprob - row[t].item()) < TOL, (j, t, v.logprob, row[t].item())
            if t != tok:  # a top entry: among the n most likely
                assert v.logprob >= kth - TOL and 1 <= v.rank <= n_top, (j, t, v)


def test_prompt_logprobs_equal_transformers_chunked_and_on_a_cached_prompt(mixtral):
    path, model = mixtral
    rng = random.Random(11)
    long = [rng.randrange(3, 512) for _ in range(45)]  # 45 tokens over steps of 16: three chunks
    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=16, show_progress=False)
    plain = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate([{"prompt_token_ids": long}], plain)[0]
    assert first.prompt_logprobs is None and first.num_cached_tokens == 0
    again = llm.generate([{"prompt_token_ids": long}], plain)[0]
    assert again.num_cached_tokens == 44, "the repeat should have found the prompt's blocks cached"

    # The same prompt asking for prompt logprobs: every position computed, none taken from the cache.
    scored = llm.generate([{"prompt_token_ids": long}], SamplingParams(temperature=0, max_tokens=2,
                                                                       prompt_logprobs=3))[0]
    assert scored.num_cached_tokens == 0
    check_against_reference(model, long, scored.prompt_logprobs, 3)
    assert scored.outputs[0].token_ids == first.outputs[0].token_ids
    # Its blocks stay cached for others.
    assert llm.generate([{"prompt_token_ids": long}], plain)[0].num_cached_tokens == 44

    # Several at once, mixed with requests that ask for none, n > 1, and a one-token prompt.
    prompts = [long[:17], [rng.randrange(3, 512) for _ in range(30)], [77], long]
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0), plain,
              SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=5),
              SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=2, prompt_logprobs=1)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    check_against_reference(model, prompts[0], outs[0].prompt_logprobs, 0)
    assert outs[1].prompt_logprobs is None
    assert outs[2].prompt_logprobs == [None]
    check_against_reference(model, prompts[3], outs[3].prompt_logprobs, 1)


def test_prompt_logprobs_survive_preemption_mid_prompt(mixtral, monkeypatch):
    """A KV cache too small for all requests at once: requests are preempted while their prompts
    are only partly computed, and recomputed; each prompt position still has exactly its logprob."""
    path, model = mixtral
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (37, 29, 41, 23, 33, 18)]
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=30, max_num_batched_tokens=24, max_num_seqs=8,
              show_progress=False)
    sched = llm.engine.scheduler
    mid_prompt = []
    preempt = sched._preempt

    def spy(req):
        if req.needs_prompt_logprobs and req.num_prompt_logprobs > 0:
            mid_prompt.append((req.request_id, req.num_prompt_logprobs))
        preempt(req)

    monkeypatch.setattr(sched, "_preempt", spy)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2))
    assert mid_prompt, "no request was preempted with its prompt logprobs partly computed"
    for p, o in zip(prompts, outs):
        check_against_reference(model, p, o.prompt_logprobs, 2)


def test_prompt_logprobs_under_the_overlap_split(mixtral, monkeypatch):
    """Steps split into two overlapped micro-batches: the prompt rows are found in either."""
    path, model = mixtral
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (30, 21, 9)]
    llm = LLM(path, dtype="float32", enable_overlap=True, overlap_min_tokens=4, max_num_batched_tokens=32,
              show_progress=False)
    runner_model = llm.engine.runner.model
    splits = []
    forward = runner_model.forward_microbatches
    monkeypatch.setattr(runner_model, "forward_microbatches", lambda *a: splits.append(1) or forward(*a))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1))
    assert splits, "no step was split"
    for p, o in zip(prompts, outs):
        check_against_reference(model, p, o.prompt_logprobs, 1)


def test_a_disaggregated_request_with_prompt_logprobs_ends_with_the_reason(mixtral):
    """The core refuses it (its prompt would be computed elsewhere) naming the field, before
    anything is reserved; the same request without kv is served."""
    from moe_serve.protocol import KVParams, NewRequest

    llm = LLM(mixtral[0], dtype="float32", show_progress=False)
    out = llm.engine.add_request(NewRequest("d", [5, 6, 7], SamplingParams(max_tokens=1, prompt_logprobs=0),
                                            KVParams("decode")))
    assert out is not None and out.finish_reason == "abort" and "prompt_logprobs" in out.stop_reason
    assert not llm.engine.has_unfinished()


def test_lm_head_slices_against_float64():
    """`sampler.prompt_logprobs` in slices of one or a few rows equals one float64 pass."""
    g = torch.Generator().manual_seed(0)
    V, D, P = 97, 16, 23
    w = torch.randn(V, D, generator=g)
    h = torch.randn(P, D, generator=g)
    targets = torch.randint(0, V, (P,), generator=g)
    ref = torch.log_softmax((h.double() @ w.double().T), dim=-1)
    for max_bytes in (1, 4 * V * 5, 1 << 28):  # one row per slice, five, all at once
        calls = []

        def head(x):
            calls.append(x.shape[0])
            return x @ w.T

        rows = prompt_logprobs(head, h, targets, 4, V, max_bytes)
        assert sum(calls) == P and max(calls) == min(P, max(1, max_bytes // (4 * V)))
        for i, r in enumerate(rows):
            t = int(targets[i])
            assert abs(r[0] - ref[i, t].item()) < 1e-5
            assert int(r[1]) == int((ref[i] > ref[i, t]).sum()) + 1
            top_v, top_i = torch.topk(ref[i], 4)
            assert [int(x) for x in r[6:10]] == top_i.tolist()
            assert max(abs(a - b) for a, b in zip(r[2:6], top_v.tolist())) < 1e-5
