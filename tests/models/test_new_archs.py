"""Checkpoint breadth: greedy tokens equal transformers' generate for the architectures added after
the first three (tests/checkpoints.py EXTRA_BUILDERS), under the settings of test_hf_parity.py
(chunked prefill mixed with decode, preemption by recompute, prefix-cache hits). A mismatch is
accepted only where transformers' own top-2 margin is under 1e-3."""
from __future__ import annotations

import pytest
import torch

from moe_serve import LLM, SamplingParams
from tests.models.test_hf_parity import check_greedy_parity, make_prompts

ARCHS = ["qwen2_moe", "olmoe", "kimi_k2", "glm4_moe"]


def hf_model(path: str):
    import json
    import os

    from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    if c.get("model_type") == "kimi_k2":
        # transformers has no kimi_k2 model type: the same weights as DeepSeek-V3 (whose model type
        # also selects transformers' expert-tensor conversion when loading).
        cfg = DeepseekV3Config.from_dict({**c, "model_type": "deepseek_v3"})
        return DeepseekV3ForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(extra_checkpoints, arch):
    path = extra_checkpoints[arch]
    check_greedy_parity(path, hf_model(path), 100 + ARCHS.index(arch))


def test_qwen2_moe_layer_kinds_follow_sparse_step_and_mlp_only_layers():
    """Which layers are MoE (decoder_sparse_step, mlp_only_layers) is decided as transformers does."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM as HF

    from expert_parallel.runtime.dispatch.local import LocalDispatcher
    from expert_parallel.runtime.layer import MoE, MoEContext
    from moe_serve.models.qwen2_moe import Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         shared_expert_intermediate_size=0, num_hidden_layers=6, num_attention_heads=2,
                         num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2,
                         mlp_only_layers=[3])
    theirs = [hasattr(layer.mlp, "experts") for layer in HF(cfg).model.layers]
    ours_model = Qwen2MoeForCausalLM(cfg.to_dict(), MoEContext(LocalDispatcher(4)), torch.float32)
    ours = [isinstance(layer.mlp, MoE) for layer in ours_model.model.layers]
    assert ours == theirs == [False, True, False, False, False, True]
    assert all(layer.mlp.shared_experts is None for layer in ours_model.model.layers if isinstance(layer.mlp, MoE))


def test_kimi_k2_under_either_architecture_name(extra_checkpoints, tmp_path):
    """Kimi-K2 configs say DeepseekV3ForCausalLM or KimiK2ForCausalLM: both are the DeepSeek-V3
    model, with the same tokens."""
    import json
    import os

    from moe_serve.config import ModelConfig
    from moe_serve.models.deepseek_v3 import DeepseekV3ForCausalLM
    from moe_serve.models.registry import model_class

    src = extra_checkpoints["kimi_k2"]
    alias = tmp_path / "kimi-alias"
    alias.mkdir()
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.join(src, name), alias / name)
    with open(os.path.join(src, "config.json")) as f:
        c = json.load(f)
    assert c["model_type"] == "kimi_k2" and c["architectures"] == ["DeepseekV3ForCausalLM"]
    with open(alias / "config.json", "w") as f:
        json.dump({**c, "architectures": ["KimiK2ForCausalLM"]}, f)
    for path, arch in ((src, "DeepseekV3ForCausalLM"), (str(alias), "KimiK2ForCausalLM")):
        mc = ModelConfig.from_path(path, "float32")
        assert mc.architecture == arch and model_class(arch) is DeepseekV3ForCausalLM
    prompts = [{"prompt_token_ids": p} for p in make_prompts(5)[:4]]
    sp = SamplingParams(temperature=0, max_tokens=6)
    runs = [[o.outputs[0].token_ids for o in LLM(p, dtype="float32", kv_cache_memory=1 << 20,
                                                  show_progress=False).generate(prompts, sp)]
            for p in (src, str(alias))]
    assert runs[0] == runs[1]


# The checks the first three architectures get elsewhere, run on these checkpoints (the modules are
# imported, not their test functions, so pytest does not collect those a second time here).
@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe", "glm4_moe"])  # Kimi-K2: no transformers class
def test_bfloat16_logits_close_to_float32(extra_checkpoints, arch):
    from tests.models import test_hf_parity

    test_hf_parity.test_bfloat16_logits_close_to_float32(extra_checkpoints, arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_forward_has_no_host_sync(extra_checkpoints, arch, monkeypatch):
    from tests.unit import test_decode_capturable

    test_decode_capturable.test_decode_forward_has_no_host_sync(extra_checkpoints, arch, monkeypatch)


@pytest.mark.parametrize("arch", ["qwen2_moe", "glm4_moe"])  # the gated shared expert; grouped routing
def test_overlap_gives_identical_tokens(extra_checkpoints, arch):
    from tests.unit import test_overlap

    test_overlap.test_overlap_gives_identical_tokens(extra_checkpoints, arch)


def test_quantized_checkpoint_is_refused_by_name(extra_checkpoints, tmp_path, caplog):
    """A checkpoint in a quantized format the engine does not load (bitsandbytes here) is refused naming its
    quant_method, not loaded with its scales ignored; load_format='dummy' still builds its sizes.
    A config that says block FP8 over tensors with no scales loads them as stored, with a warning."""
    import json
    import logging
    import os

    src = extra_checkpoints["kimi_k2"]
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.join(src, name), tmp_path / name)
    with open(os.path.join(src, "config.json")) as f:
        c = json.load(f)
    c["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(c, f)
    with pytest.raises(ValueError, match=r"quantized with quant_method='bitsandbytes'"):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory=1 << 20, show_progress=False)
    LLM(str(tmp_path), dtype="float32", kv_cache_memory=1 << 20, load_format="dummy", show_progress=False)
    c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(c, f)
    with caplog.at_level(logging.WARNING, logger="moe_serve.weights"):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory=1 << 20, show_progress=False)
    assert "no tensor has a weight_scale_inv" in caplog.text
