"""Packed int4 checkpoints of the families beyond Qwen3-MoE and Mixtral: MiniMax-M2, DeepSeek-V3 (MLA,
shared experts, a multi-token-prediction layer the engine skips) and GPT-OSS (experts with biases),
greedy-equal to transformers on the weights the format's own reference decodes.

compressed-tensors checkpoints are written by the compressed-tensors package
(tests/models/test_compressed_tensors.py `write_checkpoint`); the oracle is transformers over the
package's decompression. GPT-OSS is first linearized as llm-compressor does before it quantizes
(each expert's gate, up and down as linear layers with biases, `mlp.experts.{e}.gate_proj`): the
oracle fuses the decompressed experts back into transformers' interleaved gate_up_proj. DeepSeek-V3
is also written as GPTQ (AutoGPTQ's reference packing; oracle: its reference dequantization) and as
AutoAWQ gemm (AutoAWQ's reference packing; oracle: compressed-tensors' AutoAWQ converter).
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_serve import LLM
from tests.models.test_compressed_tensors import light_parity, oracle, write_checkpoint
from tests.models.test_hf_parity import hf_model

W4_ASYM_G32 = dict(num_bits=4, symmetric=False, strategy="group", group_size=32)
W4_SYM_G32 = dict(num_bits=4, symmetric=True, strategy="group", group_size=32)


@pytest.fixture(scope="module")
def minimax(tmp_path_factory):
    from tests.checkpoints import build_minimax_m2

    return build_minimax_m2(str(tmp_path_factory.mktemp("minimax_m2")))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from tests.checkpoints import build_deepseek_v3

    return build_deepseek_v3(str(tmp_path_factory.mktemp("deepseek_v3")))


def _packed_params(llm) -> dict[str, torch.Tensor]:
    return {n: p for n, p in llm.engine.runner.model.named_parameters() if "qweight" in n}


def test_minimax_m2_w4a16(minimax, tmp_path):
    """MiniMax-M2's per-expert w1 / w3 / w2 under block_sparse_moe and its q/k/v/o, packed int4 (the
    routers float, as the ignore list says); the checkpoint's MTP layer is quantized too and skipped."""
    dst = str(tmp_path / "ct")
    dequant = write_checkpoint(minimax, dst, W4_SYM_G32)
    assert "model.layers.2.eh_proj.weight" in dequant  # the MTP layer came packed
    model = oracle(minimax, dequant, str(tmp_path / "oracle"))
    light_parity(dst, model, 90)


def test_packed_router_refused_naming_it(minimax, tmp_path):
    """A checkpoint that packs MiniMax-M2's routers (its config does not leave them float) is refused
    at load, naming the tensor, its bits and the format: routers read their weight themselves."""
    dst = str(tmp_path / "ct")
    write_checkpoint(minimax, dst, W4_SYM_G32, ignore=["lm_head"])
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.block_sparse_moe\.gate\.weight_packed' is quantized "
                                         r"\(compressed-tensors, pack-quantized, 4-bit\).*not a linear layer"):
        LLM(dst, dtype="float32", kv_cache_memory=1 << 20, show_progress=False)


def test_deepseek_v3_w4a16(deepseek, tmp_path):
    """DeepSeek-V3: MLA projections, the dense first layer, routed and shared experts packed;
    kv_b_proj, which MLA reads per head, dequantized once at load into the model's dtype."""
    dst = str(tmp_path / "ct")
    dequant = write_checkpoint(deepseek, dst, W4_ASYM_G32)
    model = oracle(deepseek, dequant, str(tmp_path / "oracle"))
    llm = light_parity(dst, model, 91)
    packed = _packed_params(llm)
    for part in ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj",
                 "mlp.shared_experts.down_proj", "mlp.experts.w13", "mlp.experts.w2", "model.layers.0.mlp.up_proj"):
        assert any(part in n for n in packed), part
    attn = llm.engine.runner.model.model.layers[1].self_attn
    assert attn.kv_b_proj.qweight is None and attn.kv_b_proj.dequantized_at_load
    torch.testing.assert_close(attn.kv_b_proj.weight, dequant["model.layers.1.self_attn.kv_b_proj.weight"],
                               rtol=1e-6, atol=1e-6)  # (q - z) * s against s * q - z * s


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_deepseek_v3_gptq_awq(deepseek, tmp_path, method):
    """DeepSeek-V3 as a GPTQ 4-bit checkpoint (zero points, group 32), and as AutoAWQ gemm (group 32;
    oracle: compressed-tensors' AutoAWQ converter and decompression, as in test_gptq_awq.py)."""
    from tests.models.test_gptq_awq import write_awq, write_gptq

    dst = str(tmp_path / method)
    dequant = write_gptq(deepseek, dst, 4, 32, False) if method == "gptq" else write_awq(deepseek, dst, 32)
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in dequant
    model = oracle(deepseek, dequant, str(tmp_path / "oracle"))
    light_parity(dst, model, 92)


