"""compressed-tensors pack-quantized checkpoints (int4 / int8 weights, kept packed): greedy tokens
equal transformers running the weights as the compressed-tensors package itself decompresses them;
the packed weights take a quarter (int4) / half (int8) of bf16's bytes; schemes we do not serve are
refused at start-up, naming them.

The checkpoints are written by the compressed-tensors package: a tree of nn.Linear modules named as
the checkpoint's tensors (experts per expert, as llm-compressor saves them), the package's
`apply_quantization_config` with a QuantizationConfig, scales and zero points from its own
`calculate_qparams` over each group's min and max (its min-max observer's rule), then
`ModelCompressor.compress_model` and `update_config`. The oracle's weights are the same modules after
`ModelCompressor.decompress_model`, written as an unquantized checkpoint beside the rest of the
source's tensors and loaded by transformers.
"""
from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
from torch import nn

from moe_serve import LLM
from moe_serve.config import ModelConfig
from moe_serve.quantization.compressed_tensors import CompressedTensorsConfig, WeightScheme, to_packed
from tests.models.test_hf_parity import check_greedy_parity, hf_model

IGNORE = ["lm_head", "re:.*\\.gate$"]  # the routers stay float, as llm-compressor's recipes leave them


def build_qwen3_moe_128(path: str) -> str:
    """A tiny Qwen3-MoE whose every linear input dimension is a multiple of 128 (so group 128
    applies), per-expert tensors as the Hub has them."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.checkpoints import VOCAB, _tokenizer, widen_

    special = _tokenizer(path)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                         max_position_embeddings=1024, eos_token_id=special["<|im_end|>"],
                         pad_token_id=special["<|endoftext|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    m = Qwen3MoeForCausalLM(cfg).eval()
    widen_(m, 3)
    m.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_qwen3_moe_128(str(tmp_path_factory.mktemp("qwen3_moe_128")))


def _linear_tree(sd: dict[str, torch.Tensor]) -> nn.Module:
    """nn.Linear modules named as the checkpoint's 2-D weights (not embeddings or norms)."""
    root = nn.Module()
    for name, w in sd.items():
        if w.dim() != 2 or not name.endswith(".weight") or "embed_tokens" in name or "norm" in name:
            continue
        *path, leaf, _ = name.split(".")
        m = root
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, nn.Module())
            m = getattr(m, p)
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data.copy_(w)
        m.add_module(leaf, lin)
    return root


