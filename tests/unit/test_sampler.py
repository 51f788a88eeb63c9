"""The batched sampler: processed logits against a float64 reference written plainly here,
min_tokens masking, greedy rows independent of their neighbours, seeds independent of the batch,
seeded draws that follow the distribution, and logit_bias through `LLM.generate`."""
from __future__ import annotations

import json
import math
import os
import random
from collections import Counter

import pytest
import torch

from moe_serve import LLM
from moe_serve.input_batch import InputBatch
from moe_serve.logits_processors import process_logits
from moe_serve.request import Request
from moe_serve.sampler import Sampler
from moe_serve.sampling_params import SamplingParams
from moe_serve.seeded_random import fmix32, fmix32_int, seed_key, seeded_exponential, to_int32

V = 40
EOS = 2


def make_request(i, params, prompt, output=(), eos=(EOS,)):
    r = Request(f"r{i}", list(prompt), params, 64, frozenset(eos))
    r.output_token_ids = list(output)
    return r


def metadata(reqs, rows_first=0):
    """Rows for reqs in a fresh input batch (optionally after `rows_first` filler rows)."""
    batch = InputBatch(len(reqs) + rows_first, 64, 4, V)
    for k in range(rows_first):
        batch.add(make_request(f"filler{k}", SamplingParams(temperature=0.7, seed=k), [1]))
    return batch.sampling.build([batch.add(r) for r in reqs]), batch


def reference_processed(row, req):
    """bias, then min_tokens bans, then repetition, frequency and presence penalties, in float64."""
    p = req.params
    x = [float(v) for v in row]
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if req.num_output_tokens < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids)):
            x[t] = -math.inf
    seen = set(req.prompt_token_ids) | set(req.output_token_ids)
    counts = Counter(req.output_token_ids)
    for t in range(len(x)):
        if t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
    return x


def random_request(i, rng):
    kw = {}
    if rng.random() < 0.6:
        kw.update(frequency_penalty=rng.uniform(-2, 2), presence_penalty=rng.uniform(-2, 2),
                  repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 2.0)]))
    if rng.random() < 0.5:
        kw.update(logit_bias={rng.randrange(V): rng.uniform(-100, 100) for _ in range(rng.randint(1, 5))})
    if rng.random() < 0.3:
        kw.update(min_tokens=rng.randint(1, 6), stop_token_ids=[rng.randrange(V)])
    prompt = [rng.randrange(V) for _ in range(rng.randint(1, 20))]
    output = [rng.randrange(V) for _ in range(rng.randint(0, 12))]
    return make_request(i, SamplingParams(temperature=rng.choice([0.0, 1.0]), **kw), prompt, output)


@pytest.mark.parametrize("seed", range(6))
def test_processed_logits_match_float64_reference(seed):
    rng = random.Random(seed)
    reqs = [random_request(i, rng) for i in range(rng.randint(1, 9))]
    md, _ = metadata(reqs, rows_first=seed % 3)
    logits = torch.randn(len(reqs), V, generator=torch.Generator().manual_seed(seed)) * 3
    got = process_logits(logits, md)
    for i, r in enumerate(reqs):
        want = torch.tensor(reference_processed(logits[i].tolist(), r), dtype=torch.float64)
        torch.testing.assert_close(got[i].double(), want, atol=1e-4, rtol=1e-5)


def test_rows_without_penalties_or_bias_skip_the_work():
    reqs = [make_request(i, SamplingParams(temperature=t), [5, 6]) for i, t in enumerate([0.0, 1.0])]
    md, _ = metadata(reqs)
    assert md.penalized_P is None and md.bias_index_N is None and md.banned_index_M is None
    logits = torch.randn(2, V)
    assert process_logits(logits, md) is logits


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, V)
    for ignore_eos in (False, True):
        for n_out in range(5):
            params = SamplingParams(min_tokens=3, stop_token_ids=[7], ignore_eos=ignore_eos, temperature=0)
            md, _ = metadata([make_request(0, params, [4, 5], [9] * n_out)])
            x = process_logits(logits, md)[0]
            early = n_out < 3
            assert bool(torch.isinf(x[7])) == early
            assert bool(torch.isinf(x[EOS])) == (early and not ignore_eos)
            assert int(torch.isinf(x).sum()) == int(early) * (1 if ignore_eos else 2)


