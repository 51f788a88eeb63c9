"""Prefill/decode disaggregation between two real engines in one process, over NIXL: a decode
engine reserves a prompt's blocks, a prefill engine computes the prompt and writes its cache into
them, the decode engine computes the last prompt token and decodes. Greedy tokens equal
transformers' generate (or, where the oracle needs the model's own settings, the colocated
engine, itself checked against transformers in the model's tests), for every cache kind: full
GQA, MLA latent, DSA latent + indexer keys, sliding windows, linear-attention states. Blocks the
decode side has cached are not sent again; every block and slot comes back on both sides."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from moe_serve import LLM, SamplingParams
from moe_serve.protocol import KVDone, KVParams, NewRequest, RoutedExpertRows
from moe_serve.routed_experts import RoutedExperts
from tests.models.test_hf_parity import hf_greedy, make_prompts

MAX_NEW = 6
ARGS = dict(dtype="float32", block_size=4, num_kv_blocks=160, max_num_batched_tokens=24, max_num_seqs=8,
            show_progress=False)


def pair(path: str, **kw):
    return (LLM(path, disaggregation_mode="prefill", **ARGS, **kw).engine,
            LLM(path, disaggregation_mode="decode", **ARGS, **kw).engine)


def run_prefill(P, requests: list[NewRequest]) -> dict[str, object]:
    """Step the prefill engine until every request's write ended: {request id: its last output}."""
    for r in requests:
        assert P.add_request(r) is None
    ended = {}
    for _ in range(5000):
        if not P.has_unfinished() and not P.has_transfers():
            break
        if not P.has_unfinished():
            time.sleep(0.001)  # only writes in flight: NIXL's progress thread moves them
        for o in P.step() + P.poll_kv():
            if o.finished:
                ended[o.request_id] = o
    assert set(ended) == {r.request_id for r in requests}
    return ended


def disagg_generate(P, D, prompts: list[list[int]], max_new: int = MAX_NEW, fail: set[int] = frozenset(),
                    rows: list | None = None):
    """Greedy tokens of each prompt through the pair; the prompts in `fail` get a failed transfer
    (the decode engine computes them itself). rows: a list that gets each prompt's routed experts
    (return_routed_experts on both sides; the prefill side's rows of the prompt go with the KVDone,
    as the decode front end sends them)."""
    routed = rows is not None
    params = SamplingParams(temperature=0, max_tokens=max_new, return_routed_experts=routed)
    got = {f"r{i}": RoutedExperts() for i in range(len(prompts))}
    sent_rows = {}
    for i, p in enumerate(prompts):
        assert D.add_request(NewRequest(f"r{i}", p, params, KVParams("decode"))) is None
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    done, sent = set(), 0
    for _ in range(2000):
        if len(done) == len(prompts):
            break
        outs = D.step()
        targets = [o for o in outs if o.kv_target is not None]
        for o in outs:
            if o.routed_experts is not None:
                got[o.request_id].add(o.routed_experts)
            if o.kv_target is None:
                tokens[o.request_id] += o.new_token_ids
                if o.finished:
                    done.add(o.request_id)
        ok = [o for o in targets if int(o.request_id[1:]) not in fail]
        if ok:
            pre = SamplingParams(temperature=0, max_tokens=1, return_routed_experts=routed)
            ended = run_prefill(P, [NewRequest(o.request_id, prompts[int(o.request_id[1:])], pre,
                                               KVParams("prefill", o.kv_target)) for o in ok])
            assert all(e.finish_reason != "abort" for e in ended.values()), ended
            for o in ok:  # positions 0 .. end - 1, as the prefill front end answers (entrypoints/openai/prefill.py)
                if routed:
                    r = RoutedExperts()
                    r.add(ended[o.request_id].routed_experts)
                    sent_rows[o.request_id] = RoutedExpertRows(0, r.num_layers, r.top_k, r.data(o.kv_target.end))
            sent += len(ok)
        D.kv_done([KVDone(o.request_id, int(o.request_id[1:]) not in fail, "test", True,
                          sent_rows.get(o.request_id)) for o in targets])
    assert len(done) == len(prompts)
    if routed:
        rows[:] = [got[f"r{i}"].as_array() for i in range(len(prompts))]
    return [tokens[f"r{i}"] for i in range(len(prompts))], sent


def hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def check_returned(*engines) -> None:
    for e in engines:
        assert e.scheduler.kv.in_use == 0
        e.scheduler.kv.check_invariants()


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_gqa_and_mla_match_transformers(checkpoints, arch):
    path = checkpoints[arch]
    P, D = pair(path)
    prompts = make_prompts(500)
    got, sent = disagg_generate(P, D, prompts)
    model = hf(path)
    for p, g in zip(prompts, got):
        assert g == hf_greedy(model, p, MAX_NEW), p
    assert sent == len(prompts) - 1  # a one-token prompt has nothing to move
    assert D.stats().kv_received_requests == sent and P.stats().kv_sent_requests == sent
    check_returned(P, D)


def test_decode_side_prefix_hits_are_not_sent_again(checkpoints):
    P, D = pair(checkpoints["mixtral"])
    prompts = make_prompts(501)
    shared = [p for p in prompts if len(p) >= 40]
    first, _ = disagg_generate(P, D, shared[:1])
    bytes_first = P.stats().kv_sent_bytes
    again, _ = disagg_generate(P, D, shared[:1])  # every full block but the last partial one is cached on D
    assert again == first
    assert 0 < P.stats().kv_sent_bytes - bytes_first < bytes_first / 4
    check_returned(P, D)


@pytest.mark.parametrize("arch", ["qwen3_next", "gpt_oss", "deepseek_v32", "deepseek_v4"])
def test_state_sliding_and_dsa_caches_move(extra_checkpoints, arch):
    path = extra_checkpoints[arch]
    P, D = pair(path)
    prompts = make_prompts(502)
    got, sent = disagg_generate(P, D, prompts)
    want = LLM(path, **ARGS).generate([{"prompt_token_ids": p} for p in prompts],
                                      SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert got == [o.outputs[0].token_ids for o in want]
    assert sent == len(prompts) - 1
    check_returned(P, D)
    if arch == "qwen3_next":  # and the colocated engine is transformers' greedy here
        model = hf(path)
        for p, g in zip(prompts[:4], got):
            assert g == hf_greedy(model, p, MAX_NEW)


def test_failed_transfer_is_computed_on_the_decode_side(checkpoints):
    path = checkpoints["mixtral"]
    P, D = pair(path)
    prompts = make_prompts(503)[3:8]
    got, sent = disagg_generate(P, D, prompts, fail={1, 3})
    model = hf(path)
    for p, g in zip(prompts, got):
        assert g == hf_greedy(model, p, MAX_NEW)
    assert sent == 3 and D.stats().kv_fallbacks == 2
    check_returned(P, D)


def test_aborted_decode_request_holds_its_blocks_until_the_writer_is_done(checkpoints):
    """An abort while the prompt's cache is on its way keeps the blocks (the writer may still be
    writing) until the transfer is known to be over; then everything is back."""
    P, D = pair(checkpoints["mixtral"])
    prompt = make_prompts(504)[-1]
    D.add_request(NewRequest("a", prompt, SamplingParams(temperature=0, max_tokens=4), KVParams("decode")))
    (o,) = [o for o in D.step() if o.kv_target is not None]
    assert D.abort_requests(["a"])[0].finish_reason == "abort"
    assert D.scheduler.kv.in_use > 0
    run_prefill(P, [NewRequest("a", prompt, SamplingParams(temperature=0, max_tokens=1),
                               KVParams("prefill", o.kv_target))])
    D.kv_done([KVDone("a", True)])
    check_returned(P, D)


def test_mismatched_instances_and_roles_are_refused(checkpoints):
    P, D = pair(checkpoints["mixtral"])
    _, D2 = pair(checkpoints["qwen3_moe"])
    p = make_prompts(505)[-1]
    D2.add_request(NewRequest("x", p, SamplingParams(max_tokens=2), KVParams("decode")))
    (o,) = [o for o in D2.step() if o.kv_target is not None]
    refused = P.add_request(NewRequest("x", p, SamplingParams(max_tokens=1),
                                       KVParams("prefill", o.kv_target)))
    assert refused.finish_reason == "abort" and "layout" in refused.stop_reason
    wrong = D.add_request(NewRequest("y", p, SamplingParams(max_tokens=2), KVParams("prefill", o.kv_target)))
    assert "--disaggregation-mode decode" in wrong.stop_reason
    plain = LLM(checkpoints["mixtral"], **ARGS).engine
    assert "--disaggregation-mode none" in plain.add_request(
        NewRequest("z", p, SamplingParams(max_tokens=2), KVParams("decode"))).stop_reason


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_speculative_decoding_on_the_decode_side(extra_checkpoints, method):
    """Greedy text unchanged, and the drafts accepted equal the colocated engine's: with MTP (both
    sides run the layer, so its cache entries of the prompt move with the model's), the draft
    layer's cache is what the colocated engine would have had."""
    path = extra_checkpoints["deepseek_v3_mtp_copy"]
    spec = {"method": method, "num_speculative_tokens": 2}
    if method == "ngram":
        spec |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    P = LLM(path, disaggregation_mode="prefill", **ARGS, **({"speculative_config": spec} if method == "mtp" else {}))
    D = LLM(path, disaggregation_mode="decode", speculative_config=spec, **ARGS)
    prompts = [p * 3 for p in make_prompts(506)[2:6]]  # repeats: n-gram drafts find matches
    got, sent = disagg_generate(P.engine, D.engine, prompts, max_new=10)
    colocated = LLM(path, speculative_config=spec, **ARGS)
    want = colocated.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=10))
    assert got == [o.outputs[0].token_ids for o in want]
    ds, cs = D.engine.stats(), colocated.engine.stats()
    assert ds.spec_num_draft_tokens > 0 and cs.spec_num_draft_tokens > 0
    rate = ds.spec_num_accepted_tokens / ds.spec_num_draft_tokens
    assert rate >= 0.8 * cs.spec_num_accepted_tokens / cs.spec_num_draft_tokens
    if method == "mtp":  # the copy layer's drafts are mostly right
        assert rate > 0.5
    check_returned(P.engine, D.engine)


