"""moe_serve/kernels/aot_check.py compiles kernel configurations for sm_90 / sm_100 without a GPU (here
the quick sets for sm_90 (bf16, fp32) and sm_100 (bf16), over plain and FP8 KV caches, as the launches specialise them: under 2 minutes on 2 cores); an engine run launches nothing
it does not compile; and the launches select only a few compiled variants whatever the batch.

The compile runs use Triton's bundled ptxas in a subprocess (no TRITON_INTERPRET there); the
engine run uses the interpreter in a subprocess; the variant-count tests record the launchers'
compile keys without running the kernels.
"""
import functools
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_serve.kernels import aot_check

ROOT = Path(__file__).resolve().parents[2]
LAST_LINE = re.compile(r"^aot: (\d+) configurations compiled for (.+); (\d+) failed$")
SPILL_LINE = re.compile(r"^aot: (\d+) configurations spill registers.*; (\d+) grouped-GEMM or decode configurations "
                        r"over (\d+) B$")


def run_aot(*args: str, timeout: int) -> tuple[int, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "moe_serve.kernels.aot_check", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    lines = r.stdout.strip().splitlines()
    assert lines, r.stderr[-3000:]
    return r.returncode, lines


QUICK_RUNS = {"90": (("bf16", "fp32"), "fp8_e4m3"), "100": (("bf16",), "fp8_e5m2")}


@functools.lru_cache(maxsize=None)
def quick_run(arch: str) -> tuple[int, tuple[str, ...]]:
    """`aot_check --quick` for one arch, as the suite compiles it (MXFP4's whole set apart, in
    test_mxfp4_launches_compile_for_sm90_and_sm100): bf16 and fp32 for sm_90, bf16 for sm_100, over
    plain and FP8 caches, the packed kernels included; compiled once for the tests that read it."""
    names, kv = QUICK_RUNS[arch]
    rc, lines = run_aot("--arch", arch, "--dtype", *names, "--quick", "--kv-cache-dtype", "auto", kv, "--skip", "mxfp4",
                        timeout=600)
    return rc, tuple(lines)


def test_a_broken_config_is_reported_as_failed():
    """The check can fail: a config tl.dot cannot compile is counted, named, and exits 1, and so is
    a gate/up tile too large for its warps' registers (it compiles, spilling ~2.2 KB per thread),
    while the working configurations compiled in the same run still count as compiled."""
    rc, lines = run_aot("--arch", "90", "--dtype", "bf16", "--kv-cache-dtype", "auto", "--only", "broken",
                        "moe-tiny decode", "--inject-broken", timeout=600)
    m = LAST_LINE.match(lines[-1])
    assert m, lines[-5:]
    # w13 and w2 variants of the K tile 8, and the spilling one
    assert rc == 1 and m.group(2) == "sm_90" and m.group(3) == "3", lines[-5:]
    assert int(m.group(1)) >= 2  # moe-tiny decode attention, with and without split
    fails = [line for line in lines if line.lstrip().startswith("FAIL")]
    assert len(fails) == 2 and all("BLOCK_SIZE_K=8" in f for f in fails), fails
    spilled = [line for line in lines if line.lstrip().startswith("SPILL")]
    assert len(spilled) == 1 and "BLOCK_SIZE_N=256" in spilled[0] and "GATED=1" in spilled[0], spilled
    assert int(re.search(r"spills (\d+) B >", spilled[0]).group(1)) > 1000
    s = SPILL_LINE.match(lines[-3])
    assert s and int(s.group(1)) >= 1 and s.group(2) == "1" and s.group(3) == "64", lines[-4:]
    oks = [line for line in lines if line.lstrip().startswith("ok")]
    assert oks and all(re.search(r"regs +\d+ +spills +\d+ B +shared +\d+ B", line) for line in oks), oks


@pytest.mark.slow
def test_every_configuration_compiles_for_sm90_and_sm100_without_spills():
    """The sweep, as the launches specialise it (about a minute on 2 cores): every default and tuned
    grouped-GEMM tile (bf16, fp32; FP8 weights and W8A8) and the masked GEMM, GQA and MLA attention
    (decode with and without split-K, prefill; sliding window, sinks, chunks; DSA's sparse mode and
    indexer), the split reduce, KV writes, top-k sum, FP8 linear and activation quantization, linear
    attention, for every model shape. Every one compiles for both archs, and no grouped-GEMM or
    decode configuration spills more than --max-spill; the quick set (one per kernel, dtype and path)
    is a subset that covers each path (every decode path among them). The suite compiles the quick
    sets: bf16 and fp32 (twice the bytes a tile holds) for sm_90 (H100/H200), bf16 for sm_100 (fp16
    is bf16's code over an element of the same size: the full sweep compiles it); `python -m
    moe_serve.kernels.aot_check --arch 90 100 --dtype bf16 fp32 fp16` compiles the whole sweep (bench/results/aot_sm90_sm100.txt: the suite's 2-core budget
    does not hold it). FP8 KV caches (--kv-cache-dtype): the quick set over float8_e4m3fn caches for
    sm_90 and float8_e5m2 for sm_100 (the two differ only in the cache's load and store instructions;
    `aot_check --kv-cache-dtype fp8_e4m3 fp8_e5m2 --only kv=` compiles every pair): the decode tiles
    of GQA, MLA and DSA's sparse attention with and without split-K, the indexer and the cache
    write, in bf16, none spilling past --max-spill; MLA's decode over an FP8 latent runs 32 heads
    a program."""
    e5m2 = torch.float8_e5m2
    jobs = _bf16_jobs()  # the bf16 sweep, over bf16 and FP8 caches (shared with other tests: one enumeration)
    # = enumerate_jobs(dtypes=(bf16,), quick=True, kv_cache_dtypes=(None, e5m2)): quick_jobs keeps the order
    quick = aot_check.quick_jobs([j for j in jobs if j.kv_fp8 in (None, aot_check.KV_FP8[e5m2])])
    assert {j.key() for j in quick} <= {j.key() for j in jobs}
    short = {(j.short, j.constexprs.get("GATED"), j.constexprs.get("SPLIT_K"), j.constexprs.get("HAS_ROPE"))
             for j in quick}
    for path in (("grouped_gemm", True, None, None), ("grouped_gemm", False, None, None), ("masked_gemm", True, None,
                 None), ("paged_attn", None, True, True), ("paged_attn", None, False, True),
                 ("paged_attn", None, True, False), ("reduce_splits", None, None, None)):
        assert path in short, path
    assert all(aot_check.is_decode(j) for j in quick if j.kernel in (aot_check.GEMM, aot_check.MASKED, aot_check.ATTN))
    # (MXFP4's configurations left to test_mxfp4_launches_compile_for_sm90_and_sm100, which compiles them all)
    fp8_paths = {(aot_check.ATTN, sk, rope, sp) for sk in (False, True) for rope, sp in
                 ((False, False), (True, False), (True, True))} | {(aot_check.INDEX,) * 4, (aot_check.WRITE,) * 4}
    for arch, names, dts, kv in (("90", ("bf16", "fp32"), (torch.bfloat16, torch.float32), "fp8_e4m3"),
                                 ("100", ("bf16",), (torch.bfloat16,), "fp8_e5m2")):
        kv_dt = aot_check.KV_CACHE_DTYPES[kv]
        # bf16's from the shared sweep, then the other dtypes' (over their own caches: the FP8 quick
        # set is bf16's): the paths of enumerate_jobs(dtypes=dts, quick=True, kv_cache_dtypes=(None, kv_dt))
        quick_set = quick if kv_dt == e5m2 else aot_check.quick_jobs(
            [j for j in jobs if j.kv_fp8 in (None, aot_check.KV_FP8[kv_dt])]
            + aot_check.enumerate_jobs(dtypes=dts[1:], kv_cache_dtypes=(None,)))
        quick_set = [j for j in quick_set if not j.constexprs.get("B_FP4")]
        fp8 = [j for j in quick_set if j.kv_fp8]
        assert {(j.kernel, *((j.constexprs[k] for k in ("SPLIT_K", "HAS_ROPE", "SPARSE")) if j.kernel == aot_check.ATTN
                             else (j.kernel,) * 3)) for j in fp8} == fp8_paths and len(fp8) == len(fp8_paths)
        assert all(j.kv_fp8 == aot_check.KV_FP8[kv_dt] and j.dtype == "bf16" for j in fp8)
        assert QUICK_RUNS[arch] == (names, kv)
        rc, lines = quick_run(arch)
        m = LAST_LINE.match(lines[-1])
        assert m, lines[-10:]
        assert rc == 0, [line for line in lines if "FAIL" in line or "SPILL" in line]
        assert (int(m.group(1)), m.group(2), m.group(3)) == (len(quick_set), f"sm_{arch}", "0"), lines[-10:]
        s = SPILL_LINE.match(lines[-3])
        assert s and s.group(2) == "0", lines[-4:]
        # MLA decode: DeepSeek-V3's 128 heads run 64 per program (FlashMLA's tile).
        mla = [line for line in lines if line.lstrip().startswith("ok") and "BLOCK_HD=512" in line
               and "BLOCK_Q=1 " in line and "BLOCK_QH=64" in line]
        assert {line.split()[1] for line in mla} == {f"sm_{arch}"}, mla
        fp8_oks = [line for line in lines if line.lstrip().startswith("ok") and " kv=" in line]
        assert len(fp8_oks) == len(fp8_paths) and all(f" kv={aot_check.KV_FP8[kv_dt]} " in x for x in fp8_oks), fp8_oks
        fp8_mla = [line for line in fp8_oks if "BLOCK_HD=512" in line and "SPARSE=0" in line]
        assert len(fp8_mla) == 2 and all("BLOCK_QH=32" in line for line in fp8_mla), fp8_mla


# ---- no JIT recompiles during serving ----------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _bf16_jobs() -> tuple:
    """Every bf16 configuration of aot_check's sweep, over bf16 and FP8 caches (enumerated once)."""
    return tuple(aot_check.enumerate_jobs(dtypes=(torch.bfloat16,)))


def _compiled_variants() -> set:
    """(kernel, constexprs, options) of every bf16 configuration, over bf16 and FP8 caches."""
    return {(j.kernel, tuple(sorted(j.constexprs.items())), tuple(sorted(j.options.items()))) for j in _bf16_jobs()}


def _variant(kernel: str, launch: dict) -> tuple:
    constexprs, options = aot_check._split_options(launch)
    return kernel, tuple(sorted(constexprs.items())), tuple(sorted(options.items()))


# Variants of the attention kernel one model and dtype can use during decode: split-K or not.
MAX_DECODE_VARIANTS = 2


def test_decode_launch_choice_has_few_variants_all_compiled_ahead():
    """Over mixed context lengths 1..32k and batch sizes 1..256, on H200 and B200 SM counts, the split
    count varies widely but stays a runtime argument: per model and cache type (the activation
    dtype's, FP8) the attention kernel has at most MAX_DECODE_VARIANTS constexpr combinations, the
    reduce kernel one, and aot_check compiles each."""
    from attention.backends import triton_paged as tp

    compiled = _compiled_variants()
    rng = random.Random(0)
    batches = [1, 2, 3, 4, 7, 8, 16, 31, 32, 64, 100, 128, 200, 256]
    for m, fp8 in ((m, fp8) for m in aot_check.MODELS if m.attention for fp8 in (False, True)):  # V4: experts only
        QH, HD, HR, HV = (m.N, m.L, m.R, m.L) if m.mla else (m.N // m.G, m.H, 0, m.Hv)
        tile = tp.attention_launch(True, QH, HD, HR, HV, torch.bfloat16, m.mla, m.mla, False, fp8_cache=fp8)
        head_programs = m.G * -(-QH // tile["BLOCK_QH"])
        attn_variants, reduce_variants, splits = set(), set(), set()
        for num_sms in (132, 148):
            for B in batches:
                for _ in range(12):
                    ctx_lens = [rng.choice([rng.randint(1, 300), rng.randint(1, 4096), rng.randint(1, 32768)])
                                for _ in range(B)]
                    S = tp.choose_num_splits(True, B, max(ctx_lens), head_programs, num_sms)
                    assert 1 <= S <= tp.MAX_SPLITS
                    splits.add(S)
                    launch = tp.attention_launch(True, QH, HD, HR, HV, torch.bfloat16, m.mla, m.mla, S > 1,
                                                 False, m.sinks, fp8_cache=fp8)
                    attn_variants.add(_variant(aot_check.ATTN, launch))
                    if S > 1:
                        reduce_variants.add(_variant(aot_check.REDUCE, tp.reduce_launch(HV, m.sinks)))
        prefill = _variant(aot_check.ATTN, tp.attention_launch(False, QH, HD, HR, HV, torch.bfloat16, m.mla, m.mla,
                                                               False, False, m.sinks, fp8_cache=fp8))
        assert len(attn_variants) <= MAX_DECODE_VARIANTS and len(reduce_variants) <= 1, m.name
        assert attn_variants | reduce_variants | {prefill} <= compiled, (m.name, fp8)
        if m.name == "qwen3-30b-a3b":
            assert len(splits) >= 8  # the split count does vary: it is the runtime argument now


def test_serving_sweep_launches_few_compiled_variants(monkeypatch):
    """The launchers themselves, over decode batches of mixed contexts (1..32k, batch 1..256, split
    counts as on a 132-SM H200), mixed prefill chunks, expert batches of 1..4096 tokens and FP8 linear
    layers of 1..4096 rows: the kernels record the compile key Triton derives from each launch
    (moe_serve/kernels/specialization.py: constexprs, options, each argument's type and "== 1" / "divisible
    by 16" marks) instead of running, and the keys stay few."""
    from attention.backends import triton_paged as tp
    from attention.metadata import AttentionMetadata
    from moe_serve.kernels import fp8_linear
    from moe_serve.kernels import specialization as sp
    from moe_serve.kernels.grouped_gemm import config as gcfg
    from moe_serve.kernels.grouped_gemm import triton_kernel as tk

    if not tp.INTERPRETED:
        pytest.skip("CPU tensors reach the launchers only under the interpreter")
    # The per-step arguments each kernel leaves unspecialised (besides scale strides).
    assert {"num_q_tiles", "num_splits", "window"} <= sp.do_not_specialize(tp._paged_attn_kernel)
    assert {"num_splits"} <= sp.do_not_specialize(tp._reduce_splits_kernel)
    assert {"num_pairs"} <= sp.do_not_specialize(tk._grouped_gemm_kernel)
    assert {"M"} <= sp.do_not_specialize(fp8_linear._fp8_linear_kernel)
    monkeypatch.setattr(tp, "_device_sms", lambda device: 132)
    rng = random.Random(1)
    bs, N, G, H, L, R = 16, 8, 2, 16, 32, 16
    kc = torch.zeros(4, bs, G, H)
    lat = torch.zeros(4, bs, L + R)

    def meta(q_lens, ctx_lens):
        return AttentionMetadata.build(q_lens, ctx_lens, [[0] * -(-c // bs) for c in ctx_lens], bs)

    splits = set()
    with sp.record((sp.ATTN, sp.REDUCE)) as decode:
        for B in (1, 2, 3, 8, 33, 64, 128, 256):
            for _ in range(4):
                ctx = [rng.choice([rng.randint(1, 300), rng.randint(1, 32768)]) for _ in range(B)]
                m = meta([1] * B, ctx)
                tp.paged_attention(torch.zeros(B, N, H), kc, kc, m, 1.0)
                tp.mla_paged_attention(torch.zeros(B, N, L), torch.zeros(B, N, R), lat, m, 1.0)
                splits.add(next(x for x in reversed(decode) if x.kernel == sp.ATTN).grid[2])
    with sp.record((sp.ATTN,)) as prefill:
        for _ in range(12):  # prefill / chunked prefill with decodes mixed in
            q = [rng.randint(2, 200)] + [rng.choice([1, rng.randint(1, 200)]) for _ in range(rng.randint(0, 5))]
            ctx = [ql + rng.choice([0, rng.randint(0, 5000)]) for ql in q]
            tp.paged_attention(torch.zeros(sum(q), N, H), kc, kc, meta(q, ctx), 1.0)
            tp.mla_paged_attention(torch.zeros(sum(q), N, L), torch.zeros(sum(q), N, R), lat, meta(q, ctx), 1.0)
    assert len(splits) >= 4  # the split count does vary with the batch...
    # ...but decode compiles 2 variants per attention kind (GQA, MLA: split or not), the reduce 1 per
    # kind, and prefill 1 per kind.
    attn = {x for x in decode if x.kernel == sp.ATTN}
    assert len(attn) <= 2 * MAX_DECODE_VARIANTS
    assert len({x for x in decode if x.kernel == sp.REDUCE}) <= 2
    assert len(set(prefill)) <= 2

    E, K, D, F = 8, 2, 32, 16
    w13, w2 = torch.zeros(E, 2 * F, D), torch.zeros(E, D, F)
    with sp.record((sp.GEMM, sp.TOPK)) as experts:
        for T in list(range(1, 40)) + [64, 100, 255, 256, 1000, 4096]:
            ids = torch.randint(-1, E, (T, K), generator=torch.Generator().manual_seed(T))
            tk.fused_experts_triton(torch.zeros(T, D), w13, w2, torch.rand(T, K), ids)
    # One variant per default config and GEMM (gate/up, down); one top-k sum.
    assert len({x for x in experts if x.kernel == sp.GEMM}) <= 2 * len(gcfg.DEFAULT_CONFIGS)
    assert len({x for x in experts if x.kernel == sp.TOPK}) == 1

    Nl, Kl = 256, 256
    w8 = torch.zeros(Nl, Kl).to(torch.float8_e4m3fn)
    with sp.record((sp.FP8_LINEAR,)) as linear:
        for M in list(range(1, 40)) + [64, 100, 255, 256, 1000, 4096]:
            fp8_linear.fp8_linear_triton(torch.zeros(M, Kl), w8, torch.ones(2, 2), (128, 128))
    # One variant per row bucket (16 / 32 / 64-row tiles), whatever M's divisibility.
    assert len(set(linear)) == 3


ENGINE_RUN = r"""
import json, sys
from moe_serve.kernels import specialization
from moe_serve import LLM, SamplingParams
path = sys.argv[1]
prompts = [[5, 77, 301, 42], [9, 8, 7, 6, 5, 4, 3, 200, 100, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27], [450]]
llm = LLM(path, dtype="float32", kv_cache_memory=1 << 20, max_num_batched_tokens=16, moe_backend="triton",
          attention_backend="triton", show_progress=False)
warmed = llm.engine.runner.warm_up_kernels()  # what start-up compiles on a GPU (here: recorded only)
with specialization.record(run=True) as launches:
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=3))
print(json.dumps({name: [[x.kernel, x.args, x.constexprs, x.options] for x in set(keys)]
                  for name, keys in (("launched", launches), ("warmed", warmed))}))
"""


@pytest.mark.parametrize("arch", ["gpt_oss_mxfp4", "deepseek_v32"])  # V3.2 launches V3's MLA kernels too
def test_what_an_engine_run_launches_is_compiled_ahead_and_warmed_up(checkpoints, extra_checkpoints, arch):
    """An engine serving a checkpoint through the Triton backends (the interpreter here; chunked
    prefill, decodes, GQA or MLA, experts 48 or 32 wide, whose sizes Triton does not mark divisible
    by 16; GPT-OSS's sliding-window and full layers with sinks, its MXFP4 experts read packed with
    biases and the clamped SwiGLU;
    Llama-4's chunked and full layers; DeepSeek-V3.2's indexer and sparse MLA)
    records every launch's compile key. `aot_check --model config.json` compiles each of them,
    the integer and alignment marks included (not a generic variant of the same tiles), and the
    start-up warm-up (moe_serve/kernel_warmup.py, run on CUDA before serving) met each one first."""
    from moe_serve.kernels import specialization as sp

    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    path = extra_checkpoints[arch] if arch in ("gpt_oss_mxfp4", "llama4", "deepseek_v32") else checkpoints[arch]
    r = subprocess.run([sys.executable, "-c", ENGINE_RUN, path], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    launched, warmed = ([aot_check.job_from_launch(sp.Launch(k, tuple(map(tuple, a)), tuple(map(tuple, c)),
                                                             tuple(map(tuple, o))))
                         for k, a, c, o in out[name]] for name in ("launched", "warmed"))
    assert {j.kernel for j in launched} >= {sp.ATTN, sp.WRITE, sp.GEMM, sp.TOPK}
    if arch == "gpt_oss_mxfp4":  # both kinds of layer reached the kernel
        assert {j.constexprs["SLIDING"] for j in launched if j.kernel == sp.ATTN} == {True, False}
        assert all(j.constexprs["HAS_SINKS"] for j in launched if j.kernel == sp.ATTN)
        # the experts: packed MXFP4 bytes, biases on both GEMMs, the clamped SwiGLU on gate/up
        assert {(j.types["b_ptr"], j.constexprs["B_FP4"], j.constexprs["HAS_BIAS"], j.constexprs["ACT"],
                 j.constexprs["GATED"]) for j in launched if j.kernel == sp.GEMM} >= {
            ("*u8", True, True, 2, True), ("*u8", True, True, 0, False)}
    if arch == "llama4":
        assert {j.constexprs["CHUNKED"] for j in launched if j.kernel == sp.ATTN} == {True, False}
    if arch == "deepseek_v32":  # every attention launch is sparse, after the indexer's
        assert {j.constexprs["SPARSE"] for j in launched if j.kernel == sp.ATTN} == {True}
        assert sp.INDEX in {j.kernel for j in launched}
    model = aot_check.model_from_hf_config(os.path.join(path, "config.json"))
    jobs = {j.key(): j for j in aot_check.enumerate_jobs((model,), (torch.float32,), kv_cache_dtypes=(None,))}
    missing = [j for j in launched if j.key() not in jobs]
    assert not missing, [(j.describe(), j.marks) for j in missing]
    warmed_keys = {j.key() for j in warmed}
    cold = [j for j in launched if j.key() not in warmed_keys]
    assert not cold, [(j.describe(), j.marks) for j in cold]
    # The marks matter: the runtime specialises unit strides to the constant 1, and the expert width
    # (48 / 32 here) decides the GEMM's N mark.
    gemm = [j for j in launched if j.kernel == sp.GEMM]
    assert all(j.marks["stride_ak"] == "1" and j.marks["stride_bk"] == "1" for j in gemm)
    assert {j.marks["N"] for j in gemm if j.constexprs["GATED"]} == {"D" if model.F % 16 == 0 else ""}


def test_mxfp4_launches_compile_for_sm90_and_sm100():
    """The MXFP4 grouped GEMM (packed e2m1 tiles decoded in registers) as GPT-OSS-120B and
    DeepSeek-V4 launch it in bf16, each default and tuned config (gate/up with the model's activation
    and biases, down), and at the decode tile every activation with and without biases: all compile
    for sm_90 and sm_100 within --max-spill. The checkpoints' config.json say which models ship
    MXFP4 experts (aot_check --model)."""
    jobs = [j for j in _bf16_jobs() if j.constexprs.get("B_FP4")]
    decode = {(j.constexprs["GATED"], j.constexprs["ACT"], j.constexprs["HAS_BIAS"]) for j in jobs
              if aot_check.is_decode(j)}
    assert decode == {(True, a, b) for a in (0, 1, 2) for b in (False, True)} | {(False, 0, False), (False, 0, True)}
    for name, act, bias in (("gpt-oss-120b", 2, True), ("deepseek-v4", 1, False)):
        mine = [j for j in jobs if any(u.startswith("default") and ("clamped" if act == 2 else "limited") in u
                                       and ("bias" in u) == bias for u in j.users)]
        assert {j.constexprs["BLOCK_SIZE_M"] for j in mine} == {16, 32, 64}, name  # decode, middle, prefill
    rc, lines = run_aot("--arch", "90", "100", "--dtype", "bf16", "--kv-cache-dtype", "auto", "--only", "mxfp4",
                        timeout=600)
    m = LAST_LINE.match(lines[-1])
    assert m and rc == 0, [line for line in lines if "FAIL" in line or "SPILL" in line] or lines[-5:]
    assert (int(m.group(1)), m.group(2), m.group(3)) == (len(jobs), "sm_90, sm_100", "0"), lines[-5:]
    s = SPILL_LINE.match(lines[-3])
    assert s and s.group(2) == "0", lines[-4:]
    oks = [line for line in lines if line.lstrip().startswith("ok")]
    assert len(oks) == 2 * len(jobs) and all("B_FP4=1" in line for line in oks), oks
    assert {line.split()[1] for line in oks} == {"sm_90", "sm_100"}


PACKED = (aot_check.PACKED_GEMM, aot_check.PACKED_LINEAR, aot_check.INT8_QUANT)


def test_packed_launches_compile_for_sm90_and_sm100():
    """The packed int4 / int8 kernels as the Triton backends launch them (TritonExperts over
    PackedExperts, TritonLinear over packed layers; W8A8 through the kernels' own entry points and
    its int8 activation quantizer), their quick sets: the decode tiles of the grouped GEMM (int4 /
    int8 W*A16 and int8 W8A8, gate/up and down), of the linear layer (bias or not, W8A8) and the
    quantizer, in bf16 for sm_90 and sm_100 and in fp32 for sm_90, all within --max-spill.
    `aot_check --only packed` compiles every config, group size and dtype (none spills)."""
    from moe_serve.kernels import specialization as sp
    from moe_serve.kernels.grouped_gemm import TritonExperts
    from moe_serve.kernels.linear import TritonLinear

    jobs = [j for j in _bf16_jobs() if j.kernel in PACKED]
    # what the start-up warm-up launches for packed layers (moe_serve/kernel_warmup.py) is among them
    # (the backends on "cpu": the default configs, no device name to look tuned ones up by)
    m = next(m for m in aot_check.MODELS if m.name == "qwen3-30b-a3b")
    with sp.record() as warmed:
        for bits in (4, 8):
            TritonExperts("cpu").warm_up(aot_check._packed_moe_stand_in(m, torch.bfloat16, bits, 128),
                                          torch.bfloat16, 0)
            layer = aot_check._packed_linear_layer(2048, 7168, torch.bfloat16, bits, 32, True)
            TritonLinear("cpu").warm_up(layer, torch.bfloat16)
    warmed = [aot_check.job_from_launch(x) for x in warmed if x.kernel in PACKED]
    assert {j.kernel for j in warmed} == {aot_check.PACKED_GEMM, aot_check.PACKED_LINEAR}
    assert {j.key() for j in warmed} <= {j.key() for j in jobs}
    quick = aot_check.quick_jobs(jobs)
    gemm = {(j.constexprs["BITS"], j.constexprs["A_INT8"], j.constexprs["GATED"]) for j in quick
            if j.kernel == aot_check.PACKED_GEMM}
    assert gemm == {(b, a, g) for b, a in ((4, False), (8, False), (8, True)) for g in (False, True)}
    assert all(aot_check.is_decode(j) for j in quick if j.kernel != aot_check.INT8_QUANT)
    assert {j.kernel for j in quick} == set(PACKED)
    # as the other quick sets: bf16 for both, fp32 (the FMA product, its own tiles) for sm_90
    fp32 = [j for j in aot_check.enumerate_jobs(dtypes=(torch.float32,), kv_cache_dtypes=(None,)) if j.kernel in PACKED]
    shorts = {j.short for j in quick}
    for arch, n in (("90", len(quick) + len(aot_check.quick_jobs(fp32))), ("100", len(quick))):
        rc, lines = quick_run(arch)  # the suite's quick run of that arch (the packed kernels among its jobs)
        assert rc == 0, [line for line in lines if "FAIL" in line or "SPILL" in line] or lines[-5:]
        oks = [line for line in lines if line.lstrip().startswith("ok") and line.split()[3] in shorts]
        assert len(oks) == n and {line.split()[1] for line in oks} == {f"sm_{arch}"}, oks


def test_packed_launches_select_few_variants():
    """The packed launchers keep the variants few: expert batches of 1..4096 tokens record one
    variant per default config and GEMM, linear calls of 1..4096 rows one per row tile, and
    --batch-invariant's linear one for every M (the kernels record their compile keys instead of
    running)."""
    from moe_serve.kernels import specialization as sp
    from moe_serve.kernels.grouped_gemm import config as gcfg
    from moe_serve.kernels.grouped_gemm import triton_packed
    from moe_serve.kernels.grouped_gemm.triton_packed import fused_experts_packed_triton
    from moe_serve.kernels.packed_linear import packed_linear_triton
    from moe_serve.quantization.packed import quantize_reference

    if not triton_packed.INTERPRETED:
        pytest.skip("CPU tensors reach the launchers only under the interpreter")
    E, K, D, F = 8, 2, 64, 32
    w13, w2 = (quantize_reference(torch.zeros(E, r, c), 4, 32) for r, c in ((2 * F, D), (D, F)))
    with sp.record((sp.PACKED_GEMM, sp.TOPK)) as experts:
        for T in list(range(1, 40)) + [64, 100, 255, 256, 1000, 4096]:
            ids = torch.randint(-1, E, (T, K), generator=torch.Generator().manual_seed(T))
            fused_experts_packed_triton(torch.zeros(T, D), w13, w2, torch.rand(T, K), ids)
    assert len({x for x in experts if x.kernel == sp.PACKED_GEMM}) <= 2 * len(gcfg.DEFAULT_CONFIGS)
    w = quantize_reference(torch.zeros(48, 256), 8, 128)
    with sp.record((sp.PACKED_LINEAR,)) as linear:
        for M in list(range(1, 40)) + [64, 100, 255, 256, 1000, 4096]:
            packed_linear_triton(torch.zeros(M, 256), w)
    assert len(set(linear)) == 3
    # --batch-invariant's linear: one row tile whatever M, the 32-row variant, which its warm-up compiles
    from moe_serve.kernels.batch_invariant import InvariantTritonLinear
    from moe_serve.kernels.linear import TritonLinear

    layer = aot_check._packed_linear_layer(256, 512, torch.bfloat16, 4, 128, False)
    with sp.record((sp.PACKED_LINEAR,)) as invariant:
        InvariantTritonLinear("cpu").warm_up(layer, torch.bfloat16)
        for M in (1, 7, 300):
            InvariantTritonLinear("cpu").packed(layer, torch.empty(M, 512, dtype=torch.bfloat16, device="meta"))
    with sp.record((sp.PACKED_LINEAR,)) as tile32:
        TritonLinear("cpu").launch(layer, torch.bfloat16, 32)
    assert set(invariant) == set(tile32) and len(tile32) == 1


def test_fp8_kv_caches_enumerated_and_warmed_up():
    """--kv-cache-dtype fp8_e4m3 / fp8_e5m2: aot_check enumerates every attention, cache-write and
    indexer launch over both FP8 cache types too (each user of a launch over the activation dtype's
    cache has its two FP8 twins; test_every_configuration... compiles the FP8 quick sets), and
    TritonAttention.warm_up with cache_dtype (what moe_serve/kernel_warmup.py passes) launches each
    of those kernels over FP8 caches of that type, every launch among the enumerated (GQA with sinks
    and a sliding window, DSA's latent and index keys)."""
    from attention.backends import TritonAttention
    from moe_serve.kernels import specialization as sp

    jobs = _bf16_jobs()
    users = {(j.kv_fp8, u) for j in jobs if j.kernel in (sp.ATTN, sp.INDEX, sp.WRITE) for u in j.users}
    plain = {u for kv, u in users if kv is None}
    assert plain and all((kv, f"{u} kv={kv}") in users for u in plain for kv in aot_check.KV_FP8.values())
    keys = {j.key() for j in jobs}
    for m in (m for m in aot_check.MODELS if m.name in ("gpt-oss-120b", "deepseek-v3.2")):
        for kind in aot_check._attention_kinds(m):
            for fp8, kv in aot_check.KV_FP8.items():
                with sp.record() as launches:
                    TritonAttention("cuda").warm_up(aot_check._attention_layer(m, kind), m.N, torch.bfloat16,
                                                    aot_check.ENGINE_BLOCK_SIZE, 40, True, cache_dtype=fp8)
                cached = [aot_check.job_from_launch(x) for x in launches if x.kernel in (sp.ATTN, sp.WRITE, sp.INDEX)]
                assert {j.kernel for j in cached} == {sp.ATTN, sp.WRITE} | ({sp.INDEX} if m.dsa else set())
                assert all(j.kv_fp8 == kv for j in cached), [(j.describe(), j.types) for j in cached]
                assert all(j.key() in keys for j in cached)
