"""FP8 KV cache (--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2): greedy tokens equal transformers'
generate when transformers' keys and values go through the same FP8 storage (the oracle below:
every K/V row entering its cache is divided by the layer's scale, saturated, cast to FP8, widened
and multiplied back), under the parity settings of test_hf_parity.py (chunked prefill mixed with
decode, preemption, prefix-cache hits). Full attention (Qwen3-MoE, on the torch backend and the
default one), sliding windows with sinks (GPT-OSS), MLA (DeepSeek-V3: the latent is the cached
"key" and "value"), DSA (DeepSeek-V3.2: the indexer's keys too), and a checkpoint carrying
k_scale / v_scale under the three names checkpoints use. Also: the cache is the asked dtype, one
byte a value; the same memory holds 4x the float32 blocks (2x bfloat16's); the speed of light
counts one byte a value; bad names are refused naming the flag."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil

import pytest
import torch

from moe_serve import LLM, SamplingParams
from tests.models.test_hf_parity import MAX_NEW, hf_model, make_prompts

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def roundtrip(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as an FP8 cache keeps it: x / scale saturated to the format's range, rounded to FP8, then
    widened and multiplied by scale."""
    m = FP8_MAX[dtype]
    return ((x.double() / scale).clamp(-m, m).to(dtype).double() * scale).to(x.dtype)


@contextlib.contextmanager
def fp8_transformers(dtype: torch.dtype, scales: dict | None = None):
    """transformers' caches store what an FP8 cache would: every key and value row (MLA: the
    normalised latent and the rotated shared key, both with k_scale) and DSA index key entering
    Cache.update / update_indexer is round-tripped; scales: {layer: (k_scale, v_scale)}."""
    from transformers.cache_utils import Cache

    update, update_indexer = Cache.update, Cache.update_indexer

    def fp8_update(self, k, v, layer_idx, *args, **kwargs):
        ks, vs = (scales or {}).get(layer_idx, (1.0, 1.0))
        return update(self, roundtrip(k, dtype, ks), roundtrip(v, dtype, vs), layer_idx, *args, **kwargs)

    def fp8_update_indexer(self, k, layer_idx):
        return update_indexer(self, roundtrip(k, dtype), layer_idx)

    Cache.update, Cache.update_indexer = fp8_update, fp8_update_indexer
    try:
        yield
    finally:
        Cache.update, Cache.update_indexer = update, update_indexer


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """The next token's float64 log-probs, through the cache (so an FP8 oracle applies)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]), use_cache=True).logits[0, -1]
    return torch.log_softmax(logits.double(), -1)


def assert_same_greedy(model, prompt, ours: list[int], theirs: list[int]) -> None:
    """Equal tokens; a difference is accepted only where the oracle's own top-2 margin is under
    1e-3 (a genuine near-tie), after which continuations legitimately diverge."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            top = torch.topk(hf_logprobs(model, prompt + theirs[:i]), 2).values
            margin = float(top[0] - top[1])
            assert margin < 1e-3, f"token {i} differs ({a} vs transformers {b}) with top-2 margin {margin:.4g}"
            return
    assert len(ours) == len(theirs), (ours, theirs)


def parity_llm(path: str, kv: str, **kw) -> LLM:
    """test_hf_parity's settings: 40 blocks of 4 tokens (preemption), 24-token steps (chunked
    prefill beside decodes), 16 sequences a step."""
    return LLM(path, dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=24, max_num_seqs=16,
               show_progress=False, kv_cache_dtype=kv, **kw)


# The longer prompts (17-64 tokens: past GPT-OSS's 12-token window and DSA's top-8), three of them
# sharing a 40-token prefix: the parity of the other architectures, at half the cost of all eleven.
LONG = [4, 5, 6, 8, 10]


