"""Block-FP8 checkpoints in the Hub's layout (DeepSeek-V3's): greedy tokens equal transformers
running the exactly dequantized weights; weights stay FP8 in memory; `--quantization fp8`
quantizes an unquantized checkpoint faithfully; malformed configs are refused naming the field.

The test writes its FP8 checkpoints itself, with its own float64 quantizer: every linear weight
(not the router, norms, embeddings or LM head) becomes float8_e4m3fn plus a float32
`weight_scale_inv` per block, with block sizes that do not divide the dimensions (partial edge
blocks), and experts as per-expert tensors as the Hub has them. The dequantized weights, q times
the block scale, are exact in float32 (a 4-bit mantissa times a float32 is exact in float64 and
rounds once), so the oracle model holds exactly the values our engine computes with.
"""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from moe_serve import LLM
from tests.models.test_hf_parity import check_greedy_parity

FP8 = torch.float8_e4m3fn


def _is_quantized(name: str, t: torch.Tensor) -> bool:
    return (t.dim() == 2 and name.endswith(".weight") and "norm" not in name and "embed_tokens" not in name
            and name != "lm_head.weight" and not name.endswith("mlp.gate.weight"))


def _quantize64(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The test's own block quantizer: amax / 448 per block, values rounded to FP8."""
    R, C = w.shape
    b0, b1 = block
    nr, nc = math.ceil(R / b0), math.ceil(C / b1)
    q = torch.empty(R, C, dtype=FP8)
    s = torch.empty(nr, nc, dtype=torch.float32)
    w64 = w.double()
    for i in range(nr):
        for j in range(nc):
            blk = w64[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1]
            scale = float(blk.abs().max()) / 448.0 or 1.0
            s[i, j] = scale
            q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = (blk / float(s[i, j])).clamp(-448, 448).to(FP8)
    return q, s


def _dequantize64(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    R, C = q.shape
    full = s.double().repeat_interleave(block[0], 0)[:R].repeat_interleave(block[1], 1)[:, :C]
    return (q.double() * full).float()


def make_fp8_checkpoint(src: str, dst: str, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """FP8 copy of `src` at `dst`; returns the dequantized state dict (the oracle's weights)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(os.path.join(src, "model.safetensors"))
    per_expert = {}
    for k, v in sd.items():  # fused 3-D expert tensors -> the Hub's per-expert tensors
        if k.endswith(".experts.gate_up_proj"):
            pre, F = k[: -len(".gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                per_expert[f"{pre}.{e}.gate_proj.weight"] = v[e, :F]
                per_expert[f"{pre}.{e}.up_proj.weight"] = v[e, F:]
        elif k.endswith(".experts.down_proj"):
            pre = k[: -len(".down_proj")]
            for e in range(v.shape[0]):
                per_expert[f"{pre}.{e}.down_proj.weight"] = v[e]
        else:
            per_expert[k] = v
    out, dequant = {}, {}
    for k, v in per_expert.items():
        if _is_quantized(k, v):
            q, s = _quantize64(v, block)
            out[k], out[k + "_scale_inv"] = q, s
            dequant[k] = _dequantize64(q, s, block)
        else:
            out[k] = v
            dequant[k] = v.float()
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return dequant


def oracle(src: str, dequant: dict[str, torch.Tensor]):
    """transformers' model of `src` holding the dequantized weights."""
    from tests.models.test_hf_parity import hf_model

    model = hf_model(src)
    theirs = model.state_dict()
    with torch.no_grad():
        for k, v in dequant.items():
            if k in theirs:
                theirs[k].copy_(v)
        for name, p in theirs.items():  # transformers' fused expert parameters (E, 2F, D) / (E, D, F)
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                pre = name.rsplit(".", 1)[0]
                for e in range(p.shape[0]):
                    if name.endswith("gate_up_proj"):
                        p[e].copy_(torch.cat([dequant[f"{pre}.{e}.gate_proj.weight"],
                                              dequant[f"{pre}.{e}.up_proj.weight"]]).view_as(p[e]))
                    else:
                        p[e].copy_(dequant[f"{pre}.{e}.down_proj.weight"].view_as(p[e]))
    return model


CASES = {"qwen3_moe": (32, 24), "deepseek_v3": (16, 48), "deepseek_v32": (16, 16)}


@pytest.mark.parametrize("arch", list(CASES))
def test_fp8_checkpoint_greedy_matches_transformers_on_dequantized_weights(checkpoints, extra_checkpoints, tmp_path,
                                                                          arch):
    """DeepSeek-V3.2 (DSA) with its indexer's projections in FP8 blocks too."""
    src = (extra_checkpoints if arch == "deepseek_v32" else checkpoints)[arch]
    dequant = make_fp8_checkpoint(src, str(tmp_path / "fp8"), CASES[arch])
    model = oracle(src, dequant)
    # The oracle really holds different weights from the unquantized checkpoint.
    from tests.models.test_hf_parity import hf_model

    plain = dict(hf_model(src).named_parameters())
    assert any(not torch.equal(p, plain[n]) for n, p in model.named_parameters())
    check_greedy_parity(str(tmp_path / "fp8"), model, 40 + list(CASES).index(arch))


@pytest.mark.parametrize("half_matmul", [True, False], ids=["bf16-gemm-cpu", "no-bf16-gemm-cpu"])
def test_fp8_weights_stay_fp8_in_memory(checkpoints, tmp_path, monkeypatch, half_matmul):
    """FP8 layers keep one byte a weight whatever the CPU; every other weight is held as the
    platform's policy holds it in the bf16 model (moe_serve/prepare.py: GEMM weights widened to
    float32 on a CPU without bf16 matrix instructions unless our C kernels run them, both kinds of
    CPU stood in here)."""
    from moe_serve.kernels import cpu_gemm
    from moe_serve.prepare import gemm_weight_dtype

    monkeypatch.setattr(cpu_gemm, "cpu_has_half_matmul", lambda: half_matmul)
    src = checkpoints["deepseek_v3"]
    make_fp8_checkpoint(src, str(tmp_path / "fp8"), (128, 128))  # the Hub's blocks: one partial block each
    fp8_llm = LLM(str(tmp_path / "fp8"), dtype="bfloat16", kv_cache_memory=1 << 20, show_progress=False)
    model = fp8_llm.engine.runner.model
    fp8_params = [n for n, p in model.named_parameters() if p.dtype == FP8]
    assert any("experts.w13" in n for n in fp8_params) and any("q_a_proj" in n for n in fp8_params)
    # Unquantized in the checkpoint, unquantized here: router, norms, embeddings, LM head.
    for n, p in model.named_parameters():
        if "norm" in n or "embed_tokens" in n or n == "lm_head.weight" or n.endswith("mlp.gate.weight"):
            assert p.dtype != FP8, n
    bf16_llm = LLM(src, dtype="bfloat16", kv_cache_memory=1 << 20, show_progress=False)
    bf16_model = bf16_llm.engine.runner.model
    c_kernels = bf16_llm.engine.cfg.moe_backend == bf16_llm.engine.cfg.linear_backend == "cpu_c"
    gemm_dtype = gemm_weight_dtype(torch.bfloat16, torch.device("cpu"), c_kernels)
    # bf16 stays bf16 where the CPU multiplies it or our C kernels widen it in registers.
    assert gemm_dtype == (torch.bfloat16 if half_matmul or c_kernels else torch.float32)
    assert bf16_model.model.layers[0].self_attn.q_a_proj.weight.dtype == gemm_dtype  # the policy, as served
    bf16_params = dict(bf16_model.named_parameters())
    quantized = set(fp8_params)
    # Quantized layers take one byte a weight plus their scales; the rest is as the bf16 model holds it.
    want = sum(p.numel() * (1 if n in quantized else p.element_size()) for n, p in bf16_params.items())
    assert want <= fp8_llm.engine.runner.weight_bytes <= want * 1.02
    for n, p in model.named_parameters():
        if n not in quantized:
            assert p.dtype == bf16_params[n].dtype, n
    qbytes = sum(bf16_params[n].numel() * 2 for n in quantized)
    assert qbytes > 0.5 * sum(p.numel() * 2 for p in bf16_params.values())  # the quantized layers are most of it
    assert all(dict(model.named_parameters())[n].element_size() == 1 for n in quantized)


def test_online_fp8_quantization_is_faithful(checkpoints):
    """--quantization fp8: each quantized layer's scales are its blocks' amax / 448 (the test's own
    quantizer gives the same FP8 values), and every quantized weight stays within half an FP8 step."""
    from safetensors.torch import load_file

    from moe_serve.quantization.fp8 import dequantize_blocks

    src = checkpoints["qwen3_moe"]
    llm = LLM(src, dtype="float32", quantization="fp8", kv_cache_memory=1 << 20, show_progress=False)
    model = llm.engine.runner.model
    sd = load_file(os.path.join(src, "model.safetensors"))
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.weight.dtype == FP8
    w = sd["model.layers.0.self_attn.q_proj.weight"]
    q_ref, s_ref = _quantize64(w, (128, 128))
    torch.testing.assert_close(q_proj.weight_scale_inv, s_ref, rtol=1e-6, atol=0)
    same = (q_proj.weight.float() == q_ref.float()).float().mean().item()
    assert same > 0.99  # float32 vs float64 division may round a value at an FP8 midpoint differently
    deq = dequantize_blocks(q_proj.weight, q_proj.weight_scale_inv, (128, 128), torch.float32)
    assert ((deq - w).abs() <= w.abs() / 16 + float(s_ref.max()) / 512).all()  # within half an FP8 step
    # Every quantized layer of the model, experts included, dequantizes to within half an FP8 step
    # of the checkpoint's weight.
    from moe_serve.layers.linear import Linear

    checked = 0
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.weight_scale_inv is not None:
            w, got = sd[name + ".weight"], m.dense_weight(torch.float32)
            bound = m.weight_scale_inv.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
        elif name.endswith("mlp.experts") and hasattr(m, "op_weights"):
            w13, w2 = m.op_weights()
            for got, w, ws in ((w13.dequantize(torch.float32), sd[name + ".gate_up_proj"], w13),
                               (w2.dequantize(torch.float32), sd[name + ".down_proj"], w2)):
                assert got.dtype == torch.float32 and ws.q.dtype == FP8
                assert ((got - w).abs() <= w.abs() / 16 + ws.scale_inv.max() / 512).all(), name
            checked += 1
            continue
        else:
            continue
        assert ((got - w).abs() <= w.abs() / 16 + bound / 512).all(), name
        checked += 1
    assert checked >= 3 * 4 + 2  # q/k/v/o of 3 layers, 2 expert stacks (the dense layer's MLP too)


@pytest.mark.parametrize("change,field", [
    ({"quant_method": "bitsandbytes"}, "quant_method"),
    ({"weight_block_size": None}, "weight_block_size"),
    ({"activation_scheme": "static"}, "activation_scheme"),
    ({"fmt": "e5m2"}, "fmt"),
])
def test_unsupported_quantization_configs_are_refused_naming_the_field(checkpoints, tmp_path, change, field):
    src = checkpoints["qwen3_moe"]
    dst = tmp_path / "q"
    shutil.copytree(src, dst)
    with open(dst / "config.json") as f:
        cfg = json.load(f)
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    q.update(change)
    cfg["quantization_config"] = {k: v for k, v in q.items() if v is not None}
    with open(dst / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=field):
        LLM(str(dst), dtype="float32", kv_cache_memory=1 << 20, show_progress=False)
