"""MiniMax-M2 (MiniMaxM2ForCausalLM): greedy tokens equal transformers' generate under chunked
prefill mixed with decode, preemption by recompute and prefix-cache hits; the correction bias
really moves the routing; the checkpoint also loads under transformers 5's in-memory names (fused
experts, `mlp.`) and as block FP8; config values transformers' model does not compute are refused
by name."""
from __future__ import annotations

import json
import os

import pytest
import torch

from moe_serve import LLM, SamplingParams
from tests.models.test_hf_parity import check_greedy_parity, hf_model, make_prompts


def test_greedy_matches_transformers(extra_checkpoints):
    path = extra_checkpoints["minimax_m2"]
    check_greedy_parity(path, hf_model(path), 200)


def test_correction_bias_changes_the_chosen_experts(extra_checkpoints):
    """The tiny checkpoint's e_score_correction_bias is wide enough that transformers' router picks
    other experts than the sigmoid scores alone would, so the parity test covers the bias."""
    m = hf_model(extra_checkpoints["minimax_m2"])
    seen = []  # (router input, chosen ids) of each layer
    for layer in m.model.layers:
        layer.mlp.gate.register_forward_hook(lambda mod, args, out: seen.append((args[0], out[2])))
    with torch.no_grad():
        m(torch.tensor([make_prompts(0)[5]]))
    changed = 0
    for layer, (x, ids) in zip(m.model.layers, seen):
        gate = layer.mlp.gate
        plain = torch.topk(torch.sigmoid(x.float() @ gate.weight.float().t()), gate.top_k, dim=-1)[1]
        changed += int((plain.sort(-1)[0] != ids.sort(-1)[0]).any(-1).sum())
    assert len(seen) == len(m.model.layers) and changed > 0


def _copy_with(src: str, dst, config: dict | None = None, tensors: dict | None = None) -> str:
    """A copy of checkpoint `src` at `dst` with its config.json and/or model.safetensors replaced."""
    from safetensors.torch import save_file

    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if (name == "config.json" and config is not None) or (name == "model.safetensors" and tensors is not None):
            continue
        os.symlink(os.path.join(src, name), os.path.join(dst, name))
    if config is not None:
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f)
    if tensors is not None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"),
                  metadata={"format": "pt"})
    return str(dst)


def test_transformers_in_memory_names_load_the_same_model(extra_checkpoints, tmp_path):
    """The same weights under transformers 5's in-memory names (`mlp.gate`, fused
    `mlp.experts.gate_up_proj` (E, 2F, D) and `down_proj` (E, D, F), `mlp.e_score_correction_bias`)
    give the same tokens as the Hub layout (`block_sparse_moe`, per-expert w1/w3/w2). Here 2F = D,
    so gate_up_proj's (2F, D) rows look the same as a transposed (D, 2F) layout would."""
    from safetensors.torch import load_file

    src = extra_checkpoints["minimax_m2"]
    sd = load_file(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        c = json.load(f)
    E, F, D = c["num_local_experts"], c["intermediate_size"], c["hidden_size"]
    assert 2 * F == D
    out = {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in sd.items() if ".experts." not in k}
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}.block_sparse_moe.experts"
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([sd[f"{pre}.{e}.w1.weight"], sd[f"{pre}.{e}.w3.weight"]]) for e in range(E)])
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([sd[f"{pre}.{e}.w2.weight"] for e in range(E)])
    assert "model.layers.1.mlp.e_score_correction_bias" in out
    fused = _copy_with(src, tmp_path / "fused", tensors=out)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(3)[:5]]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in LLM(p, dtype="float32", kv_cache_memory=1 << 20,
                                                  show_progress=False).generate(prompts, sp)]
            for p in (src, fused)]
    assert runs[0] == runs[1]


def test_block_fp8_checkpoint_matches_transformers_on_dequantized_weights(extra_checkpoints, tmp_path):
    """Block FP8 as MiniMax-M2 ships it: every linear weight but the router's (per-expert w1/w2/w3
    included) in float8_e4m3fn with a float32 weight_scale_inv per block (blocks that do not divide
    the dimensions here). The oracle is transformers' model of the exactly dequantized weights."""
    from safetensors.torch import load_file

    from tests.models.test_fp8 import _dequantize64, _quantize64

    src = extra_checkpoints["minimax_m2"]
    block = (16, 24)
    out, dequant = {}, {}
    for k, v in load_file(os.path.join(src, "model.safetensors")).items():
        if (v.dim() == 2 and k.endswith(".weight") and "norm" not in k and "embed_tokens" not in k
                and k != "lm_head.weight" and not k.endswith(".gate.weight")):
            q, scale = _quantize64(v, block)
            out[k], out[k + "_scale_inv"], dequant[k] = q, scale, _dequantize64(q, scale, block)
        else:
            out[k] = dequant[k] = v
    assert "model.layers.0.block_sparse_moe.experts.7.w2.weight_scale_inv" in out
    with open(os.path.join(src, "config.json")) as f:
        c = json.load(f)
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    fp8 = _copy_with(src, tmp_path / "fp8", config={**c, "quantization_config": quant}, tensors=out)
    oracle = _copy_with(src, tmp_path / "oracle", tensors=dequant)
    check_greedy_parity(fp8, hf_model(oracle), 201)


@pytest.mark.parametrize("field, value, match", [
    ("use_qk_norm", False, r"use_qk_norm=False is not supported"),
    ("qk_norm_type", "per_head", r"qk_norm_type='per_head' is not supported"),
    ("scoring_func", "softmax", r"scoring_func='softmax' is not supported"),
    ("use_routing_bias", False, r"use_routing_bias=False is not supported"),
    ("hidden_act", "gelu", r"hidden_act='gelu' is not supported"),
    ("routed_scaling_factor", 2.0, r"routed_scaling_factor=2.0 is not supported"),
    ("shared_intermediate_size", 64, r"shared_intermediate_size=64 \(shared experts\) is not supported"),
    ("attn_type_list", [0, 1], r"attn_type_list=\[0, 1\] is not supported: only full-attention"),
])
def test_architecture_accepted_and_other_variants_refused(extra_checkpoints, tmp_path, field, value, match):
    from moe_serve.config import ModelConfig
    from moe_serve.models.minimax_m2 import MiniMaxM2ForCausalLM
    from moe_serve.models.registry import model_class, supported_architectures

    src = extra_checkpoints["minimax_m2"]
    assert "MiniMaxM2ForCausalLM" in supported_architectures()
    assert ModelConfig.from_path(src, "float32").architecture == "MiniMaxM2ForCausalLM"
    assert model_class("MiniMaxM2ForCausalLM") is MiniMaxM2ForCausalLM
    with open(os.path.join(src, "config.json")) as f:
        c = json.load(f)
    path = _copy_with(src, tmp_path / field, config={**c, field: value})
    with pytest.raises(ValueError, match=match):
        LLM(path, dtype="float32", kv_cache_memory=1 << 20, load_format="dummy", show_progress=False)


# Checks the other architectures get elsewhere, run on this checkpoint (modules imported, not their
# test functions, so pytest does not collect those a second time here).
def test_bfloat16_logits_close_to_float32(extra_checkpoints):
    from tests.models import test_hf_parity

    test_hf_parity.test_bfloat16_logits_close_to_float32(extra_checkpoints, "minimax_m2")


def test_decode_forward_has_no_host_sync(extra_checkpoints, monkeypatch):
    from tests.unit import test_decode_capturable

    test_decode_capturable.test_decode_forward_has_no_host_sync(extra_checkpoints, "minimax_m2", monkeypatch)
