"""GPT-OSS: greedy tokens equal transformers' generate, in float32 and with MXFP4 experts (the
oracle is transformers running exactly the weights transformers' own MXFP4 unpacking gives for
the checkpoint's bytes), under the parity settings of test_hf_parity.py: block size 4 against a
12-token sliding window, prompts and chunked prefills that cross the window, decode past it."""
from __future__ import annotations

import pytest
import torch

from moe_serve import LLM, SamplingParams
from tests.checkpoints import GPT_OSS_WINDOW
from tests.models.test_hf_parity import check_greedy_parity, make_prompts


def hf_model(path: str, dtype=torch.float32, **config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **config).eval()


def oracle_path(extra_checkpoints, arch: str) -> str:
    path = extra_checkpoints[arch]
    return path + "_oracle" if arch == "gpt_oss_mxfp4" else path


@pytest.mark.parametrize("arch", ["gpt_oss", "gpt_oss_mxfp4"])
def test_greedy_matches_transformers(extra_checkpoints, arch):
    path = extra_checkpoints[arch]
    prompts = make_prompts(200)
    assert max(map(len, prompts)) > 3 * GPT_OSS_WINDOW
    check_greedy_parity(path, hf_model(oracle_path(extra_checkpoints, arch)), 200)


def test_window_and_sinks_change_the_reference(extra_checkpoints):
    """The checkpoint makes both features matter: transformers' logits move when the window is
    lifted or the sinks are zeroed (so parity above checks them)."""
    path = extra_checkpoints["gpt_oss"]
    ids = torch.tensor([make_prompts(200)[5]])  # 33 tokens: past the window
    base = hf_model(path)
    no_window = hf_model(path, layer_types=["full_attention"] * 3)
    with torch.no_grad():
        ref = base(ids).logits[0, -1]
        assert (no_window(ids).logits[0, -1] - ref).abs().max() > 0.1
        for layer in base.model.layers:
            layer.self_attn.sinks.zero_()
        assert (base(ids).logits[0, -1] - ref).abs().max() > 0.1