def check_fp8_parity(path: str, model, seed: int, kv: str = "fp8", scales: dict | None = None,
                     pick: list[int] | None = None, **llm_kw) -> LLM:
    """Greedy parity with the FP8 oracle; with every prompt (pick None), the run must also preempt
    and take prefix-cache hits."""
    prompts = make_prompts(seed)
    prompts = prompts if pick is None else [prompts[i] for i in pick]
    with fp8_transformers(FP8[kv], scales):
        expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    llm = parity_llm(path, kv, **llm_kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    core = llm.engine
    if pick is None:
        assert core.scheduler.num_preemptions > 0, "the test meant to exhaust the KV cache did not"
        assert core.allocator.hit_tokens > 0, "prompts sharing a prefix got no prefix-cache hit"
    with fp8_transformers(FP8[kv], scales):
        for p, o, e in zip(prompts, outs, expected):
            assert_same_greedy(model, p, o.outputs[0].token_ids, e)
    assert core.allocator.usage == 0.0
    for layer in core.runner.attn_layers:  # every K/V cache tensor is the asked FP8 type
        for t in _caches(layer):
            assert t.dtype == FP8[kv] and t.element_size() == 1
    return llm


def _caches(layer) -> list[torch.Tensor]:
    names = ("k_cache", "v_cache", "latent_cache", "index_cache")
    return [getattr(layer, n) for n in names if getattr(layer, n, None) is not None] + list(getattr(layer, "caches", []))


@pytest.fixture(scope="module")
def refs():
    return {}


def ref(refs, path: str):
    if path not in refs:
        refs[path] = hf_model(path)
    return refs[path]


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_qwen3_moe_greedy_matches_fp8_transformers(checkpoints, refs, backend):
    path = checkpoints["qwen3_moe"]
    check_fp8_parity(path, ref(refs, path), 1, pick=None if backend == "torch" else LONG, attention_backend=backend)


@pytest.mark.parametrize("arch, seed", [("gpt_oss", 200), ("deepseek_v32", 500)])
def test_windowed_and_sparse_greedy_match_fp8_transformers(extra_checkpoints, refs, arch, seed):
    """GPT-OSS (12-token sliding windows with sinks beside full layers) and DeepSeek-V3.2 (MLA over
    the indexer's top-8, the indexer's keys in FP8 as well)."""
    path = extra_checkpoints[arch]
    check_fp8_parity(path, ref(refs, path), seed, pick=LONG, attention_backend="torch")


def test_mla_greedy_matches_fp8_transformers(checkpoints, refs):
    path = checkpoints["deepseek_v3"]
    check_fp8_parity(path, ref(refs, path), 2, pick=LONG)


def test_fp8_logprobs_follow_the_fp8_oracle(checkpoints, refs):
    """Not a vacuous oracle: our FP8 log-probs match the FP8 transformers' closely, while plain
    transformers' (float32 K/V) are measurably elsewhere; e5m2 (2 mantissa bits) lands elsewhere
    than e4m3 and matches its own oracle."""
    path = checkpoints["qwen3_moe"]
    model = ref(refs, path)
    prompt = make_prompts(3)[6]  # 50 tokens
    plain = hf_logprobs(model, prompt)
    ours = {}
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        llm = LLM(path, dtype="float32", kv_cache_dtype=kv, kv_cache_memory=1 << 20, attention_backend="torch",
                  show_progress=False)
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1, logprobs=8))
        ours[kv] = out[0].outputs[0].logprobs[0]
        with fp8_transformers(FP8[kv]):
            oracle = hf_logprobs(model, prompt)
        err = max(abs(lp.logprob - float(oracle[t])) for t, lp in ours[kv].items())
        off = max(abs(float(plain[t]) - float(oracle[t])) for t in ours[kv])
        assert err < 2e-3 and off > 10 * err, (kv, err, off)
    diff = max(abs(lp.logprob - ours["fp8_e5m2"][t].logprob) for t, lp in ours["fp8_e4m3"].items()
               if t in ours["fp8_e5m2"])
    assert diff > 1e-3, diff


def test_deepseek_v4_rows(extra_checkpoints, monkeypatch):
    """DeepSeek-V4's paged rows (window K, the compressors' raw rows, compressed entries, index
    keys) in FP8: the same greedy tokens as the float32 cache holding exactly the values an FP8
    cache keeps (every row round-tripped as it is written: transformers' V4 keeps its compressor
    state outside its cache, so it cannot store the same thing), other tokens than the plain float32
    cache; a decode step reads a quarter of float32's cache bytes."""
    import attention.layer as layer_mod
    from moe_serve.speed_of_light import DecodeBytes

    path = extra_checkpoints["deepseek_v4"]
    prompts = [{"prompt_token_ids": make_prompts(3)[i]} for i in (5, 6, 8)]  # 33-50 tokens: many groups, windows
    greedy = SamplingParams(temperature=0, max_tokens=8)

    def run(kv: str):
        llm = LLM(path, dtype="float32", kv_cache_dtype=kv, block_size=4, kv_cache_memory=1 << 21, show_progress=False)
        return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]

    fp8, ours = run("fp8")
    assert all(t.dtype == torch.float8_e4m3fn for a in fp8.engine.runner.attn_layers for t in _caches(a))
    plain, theirs = run("auto")
    assert ours != theirs  # the FP8 storage changes these tokens: the comparison below means something
    store = layer_mod.store_rows
    monkeypatch.setattr(layer_mod, "store_rows", lambda flat, slots, x: store(flat, slots, roundtrip(x, FP8["fp8"])))
    assert run("auto")[1] == ours
    lens = [9, 40, 64]
    b8 = DecodeBytes.of(fp8.engine.runner.model, fp8.engine.runner.attn_layers).cache_bytes(lens)
    assert 4 * b8 == DecodeBytes.of(plain.engine.runner.model, plain.engine.runner.attn_layers).cache_bytes(lens)