def test_greedy_rows_unchanged_by_random_neighbours():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, V, generator=g) * 2
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.0, repetition_penalty=1.3),
             dict(temperature=0.7, seed=5, top_k=5), dict(temperature=0.0), dict(temperature=1.5, top_p=0.8),
             dict(temperature=0.0, logit_bias={3: 2.0}), dict(temperature=0.9, min_p=0.1)]
    reqs = [make_request(i, SamplingParams(**k), [1, 3, 5]) for i, k in enumerate(kinds)]
    greedy = [i for i, k in enumerate(kinds) if k["temperature"] == 0]
    alone = []
    for i in greedy:
        md, _ = metadata([reqs[i]])
        alone.append(Sampler("cpu", seed=0)(logits[i:i + 1], md).token_ids[0])
    md, _ = metadata(reqs)
    for s in range(5):
        out = Sampler("cpu", seed=s)(logits, md).token_ids
        assert [out[i] for i in greedy] == alone
    assert alone[0] == int(logits[0].argmax()) and alone[2] == int(logits[4].argmax())


def sample_sequence(req_factory, others, steps, rows_first=0, seed=0):
    """Tokens a seeded request draws over `steps` output positions, batched with `others`."""
    logits_gen = torch.Generator().manual_seed(123)
    row_logits = [torch.randn(V, generator=logits_gen) for _ in range(steps)]
    sampler = Sampler("cpu", seed=seed)
    req, out = req_factory(), []
    for k in range(steps):
        batch_reqs = others[: k % (len(others) + 1)] + [req] + others[k % (len(others) + 1):]
        md, _ = metadata(batch_reqs, rows_first=rows_first + k % 2)
        logits = torch.randn(len(batch_reqs), V)
        pos = batch_reqs.index(req)
        logits[pos] = row_logits[k]
        tok = sampler(logits, md).token_ids[pos]
        out.append(tok)
        req.output_token_ids.append(tok)
    return out


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    def mine(seed=1234):
        return lambda: make_request("me", SamplingParams(temperature=0.8, top_p=0.95, seed=seed), [5, 6, 7])

    others = [make_request(f"o{i}", SamplingParams(temperature=1.0, seed=(i if i % 2 else None),
                                                   frequency_penalty=0.5 * (i % 3)), [9, i]) for i in range(5)]
    alone = sample_sequence(mine(), [], 12)
    assert sample_sequence(mine(), others, 12, rows_first=2, seed=99) == alone
    assert sample_sequence(mine(), others[:2], 12, seed=7) == alone
    assert sample_sequence(mine(seed=4321), [], 12) != alone  # the seed does matter


