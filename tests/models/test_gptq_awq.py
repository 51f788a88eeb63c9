"""AutoAWQ int4 'gemm' and GPTQ checkpoints, kept packed.

AWQ: greedy tokens equal transformers running the weights
as compressed-tensors' own AutoAWQ converter decodes them (its unpacking and reordering, then the
package's pack-quantized decompression), and AWQ configs we do not serve are refused naming the field.

The checkpoint is written with AutoAWQ's reference quantization and packing (pseudo_quantize_tensor's
min/max zero point per group, WQLinear_GEMM.from_linear's interleaved column order), reproduced here.

GPTQ: written with AutoGPTQ's reference packing (QuantLinear.pack: codes along K, zero points along N
stored minus one) and dequantized for the oracle by AutoGPTQ's reference torch path (shifts, the
zero point's + 1, scale * (q - z) per group), both reproduced here.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from moe_serve import LLM
from moe_serve.quantization.formats import validate
from tests.models.test_compressed_tensors import build_qwen3_moe_128, light_parity, oracle
from tests.models.test_hf_parity import hf_model

ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]  # WQLinear_GEMM.from_linear's order within an int32


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_qwen3_moe_128(str(tmp_path_factory.mktemp("qwen3_moe_128")))


def _awq_quantize(w: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ's pseudo_quantize_tensor (zero point, 4 bits): scales and zeros (N, K / G), codes (N, K)."""
    N, K = w.shape
    g = w.reshape(-1, G)
    max_val, min_val = g.amax(dim=1, keepdim=True), g.amin(dim=1, keepdim=True)
    scales = (max_val - min_val).clamp(min=1e-5) / 15
    zeros = (-torch.round(min_val / scales)).clamp_(0, 15)
    scales, zeros = scales.reshape(N, K // G), zeros.reshape(N, K // G)
    # from_linear: round((w + zeros * scales) / scales), per input column's group
    sz = (zeros * scales).repeat_interleave(G, dim=1)
    q = torch.round((w + sz) / scales.repeat_interleave(G, dim=1)).to(torch.int32)
    return q, scales, zeros.to(torch.int32)


def _awq_pack(intweight_KN: torch.Tensor) -> torch.Tensor:
    """from_linear's packing: (R, C) int -> (R, C / 8) int32, column col * 8 + ORDER_MAP[i] at bits 4i."""
    R, C = intweight_KN.shape
    out = torch.zeros(R, C // 8, dtype=torch.int32)
    for col in range(C // 8):
        for i in range(8):
            out[:, col] |= intweight_KN[:, col * 8 + ORDER_MAP[i]].to(torch.int32) << (i * 4)
    return out


def _is_quantized(name: str, t: torch.Tensor) -> bool:
    return (t.dim() == 2 and name.endswith(".weight") and "norm" not in name and "embed_tokens" not in name
            and name != "lm_head.weight" and not name.endswith("mlp.gate.weight"))


def write_awq(src: str, dst: str, G: int) -> dict[str, torch.Tensor]:
    """An AutoAWQ gemm copy of `src` at `dst`; returns the weights compressed-tensors' AutoAWQ converter
    and pack-quantized decompression give for it, by tensor name."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for k, v in sd.items():
        if not _is_quantized(k, v):
            out[k] = v
            continue
        m = k[: -len(".weight")]
        q, scales, zeros = _awq_quantize(v.float(), G)
        out[m + ".qweight"] = _awq_pack(q.t().contiguous())
        out[m + ".qzeros"] = _awq_pack(zeros.t().contiguous())
        out[m + ".scales"] = scales.t().contiguous().half()
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True,
                                  "version": "gemm", "modules_to_not_convert": ["mlp.gate"]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    converter = AutoAWQConverter(bits=4, group_size=G, zero_point=True, ignore=["lm_head", "re:.*mlp\\.gate$"])
    ct = converter.process(dict(out))
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=False,
                                                                           strategy="group", group_size=G))
    dequant = {}
    for k in ct:
        if k.endswith(".weight_packed"):
            m = k[: -len(".weight_packed")]
            parts = {s: ct[f"{m}.{s}"] for s in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")}
            dequant[m + ".weight"] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"].float()
    assert len(dequant) == sum(_is_quantized(k, v) for k, v in sd.items())
    return dequant


def test_awq_greedy_matches_transformers_on_converter_decoded_weights(qwen3, tmp_path):
    dequant = write_awq(qwen3, str(tmp_path / "awq"), 64)
    model = oracle(qwen3, dequant, str(tmp_path / "oracle"))
    plain = dict(hf_model(qwen3).named_parameters())
    assert any(not torch.equal(p, plain[n]) for n, p in model.named_parameters())
    light_parity(str(tmp_path / "awq"), model, 90)
    llm = LLM(str(tmp_path / "awq"), dtype="float32", kv_cache_memory=1 << 20, show_progress=False)
    m = llm.engine.runner.model
    assert m.model.layers[0].self_attn.q_proj.qweight.dtype == torch.uint8
    assert m.model.layers[0].mlp.experts.w13_qweight.dtype == torch.uint8
    # our conversion, module by module, against the converter's (its fp16 arithmetic: within fp16 rounding)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        ours = m.get_submodule(name).packed().dequantize()
        torch.testing.assert_close(ours, dequant[name + ".weight"], rtol=2e-3, atol=2e-3)
    w13, w2 = m.model.layers[0].mlp.experts.op_weights()
    torch.testing.assert_close(w2.dequantize()[3], dequant["model.layers.0.mlp.experts.3.down_proj.weight"],
                               rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(w13.dequantize()[2, 128:], dequant["model.layers.0.mlp.experts.2.up_proj.weight"],
                               rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("field,value,words", [("version", "gemv", "version='gemv'"), ("bits", 8, "bits=8")])
def test_unsupported_awq_configs_refused_naming_them(field, value, words):
    q = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    q[field] = value
    with pytest.raises(ValueError, match=words):
        validate(q)


def _gptq_pack(intweight_KN: torch.Tensor, zeros_GN: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ QuantLinear.pack: qweight (K * bits / 32, N) along K, qzeros (K / G, N * bits / 32) along N
    of the zero points minus one."""
    per = 32 // bits
    K, N = intweight_KN.shape
    qweight = torch.zeros(K // per, N, dtype=torch.int32)
    for row in range(K // per):
        for j in range(per):
            qweight[row] |= intweight_KN[row * per + j].to(torch.int32) << (bits * j)
    zeros = zeros_GN.to(torch.int32) - 1
    qzeros = torch.zeros(zeros.shape[0], N // per, dtype=torch.int32)
    for col in range(N // per):
        for j in range(per):
            qzeros[:, col] |= (zeros[:, col * per + j] & ((1 << bits) - 1)) << (bits * j)
    return qweight, qzeros


def _gptq_dequantize(qweight, qzeros, scales, bits: int, G: int) -> torch.Tensor:
    """AutoGPTQ's reference torch dequantization (its QuantLinear forward without the fused kernel)."""
    wf = torch.arange(0, 32, bits, dtype=torch.int32).unsqueeze(0)
    zeros = torch.bitwise_right_shift(qzeros.unsqueeze(2).expand(-1, -1, 32 // bits), wf.unsqueeze(0)).to(torch.int16)
    zeros = torch.bitwise_and(zeros + 1, (2 ** bits) - 1).reshape(scales.shape)
    weight = torch.bitwise_right_shift(qweight.unsqueeze(1).expand(-1, 32 // bits, -1), wf.unsqueeze(-1)).to(torch.int16)
    weight = torch.bitwise_and(weight, (2 ** bits) - 1).reshape(-1, G, weight.shape[2])  # (K / G, G, N)
    w = scales.float().unsqueeze(1) * (weight.float() - zeros.float().unsqueeze(1))
    return w.reshape(-1, w.shape[-1]).t().contiguous()  # (N, K)


def write_gptq(src: str, dst: str, bits: int, G: int, sym: bool) -> dict[str, torch.Tensor]:
    """A GPTQ (v1) copy of `src` at `dst` (min/max quantizer); returns the reference dequantization."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(os.path.join(src, "model.safetensors"))
    out, dequant, maxq = {}, {}, 2 ** bits - 1
    for k, v in sd.items():
        if not _is_quantized(k, v):
            out[k] = v
            continue
        m, (N, K) = k[: -len(".weight")], v.shape
        g = v.float().reshape(N, K // G, G)
        if sym:
            scale = (g.abs().amax(-1) * 2 / maxq).clamp(min=1e-8)
            zero = torch.full_like(scale, (maxq + 1) // 2)
        else:
            lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
            scale = ((hi - lo) / maxq).clamp(min=1e-8)
            zero = torch.round(-lo / scale)
        scale = scale.half().float()  # as the checkpoint stores it
        q = torch.clamp(torch.round(g / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, maxq).reshape(N, K)
        qweight, qzeros = _gptq_pack(q.t().to(torch.int32), zero.t(), bits)
        out[m + ".qweight"], out[m + ".qzeros"] = qweight, qzeros
        out[m + ".scales"] = scale.t().contiguous().half()
        out[m + ".g_idx"] = torch.arange(K, dtype=torch.int32) // G
        dequant[k] = _gptq_dequantize(qweight, qzeros, out[m + ".scales"], bits, G)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": G, "sym": sym,
                                  "desc_act": False, "checkpoint_format": "gptq"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return dequant


@pytest.mark.parametrize("bits,G,sym", [(4, 128, True), (8, 32, False)], ids=["gptq4-g128-sym", "gptq8-g32-asym"])
def test_gptq_greedy_matches_transformers_on_reference_dequantized_weights(qwen3, tmp_path, bits, G, sym):
    dst = str(tmp_path / "gptq")
    dequant = write_gptq(qwen3, dst, bits, G, sym)
    model = oracle(qwen3, dequant, str(tmp_path / "oracle"))
    light_parity(dst, model, 95 + bits)
    m = LLM(dst, dtype="float32", kv_cache_memory=1 << 20, show_progress=False).engine.runner.model
    for name in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.up_proj"):
        torch.testing.assert_close(m.get_submodule(name).packed().dequantize(), dequant[name + ".weight"],
                                   rtol=1e-6, atol=1e-6)
    w13, _ = m.model.layers[0].mlp.experts.op_weights()
    torch.testing.assert_close(w13.dequantize()[1, :128], dequant["model.layers.0.mlp.experts.1.gate_proj.weight"],
                               rtol=1e-6, atol=1e-6)


def test_gptq_activation_order_refused_naming_the_module(qwen3, tmp_path):
    from safetensors.torch import load_file, save_file

    dst = str(tmp_path / "gptq")
    write_gptq(qwen3, dst, 4, 64, True)
    path = os.path.join(dst, "model.safetensors")
    sd = load_file(path)
    sd["model.layers.0.self_attn.o_proj.g_idx"] = sd["model.layers.0.self_attn.o_proj.g_idx"].flip(0).contiguous()
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.0.self_attn.o_proj.g_idx is not k // group_size"):
        LLM(dst, dtype="float32", kv_cache_memory=1 << 20, show_progress=False)


@pytest.mark.parametrize("method", ["awq", "gptq", "compressed-tensors"])
def test_module_missing_a_part_refused_naming_it(method):
    """A quantized module whose checkpoint lacks one of its tensors (here the zero points) is refused
    once the files are read, naming the module, the format, the parts it has and those it needs."""
    from moe_serve.quantization.formats import packed_collector

    q = {"awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
         "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False},
         "compressed-tensors": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                "config_groups": {"g": {"targets": ["Linear"], "weights": {
                                    "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                                    "group_size": 32}}}}}[method]
    parts = {"awq": ("qweight", "scales"), "gptq": ("qweight", "scales", "g_idx"),
             "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape")}[method]
    collector = packed_collector({"quantization_config": q})
    module = "model.layers.0.self_attn.o_proj"
    for part in parts:
        assert collector.take(module, part, torch.zeros(1), f"{module}.{part}") is None
    with pytest.raises(ValueError) as e:
        collector.finish("/ckpt")
    msg = str(e.value)
    assert f"quantized module '{module}' ({method}, " in msg and f"has only {sorted(parts)!r}" in msg, msg
    assert ("weight_zero_point" if method == "compressed-tensors" else "qzeros") in msg.split("has only")[1], msg