def write_checkpoint(src: str, dst: str, weights: dict, ignore=IGNORE, fmt: str = "pack-quantized",
                     activations: dict | None = None) -> dict[str, torch.Tensor]:
    """A compressed-tensors copy of `src` at `dst` in format `fmt` (weights, activations: the
    QuantizationArgs' fields); returns the package's decompressed weights by tensor name."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = {}
    for f in sorted(os.listdir(dst)):  # a sharded source is written back as one file
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            if f.endswith(".safetensors"):
                sd.update(load_file(os.path.join(dst, f)))
            os.remove(os.path.join(dst, f))
    root = _linear_tree(sd)
    args = QuantizationArgs(**{"type": "int", **weights})
    acts = None if activations is None else QuantizationArgs(**activations)
    qc = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args,
                                                                         input_activations=acts)},
                            ignore=list(ignore), format=fmt)
    apply_quantization_config(root, qc)
    for _, m in root.named_modules():
        if getattr(m, "quantization_scheme", None) is None:
            continue
        w = m.weight.detach()
        G = args.group_size if args.strategy == "group" else w.shape[1]
        g = w.reshape(w.shape[0], w.shape[1] // G, G)
        scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), args)
        m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(zero.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(root, fmt)
    compressor.compress_model(root)
    out = {k: v for k, v in sd.items() if not (k in dict(root.named_parameters()) or
                                                k[: -len(".weight")] in dict(root.named_modules()))}
    out.update({k: v.contiguous() for k, v in root.state_dict().items()})
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    compressor.update_config(dst)
    compressor.decompress_model(root)
    return {k: v.detach().float() for k, v in root.state_dict().items() if k.endswith(".weight")}


CASES = {"w4a16-group128-sym": dict(num_bits=4, symmetric=True, strategy="group", group_size=128),
         "w8a16-channel-asym": dict(num_bits=8, symmetric=False, strategy="channel")}


def oracle(src: str, dequant: dict[str, torch.Tensor], dst: str):
    """transformers' model of `src` with the package's decompressed weights: `src` with those tensors
    replaced, written at `dst` and loaded by transformers (which maps the checkpoint's names)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = {}
    for f in sorted(os.listdir(dst)):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            if f.endswith(".safetensors"):
                sd.update(load_file(os.path.join(dst, f)))
            os.remove(os.path.join(dst, f))
    assert set(dequant) <= set(sd)
    sd.update(dequant)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    return hf_model(dst)


def light_parity(path: str, model, seed: int):
    """Greedy tokens of four prompts equal transformers' (check_greedy_parity's engine stress, once
    per file, is left to the first case); returns our LLM, for checks of what it holds."""
    from moe_serve import SamplingParams
    from tests.models.test_hf_parity import assert_same_greedy, hf_greedy, make_prompts

    prompts = make_prompts(seed)[:4]
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 22, show_progress=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8))
    for p, o in zip(prompts, outs):
        assert_same_greedy(model, p, o.outputs[0].token_ids, hf_greedy(model, p, 8))
    return llm


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers_on_package_decompressed_weights(qwen3, tmp_path, case):
    """W4A16 under chunked prefill, preemption and prefix hits (check_greedy_parity); W8A16 on four
    prompts."""
    dst = str(tmp_path / case)
    dequant = write_checkpoint(qwen3, dst, CASES[case])
    with open(os.path.join(dst, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "compressed-tensors"
    model = oracle(qwen3, dequant, str(tmp_path / "oracle"))
    plain = dict(hf_model(qwen3).named_parameters())  # the oracle really holds the quantized weights
    assert any(not torch.equal(p, plain[n]) for n, p in model.named_parameters())
    if case == "w4a16-group128-sym":
        check_greedy_parity(dst, model, 60)
    else:
        light_parity(dst, model, 61)


@pytest.mark.parametrize("weights", [dict(num_bits=4, symmetric=False, strategy="group", group_size=32),
                                     dict(num_bits=8, symmetric=True, strategy="group", group_size=64),
                                     dict(num_bits=4, symmetric=True, strategy="channel")],
                         ids=["w4-asym-g32", "w8-sym-g64", "w4-sym-channel"])
def test_packed_weight_equals_package_decompression(qwen3, tmp_path, weights):
    """Each module's tensors, converted to PackedWeight, dequantize to the package's own weights."""
    from safetensors.torch import load_file

    dst = str(tmp_path / "ct")
    dequant = write_checkpoint(qwen3, dst, weights)
    sd = load_file(os.path.join(dst, "model.safetensors"))
    scheme = WeightScheme(weights["num_bits"], weights["symmetric"], weights["strategy"], weights.get("group_size"))
    modules = sorted(k[: -len(".weight_packed")] for k in sd if k.endswith(".weight_packed"))
    assert any(".experts.3.down_proj" in m for m in modules) and any("self_attn.o_proj" in m for m in modules)
    assert not any(m.endswith("mlp.gate") or m == "lm_head" for m in modules)  # the ignore list
    for m in modules:
        parts = {k.rsplit(".", 1)[1]: v for k, v in sd.items() if k.rsplit(".", 1)[0] == m}
        pw = to_packed(parts, scheme, m)
        assert pw.qweight.dtype == torch.uint8 and pw.bits == weights["num_bits"]
        torch.testing.assert_close(pw.dequantize(), dequant[m + ".weight"], rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from tests.checkpoints import build_mixtral

    return build_mixtral(str(tmp_path_factory.mktemp("mixtral")))


def test_mixtral_greedy_matches_transformers(mixtral, tmp_path):
    """Mixtral's names (block_sparse_moe, experts' w1 / w3 / w2, a sharded source): W4A16 with zero
    points, group 32 (the expert down projection's K = 96 takes three groups)."""
    dst = str(tmp_path / "mixtral_w4")
    dequant = write_checkpoint(mixtral, dst, dict(num_bits=4, symmetric=False, strategy="group", group_size=32))
    from safetensors import safe_open

    with safe_open(os.path.join(dst, "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.5.w2.weight_zero_point" in names
    assert "model.layers.1.block_sparse_moe.gate.weight" in names  # the ignored router stays float
    model = oracle(mixtral, dequant, str(tmp_path / "oracle"))
    light_parity(dst, model, 70)


def test_c_kernels_serve_packed_decode_as_the_torch_path_does(qwen3, tmp_path, monkeypatch):
    """With our C backends (cpu_c), decode-sized linear and expert calls over packed weights run in
    cpu_ops/quant.c; greedy tokens equal the torch backends' (which dequantize per call), and the
    C path's per-step logits stay within float32 accumulation-order noise of them."""
    from moe_serve import SamplingParams
    from moe_serve.kernels.cpu_ops import quant
    from tests.models.test_hf_parity import make_prompts

    if not quant.cpu_ops.available():
        pytest.fail("the C kernels did not build here (cpu_ops.status())")
    calls = {"quant_linear": 0, "quant_experts": 0}
    for name in calls:
        real = getattr(quant, name)

        def spy(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(quant, name, spy)
    dst = str(tmp_path / "w4asym")
    write_checkpoint(qwen3, dst, dict(num_bits=4, symmetric=False, strategy="group", group_size=64))
    prompts = make_prompts(80)[:4]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1)
    toks, lps = {}, {}
    for backend in ("cpu_c", "torch"):
        llm = LLM(dst, dtype="float32", kv_cache_memory=1 << 22, show_progress=False, moe_backend=backend,
                  linear_backend=backend, attention_backend=backend, norm_backend=backend)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        toks[backend] = [o.outputs[0].token_ids for o in outs]
        lps[backend] = [o.outputs[0].cumulative_logprob for o in outs]
        if backend == "cpu_c":
            assert calls["quant_linear"] > 0 and calls["quant_experts"] > 0, calls
            seen = dict(calls)
    assert calls == seen  # the torch backends never call the C kernels
    assert toks["cpu_c"] == toks["torch"]
    for a, b in zip(lps["cpu_c"], lps["torch"]):
        assert abs(a - b) < 1e-3


def test_packed_weights_stay_packed_in_memory(qwen3, tmp_path):
    """Quantized layers keep their codes (a byte per two int4 / per int8 weight) and float32 scales
    and offsets: about a quarter (int4, group 128) / half (int8, per channel) of bf16's bytes."""
    bf16 = LLM(qwen3, dtype="bfloat16", kv_cache_memory=1 << 20, show_progress=False)
    bf16_params = dict(bf16.engine.runner.model.named_parameters())
    for case, ratio in (("w4a16-group128-sym", 0.25), ("w8a16-channel-asym", 0.5)):
        dst = str(tmp_path / case)
        write_checkpoint(qwen3, dst, CASES[case])
        model = LLM(dst, dtype="bfloat16", kv_cache_memory=1 << 20, show_progress=False).engine.runner.model
        packed = {n: p for n, p in model.named_parameters() if n.endswith(("qweight", "qscales", "qoffsets",
                                                                           "_scales", "_offsets"))}
        assert any("experts.w13_qweight" in n for n in packed) and any("o_proj.qweight" in n for n in packed)
        assert all(p.dtype == torch.uint8 for n, p in packed.items() if "qweight" in n)
        dense_names = {n.replace("qweight", "weight").replace("experts.w13_weight", "experts.w13")
                       .replace("experts.w2_weight", "experts.w2") for n in packed if "qweight" in n}
        assert dense_names <= set(bf16_params)
        bf16_bytes = sum(bf16_params[n].numel() * 2 for n in dense_names)
        packed_bytes = sum(p.numel() * p.element_size() for p in packed.values())
        assert ratio <= packed_bytes / bf16_bytes <= ratio * 1.15, (case, packed_bytes / bf16_bytes)
        # no dense copy of a quantized weight anywhere in the model
        assert not any(n in dict(model.named_parameters()) for n in dense_names)
        assert model.model.layers[0].self_attn.q_proj.weight is None
        # q, k and v run as one packed GEMM whose codes, scales and offsets are the layers' own storage
        attn = model.model.layers[0].self_attn
        parts = [attn.q_proj, attn.k_proj, attn.v_proj]
        fused = attn.qkv_packed
        assert fused is not None and fused.out_features == sum(p.out_features for p in parts)
        starts = [0, parts[0].out_features, parts[0].out_features + parts[1].out_features]
        # symmetric: the offsets (-8 * scale) dropped for the zero code 8; asymmetric: kept
        assert (fused.qoffsets is None, fused.packed_zero) == ((True, 8) if case.endswith("-sym") else (False, 0))
        for name in ("qweight", "qscales") + (("qoffsets",) if fused.qoffsets is not None else ()):
            whole = getattr(fused, name)
            assert [getattr(p, name).data_ptr() for p in parts] == [
                whole.data_ptr() + r * whole.stride(0) * whole.element_size() for r in starts]


BASE = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                  "strategy": "group", "group_size": 128}}}}


def _with(path: list, value) -> dict:
    cfg = json.loads(json.dumps(BASE))
    d = cfg
    for p in path[:-1]:
        d = d[p]
    d[path[-1]] = value
    return cfg


W8A8_ACT = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


@pytest.mark.parametrize("path,value,words", [
    (["config_groups", "group_0", "input_activations"], W8A8_ACT, ["input_activations", "activation quantization"]),
    (["format"], "nvfp4-pack-quantized", ["format", "nvfp4-pack-quantized"]),
    (["config_groups", "group_0", "format"], "naive-quantized", ["group_0.format", "naive-quantized"]),
    (["config_groups", "group_0", "weights", "actorder"], "group", ["actorder", "g_idx"]),
    (["config_groups", "group_0", "weights", "num_bits"], 2, ["num_bits=2"]),
    (["config_groups", "group_0", "weights", "type"], "float", ["type='float'"]),
    (["config_groups", "group_0", "weights", "strategy"], "tensor", ["strategy='tensor'"]),
    (["config_groups", "group_0", "weights", "zp_dtype"], "torch.float8_e4m3fn", ["zp_dtype='torch.float8_e4m3fn'"]),
    (["config_groups", "group_0", "weights", "scale_dtype"], "torch.float8_e4m3fn", ["scale_dtype"]),
    (["kv_cache_scheme"], {"num_bits": 8, "type": "float"}, ["kv_cache_scheme"]),
])
def test_unsupported_schemes_refused_naming_them(path, value, words):
    with pytest.raises(ValueError) as e:
        CompressedTensorsConfig.from_hf(_with(path, value))
    assert all(w in str(e.value) for w in words), str(e.value)
    assert "compressed-tensors" in str(e.value)


def test_activation_quantization_over_packed_weights_refused_at_start(qwen3, tmp_path):
    """Quantized activations over pack-quantized weights (W8A8 is served as int-quantized only) fail
    when the engine's config is read, before any weight is."""
    dst = str(tmp_path / "w8a8")
    write_checkpoint(qwen3, dst, CASES["w8a16-channel-asym"])
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = W8A8_ACT
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="group_0.input_activations.*activation quantization"):
        ModelConfig.from_path(dst)


