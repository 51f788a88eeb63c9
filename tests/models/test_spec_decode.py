"""Speculative decoding with n-gram drafts (moe_serve/spec_decode): the output is the plain engine's
(itself checked against transformers in test_hf_parity.py), token for token under greedy decoding
and seeded sampling, with draft tokens really accepted; unseeded sampling keeps the target
distribution; rejected drafts leave the cache as if never written; settings are checked."""
import math
import random
from collections import Counter

import pytest

from moe_serve import LLM, SamplingParams
from moe_serve.spec_decode import SpeculativeConfig, accept
from moe_serve.spec_decode.ngram import propose
from tests.checkpoints import VOCAB

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def repetitive_prompts(n: int, seed: int = 0) -> list[dict]:
    """Prompts that repeat a phrase, so that a random model's continuations (which fall into loops)
    and the prompt itself give the n-gram lookup something to find."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(10, VOCAB) for _ in range(rng.randrange(5, 13))]
        out.append({"prompt_token_ids": phrase * 3 + phrase[:i % len(phrase) + 1]})
    return out


def engines(path: str, **kw):
    common = dict(dtype="float32", num_kv_blocks=kw.pop("num_kv_blocks", 96), show_progress=False, **kw)
    return LLM(path, **common), LLM(path, speculative_config=NGRAM, **common)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_greedy_output_is_the_plain_engines(arch, checkpoints, extra_checkpoints):
    """GQA, MLA and sliding-window layers (GPT-OSS's 12-token window: drafts cross it)."""
    path = checkpoints[arch] if arch in checkpoints else extra_checkpoints[arch]
    plain, spec = engines(path)
    prompts = repetitive_prompts(8)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    s = spec.engine.spec
    assert s.num_drafts > 0
    if arch != "gpt_oss":  # (whose random weights do not fall into loops: every draft is rejected)
        assert s.num_accepted_tokens > 0, "no draft was ever accepted: the multi-token path went untested"
    assert s.num_draft_tokens >= s.num_accepted_tokens and sum(s.accepted_per_pos) == s.num_accepted_tokens
    assert spec.engine.num_steps < plain.engine.num_steps or s.num_accepted_tokens < 8 * 40


def test_seeded_sampling_penalties_min_tokens_and_logprobs_reproduce(checkpoints):
    """Position j of a piece samples as the plain engine does at that output position: the seeded
    noise, min_tokens, presence penalty and top-k all see the drafts before it as outputs."""
    plain, spec = engines(checkpoints["qwen3_moe"])
    prompts = repetitive_prompts(6, seed=1)
    sps = [SamplingParams(max_tokens=30, temperature=0.05 if i % 2 else 0.7, seed=100 + i, top_k=40, min_tokens=5,
                          presence_penalty=0.3 * (i % 3), logprobs=2) for i in range(6)]
    a = plain.generate(prompts, sps, use_tqdm=False)
    b = spec.generate(prompts, sps, use_tqdm=False)
    assert spec.engine.spec.num_accepted_tokens > 0
    for x, y in zip(a, b):
        X, Y = x.outputs[0], y.outputs[0]
        assert Y.token_ids == X.token_ids
        assert Y.finish_reason == X.finish_reason
        assert len(Y.logprobs) == len(Y.token_ids)
        assert Y.cumulative_logprob == pytest.approx(X.cumulative_logprob, abs=1e-3)
        for lx, ly, t in zip(X.logprobs, Y.logprobs, Y.token_ids):
            assert ly[t].logprob == pytest.approx(lx[t].logprob, abs=1e-4)


def test_stops_inside_an_accepted_run_end_the_output_there(checkpoints):
    """A stop token or max_tokens reached in the middle of the tokens a piece emits cuts them there."""
    plain, spec = engines(checkpoints["qwen3_moe"])
    prompts = repetitive_prompts(8, seed=2)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    runs = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    for i, (p, run) in enumerate(zip(prompts, runs)):
        stop = run[10 + i]  # a token the run emits: the output must end at its first occurrence
        for sp in (SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[stop]),
                   SamplingParams(max_tokens=7 + i, temperature=0, ignore_eos=True)):
            want = plain.generate([p], sp, use_tqdm=False)[0].outputs[0]
            got = spec.generate([p], sp, use_tqdm=False)[0].outputs[0]
            assert (got.token_ids, got.finish_reason, got.stop_reason) == \
                (want.token_ids, want.finish_reason, want.stop_reason)


