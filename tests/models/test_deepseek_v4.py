"""DeepSeek-V4 (DeepseekV4ForCausalLM) against transformers' own model: CSA (groups of 2, an indexer
keeping 4 entries), HCA (groups of 8) and sliding layers (window 8), hyper-connections, hash and
sqrt-softplus routing. Prompts of 16-64 tokens span many groups and windows, so entries are pooled
across chunk boundaries, prefix hits resume mid-sequence, and the indexer really drops entries
(transformers' own logits move when it keeps them all). Greedy tokens equal transformers' under
chunked prefill mixed with decode, preemption by recompute, prefix-cache hits and random schedules;
every block is returned; the Hub's tensor names load; two overlapped micro-batches give the plain
path's tokens; what the model cannot compute is refused by name."""
from __future__ import annotations

import json
import os

import pytest
import torch

from moe_serve import LLM, SamplingParams
from tests.models.test_hf_parity import assert_same_greedy, check_greedy_parity, hf_greedy, hf_model, make_prompts
from tests.models.test_qwen3_next import check_random_schedule

ARCH = "deepseek_v4"


@pytest.fixture(scope="module")
def ref(extra_checkpoints):
    return hf_model(extra_checkpoints[ARCH])


def test_greedy_matches_transformers(extra_checkpoints, ref):
    check_greedy_parity(extra_checkpoints[ARCH], ref, 3)


@pytest.mark.parametrize("seed", [1])  # one drawn schedule: test_batch_invariance.py and the MTP tests mix chunks too
def test_random_schedules_give_the_same_tokens(extra_checkpoints, ref, seed):
    """Block size, token budget (chunks end at every offset of a group), cache size (preemption)
    and prefix caching drawn at random: transformers' tokens, every block returned."""
    check_random_schedule(extra_checkpoints[ARCH], ref, 40 + seed)