def test_routed_experts_of_moved_and_fallback_prompts(checkpoints):
    """return_routed_experts through the pair: the prompt rows the prefill side computed (sent with
    the KVDone), the ones of a prompt computed on the decode side after a failed transfer, and,
    for prompts sent again, the decode side's own cached blocks' rows plus the rest from the
    prefill side: every prompt and output position, equal to the colocated engine's rows and to
    transformers' routing."""
    from tests.models.test_routed_experts import assert_same_routing
    from tests.models.test_hf_parity import hf_model

    path = checkpoints["qwen3_moe"]
    P, D = pair(path)
    prompts = make_prompts(507)[2:7]
    rows: list = []
    got, sent = disagg_generate(P, D, prompts, fail={1, 3}, rows=rows)
    assert sent == 3 and D.stats().kv_fallbacks == 2
    want = LLM(path, **ARGS).generate([{"prompt_token_ids": p} for p in prompts],
                                      SamplingParams(temperature=0, max_tokens=MAX_NEW, return_routed_experts=True))
    model = hf_model(path)
    for p, g, r, w in zip(prompts, got, rows, want):
        assert g == w.outputs[0].token_ids
        assert r.shape == (len(p) + len(g) - 1, *r.shape[1:]) and (r >= 0).all()
        assert np.array_equal(r, w.outputs[0].routed_experts)
        assert_same_routing(model, p, g, r)
    hits = D.allocator.hit_tokens
    again, _ = disagg_generate(P, D, prompts[-2:], rows=rows)  # decode-side hits, the rest moved
    assert again == got[-2:] and D.allocator.hit_tokens > hits
    for r, w in zip(rows, want[-2:]):
        assert np.array_equal(r, w.outputs[0].routed_experts)
    check_returned(P, D)