@pytest.mark.parametrize("vary", ["seed", "position"])
def test_seeded_draws_follow_the_distribution(vary):
    """Over many seeds at one position, and over many positions of one seed."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 3000
    reqs = [make_request(i, SamplingParams(temperature=1.0, seed=i if vary == "seed" else 7), [1],
                         [0] * (i % 7 if vary == "seed" else i)) for i in range(n)]
    batch = InputBatch(n, n + 1, 4, 4)
    md = batch.sampling.build([batch.add(r) for r in reqs])
    ids = Sampler("cpu")(probs.log().expand(n, 4), md).token_ids
    freq = torch.bincount(torch.tensor(ids), minlength=4).double() / n
    assert torch.allclose(freq, probs.double(), atol=0.03), freq


def test_hash_matches_python_integers():
    """The int32 tensor hash (wrapping products, masked shifts) is MurmurHash3's fmix32, and a
    seeded draw is -log of the uniform built from it, computed here on Python ints."""
    rng = random.Random(0)
    vals = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 0xDEADBEEF] + [rng.getrandbits(32) for _ in range(50)]
    got = fmix32(torch.tensor([to_int32(v) for v in vals], dtype=torch.int32)).tolist()
    assert [g & 0xFFFFFFFF for g in got] == [fmix32_int(v) for v in vals]
    keys, pos = [seed_key(s) for s in (0, -5, 1 << 70, 12345)], [0, 3, 1000, 7]
    draws = seeded_exponential(torch.tensor(keys), torch.tensor(pos), 10)
    gold = 0x9E3779B9
    for q, (k, p) in enumerate(zip(keys, pos)):
        key = fmix32_int((k & 0xFFFFFFFF) ^ fmix32_int((p + gold) & 0xFFFFFFFF))
        for t in range(10):
            bits = fmix32_int(key ^ fmix32_int(2 * t + 1)) >> 8
            assert abs(float(draws[q, t]) + math.log((bits + 0.5) / 2**24)) < 1e-5


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    reqs = [make_request(0, SamplingParams(temperature=0, logprobs=3, logit_bias={5: 50.0}), [1]),
            make_request(1, SamplingParams(temperature=0), [1]),
            make_request(2, SamplingParams(temperature=1.0, seed=3, logprobs=0, repetition_penalty=2.0), [1, 2])]
    md, _ = metadata(reqs)
    res = Sampler("cpu")(logits, md)
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert res.token_ids[0] == 5 and res.logprobs[1] is None
    lp, top = res.logprobs[0]
    assert abs(lp - float(raw[0, 5])) < 1e-5
    want_top = torch.topk(raw[0], 3)
    assert [t for t, _ in top] == want_top.indices.tolist()
    assert all(abs(v - w) < 1e-5 for (_, v), w in zip(top, want_top.values.tolist()))
    lp2, top2 = res.logprobs[2]
    assert top2 == [] and abs(lp2 - float(raw[2, res.token_ids[2]])) < 1e-5


def test_logit_bias_forces_and_bans_tokens_in_generate(checkpoints):
    path = checkpoints["mixtral"]
    with open(os.path.join(path, "config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    llm = LLM(path, dtype="float32", kv_cache_memory=2 << 20, show_progress=False)
    prompts = [{"prompt_token_ids": [5, 77, 301, 42, 9]}, {"prompt_token_ids": [33] * 11}]
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    firsts = [o.outputs[0].token_ids[0] for o in plain]
    forced = 123 if 123 not in firsts else 124
    got = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={forced: 100}),
                                 SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
                                                logit_bias={forced: 100})])
    assert all(o.outputs[0].token_ids == [forced] * 6 for o in got)
    banned = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                   logit_bias={f: -100}) for f in firsts])
    assert all(o.outputs[0].token_ids[0] != f for o, f in zip(banned, firsts))
    # min_tokens holds back an EOS that the bias makes certain: exactly min_tokens + 1 tokens.
    held = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=12, min_tokens=4, logit_bias={eos: 100}))
    toks = held[0].outputs[0].token_ids
    assert len(toks) == 5 and eos not in toks[:4] and toks[4] == eos and held[0].outputs[0].finish_reason == "stop"


def test_seeded_draws_are_positive_at_the_extreme_bit_patterns():
    """The seeded Exp(1) draw for the largest 24-bit patterns rounds to 0 (or below) in float32 if
    computed naively; a 0 draw turns p / q into NaN for a token of probability 0 (one a grammar
    forbids) and argmax then picks it. Every draw is positive and ordered like the exact value."""
    from moe_serve.seeded_random import exponential_from_bits

    bits = torch.tensor([0, 1, 1 << 23, (1 << 24) - 3, (1 << 24) - 2, (1 << 24) - 1], dtype=torch.int32)
    got = exponential_from_bits(bits.clone())
    exact = -torch.log((bits.double() + 0.5) / 2 ** 24)
    assert (got > 0).all(), got
    assert torch.allclose(got.double()[:3], exact[:3], rtol=1e-6)
    assert (got.double()[3:] <= 4e-7).all()  # the top patterns: tiny positive draws, as the exact ones


def test_forbidden_tokens_are_never_sampled_with_seeds():
    """Rows whose logits are -inf except for a few tokens (a grammar's mask) never sample a
    forbidden token under seeded sampling, over many steps and a large vocabulary."""
    from moe_serve.seeded_random import seeded_exponential

    V, Q = 49152, 64
    gen = torch.Generator().manual_seed(0)
    for pos in range(40):
        x = torch.full((Q, V), float("-inf"))
        allowed = torch.randint(0, V, (Q, 5), generator=gen)
        x.scatter_(1, allowed, torch.randn(Q, 5, generator=gen))
        probs = torch.softmax(x, dim=-1)
        q = seeded_exponential(torch.arange(Q, dtype=torch.int32), torch.full((Q,), pos, dtype=torch.int32), V)
        chosen = torch.argmax(probs / q, dim=-1)
        assert (allowed == chosen[:, None]).any(dim=1).all()