@pytest.mark.parametrize("fields", [{"index_topk": 4096}, {"sliding_window": 64}], ids=["dense-indexer", "wide-window"])
def test_each_feature_moves_transformers_logits(extra_checkpoints, ref, fields):
    """Keeping every entry, or a window over the whole prompt, give other logits in transformers
    itself: the parity tests exercise the indexer's selection and the window."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([make_prompts(0)[6]])  # 50 tokens
    with torch.no_grad():
        base = ref(ids, use_cache=False).logits
        other = AutoModelForCausalLM.from_pretrained(extra_checkpoints[ARCH], dtype=torch.float32, **fields).eval()
        other = other(ids, use_cache=False).logits
    assert (base - other).abs().max() > 1e-2


def test_hub_names_load(extra_checkpoints, ref, tmp_path):
    """The Hub's layout (no `model.` prefix, `embed`, `head`, `hc_head_fn`, an `mtp.*` layer, which
    is skipped) gives the same tokens."""
    from safetensors.torch import load_file, save_file

    src = extra_checkpoints[ARCH]
    sd = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for k, v in sd.items():
        k = k[len("model."):] if k.startswith("model.") else k
        k = {"embed_tokens.weight": "embed.weight"}.get(k, k)
        k = k.replace("hc_head.hc_", "hc_head_")
        out[k] = v
    out["mtp.0.attn.wq_a.weight"] = torch.zeros(2, 2)
    assert "embed.weight" in out and "head.weight" in out and "hc_head_fn" in out
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            os.symlink(os.path.join(src, f), tmp_path / f)
    save_file(out, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    prompt = make_prompts(1)[6]
    got = LLM(str(tmp_path), dtype="float32", kv_cache_memory=4 << 20, show_progress=False).generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6))
    assert list(got[0].outputs[0].token_ids) == hf_greedy(ref, prompt, 6)


def test_caches_are_paged_groups(extra_checkpoints):
    """One sliding group (K and the raw projections, max(window, 2m, m') tokens) and one full group
    (the compressed entries): a finished request leaves nothing referenced in either."""
    llm = LLM(extra_checkpoints[ARCH], dtype="float32", kv_cache_memory=4 << 20, block_size=4, show_progress=False)
    kv = llm.engine.scheduler.kv
    assert sorted(str(k) for k in kv.kinds) == ["full", "sliding(8)"]
    llm.generate([{"prompt_token_ids": make_prompts(2)[9]}], SamplingParams(temperature=0, max_tokens=4))
    assert kv.in_use == 0
    kv.check_invariants()


def test_overlap_gives_identical_tokens(extra_checkpoints):
    from tests.unit import test_overlap

    test_overlap.test_overlap_gives_identical_tokens(extra_checkpoints, ARCH)


@pytest.mark.parametrize("fields, match", [({"num_key_value_heads": 2}, "num_key_value_heads"),
                                           ({"scoring_func": "softmax"}, "scoring_func"),
                                           ({"layer_types": ["full_attention"] * 4}, "layer_types"),
                                           ({"mlp_layer_types": ["dense"] * 4}, "mlp_layer_types")])
def test_other_variants_refused(extra_checkpoints, tmp_path, fields, match):
    src = extra_checkpoints[ARCH]
    for f in os.listdir(src):
        if f != "config.json":
            os.symlink(os.path.join(src, f), tmp_path / f)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory=4 << 20, show_progress=False)


def test_fp8_and_fp4_weights_as_released(extra_checkpoints):
    """Block FP8 linears with ue8m0 scales and FP4 experts, as DeepSeek-V4 is released: they stay
    packed in memory (FP8 values, uint8 MXFP4 blocks) and give transformers' greedy tokens on the
    exactly dequantized weights."""
    from expert_parallel.runtime.layer import MoE

    path = extra_checkpoints["deepseek_v4_fp4"]
    model = hf_model(os.path.join(path, "reference"))
    llm = LLM(path, dtype="float32", kv_cache_memory=4 << 20, block_size=4, max_num_batched_tokens=16,
              show_progress=False)
    net = llm.engine.runner.model
    attn = net.model.layers[1].attn
    assert attn.wq_b.weight.dtype == torch.float8_e4m3fn and attn.wq_b.weight_scale_inv is not None
    assert attn.compressor.wkv.weight.dtype == torch.float32  # shipped unquantized, kept so
    experts = [m for m in net.modules() if isinstance(m, MoE)][0].experts
    assert experts.w13_blocks.dtype == torch.uint8 and experts.w13 is None
    prompts = make_prompts(4)[4:9]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=6))
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(model, p, 6)
    # Its MTP layer, packed the same way (FP8 e_proj / h_proj, FP4 experts), drafts: the same tokens.
    spec = LLM(path, dtype="float32", kv_cache_memory=4 << 20, block_size=4, max_num_batched_tokens=16,
               show_progress=False, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    layer = spec.engine.runner.model.mtp[0]
    assert layer.e_proj.weight.dtype == torch.float8_e4m3fn and layer.block.ffn.experts.w13_blocks.dtype == torch.uint8
    again = spec.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=6))
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    assert spec.engine.spec.num_drafts > 0


@pytest.mark.parametrize("arch,k", [("deepseek_v4_mtp_copy", 3), ("deepseek_v4_mtp", 2)])
def test_mtp_speculative_decoding(extra_checkpoints, arch, k):
    """The checkpoint's MTP layer (`mtp.0.*` as the Hub ships it) drafts; greedy text equals the
    plain engine's and transformers' under chunked prefill mixed with verify steps. The layer that
    copies the model shifted by a token (tests/checkpoints.py build_deepseek_v4_mtp) must draft
    well, which it only does when its Hub names, its stream input and its own sliding cache are
    right; the random one's drafts are nearly all rejected, so its cache is rolled back often."""
    from tests.models.test_mtp import engines, prompts

    path = extra_checkpoints[arch]
    plain, spec = engines(path, k, max_num_batched_tokens=24)
    ps = [p * 2 for p in prompts(6, seed=3)]  # 6-78 tokens: past the window of 8
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)]
    assert got == want
    model = hf_model(path)
    for p, ours in list(zip(ps, got))[:2]:
        theirs = hf_greedy(model, p, len(ours))  # stops at EOS, which ours ignores
        assert_same_greedy(model, p, ours[:len(theirs)], theirs)
    s = spec.engine.spec
    assert s.num_drafts > 0 and sum(s.accepted_per_pos) == s.num_accepted_tokens
    if arch == "deepseek_v4_mtp_copy":
        assert s.num_accepted_tokens > 0.5 * s.num_draft_tokens, (s.num_accepted_tokens, s.num_draft_tokens)
        assert spec.engine.num_steps < plain.engine.num_steps
    for llm in (plain, spec):
        assert llm.engine.scheduler.kv.in_use == 0
        llm.engine.scheduler.kv.check_invariants()