def test_sliding_layers_free_blocks_out_of_their_window(extra_checkpoints):
    """The sliding layers keep their own block table and free what falls out of the window as the
    request advances: over a 200-token prompt and 30 decodes their group never holds more than the
    window plus a prefill chunk, while the full layers' group holds the whole context; tokens are
    the same with prefix caching on and off (with it, the freed blocks stay cached and a second
    identical prompt hits)."""
    path = extra_checkpoints["gpt_oss"]
    prompt = [t for p in make_prompts(201) for t in p][:200]
    assert len(prompt) == 200
    outs = []
    for prefix in (False, True):
        llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=80, max_num_batched_tokens=16,
                  enable_prefix_caching=prefix, show_progress=False)
        core = llm.engine
        kv = core.scheduler.kv
        assert [str(k) for k in kv.kinds] == ["full", f"sliding({GPT_OSS_WINDOW})"]
        peak = {0: 0, 1: 0}
        update = core.scheduler.update

        def update_recording(out, *args):
            for g, alloc in enumerate(kv.allocs):
                peak[g] = max(peak[g], alloc.num_blocks - alloc.num_free_blocks)
            return update(out, *args)

        core.scheduler.update = update_recording
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        outs.append(llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids)
        assert peak[0] == -(-(200 + 29) // 4)  # every computed token of the context
        assert peak[1] <= (GPT_OSS_WINDOW + 16) // 4 + 2
        assert kv.in_use == 0
        if prefix:
            again = llm.generate([{"prompt_token_ids": prompt}], params)[0]
            assert again.outputs[0].token_ids == outs[0]
            assert core.allocator.hit_tokens >= 196
    assert outs[0] == outs[1]


def test_mxfp4_experts_stay_compressed(extra_checkpoints):
    """On the CPU the expert weights are the checkpoint's uint8 blocks and scales: no dense copy."""
    from moe_serve.kernels.grouped_gemm.mxfp4 import Mxfp4Weight
    from moe_serve.layers.experts import Mxfp4Experts

    llm = LLM(extra_checkpoints["gpt_oss_mxfp4"], dtype="float32", kv_cache_memory=1 << 20, show_progress=False)
    model = llm.engine.runner.model
    experts = [m for m in model.modules() if isinstance(m, Mxfp4Experts)]
    assert len(experts) == 3
    for ex in experts:
        assert ex.w13 is None and ex.w2 is None
        assert {n: p.dtype for n, p in ex.named_parameters()} == {
            "w13_blocks": torch.uint8, "w13_scales": torch.uint8, "w2_blocks": torch.uint8,
            "w2_scales": torch.uint8, "w13_bias": torch.float32, "w2_bias": torch.float32}
        assert all(isinstance(w, Mxfp4Weight) for w in ex.op_weights())
    dense = LLM(extra_checkpoints["gpt_oss"], dtype="float32", kv_cache_memory=1 << 20, show_progress=False)
    assert llm.engine.runner.weight_bytes < dense.engine.runner.weight_bytes - 3 * 8 * 3 * 64 * 64 * 3


@pytest.mark.parametrize("arch", ["gpt_oss_mxfp4"])  # the dense experts take the same path as other models
def test_bfloat16_logits_close_to_float32(extra_checkpoints, arch):
    """As test_hf_parity's bf16 check: our bf16 log-probs stay as close to transformers' float32
    ones as transformers' own bf16 run does."""
    path, oracle = extra_checkpoints[arch], oracle_path(extra_checkpoints, arch)
    m32, m16 = hf_model(oracle), hf_model(oracle, torch.bfloat16)
    prompts = make_prompts(7)[:6]
    llm = LLM(path, dtype="bfloat16", kv_cache_memory=1 << 22, show_progress=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = torch.log_softmax(m32(torch.tensor([p])).logits[0, -1].double(), -1)
            hf16 = torch.log_softmax(m16(torch.tensor([p])).logits[0, -1].double(), -1)
        ours = o.outputs[0].logprobs[0]
        our_err = max(abs(lp.logprob - float(ref[t])) for t, lp in ours.items())
        hf_err = max(abs(float(hf16[t]) - float(ref[t])) for t in ours)
        assert our_err <= max(0.15, 1.5 * hf_err + 0.05), (len(p), our_err, hf_err)


@pytest.mark.parametrize("arch", ["gpt_oss_mxfp4"])  # windowed decode attention and every expert dequantized
def test_decode_forward_has_no_host_sync(extra_checkpoints, arch, monkeypatch):
    from tests.unit import test_decode_capturable

    test_decode_capturable.test_decode_forward_has_no_host_sync(extra_checkpoints, arch, monkeypatch)


def test_mxfp4_dequantized_at_load_gives_the_same_tokens(extra_checkpoints, monkeypatch, caplog):
    """mxfp4_compressed=False (dense expert weights dequantized once at load, the cost logged):
    the same greedy tokens as the compressed experts."""
    import logging

    from moe_serve.layers.experts import Mxfp4Experts
    from moe_serve.models.gpt_oss import GptOssForCausalLM

    path = extra_checkpoints["gpt_oss_mxfp4"]
    prompts = [{"prompt_token_ids": p} for p in make_prompts(201)[4:7]]  # 16, 17, 33 tokens
    sp = SamplingParams(temperature=0, max_tokens=10)
    want = [o.outputs[0].token_ids for o in LLM(path, dtype="float32", kv_cache_memory=1 << 20,
                                                  show_progress=False).generate(prompts, sp)]
    monkeypatch.setattr(GptOssForCausalLM, "mxfp4_compressed", False)
    with caplog.at_level(logging.INFO, logger="moe_serve.models.gpt_oss"):
        llm = LLM(path, dtype="float32", kv_cache_memory=1 << 20, show_progress=False)
    assert "MXFP4 experts dequantized at load to float32" in caplog.text
    model = llm.engine.runner.model
    assert not any(isinstance(m, Mxfp4Experts) for m in model.modules())
    assert model.model.layers[0].mlp.experts.w13.dtype == torch.float32 and not model._pending
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == want


def test_mxfp4_tensors_need_the_quantization_config(extra_checkpoints, tmp_path):
    """MXFP4 blocks in a checkpoint whose config.json does not say mxfp4 are refused, naming the
    tensor; load_format='dummy' builds an MXFP4 model from the config alone and runs it."""
    import json
    import os

    src = extra_checkpoints["gpt_oss_mxfp4"]
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.join(src, name), tmp_path / name)
    with open(os.path.join(src, "config.json")) as f:
        c = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({k: v for k, v in c.items() if k != "quantization_config"}, f)
    with pytest.raises(ValueError, match=r"experts\.(gate_up|down)_proj_(blocks|scales)'.*is MXFP4 but config\.json"):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory=1 << 20, show_progress=False)
    llm = LLM(src, dtype="float32", kv_cache_memory=1 << 20, load_format="dummy", show_progress=False)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3


def test_overlap_gives_identical_tokens(extra_checkpoints):
    """Two overlapped micro-batches (a sequence cut across them reads its first part's K/V through
    the window) give the plain path's tokens."""
    from tests.unit import test_overlap

    test_overlap.test_overlap_gives_identical_tokens(extra_checkpoints, "gpt_oss_mxfp4")


def test_padded_decode_matches_unpadded(extra_checkpoints):
    """Decode steps padded to the capture-size ladder (dummy rows on the scratch block) give the
    unpadded tokens through the windowed, sink-carrying decode attention."""
    from tests.unit import test_decode_padding

    test_decode_padding.test_padded_decode_matches_unpadded(extra_checkpoints, "gpt_oss_mxfp4")
