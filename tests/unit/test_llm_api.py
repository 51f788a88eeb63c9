"""The offline LLM API: sampling controls, stops, log-probs against transformers, bad input."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from moe_serve import LLM, SamplingParams
from moe_serve.protocol import NewRequest
from moe_serve.tokenizer import IncrementalDetokenizer, Tokenizer

PROMPTS = [[5, 77, 301, 42], [9, 8, 7, 6, 5, 4, 3, 200, 100], [450]]


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(checkpoints["qwen3_moe"], dtype="float32", kv_cache_memory=1 << 22, show_progress=False)


def ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_output_shape_like_vllm(llm):
    out = llm.generate(["Hello there", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=5))
    assert [o.prompt for o in out] == ["Hello there", None]
    assert out[0].prompt_token_ids == llm.tokenizer.encode("Hello there")
    for o in out:
        c = o.outputs[0]
        assert o.finished and c.finish_reason in ("stop", "length")
        assert 1 <= len(c.token_ids) <= 5
        assert c.text == llm.tokenizer.decode(c.token_ids)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    a = llm.generate(ids(PROMPTS), sp)
    b = llm.generate(ids(PROMPTS[::-1]), sp)[::-1]  # another batch order
    c = llm.generate(ids(PROMPTS[:1]), sp)  # alone
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert a[0].outputs[0].token_ids == c[0].outputs[0].token_ids
    d = llm.generate(ids(PROMPTS), SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in a] != [o.outputs[0].token_ids for o in d]


def test_top_k_1_and_tiny_top_p_and_full_min_p_equal_greedy(llm):
    greedy = llm.generate(ids(PROMPTS), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for sp in (SamplingParams(temperature=0.8, top_k=1, max_tokens=10, ignore_eos=True),
               SamplingParams(temperature=1.3, top_p=1e-6, max_tokens=10, ignore_eos=True),
               SamplingParams(temperature=1.0, min_p=1.0, max_tokens=10, ignore_eos=True)):
        got = llm.generate(ids(PROMPTS), sp)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in greedy], sp


def test_n_samples(llm):
    out = llm.generate(ids(PROMPTS[:1]), SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs) == 3 and [c.index for c in out[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1


def test_stop_strings_and_stop_token_ids(llm):
    base = llm.generate(ids(PROMPTS), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for o, p in zip(base, PROMPTS):
        text = o.outputs[0].text
        assert len(text) > 6
        stop = text[3:6]
        first = text.find(stop)
        got = llm.generate(ids([p]), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop, "\x00"]))[0]
        c = got.outputs[0]
        assert c.text == text[:first] and c.finish_reason == "stop" and c.stop_reason == stop
        kept = llm.generate(ids([p]), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stop,
                                                     include_stop_str_in_output=True))[0].outputs[0]
        assert kept.text == text[:first + len(stop)]
        tok = o.outputs[0].token_ids[4]
        first_tok = o.outputs[0].token_ids.index(tok)
        got = llm.generate(ids([p]), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                    stop_token_ids=[tok]))[0].outputs[0]
        assert got.token_ids == o.outputs[0].token_ids[:first_tok + 1]
        assert got.finish_reason == "stop" and got.stop_reason == tok


def test_logprobs_match_transformers(llm, checkpoints):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"], dtype=torch.float32).eval()
    out = llm.generate(ids(PROMPTS), SamplingParams(temperature=0, max_tokens=6, logprobs=4, ignore_eos=True))
    for p, o in zip(PROMPTS, out):
        c = o.outputs[0]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([p + c.token_ids])).logits[0].double(), -1)
        total = 0.0
        for i, (tok, lps) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(p) - 1 + i]
            assert abs(lps[tok].logprob - float(row[tok])) < 1e-4
            top = torch.topk(row, 4).indices.tolist()
            assert set(top) <= set(lps)  # the top-4 reference tokens are reported
            for t, lp in lps.items():
                assert abs(lp.logprob - float(row[t])) < 1e-4
            total += float(row[tok])
        assert abs(c.cumulative_logprob - total) < 1e-3


@pytest.mark.parametrize("prompt, params, field", [
    ({"prompt_token_ids": []}, {}, "prompt"),
    ({"prompt_token_ids": [3 + i % 500 for i in range(1100)]}, {}, "max_model_len"),
    ({"prompt_token_ids": [1, 2, 99999]}, {}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, 2]}, {"max_tokens": 1023}, "max_tokens"),
])
def test_bad_requests_raise_naming_the_field(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([{"prompt_token_ids": [5, 6]}, prompt], SamplingParams(**params))
    assert not llm.engine.has_unfinished()  # the good prompt in the same call was not submitted either
    ok = llm.generate(ids(PROMPTS[:1]), SamplingParams(temperature=0, max_tokens=2))
    assert len(ok[0].outputs[0].token_ids) >= 1


@pytest.mark.parametrize("kw, field", [({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.5}, "temperature"),
                                       ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"),
                                       ({"top_k": -3}, "top_k"), ({"min_p": 2.0}, "min_p")])
def test_bad_sampling_params(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_abort_frees_blocks(llm):
    core = llm.engine
    assert core.add_request(NewRequest("x", list(range(3, 60)), SamplingParams(max_tokens=50))) is None
    core.step()
    assert core.allocator.usage > 0
    assert [(o.request_id, o.finish_reason) for o in core.abort_requests(["x"])] == [("x", "abort")]
    assert core.allocator.usage == 0 and not core.has_unfinished()


def test_incremental_detokenizer_multibyte(checkpoints):
    tok = Tokenizer(checkpoints["mixtral"])
    text = "Café naïve 東京は日本の首都です。 Привет, мир! 🙂 done"
    ids_ = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [])
    deltas = [d.add(t) for t in ids_]
    deltas.append(d.flush())
    assert "".join(deltas) == tok.decode(ids_) == text
    assert not any("\ufffd" in x for x in deltas)


def test_dummy_weights_and_checkpoint_errors(checkpoints, tmp_path):
    src = checkpoints["deepseek_v3"]
    llm = LLM(src, load_format="dummy", kv_cache_memory=1 << 20, show_progress=False)
    assert len(llm.generate(ids(PROMPTS[:1]), SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3
    # Unsupported architecture.
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        LLM(str(bad), show_progress=False)
    # Missing and unexpected tensors are named.
    from safetensors.torch import load_file, save_file

    miss = tmp_path / "miss"
    shutil.copytree(src, miss)
    sd = load_file(str(miss / "model.safetensors"))
    del sd["model.layers.1.self_attn.kv_b_proj.weight"]
    save_file(sd, str(miss / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.self_attn\.kv_b_proj"):
        LLM(str(miss), kv_cache_memory=1 << 20, show_progress=False)
    sd["model.layers.1.self_attn.kv_b_proj.weight"] = torch.zeros(128, 32)
    sd["model.layers.0.mystery.weight"] = torch.zeros(2)
    save_file(sd, str(miss / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.mystery.weight'"):
        LLM(str(miss), kv_cache_memory=1 << 20, show_progress=False)
    assert os.path.isdir(src)