def test_rejected_drafts_and_preemption_leave_the_cache_as_never_written(checkpoints):
    """With blocks of 4 tokens, drafts cross block boundaries and most are rejected; with a cache of
    a few blocks, requests are preempted and recomputed (prefix hits on blocks whose tail once held
    rejected drafts). The tokens stay the plain engine's."""
    path = checkpoints["deepseek_v3"]
    plain, spec = engines(path, block_size=4, num_kv_blocks=40, max_num_seqs=8)
    prompts = repetitive_prompts(8, seed=3)
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.spec.num_draft_tokens > spec.engine.spec.num_accepted_tokens > 0
    assert spec.engine.allocator.usage == 0  # every block back


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_unseeded_sampling_keeps_the_target_distribution(checkpoints, extra_checkpoints, method):
    """The second token (the first one verified against a draft: the prompt holds every token, so
    the lookup always finds one; MTP drafts after every prefill) over 1500 unseeded samples, with
    and without speculation: a chi-square test of homogeneity (Wilson-Hilferty normal
    approximation, |z| < 4). MTP on the checkpoint whose MTP layer drafts well, so that both
    accepted and rejected drafts shape the distribution."""
    if method == "ngram":
        plain, spec = engines(checkpoints["qwen3_moe"], max_num_seqs=64, num_kv_blocks=256)  # no preemption
    else:
        common = dict(dtype="float32", num_kv_blocks=256, max_num_seqs=64, show_progress=False)
        path = extra_checkpoints["deepseek_v3_mtp_copy"]
        plain = LLM(path, **common)
        spec = LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": 1}, **common)
    rng = random.Random(4)
    vocab = list(range(VOCAB))
    rng.shuffle(vocab)
    prompt = {"prompt_token_ids": vocab}  # 512 tokens, each once
    sp = SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)  # room for one draft
    counts = []
    for llm in (plain, spec):
        outs = llm.generate([prompt] * 1500, sp, use_tqdm=False)
        counts.append(Counter(tuple(o.outputs[0].token_ids[:2]) for o in outs))
    assert spec.engine.spec.num_drafts >= 1500  # every second token was verified against a draft
    if method == "mtp":
        assert 0 < spec.engine.spec.num_accepted_tokens < spec.engine.spec.num_draft_tokens
    keys = sorted(set(counts[0]) | set(counts[1]))
    n0, n1 = sum(counts[0].values()), sum(counts[1].values())
    chi2, df = 0.0, -1
    for k in keys:
        a, b = counts[0][k], counts[1][k]
        if a + b < 10:  # sparse cells pooled out (too few to test)
            continue
        df += 1
        tot = a + b
        for obs, n in ((a, n0), (b, n1)):
            exp = tot * n / (n0 + n1)
            chi2 += (obs - exp) ** 2 / exp
    assert df >= 8
    z = ((chi2 / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    assert abs(z) < 4, (chi2, df, z)


def test_ngram_lookup_and_acceptance():
    assert propose([1, 2, 3, 9, 1, 2, 3], 3, 1, 3) == [9, 1, 2]  # the 3-gram 1 2 3, then what followed
    assert propose([4, 1, 7, 7, 1], 2, 1, 3) == [7, 7]  # only the 1-gram matches
    assert propose([1, 2, 5, 1, 2, 6, 1, 2], 2, 2, 2) == [6, 1]  # the most recent occurrence
    assert propose([1, 2, 3], 4, 1, 3) == []
    assert propose([1, 2, 3, 1], 4, 2, 3) == []  # below prompt_lookup_min
    assert accept([5, 6, 7], [5, 6]) == [5, 6, 7]
    assert accept([5, 9, 7], [5, 6]) == [5, 9]
    assert accept([8, 6, 7], [5, 6]) == [8]


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 2}, "prompt_lookup_max applies to method 'ngram'"),
    ("{not json", "JSON"),
])
def test_bad_settings_are_refused_naming_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_defaults():
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}) == \
        SpeculativeConfig("ngram", 3, 5, 5)
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}') == \
        SpeculativeConfig("ngram", 2, 4, 4)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_linear_attention_state_rolls_back(extra_checkpoints, arch):
    """Gated DeltaNet layers update their conv and recurrent state in place token by token: a step
    that verifies drafts keeps a copy of each such sequence's state, and where a draft is rejected
    the state goes back to that copy and the piece's accepted tokens are computed again next step.
    Greedy output equals the plain engine's, with drafts both accepted and rejected, and with
    chunked prompts and prefix hits on their state snapshots; every block and state slot returns."""
    plain, spec = engines(extra_checkpoints[arch], max_num_batched_tokens=32)
    prompts = repetitive_prompts(6, seed=5)
    prompts += [dict(prompts[0])]  # a prefix-cache hit on a state snapshot
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    # A random model's continuations seldom repeat, so drafts come from the plain run's own output
    # (the drafter only; the engine verifies them as any): all right, or wrong from some position
    # on, changing with the length, so that steps accept all, some or none of them.
    full = {tuple(p["prompt_token_ids"]): p["prompt_token_ids"] + w for p, w in zip(prompts, want)}

    def oracle(tokens, k, lo, hi):
        seq = next(f for f in full.values() if f[:len(tokens)] == tokens)
        drafts = seq[len(tokens):len(tokens) + k]
        bad = len(tokens) % (k + 2)
        return [t if j < bad else (t + 1) % VOCAB for j, t in enumerate(drafts)]

    spec.engine.spec.proposer.lookup = oracle
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    s = spec.engine.spec
    assert s.num_draft_tokens > s.num_accepted_tokens > 0  # both accepted and rejected drafts
    assert spec.engine.allocator.usage == 0


