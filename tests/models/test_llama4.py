"""Llama-4 (Llama4ForCausalLM, and Llama4ForConditionalGeneration's language model): greedy tokens
equal transformers' generate under chunked prefill mixed with decode, preemption by recompute and
prefix-cache hits, with prompts spanning several attention chunks; top-2 routing (the weight on
each expert's input) too; the image-text checkpoint serves its language model; the tiny
checkpoint's features each move transformers' logits (so parity covers them); config values
transformers' model does not compute are refused by name."""
from __future__ import annotations

import json
import os

import pytest
import torch

from moe_serve import LLM
from tests.checkpoints import LLAMA4_CHUNK
from tests.models.test_hf_parity import check_greedy_parity, hf_model, make_prompts


def _copy_with_config(src: str, dst, **fields) -> str:
    """A copy of checkpoint `src` at `dst` (files linked) with config.json's fields replaced."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(src, "config.json")) as f:
        c = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**c, **fields}, f)
    return str(dst)


def test_greedy_matches_transformers(extra_checkpoints):
    assert max(len(p) for p in make_prompts(300)) > 6 * LLAMA4_CHUNK  # prompts cross several chunks
    path = extra_checkpoints["llama4"]
    check_greedy_parity(path, hf_model(path), 300)


def test_top2_routing_matches_transformers(extra_checkpoints, tmp_path):
    """Two experts per token, each fed the token scaled by its own weight (rows per (token, expert)
    pair through the dispatcher), their outputs added with weight 1."""
    path = _copy_with_config(extra_checkpoints["llama4"], tmp_path / "top2", num_experts_per_tok=2)
    check_greedy_parity(path, hf_model(path), 301)


def test_multimodal_checkpoint_serves_its_language_model(extra_checkpoints):
    """Llama4ForConditionalGeneration: config from text_config, `language_model.*` tensors loaded,
    the vision tower and projector skipped; tokens equal those of the language model transformers
    loads from the checkpoint (its image-text model's own text-only forward fails in transformers
    5.24: the language model's output has no image_outputs)."""
    from transformers import Llama4ForConditionalGeneration

    from moe_serve.config import ModelConfig
    from moe_serve.models.registry import supported_architectures

    path = extra_checkpoints["llama4_mm"]
    assert {"Llama4ForCausalLM", "Llama4ForConditionalGeneration"} <= set(supported_architectures())
    cfg = ModelConfig.from_path(path, "float32")
    assert cfg.architecture == "Llama4ForConditionalGeneration" and cfg.hf["model_type"] == "llama4_text"
    model = Llama4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    check_greedy_parity(path, model.language_model, 302)


@pytest.mark.parametrize("field, value", [("layer_types", ["full_attention"] * 4), ("attn_temperature_tuning", False),
                                          ("use_qk_norm", False), ("no_rope_layers", [1, 1, 1, 0])])
def test_each_feature_moves_transformers_logits(extra_checkpoints, field, value):
    """Without chunked layers, temperature tuning or q/k norm, or with other NoPE layers,
    transformers' own logits differ: the parity test exercises each of them."""
    from transformers import AutoModelForCausalLM

    path = extra_checkpoints["llama4"]
    ids = torch.tensor([make_prompts(0)[6]])  # 50 tokens: 7 chunks, positions past floor_scale
    with torch.no_grad():
        base = hf_model(path)(ids, use_cache=False).logits
        other = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **{field: value}).eval()
        assert getattr(other.config, field) == value
        other = other(ids, use_cache=False).logits
    assert (base - other).abs().max() > 1e-2


@pytest.mark.parametrize("fields, match", [
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({"layer_types": ["sliding_attention"] * 4}, r"layer_types=.*need 4 of 'chunked_attention' / 'full_attention'"),
    ({"layer_types": ["chunked_attention"] * 4, "attention_chunk_size": None},
     r"chunked_attention layers but attention_chunk_size=None"),
    ({"no_rope_layers": [1, 0]}, r"no_rope_layers=\[1, 0\]: need a 0 \(NoPE\) or 1 \(RoPE\) for each of the 4"),
    ({"moe_layers": [4]}, r"moe_layers=\[4\]: layer ids must be in \[0, 4\)"),
])
def test_other_variants_refused(extra_checkpoints, tmp_path, fields, match):
    path = _copy_with_config(extra_checkpoints["llama4"], tmp_path / "variant", **fields)
    with pytest.raises(ValueError, match=match):
        LLM(path, dtype="float32", kv_cache_memory=1 << 20, load_format="dummy", show_progress=False)


# Checks the other architectures get elsewhere, run on this checkpoint (modules imported, not their
# test functions, so pytest does not collect those a second time here).
def test_bfloat16_logits_close_to_float32(extra_checkpoints):
    from tests.models import test_hf_parity

    test_hf_parity.test_bfloat16_logits_close_to_float32(extra_checkpoints, "llama4")


def test_decode_forward_has_no_host_sync(extra_checkpoints, monkeypatch):
    from tests.unit import test_decode_capturable

    # The chunked layers' blocks are sized for a whole step of new tokens per request: more than
    # that test's 1 MiB budget holds at this width.
    monkeypatch.setattr(test_decode_capturable, "LLM",
                        lambda path, **kw: LLM(path, **{**kw, "kv_cache_memory": 1 << 22}))
    test_decode_capturable.test_decode_forward_has_no_host_sync(extra_checkpoints, "llama4", monkeypatch)
