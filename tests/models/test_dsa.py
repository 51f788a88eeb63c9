"""DeepSeek Sparse Attention models: DeepSeek-V3.2 (DeepseekV32ForCausalLM) and GLM-5
(GlmMoeDsaForCausalLM, whose "shared" layers reuse the selection of the full layer before them).
The tiny checkpoints select DSA_TOPK = 8 tokens per query, so the 16-64 token prompts really are
sparse (transformers' own logits move when the selection is made dense): greedy tokens equal
transformers' under chunked prefill mixed with decode, preemption by recompute, prefix-cache hits
and random schedules; the decode forward reads nothing on the host; two overlapped micro-batches
give the plain path's tokens; configs transformers' model would not compute are refused by name."""
from __future__ import annotations

import pytest
import torch

from expert_parallel.runtime.dispatch.local import LocalDispatcher
from expert_parallel.runtime.layer import MoEContext
from moe_serve.config import ModelConfig
from moe_serve.models.registry import model_class
from tests.checkpoints import DSA_TOPK
from tests.models.test_hf_parity import check_greedy_parity, hf_model, make_prompts
from tests.models.test_llama4 import _copy_with_config
from tests.models.test_qwen3_next import check_random_schedule

ARCHS = ["deepseek_v32", "glm_moe_dsa"]


@pytest.fixture(scope="module")
def refs():
    return {}


def ref_model(extra_checkpoints, refs, arch):
    if arch not in refs:
        refs[arch] = hf_model(extra_checkpoints[arch])
    return refs[arch]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(extra_checkpoints, refs, arch):
    assert sum(len(p) > 3 * DSA_TOPK for p in make_prompts(0)) >= 5  # most prompts are sparse
    check_greedy_parity(extra_checkpoints[arch], ref_model(extra_checkpoints, refs, arch), 500 + ARCHS.index(arch))


@pytest.mark.parametrize("arch, fields", [("deepseek_v32", {"index_topk": 4096}),
                                          ("glm_moe_dsa", {"index_topk": 4096}),
                                          ("glm_moe_dsa", {"indexer_types": ["full"] * 4})],
                         ids=["v32-dense", "glm-dense", "glm-no-sharing"])
def test_each_feature_moves_transformers_logits(extra_checkpoints, refs, arch, fields):
    """Dense attention (a top-k above every context), or GLM-5 without shared layers, gives other
    logits in transformers itself: the parity tests exercise the sparse selection and the sharing."""
    from transformers import AutoModelForCausalLM

    path = extra_checkpoints[arch]
    ids = torch.tensor([make_prompts(0)[6]])  # 50 tokens
    with torch.no_grad():
        base = ref_model(extra_checkpoints, refs, arch)(ids, use_cache=False).logits
        other = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **fields).eval()
        other = other(ids, use_cache=False).logits
    assert (base - other).abs().max() > 1e-2


@pytest.mark.parametrize("seed", range(2))
def test_random_schedules_give_the_same_tokens(extra_checkpoints, refs, seed):
    """Block size, token budget (prefill chunks end at every offset), cache size (preemption) and
    prefix caching drawn at random: transformers' tokens, every block returned."""
    arch = ARCHS[seed % 2]
    check_random_schedule(extra_checkpoints[arch], ref_model(extra_checkpoints, refs, arch), 10 + seed)


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_forward_has_no_host_sync(extra_checkpoints, arch, monkeypatch):
    """The indexer's selection and the sparse attention of a decode step: no host read, no
    data-dependent shape (a CUDA graph holds them)."""
    from tests.unit import test_decode_capturable

    test_decode_capturable.test_decode_forward_has_no_host_sync(extra_checkpoints, arch, monkeypatch)


def test_overlap_gives_identical_tokens(extra_checkpoints):
    from tests.unit import test_overlap

    test_overlap.test_overlap_gives_identical_tokens(extra_checkpoints, "glm_moe_dsa")


def test_index_keys_are_cached_beside_the_latent(extra_checkpoints):
    """Layers with an indexer keep one key row per token in the latent's blocks; shared layers none."""
    from attention.layer import PagedDSAAttention
    from moe_serve import LLM

    llm = LLM(extra_checkpoints["glm_moe_dsa"], dtype="float32", kv_cache_memory=1 << 20, show_progress=False)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, PagedDSAAttention)]
    assert [m.index_cache is not None for m in layers] == [True, False, True, False]
    assert all(m.index_cache.shape[:2] == m.latent_cache.shape[:2] for m in layers if m.index_cache is not None)


@pytest.mark.parametrize("fields, match", [
    ({"indexer_types": ["shared", "full", "full", "shared"]}, "first layer must run its indexer"),
    ({"indexer_types": ["full", "sparse", "full", "shared"]}, "indexer_types"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types"),
])
def test_other_variants_refused(extra_checkpoints, tmp_path, fields, match):
    path = _copy_with_config(extra_checkpoints["glm_moe_dsa"], tmp_path / "variant", **fields)
    cfg = ModelConfig.from_path(path, "float32")
    with pytest.raises(ValueError, match=match):
        model_class(cfg.architecture)(cfg.hf, MoEContext(LocalDispatcher(8)), torch.float32)


def test_hub_style_indexer_schedule(extra_checkpoints, tmp_path):
    """GLM-5's Hub config gives the schedule as a frequency and offset (or an F/S pattern), not
    indexer_types: the same layers run their indexer as transformers derives."""
    from transformers import AutoConfig

    from moe_serve.models.deepseek_v32 import indexer_types

    for fields in ({"index_topk_freq": 2, "index_skip_topk_offset": 1}, {"index_topk_pattern": "FSFS"}):
        path = _copy_with_config(extra_checkpoints["glm_moe_dsa"], tmp_path / str(len(fields)), indexer_types=None,
                                 **fields)
        hf = ModelConfig.from_path(path, "float32").hf
        assert indexer_types(hf) == AutoConfig.from_pretrained(path).indexer_types
