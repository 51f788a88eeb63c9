"""Weights replaced while serving, for quantized checkpoints: a block-FP8 DeepSeek-V3 checkpoint
(its MLA kv_b_proj dequantized at load, the rest kept FP8) and GPT-OSS's MXFP4 experts (kept
compressed, or dequantized at load). Updated from disk, or broadcast by a trainer, the engine
serves exactly what a fresh load of the new checkpoint serves: the same greedy tokens and bitwise
the same logprobs (every tensor goes through the preparation the load gives it). In process: the
engine's weights-update feature is called as its core calls it between steps."""
from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

from moe_serve import LLM, SamplingParams
from tests.models.test_fp8 import make_fp8_checkpoint

PROMPTS = [[5, 77, 301, 42] * 3, [9, 8, 7, 6, 5, 4, 3, 200, 100], [450, 12, 13]]
FP8_BLOCK = (16, 48)  # blocks that do not divide the tiny model's dimensions: partial edge blocks


def _tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _write(src: str, dst: str, tensors: dict[str, torch.Tensor]) -> str:
    """A copy of the checkpoint `src` at `dst` (config, tokenizer) holding `tensors`."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    return dst


def _perturbed(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    if not t.is_floating_point() or t.dim() < 2:
        return t
    return (t.float() + 0.5 * t.float().std() * torch.randn(t.shape, generator=g)).to(t.dtype)


def _llm(path: str, dtype: str = "float32") -> LLM:
    return LLM(path, dtype=dtype, kv_cache_memory=1 << 20, show_progress=False)


def _served(llm: LLM) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs for PROMPTS."""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                             o.outputs[0].token_ids)])
            for o in outs]


def _feature(llm: LLM):
    return llm.engine.features.get("weights_update")


@pytest.fixture(scope="module")
def fp8_pair(checkpoints, tmp_path_factory):
    """(served, new): two block-FP8 DeepSeek-V3 checkpoints, the new one from perturbed weights."""
    root = tmp_path_factory.mktemp("fp8_update")
    src = checkpoints["deepseek_v3"]
    g = torch.Generator().manual_seed(51)
    plain = _write(src, str(root / "plain"), {k: _perturbed(v, g) for k, v in _tensors(src).items()})
    make_fp8_checkpoint(src, str(root / "served"), FP8_BLOCK)
    make_fp8_checkpoint(plain, str(root / "new"), FP8_BLOCK)
    return str(root / "served"), str(root / "new")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_update_from_disk_equals_a_fresh_load(fp8_pair, dtype):
    """kv_b_proj comes as FP8 blocks and is served dense (dequantized at load): its new blocks are
    dequantized on arrival; the other FP8 layers take the new values and scales as they are
    (bfloat16: whatever the platform widens or narrows at load, the update writes through it)."""
    served, new = fp8_pair
    want = _served(_llm(new, dtype))
    llm = _llm(served, dtype)
    kv_b = llm.engine.runner.model.model.layers[0].self_attn.kv_b_proj
    assert kv_b.weight_scale_inv is None and kv_b.weight.dtype != torch.float8_e4m3fn  # dense, as load made it
    before = _served(llm)
    assert [t for t, _ in before] != [t for t, _ in want]  # the new weights answer otherwise
    ptr = kv_b.weight.data_ptr()
    feature = _feature(llm)
    feature.load_from_disk(new, True)
    assert kv_b.weight.data_ptr() == ptr  # in place: captured graphs read the same addresses
    assert _served(llm) == want
    feature.sleep(2)  # the weights given back, and reloaded from the last checkpoint at the wake
    feature.wake_up()
    assert _served(llm) == want


def test_fp8_update_from_a_trainer_equals_a_fresh_load(fp8_pair):
    """The new checkpoint's tensors broadcast over gloo, as a trainer sends them: the same answer as
    loading it; an FP8 weight named without its weight_scale_inv is refused, naming it."""
    from moe_serve.weight_sync import broadcast_tensors, check_tensors, checkpoint_manifest, trainer_group

    served, new = fp8_pair
    want = _served(_llm(new))
    llm = _llm(served)
    feature = _feature(llm)
    state = _tensors(new)
    names = sorted(state)
    dtypes, shapes = [str(state[n].dtype) for n in names], [list(state[n].shape) for n in names]
    manifest = checkpoint_manifest(served)
    alone = "model.layers.0.self_attn.kv_b_proj.weight"
    i = names.index(alone + "_scale_inv")
    problem = check_tensors(manifest, names[:i] + names[i + 1:], dtypes[:i] + dtypes[i + 1:], shapes[:i] + shapes[i + 1:])
    assert problem is not None and alone in problem[1] and "weight_scale_inv" in problem[1]

    from tests.e2e.server import free_port

    port, box = free_port(), {}
    trainer = threading.Thread(target=lambda: box.update(group=trainer_group("127.0.0.1", port, 2, "q")))
    trainer.start()
    feature._do("weights_init_group", {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                                       "world_size": 2, "group_name": "q", "backend": "gloo"}, 0)
    trainer.join()
    push = threading.Thread(target=broadcast_tensors, args=(box["group"], [state[n] for n in names]))
    push.start()
    out = feature.receive(names, dtypes, shapes, True)
    push.join()
    assert out["tensors"] == len(names)
    assert _served(llm) == want


def _mxfp4_perturbed(src: str, dst: str, seed: int) -> str:
    """`src` with new expert codes (random bytes: every byte is two valid e2m1 codes), scales moved
    by one binade here and there, and every other weight perturbed."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in _tensors(src).items():
        if k.endswith("_blocks"):
            out[k] = torch.randint(0, 256, v.shape, generator=g, dtype=torch.int32).to(torch.uint8)
        elif k.endswith("_scales"):
            out[k] = (v.int() + torch.randint(-1, 2, v.shape, generator=g, dtype=torch.int32)).to(torch.uint8)
        else:
            out[k] = _perturbed(v, g)
    return _write(src, dst, out)


@pytest.mark.parametrize("compressed", [True, False], ids=["compressed", "dequantized-at-load"])
def test_mxfp4_update_from_disk_equals_a_fresh_load(extra_checkpoints, tmp_path, monkeypatch, compressed):
    """GPT-OSS's MXFP4 experts replaced from disk: kept compressed (the new blocks and scales as
    they are), or dequantized at load (each expert's blocks wait for its scales, then dequantize,
    as at load); the same tokens and logprobs as a fresh load of the new checkpoint."""
    from moe_serve.models.gpt_oss import GptOssForCausalLM

    monkeypatch.setattr(GptOssForCausalLM, "mxfp4_compressed", compressed)
    served = extra_checkpoints["gpt_oss_mxfp4"]
    new = _mxfp4_perturbed(served, str(tmp_path / "new"), 52)
    want = _served(_llm(new))
    llm = _llm(served)
    assert [t for t, _ in _served(llm)] != [t for t, _ in want]
    _feature(llm).load_from_disk(new, True)
    assert not llm.engine.runner.model._pending  # every block met its scales
    assert _served(llm) == want
