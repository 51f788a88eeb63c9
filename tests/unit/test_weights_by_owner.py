"""A rank reads only its own experts from the checkpoint, in both expert layouts on disk."""
from __future__ import annotations

import re

import pytest
import safetensors

from expert_parallel.runtime.dispatch.base import Dispatcher
from expert_parallel.runtime.layer import GroupedExperts, MoEContext
from moe_serve.config import ModelConfig
from moe_serve.models.registry import model_class
from moe_serve.weights import load_weights


class NoCommDispatcher(Dispatcher):
    """Rank r of an EP group, for building and loading only (no collectives are made)."""

    def dispatch(self, *a):
        raise AssertionError("not used")

    def combine(self, *a):
        raise AssertionError("not used")


@pytest.mark.parametrize("arch, world", [("mixtral", 2), ("qwen3_moe", 4), ("deepseek_v3", 4)])
def test_each_rank_reads_only_its_experts(checkpoints, arch, world, monkeypatch):
    mc = ModelConfig.from_path(checkpoints[arch], "float32")
    E = mc.hf.get("num_local_experts") or mc.hf.get("num_experts") or mc.hf.get("n_routed_experts")
    slots = -(-E // world) * world
    read: list[tuple[str, object]] = []
    real_open = safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            read.append((name, None))
            return self.f.get_tensor(name)

        def get_slice(self, name):
            sl = self.f.get_slice(name)

            class S:
                def get_shape(self):
                    return sl.get_shape()

                def __getitem__(self, idx):
                    read.append((name, idx))
                    return sl[idx]
            return S()

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    for rank in range(world):
        read.clear()
        ctx = MoEContext(NoCommDispatcher(slots, rank, world))
        model = model_class(mc.architecture)(mc.hf, ctx, mc.dtype)
        load_weights(model, mc.path, mc.dtype, show_progress=False)
        mine = set()
        for m in model.modules():
            if isinstance(m, GroupedExperts):
                mine |= set(m.local_logical)
        assert len(mine) == slots // world
        experts_read = set()
        for name, idx in read:
            m = re.search(r"\.experts\.(\d+)\.", name)
            if m:
                experts_read.add(int(m.group(1)))
            elif idx is not None:  # fused 3-D tensor: one expert's rows per read
                experts_read.add(int(idx))
        assert experts_read == mine, (rank, sorted(experts_read), sorted(mine))


def test_multi_token_prediction_layers_are_skipped_with_a_log_line(checkpoints, caplog):
    """DeepSeek-V3's checkpoint carries layer 3 after its 3 layers (multi-token prediction): not
    loaded, and the log says so."""
    import logging

    from moe_serve import LLM

    with caplog.at_level(logging.INFO, logger="moe_serve.weights"):
        LLM(checkpoints["deepseek_v3"], dtype="float32", kv_cache_memory=1 << 20, show_progress=False)
    assert "skipped the checkpoint's layer(s) [3] after the model's 3: multi-token-prediction" in caplog.text