def _with_kv_scales(src: str, dst: str, scales: dict) -> str:
    """A copy of a single-file checkpoint with KV scales under each naming convention in turn:
    layer 0 `self_attn.k_scale`, layer 1 `self_attn.attn.k_scale`, layer 2 compressed-tensors'
    `self_attn.k_proj.output_scale`."""
    from safetensors.torch import load_file, save_file

    if os.path.exists(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    sd = load_file(os.path.join(dst, "model.safetensors"))
    names = ["self_attn.{}_scale", "self_attn.attn.{}_scale", "self_attn.{}_proj.output_scale"]
    for layer, (ks, vs) in scales.items():
        pattern = f"model.layers.{layer}." + names[layer % 3]
        sd[pattern.format("k")] = torch.tensor(ks, dtype=torch.float32)
        sd[pattern.format("v")] = torch.tensor(vs, dtype=torch.float32)
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_checkpoint_kv_scales(checkpoints, refs, tmp_path, caplog):
    """k_scale / v_scale shipped by the checkpoint (small enough that some K saturates): greedy
    tokens equal the oracle with the same scales; logged once; with "auto" the scales are ignored
    (as vLLM does): plain parity with transformers."""
    src = checkpoints["qwen3_moe"]
    scales = {0: (0.02, 0.5), 1: (0.05, 2.0), 2: (0.3, 0.01)}
    path = _with_kv_scales(src, str(tmp_path / "scaled"), scales)
    model = ref(refs, src)
    with caplog.at_level("INFO", logger="moe_serve.model_runner"):
        llm = check_fp8_parity(path, model, 4, scales=scales, pick=LONG, attention_backend="torch")
    assert "kv cache fp8_e4m3: k/v scales from the checkpoint for 3 of 3 attention layers" in caplog.text
    got = {i: (a.k_scale, a.v_scale) for i, a in enumerate(llm.engine.runner.attn_layers)}
    assert got == {i: pytest.approx(s) for i, s in scales.items()}
    prompt = make_prompts(4)[5]
    auto = LLM(path, dtype="float32", kv_cache_memory=1 << 20, show_progress=False)
    assert all(a.k_scale == a.v_scale == 1.0 for a in auto.engine.runner.attn_layers)
    out = auto.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6))
    from tests.models.test_hf_parity import assert_same_greedy as plain_same, hf_greedy as plain_greedy

    plain_same(model, prompt, out[0].outputs[0].token_ids, plain_greedy(model, prompt, 6))


def test_bad_kv_scale_is_refused(checkpoints, tmp_path):
    src = checkpoints["qwen3_moe"]
    path = _with_kv_scales(src, str(tmp_path / "bad"), {0: (-1.0, 1.0)})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_scale.*positive"):
        LLM(path, dtype="float32", kv_cache_dtype="fp8", kv_cache_memory=1 << 20, show_progress=False)


def test_cache_sizes_and_speed_of_light(checkpoints):
    """The same budget holds 4x float32's blocks and 2x bfloat16's; a decode step's cache bytes
    (the speed of light) are one per value."""
    from moe_serve.runner.memory import size_kv_cache
    from moe_serve.speed_of_light import DecodeBytes

    path = checkpoints["qwen3_moe"]
    llms = {kv: LLM(path, dtype="float32", kv_cache_dtype=kv, kv_cache_memory=1 << 20, attention_backend="torch",
                    show_progress=False) for kv in ("auto", "fp8_e5m2")}
    fp8, f32 = (llms[k].engine.runner for k in ("fp8_e5m2", "auto"))
    assert fp8.num_blocks == pytest.approx(4 * f32.num_blocks, abs=4)
    resident = sum(t.numel() for a in fp8.attn_layers for t in _caches(a))
    assert sum(t.nbytes for a in fp8.attn_layers for t in _caches(a)) == resident
    assert all(t.dtype == torch.float8_e5m2 for a in fp8.attn_layers for t in _caches(a))
    # bfloat16 activations: the same budget, half the bytes per value of bf16
    cfg = llms["auto"].engine.cfg
    bf16 = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=torch.bfloat16), attention_backend="torch")
    sizes = {kv: size_kv_cache(f32.attn_layers, dataclasses.replace(bf16, cache=dataclasses.replace(
        cfg.cache, kv_cache_dtype=kv)), 0, None) for kv in ("auto", "fp8")}
    assert sizes["auto"].block_bytes == 2 * sizes["fp8"].block_bytes
    assert sizes["fp8"].num_blocks == pytest.approx(2 * sizes["auto"].num_blocks, abs=2)
    lens = [7, 100, 513]
    b8 = DecodeBytes.of(fp8.model, fp8.attn_layers).cache_bytes(lens)
    b32 = DecodeBytes.of(f32.model, f32.attn_layers).cache_bytes(lens)
    per_token = sum(a.num_kv_heads * (a.head_dim + a.v_head_dim) for a in fp8.attn_layers)
    assert b8 == per_token * sum(lens) and b32 == 4 * b8


def test_bad_kv_cache_dtype_is_refused(checkpoints):
    import argparse

    from moe_serve.engine.args import EngineArgs

    with pytest.raises(ValueError, match="kv_cache_dtype='bogus' .--kv-cache-dtype."):
        EngineArgs(model=checkpoints["qwen3_moe"], kv_cache_dtype="bogus").create_engine_config()
    p = argparse.ArgumentParser(exit_on_error=False)
    EngineArgs.add_cli_args(p)
    with pytest.raises(argparse.ArgumentError, match="--kv-cache-dtype"):
        p.parse_args(["--kv-cache-dtype", "bogus"])
    assert p.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
