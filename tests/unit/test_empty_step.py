"""A forward with no tokens (what an idle rank runs in expert-parallel lockstep) works for every
architecture and leaves the cache untouched."""
import pytest
import torch

from moe_serve import LLM


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_empty_forward(checkpoints, arch):
    llm = LLM(checkpoints[arch], dtype="float32", kv_cache_memory=1 << 20, show_progress=False)
    runner = llm.engine.runner
    before = [t.clone() for layer in runner.attn_layers for t in
              ([layer.k_cache, layer.v_cache] if hasattr(layer, "k_cache") else [layer.latent_cache])]
    runner.execute_empty()
    after = [t for layer in runner.attn_layers for t in
             ([layer.k_cache, layer.v_cache] if hasattr(layer, "k_cache") else [layer.latent_cache])]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert llm.engine.step(lockstep=True) == []
