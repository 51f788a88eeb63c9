"""Structured outputs in the engine: the token bitmask against an explicit reference (a token is
allowed iff a copy of the matcher accepts it), and offline generation under grammars: outputs
validate (`jsonschema` as the oracle) through preemptions and n > 1, and unconstrained requests in
the same batch get exactly the tokens they get alone."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from moe_serve import LLM, SamplingParams
from moe_serve.structured_output import StructuredOutputsParams as SO

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2}},
          "required": ["name", "age", "ok", "tags"], "additionalProperties": False}


def test_bitmask_matches_explicit_reference(checkpoints):
    import xgrammar as xgr

    from moe_serve.structured_output.bitmask import BitmaskFiller, apply_token_bitmask_, mask_rows_
    from moe_serve.structured_output.grammar import GrammarState, build_grammar, tokenizer_info
    from moe_serve.tokenizer import Tokenizer

    path = checkpoints["qwen3_moe"]
    tok = Tokenizer(path)
    V = 600  # logits wider than the 512-token vocabulary: ids 512.. must never be allowed
    compiler = xgr.GrammarCompiler(tokenizer_info(path, V, [tok.eos_token_id]), max_threads=1)
    cases = [(SO(json=SCHEMA), ""), (SO(json=SCHEMA), '{"name": "ab'), (SO(json=SCHEMA), '{"name": "x", "age": 1'),
             (SO(regex=r"[a-c]{2}\d"), "a"), (SO(choice=["yes", "no"]), "yes"), (SO(json_object=True), "{")]
    states = []
    for so, prefix in cases:
        st = GrammarState(xgr.GrammarMatcher(compiler.compile_grammar(build_grammar(*so.key))))
        for t in tok.encode(prefix, add_special_tokens=False):
            assert st.matcher.accept_token(t)
        states.append(st)
    S = 2 * len(states) + 1
    rows = [(2 * g + 1, st) for g, st in enumerate(states)]  # constrained rows between unconstrained ones
    rows_G, bitmask_GW = BitmaskFiller(S, V, torch.device("cpu")).fill(rows)
    x64_SV = torch.randn(S, V, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 5
    x_SV = x64_SV.to(torch.float32)
    got_SV = x_SV.clone()
    apply_token_bitmask_(got_SV, bitmask_GW, rows_G)  # the sampler's path (xgrammar's kernel on CPUs)
    # The tensor-op kernel (used on accelerators) gives the same masked rows.
    sub_GV = x_SV.index_select(0, rows_G)
    mask_rows_(sub_GV, bitmask_GW, kernel="torch")
    assert torch.equal(sub_GV, got_SV.index_select(0, rows_G))
    constrained = {i for i, _ in rows}
    for i in range(S):
        if i not in constrained:
            assert torch.equal(got_SV[i], x_SV[i])
    for (i, st), (so, prefix) in zip(rows, cases):
        allowed_V = torch.tensor([st.matcher.fork().accept_token(t) for t in range(V)])
        assert 0 < int(allowed_V.sum()) < 512 and not allowed_V[512:].any(), (so, prefix)
        ref_V = torch.where(allowed_V, x64_SV[i], torch.tensor(float("-inf"), dtype=torch.float64))
        assert torch.equal(got_SV[i].to(torch.float64), ref_V.to(torch.float32).to(torch.float64)), (so, prefix)
        if prefix == "yes":  # a finished choice: only EOS may follow
            assert allowed_V.nonzero().flatten().tolist() == [tok.eos_token_id]
    # Many rows are filled by xgrammar's batch matcher: the same masks.
    from moe_serve.structured_output.bitmask import BATCH_FILL_ROWS

    many = [(i, states[i % len(states)]) for i in range(BATCH_FILL_ROWS + 3)]
    rows_G, big_GW = BitmaskFiller(len(many), V, torch.device("cpu")).fill(many)
    assert torch.equal(rows_G, torch.arange(len(many)))
    assert torch.equal(big_GW, bitmask_GW[torch.arange(len(many)) % len(states)])


def test_spec_and_param_checks():
    from moe_serve.structured_output.grammar import check_spec

    with pytest.raises(ValueError, match="exactly one"):
        SO(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        SO()
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=SO(regex="a+"))
    for bad in (SO(regex="(ab"), SO(json='{"type": "nonsense"}'), SO(grammar="root ::= undefined_rule"),
                SO(json="{not json")):
        with pytest.raises(ValueError) as e:
            check_spec(bad)
        assert "/project/" not in str(e.value) and str(e.value)
    check_spec(SO(choice=['say "hi"\n', "back\\slash"]))
    # The spec crosses to the core inside SamplingParams as msgpack.
    import msgspec

    p = SamplingParams(structured_outputs=SO(json=SCHEMA))
    q = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams)
    assert q.structured_outputs.key == p.structured_outputs.key and json.loads(q.structured_outputs.json) == SCHEMA


def test_preemption_and_n_keep_outputs_valid(checkpoints):
    # 10 blocks of 16 tokens for 4 sequences of ~40-110 tokens: requests are preempted and
    # recomputed while their matchers stay where their tokens are.
    llm = LLM(checkpoints["qwen3_moe"], dtype="float32", num_kv_blocks=10, show_progress=False)
    params = [SamplingParams(temperature=1.0, seed=s, n=2, max_tokens=110, structured_outputs=SO(json=SCHEMA))
              for s in range(2)]
    outs = llm.generate(["JSON please", "x"], params)
    assert llm.engine.scheduler.num_preemptions > 0
    texts = []
    for o in outs:
        assert len(o.outputs) == 2
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
            texts.append(c.text)
    assert len(set(texts)) == len(texts)  # every sample its own: the children do not share a matcher
    regex = r"[a-z]{2,5}-\d{3}"
    outs = llm.generate(["a"] * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=40,
                                                   structured_outputs=SO(regex=regex)) for s in range(3)])
    assert all(re.fullmatch(regex, o.outputs[0].text) and o.outputs[0].finish_reason == "stop" for o in outs)


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(checkpoints["qwen3_moe"], dtype="float32", kv_cache_memory=8 << 20, show_progress=False)


def test_length_bounded_strings_are_strict_json(llm):
    # xgrammar's own class for minLength/maxLength strings lets raw control characters through;
    # the schema is rewritten so they are exact (this schema failed json.loads before).
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 6},
                                               "b": {"type": "array", "items": {"type": "string", "minLength": 2,
                                                                                "maxLength": 3}, "maxItems": 2}},
              "required": ["a", "b"], "additionalProperties": False}
    outs = llm.generate(["x"] * 6, [SamplingParams(temperature=1.0, seed=s, max_tokens=150,
                                                   structured_outputs=SO(json=schema)) for s in range(6)])
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        value = json.loads(o.outputs[0].text)  # strict: no raw control characters
        jsonschema.validate(value, schema)


def test_unconstrained_rows_untouched_in_a_mixed_batch(llm):
    plain = [("The capital of France", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
             ("Hello there", SamplingParams(temperature=1.0, seed=7, top_p=0.9, max_tokens=24, ignore_eos=True)),
             ("One, two", SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True))]
    alone = llm.generate([p for p, _ in plain], [sp for _, sp in plain])
    constrained = [("Person:", SamplingParams(temperature=1.0, seed=s, max_tokens=120,
                                              structured_outputs=SO(json=SCHEMA))) for s in range(3)]
    constrained.append(("Answer:", SamplingParams(temperature=0, max_tokens=8,
                                                  structured_outputs=SO(choice=["A", "B"]))))
    mixed = constrained[:2] + plain[:1] + constrained[2:] + plain[1:]
    compiled = llm.engine.grammars.num_compiled
    outs = llm.generate([p for p, _ in mixed], [sp for _, sp in mixed])
    assert llm.engine.grammars.num_compiled - compiled <= 2  # one compile per distinct spec
    got = [outs[2], outs[5], outs[6]]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in alone]
    for o in [outs[0], outs[1], outs[3]]:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert outs[4].outputs[0].text in ("A", "B")
    compiled = llm.engine.grammars.num_compiled
    again = llm.generate([p for p, _ in mixed], [sp for _, sp in mixed])
    assert llm.engine.grammars.num_compiled == compiled  # cached: nothing compiles again
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_tokenizer_info_agrees_with_xgrammar_from_huggingface(checkpoints):
    import os

    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    from moe_serve.structured_output.grammar import tokenizer_info

    path = checkpoints["qwen3_moe"]
    ref = xgr.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json")), vocab_size=600,
        stop_token_ids=[2])
    ours = tokenizer_info(path, 600, [2])
    assert ours.dump_metadata() == ref.dump_metadata()
    assert ours.decoded_vocab == ref.decoded_vocab and ours.vocab_size == 600 and ours.stop_token_ids == [2]


def test_a_token_the_grammar_rejects_ends_the_request(llm):
    # Fault injection: the sampler returns a token the grammar forbids (never the case when the
    # mask is applied). The request must end at once with the reason, not hang or run on.
    from moe_serve.sampler import SampleResult

    sampler = llm.engine.runner.sampler
    real = sampler.__call__

    class Forbidding:
        def __call__(self, logits, md):
            res = real(logits, md)
            if md.grammar_cpu is not None:
                res = SampleResult([1 if i in {g for g, _ in md.grammar_cpu} else t  # <|im_start|>
                                    for i, t in enumerate(res.token_ids)], res.logprobs)
            return res

    llm.engine.runner.sampler = Forbidding()
    try:
        outs = llm.generate(["x", "y"], [SamplingParams(max_tokens=20, structured_outputs=SO(json_object=True)),
                                         SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)])
    finally:
        llm.engine.runner.sampler = sampler
    bad, ok = outs[0].outputs[0], outs[1].outputs[0]
    assert bad.finish_reason == "abort" and "rejected token 1" in bad.stop_reason and bad.token_ids == [1]
    assert ok.finish_reason == "length" and len(ok.token_ids) == 5
    assert not llm.engine.has_unfinished()


def test_abort_while_the_grammar_compiles(llm):
    from moe_serve.protocol import NewRequest

    core = llm.engine
    p = SamplingParams(max_tokens=5, structured_outputs=SO(regex=r"never-seen-before-[0-9]{3}"))
    assert core.add_request(NewRequest("g1", [5, 6, 7], p)) is None
    assert core.has_unfinished() and core.stats().num_waiting == 1
    assert core.add_request(NewRequest("g1", [5], p)).stop_reason.endswith("already in use")
    (out,) = core.abort_requests(["g1"])
    assert out.finished and out.finish_reason == "abort"
    assert not core.has_unfinished() and core.step() == []


def test_logprobs_are_the_models_not_the_masked_ones(llm):
    # The first position's distribution is the same with and without a grammar: its top logprobs
    # must be too (the mask changes what is sampled, not the logprobs reported).
    grammar = SamplingParams(temperature=0, max_tokens=3, logprobs=5, structured_outputs=SO(regex="[0-9]{3}"))
    free = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    got, ref = (o.outputs[0] for o in llm.generate(["Numbers:", "Numbers:"], [grammar, free]))
    assert got.text.isdigit() and len(got.text) == 3
    ref0, got0 = ref.logprobs[0], got.logprobs[0]
    assert any(not lp.decoded_token.strip().isdigit() for lp in ref0.values())  # the grammar forbids some
    for t, lp in ref0.items():
        assert t in got0 and abs(got0[t].logprob - lp.logprob) < 1e-5