def _linearize_gpt_oss(src: str, dst: str) -> None:
    """GPT-OSS with its fused experts split into per-expert linear layers with biases, as
    llm-compressor's GPT-OSS conversion does before quantizing: gate = gate_up_proj[e, :, 0::2].T,
    up = gate_up_proj[e, :, 1::2].T, down = down_proj[e].T, the biases split alike."""
    shutil.copytree(src, dst)
    sd = load_file(os.path.join(dst, "model.safetensors"))
    out = {}
    for k, v in sd.items():
        if k.endswith("experts.gate_up_proj"):
            pre = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = v[e, :, 0::2].t().contiguous()
                out[f"{pre}{e}.up_proj.weight"] = v[e, :, 1::2].t().contiguous()
        elif k.endswith("experts.gate_up_proj_bias"):
            pre = k[: -len("gate_up_proj_bias")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.bias"] = v[e, 0::2].contiguous()
                out[f"{pre}{e}.up_proj.bias"] = v[e, 1::2].contiguous()
        elif k.endswith("experts.down_proj"):
            pre = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = v[e].t().contiguous()
        elif k.endswith("experts.down_proj_bias"):
            pre = k[: -len("down_proj_bias")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.down_proj.bias"] = v[e].contiguous()
        else:
            out[k] = v
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def _fuse_gpt_oss(src: str, dequant: dict[str, torch.Tensor], dst: str):
    """transformers' GPT-OSS over the decompressed weights: the linearized experts fused back into
    gate_up_proj (E, D, 2F) interleaved and down_proj (E, F, D), the rest as decompressed."""
    shutil.copytree(src, dst)
    sd = load_file(os.path.join(dst, "model.safetensors"))
    for k in list(sd):
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            E = sd[k].shape[0]
            pre = k.rpartition(".")[0]
            for e in range(E):
                if k.endswith("gate_up_proj"):
                    sd[k][e, :, 0::2] = dequant[f"{pre}.{e}.gate_proj.weight"].t()
                    sd[k][e, :, 1::2] = dequant[f"{pre}.{e}.up_proj.weight"].t()
                else:
                    sd[k][e] = dequant[f"{pre}.{e}.down_proj.weight"].t()
        elif k in dequant:
            sd[k] = dequant[k]
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    return hf_model(dst)


def test_gpt_oss_w4a16_experts_with_biases(tmp_path):
    """GPT-OSS linearized and packed: per-expert int4 weights with float biases, the clamped SwiGLU,
    attention projections with biases packed; the router (`mlp.router`) stays float."""
    from tests.checkpoints import build_gpt_oss

    src = build_gpt_oss(str(tmp_path / "gpt_oss"))
    lin = str(tmp_path / "linear")
    _linearize_gpt_oss(src, lin)
    dst = str(tmp_path / "ct")
    dequant = write_checkpoint(lin, dst, W4_SYM_G32, ignore=["lm_head", "re:.*router$"])
    with open(os.path.join(dst, "config.json")) as f:  # the package names each module it left float
        assert "model.layers.0.mlp.router" in json.load(f)["quantization_config"]["ignore"]
    model = _fuse_gpt_oss(src, dequant, str(tmp_path / "oracle"))
    llm = light_parity(dst, model, 93)
    ex = llm.engine.runner.model.model.layers[0].mlp.experts
    assert ex.w13_qweight.dtype == torch.uint8 and ex.w13_bias is not None
    sd = load_file(os.path.join(lin, "model.safetensors"))
    torch.testing.assert_close(ex.w2_bias[3], sd["model.layers.0.mlp.experts.3.down_proj.bias"], rtol=0, atol=0)
