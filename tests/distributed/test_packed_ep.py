"""A packed int4 checkpoint under real expert parallelism (torchrun, gloo, EP 2): each rank keeps only
its experts' packed codes, and greedy text through HTTP equals the single-process engine's, which
tests/models/test_compressed_tensors.py holds to transformers over the package's decompression."""
from __future__ import annotations

import asyncio
import os
import signal

import torch

from tests.distributed.jobs import TorchrunJob
from tests.distributed.test_launcher import ARGS, PROMPTS, _complete_all, expected_texts
from tests.models.test_compressed_tensors import build_qwen3_moe_128, write_checkpoint


def _packed_experts_of(path: str, rank: int, world: int):
    """The MoE layer's experts as rank `rank` of `world` loads them (built and loaded in this process,
    no collectives)."""
    from expert_parallel.runtime.layer import MoEContext
    from moe_serve.config import ModelConfig
    from moe_serve.models.registry import model_class
    from moe_serve.weights import load_weights
    from tests.unit.test_weights_by_owner import NoCommDispatcher

    mc = ModelConfig.from_path(path, "float32")
    model = model_class(mc.architecture)(mc.hf, MoEContext(NoCommDispatcher(4, rank, world)), mc.dtype)
    load_weights(model, mc.path, mc.dtype, show_progress=False)
    return model.model.layers[0].mlp.experts


def test_ep2_packed_w4a16_matches_single_process(tmp_path):
    """Qwen3-MoE W4A16 with zero points, group 64 (4 experts: two a rank). Each rank's packed experts
    are its two experts' codes, scales and offsets, as one rank holding all four has them."""
    from moe_serve.layers.experts import PackedExperts

    src = build_qwen3_moe_128(str(tmp_path / "src"))
    path = str(tmp_path / "w4")
    write_checkpoint(src, path, dict(num_bits=4, symmetric=False, strategy="group", group_size=64))
    whole = _packed_experts_of(path, 0, 1)
    for rank in (0, 1):
        ex = _packed_experts_of(path, rank, 2)
        assert isinstance(ex, PackedExperts) and ex.local_logical == [2 * rank, 2 * rank + 1]
        for name in ("w13_qweight", "w13_scales", "w13_offsets", "w2_qweight", "w2_scales", "w2_offsets"):
            assert getattr(ex, name).shape[0] == 2
            assert torch.equal(getattr(ex, name), getattr(whole, name)[2 * rank: 2 * rank + 2]), (rank, name)
    want = expected_texts(path, PROMPTS, 8)
    job = TorchrunJob(2, ["--model", path, *ARGS])
    try:
        assert asyncio.run(_complete_all(job.url, PROMPTS[:1], 8)) == want[:1]  # rank 1 runs empty steps
        assert asyncio.run(_complete_all(job.url, PROMPTS, 8)) == want
        assert "[rank 1] moe_serve.weights: compressed-tensors checkpoint (pack-quantized)" in job.log()
        os.kill(job.rank_pid(0), signal.SIGTERM)
        assert job.wait(60) == 0
    finally:
        job.kill()
