"""The built-in default model through *our* engine, against transformers on real pretrained weights.

  - noise 0: the upcycled MoE is mathematically the dense SmolLM2; our engine's greedy tokens equal
    transformers' dense LlamaForCausalLM on the dequantized weights (chat prompts of mixed lengths,
    one batch, float32);
  - the real default (noise 0.1) through our engine equals transformers' MixtralForCausalLM on the
    built checkpoint, greedy, float32;
  - through the OpenAI endpoint of `moe-serve serve` with no --model, the capital of France is Paris;
  - our engine's expert-load recorder sees every expert of every layer get tokens on a fixed text.
"""
from __future__ import annotations

import openai
import torch

from moe_serve import LLM, SamplingParams
from tests.e2e.server import ServerProcess
from tests.models.test_hf_parity import assert_same_greedy

QUESTIONS = ["What is the capital of France?", "Who wrote Romeo and Juliet?",
             "Name three primary colors and say which one you like best, in one sentence.", "Hi!",
             "Explain in two sentences why the sky looks blue during the day."]
MAX_NEW = 8  # greedy tokens compared per prompt (each costs a transformers Mixtral step of the real model)


def chat_ids(tok, q: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True,
                                   return_dict=False)


def hf_greedy_all(cls_name: str, path: str, prompts: list[list[int]]):
    import transformers

    model = getattr(transformers, cls_name).from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            g = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))
            outs.append(g[0, len(p):].tolist())
    return model, outs


def ours(path: str, prompts: list[list[int]]):
    llm = LLM(path, dtype="float32", kv_cache_memory=64 << 20, max_num_batched_tokens=64, show_progress=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    return llm, [o.outputs[0].token_ids for o in outs]


def test_noise0_moe_equals_dense_llama(moe_noise0_dir, dense_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(moe_noise0_dir)
    prompts = [chat_ids(tok, q) for q in QUESTIONS[2:]]  # the Mixtral test below runs the first two
    assert len({len(p) for p in prompts}) == 3
    dense, expected = hf_greedy_all("LlamaForCausalLM", dense_dir, prompts)
    _, got = ours(moe_noise0_dir, prompts)
    for p, g, e in zip(prompts, got, expected):
        assert_same_greedy(dense, p, g, e)


def test_default_model_equals_transformers_mixtral_and_uses_every_expert(default_build):
    from transformers import AutoTokenizer

    path = default_build["path"]
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:2]]  # the noise-0 test above runs the other three
    mixtral, expected = hf_greedy_all("MixtralForCausalLM", path, prompts)
    llm, got = ours(path, prompts)
    for p, g, e in zip(prompts, got, expected):
        assert_same_greedy(mixtral, p, g, e)
    # Expert load on a fixed text, counted by the engine's recorder: every expert gets tokens.
    text = ("Photosynthesis is the process by which green plants turn light, water and carbon dioxide into "
            "sugar and oxygen. It happens mostly in the leaves. In 1779 Jan Ingenhousz showed that plants "
            "need light to do this. for i in range(3): print(i * i)")
    rec = llm.engine.enable_load_recording(window_steps=1, start=True)
    llm.generate([text], SamplingParams(temperature=0, max_tokens=1))
    counts = rec.windows().sum(0)  # (layers, experts)
    assert counts.shape == (30, 4)
    assert bool((counts > 0).all()), counts


def test_serve_with_no_model_answers_paris(default_build):
    s = ServerProcess(["--dtype", "float32", "--kv-cache-memory", str(64 << 20)],
                      env={"MOE_SERVE_CACHE": default_build["cache"]})
    try:
        assert "moe-smollm2-4x135m" in s.log()
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", timeout=120, max_retries=0)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, temperature=0, max_tokens=24,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
    finally:
        assert s.stop() == 0