def test_w8a8_int8_greedy_matches_transformers_and_stays_int8(qwen3, tmp_path, caplog):
    """W8A8 int8 as llm-compressor writes it (int-quantized: int8 weights per channel, activations
    int8 per token, dynamic): the weights load kept int8 (a byte each, float32 scales and offsets per
    row), and greedy tokens equal transformers over the package's decompression (float activations:
    what our kernels compute)."""
    dst = str(tmp_path / "w8a8")
    dequant = write_checkpoint(qwen3, dst, dict(num_bits=8, symmetric=True, strategy="channel"), fmt="int-quantized",
                               activations=W8A8_ACT)
    from safetensors import safe_open

    with safe_open(os.path.join(dst, "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.int8
    with open(os.path.join(dst, "config.json")) as f:
        q = json.load(f)["quantization_config"]
    assert q["format"] == "int-quantized" and q["config_groups"]["group_0"]["input_activations"]["dynamic"]
    model = oracle(qwen3, dequant, str(tmp_path / "oracle"))
    with caplog.at_level(logging.INFO, logger="moe_serve"):
        ours = light_parity(dst, model, 62).engine.runner.model
    # the checkpoint's int8 activations are not applied on the CPU, and the log says so
    assert "W8A8 checkpoint:" in caplog.text and "inputs stay float" in caplog.text
    q_proj = ours.model.layers[0].self_attn.q_proj
    assert q_proj.weight is None and q_proj.qweight.dtype == torch.uint8 and q_proj.packed_bits == 8
    assert q_proj.qscales.shape == (q_proj.out_features, 1)
    ex = ours.model.layers[0].mlp.experts
    assert ex.bits == 8 and ex.w13_qweight.dtype == torch.uint8
    torch.testing.assert_close(q_proj.packed().dequantize(), dequant["model.layers.0.self_attn.q_proj.weight"],
                               rtol=1e-6, atol=1e-6)


def test_fp8_dynamic_greedy_matches_transformers_and_stays_fp8(qwen3, tmp_path):
    """FP8 dynamic as llm-compressor writes it (float-quantized: e4m3 weights per channel, activations
    FP8 per token, dynamic): kept FP8 as block FP8 with one block a row (a byte a weight, a float32
    scale a row), greedy-equal to transformers over the package's decompression (float activations,
    as our block-FP8 ops compute)."""
    from moe_serve.quantization.fp8 import FP8

    dst = str(tmp_path / "fp8")
    dequant = write_checkpoint(qwen3, dst, dict(type="float", num_bits=8, symmetric=True, strategy="channel"),
                               fmt="float-quantized", activations=dict(W8A8_ACT, type="float"))
    with open(os.path.join(dst, "config.json")) as f:
        assert json.load(f)["quantization_config"]["format"] == "float-quantized"
    model = oracle(qwen3, dequant, str(tmp_path / "oracle"))
    ours = light_parity(dst, model, 63).engine.runner.model
    o_proj = ours.model.layers[0].self_attn.o_proj
    assert o_proj.weight.dtype == FP8 and o_proj.weight_scale_inv.shape == (o_proj.out_features, 1)
    assert o_proj.qweight is None and o_proj.fp8_block == (1, o_proj.in_features)
    torch.testing.assert_close(o_proj.dense_weight(torch.float32), dequant["model.layers.0.self_attn.o_proj.weight"],
                               rtol=0, atol=0)
    ex = ours.model.layers[0].mlp.experts
    w13, w2 = ex.op_weights()
    assert ex.float8 and w13.dtype == FP8 and w2.dtype == FP8
    want = torch.cat([dequant[f"model.layers.0.mlp.experts.2.{p}.weight"] for p in ("gate_proj", "up_proj")])
    torch.testing.assert_close(w13.dequantize(torch.float32, torch.tensor([2]))[0], want, rtol=0, atol=0)
    torch.testing.assert_close(w2.dequantize(torch.float32, torch.tensor([2]))[0],
                               dequant["model.layers.0.mlp.experts.2.down_proj.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("acts,words", [(dict(W8A8_ACT, dynamic=False), "dynamic=False"),
                                        (dict(W8A8_ACT, strategy="tensor"), "strategy='tensor'")])
def test_w8a8_activation_schemes_we_do_not_serve_refused(acts, words):
    cfg = _with(["config_groups", "group_0", "input_activations"], acts)
    cfg["format"] = cfg["config_groups"]["group_0"]["format"] = "int-quantized"
    cfg["config_groups"]["group_0"]["weights"].update(num_bits=8, strategy="channel")
    with pytest.raises(ValueError, match=f"group_0.input_activations.{words}.*int-quantized"):
        CompressedTensorsConfig.from_hf(cfg)


def test_packed_module_the_config_ignores_is_refused(qwen3, tmp_path):
    """`ignore` is honoured: a packed tensor for a module the config ignores is an error naming it."""
    dst = str(tmp_path / "ignored")
    write_checkpoint(qwen3, dst, CASES["w4a16-group128-sym"])
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"]["ignore"].append("model.layers.0.self_attn.o_proj")
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.o_proj.weight_packed.*ignore"):
        LLM(dst, dtype="float32", kv_cache_memory=1 << 20, show_progress=False)


def test_packed_module_we_cannot_keep_packed_is_refused(qwen3, tmp_path):
    """A packed LM head (the config does not ignore it) is refused at load, naming the tensor, its
    bits and the format."""
    dst = str(tmp_path / "head")
    write_checkpoint(qwen3, dst, CASES["w8a16-channel-asym"], ignore=["re:.*\\.gate$"])
    with pytest.raises(ValueError, match=r"'lm_head.weight_packed' is quantized \(compressed-tensors, "
                                         r"pack-quantized, 8-bit\).*not a linear layer"):
        LLM(dst, dtype="float32", kv_cache_memory=1 << 20, show_progress=False)


def test_group_size_not_dividing_the_input_is_refused():
    """compressed-tensors pads a last partial group; PackedWeight's groups divide K: refused, naming
    the module and the sizes."""
    K, N, G = 96, 4, 64
    parts = {"weight_packed": torch.zeros(N, K * 4 // 32, dtype=torch.int32),
             "weight_scale": torch.ones(N, 2), "weight_shape": torch.tensor([N, K])}
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj: group_size 64 does not divide the input "
                                         "dimension 96"):
        to_packed(parts, WeightScheme(4, True, "group", G), "model.layers.0.mlp.down_proj")


def test_weight_updates_of_a_packed_model_are_refused(qwen3, tmp_path):
    """Updating a packed model's weights while serving is not supported yet: refused, naming the format."""
    from moe_serve.weight_sync import LiveWriter

    dst = str(tmp_path / "w8")
    write_checkpoint(qwen3, dst, CASES["w8a16-channel-asym"])
    llm = LLM(dst, dtype="float32", kv_cache_memory=1 << 20, show_progress=False)
    with pytest.raises(ValueError, match="weight updates of a compressed-tensors .*not supported yet"):
        LiveWriter(llm.engine.runner.model, llm.engine.cfg, dst)


def test_llm_compressor_config_fields_accepted():
    """Fields llm-compressor writes that change nothing we read: observers, an explicit int8 zero-point
    dtype, bf16 scale rounding, an empty sparsity / transform config, a version."""
    cfg = _with(["config_groups", "group_0", "weights"],
                {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128,
                 "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {},
                 "zp_dtype": "torch.int8", "scale_dtype": "torch.bfloat16"})
    cfg.update(sparsity_config={}, transform_config={}, version="0.20.1", global_compression_ratio=None)
    parsed = CompressedTensorsConfig.from_hf(cfg)
    assert parsed.scheme_for("model.layers.0.self_attn.q_proj") == WeightScheme(4, False, "group", 128)
    assert parsed.scheme_for("lm_head") is None


def test_packed_linear_has_a_warm_up_key():
    """The CUDA warm-up groups linear layers by weight shape and dtype: a packed layer (no dense
    weight) gets its own key from its codes instead of failing the whole warm-up."""
    from moe_serve.kernel_warmup import _shape_key
    from moe_serve.layers.linear import Linear

    dense, packed = Linear(64, 8), Linear(64, 8)
    packed.to_packed(4, 32)
    assert packed.weight is None and _shape_key(packed)[1:3] == ((8, 32), torch.uint8)
    assert _shape_key(packed) != _shape_key(dense)
    # Same codes' shape, another group size: other scales, another kernel variant.
    other = Linear(64, 8)
    other.to_packed(4, 64)
    assert _shape_key(other) != _shape_key(packed)


def test_packed_experts_warm_up_key_names_each_weights_bits_and_group():
    """Packed experts whose gate/up match but whose down weights differ (a Q4_K_M file's 4-bit and
    8-bit down layers; another group size) launch other kernel variants: each gets a warm-up call."""
    from types import SimpleNamespace

    from moe_serve.kernel_warmup import _shape_key
    from moe_serve.layers.experts import PackedExperts

    def layer(bits, groups):
        return SimpleNamespace(op_kind="experts", experts=PackedExperts(4, 64, 32, list(range(4)), torch.float32,
                                                                        bits, groups))

    keys = [_shape_key(layer(b, g)) for b, g in (((4, 4), (32, 32)), ((4, 8), (32, 32)), ((4, 4), (32, 16)))]
    assert len(set(keys)) == 3, keys
    assert _shape_key(layer(4, (32, 32))) == keys[0]


@pytest.mark.parametrize("backend", ["cpu_c", "torch"])
def test_batch_invariant_serves_packed_weights(qwen3, tmp_path, backend):
    """--batch-invariant over a W4A16 checkpoint (packed linear layers and experts): a request's
    tokens and logprobs are bitwise the same alone and among companions of other lengths, whose
    prefill takes the batch past the C kernels' panel threshold (the packed kernels choose their
    path by row count; the invariant backends dequantize instead)."""
    from moe_serve import SamplingParams
    from tests.models.test_hf_parity import make_prompts

    dst = str(tmp_path / "w4")
    write_checkpoint(qwen3, dst, dict(num_bits=4, symmetric=False, strategy="group", group_size=64))
    llm = LLM(dst, dtype="float32", kv_cache_memory=1 << 22, show_progress=False, batch_invariant=True,
              moe_backend=backend, linear_backend=backend, attention_backend=backend, norm_backend=backend)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(80)[:5]]

    def result(out):
        o = out.outputs[0]
        return list(o.token_ids), [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.logprobs]

    alone = result(llm.generate(prompts[2], params)[0])
    assert result(llm.generate(prompts, params)[2]) == alone