def test_structured_outputs_keep_their_grammar_and_the_plain_output(checkpoints):
    """Drafts are cut to what the grammar allows and each position is masked as if the drafts
    before it were accepted: seeded JSON (a list of objects with the same keys, which the n-gram
    lookup finds again) and regex outputs equal the plain engine's, and are valid."""
    import json
    import re

    import jsonschema

    from moe_serve.structured_output import StructuredOutputsParams as SO

    schema = {"type": "array", "minItems": 3, "maxItems": 4,
              "items": {"type": "object", "properties": {"name": {"enum": ["ab", "cd", "efg"]},
                                                         "id": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["name", "id"], "additionalProperties": False}}
    plain, spec = engines(checkpoints["qwen3_moe"], num_kv_blocks=200)
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=200, structured_outputs=SO(json=schema))
              for s in range(4)]
    params += [SamplingParams(temperature=0.8, seed=9, max_tokens=60, structured_outputs=SO(regex=r"(ab|cd){3,8}"))]
    prompts = ["JSON please"] * 4 + ["x"]
    a = plain.generate(prompts, params, use_tqdm=False)
    b = spec.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert y.outputs[0].token_ids == x.outputs[0].token_ids
        assert y.outputs[0].finish_reason == "stop", y.outputs[0].text
    for o in b[:4]:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
    assert re.fullmatch(r"(ab|cd){3,8}", b[4].outputs[0].text)
    assert spec.engine.spec.num_accepted_tokens > 0
