"""kernels/aot_check.py compiles kernel configurations for sm_90 / sm_100 without a GPU (here the
--quick set: one per kernel, dtype and code path, decode defaults first; the full sweep of every
configuration is `python -m kernels.aot_check --arch 90 100`, a few minutes), and the decode
attention's launch choice selects only a few compiled variants whatever the batch.

The compile runs use Triton's bundled ptxas in a subprocess (no TRITON_INTERPRET there); the
variant-count test is pure Python over the launchers' choice functions.
"""
import inspect
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import aot_check

ROOT = Path(__file__).resolve().parents[2]
LAST_LINE = re.compile(r"^aot: (\d+) configurations compiled for (.+); (\d+) failed$")
SPILL_LINE = re.compile(r"^aot: (\d+) configurations spill registers.*; (\d+) grouped-GEMM or decode configurations "
                        r"over (\d+) B$")


def run_aot(*args: str, timeout: int) -> tuple[int, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "kernels.aot_check", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    lines = r.stdout.strip().splitlines()
    assert lines, r.stderr[-3000:]
    return r.returncode, lines


def test_a_broken_config_is_reported_as_failed():
    """The check can fail: a config tl.dot cannot compile is counted, named, and exits 1, and so is
    the decode gate/up tile as it was before its K tile was capped (it compiles, spilling ~4.7 KB
    per thread), while the working configurations compiled in the same run still count as compiled."""
    rc, lines = run_aot("--arch", "90", "--dtype", "bf16", "--only", "broken", "moe-tiny decode",
                        "--inject-broken", timeout=600)
    m = LAST_LINE.match(lines[-1])
    assert m, lines[-5:]
    # w13 and w2 variants of the K tile 8, and the spilling one
    assert rc == 1 and m.group(2) == "sm_90" and m.group(3) == "3", lines[-5:]
    assert int(m.group(1)) >= 2  # moe-tiny decode attention, with and without split
    fails = [line for line in lines if line.lstrip().startswith("FAIL")]
    assert len(fails) == 2 and all("BLOCK_SIZE_K=8" in f for f in fails), fails
    spilled = [line for line in lines if line.lstrip().startswith("SPILL")]
    assert len(spilled) == 1 and "BLOCK_SIZE_K=128" in spilled[0] and "GATED=1" in spilled[0], spilled
    assert int(re.search(r"spills (\d+) B >", spilled[0]).group(1)) > 1000
    s = SPILL_LINE.match(lines[-3])
    assert s and int(s.group(1)) >= 1 and s.group(2) == "1" and s.group(3) == "64", lines[-4:]
    oks = [line for line in lines if line.lstrip().startswith("ok")]
    assert oks and all(re.search(r"regs +\d+ +spills +\d+ B +shared +\d+ B", line) for line in oks), oks


@pytest.mark.slow
def test_default_configurations_compile_for_sm90_and_sm100_without_spills():
    """The --quick set in bf16 (the dtype the real models are served in): the decode default of the
    grouped GEMM (gate/up and down; bf16, FP8 weights, W8A8) and of the masked GEMM, GQA and MLA
    decode attention with and without split-K, the split reduce, KV writes, top-k sum, the FP8
    linear and activation quantization. Every one compiles for both archs, and none of the
    grouped-GEMM or decode ones spills more than --max-spill."""
    jobs = aot_check.enumerate_jobs(dtypes=(torch.bfloat16,), quick=True)
    short = {(j.short, j.constexprs.get("GATED"), j.constexprs.get("SPLIT_K"), j.constexprs.get("HAS_ROPE"))
             for j in jobs}
    for path in (("grouped_gemm", True, None, None), ("grouped_gemm", False, None, None), ("masked_gemm", True, None,
                 None), ("paged_attn", None, True, True), ("paged_attn", None, False, True),
                 ("paged_attn", None, True, False), ("reduce_splits", None, None, None)):
        assert path in short, path
    assert all(aot_check.is_decode(j) for j in jobs if j.kernel in (aot_check.GEMM, aot_check.MASKED, aot_check.ATTN))
    rc, lines = run_aot("--arch", "90", "100", "--quick", "--dtype", "bf16", timeout=600)
    m = LAST_LINE.match(lines[-1])
    assert m, lines[-10:]
    assert rc == 0, [line for line in lines if "FAIL" in line or "SPILL" in line]
    assert (int(m.group(1)), m.group(2), m.group(3)) == (len(jobs), "sm_90, sm_100", "0")
    s = SPILL_LINE.match(lines[-3])
    assert s and s.group(2) == "0", lines[-4:]


# ---- no JIT recompiles during serving ----------------------------------------------------------------

def _compiled_variants() -> set:
    return {(j.kernel, tuple(sorted(j.constexprs.items())), tuple(sorted(j.options.items())))
            for j in aot_check.enumerate_jobs(dtypes=(torch.bfloat16,))}


def _variant(kernel: str, launch: dict) -> tuple:
    constexprs, options = aot_check._split_options(launch)
    return kernel, tuple(sorted(constexprs.items())), tuple(sorted(options.items()))


# Variants of the attention kernel one model and dtype can use during decode: split-K or not.
MAX_DECODE_VARIANTS = 2


def test_decode_launch_choice_has_few_variants_all_compiled_ahead():
    """Over mixed context lengths 1..32k and batch sizes 1..256, on H200 and B200 SM counts, the split
    count varies widely but stays a runtime argument: per model the attention kernel has at most
    MAX_DECODE_VARIANTS constexpr combinations, the reduce kernel one, and aot_check compiles each."""
    from attention.backends import triton_paged as tp

    compiled = _compiled_variants()
    rng = random.Random(0)
    batches = [1, 2, 3, 4, 7, 8, 16, 31, 32, 64, 100, 128, 200, 256]
    for m in aot_check.MODELS:
        QH, HD, HR, HV = (m.N, m.L, m.R, m.L) if m.mla else (m.N // m.G, m.H, 0, m.Hv)
        tile = tp.attention_launch(True, QH, HD, HR, HV, torch.bfloat16, m.mla, m.mla, False)
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
                                                 False, m.sinks)
                    attn_variants.add(_variant(aot_check.ATTN, launch))
                    if S > 1:
                        reduce_variants.add(_variant(aot_check.REDUCE, tp.reduce_launch(HV, m.sinks)))
        prefill = _variant(aot_check.ATTN, tp.attention_launch(False, QH, HD, HR, HV, torch.bfloat16, m.mla, m.mla,
                                                               False, False, m.sinks))
        assert len(attn_variants) <= MAX_DECODE_VARIANTS and len(reduce_variants) <= 1, m.name
        assert attn_variants | reduce_variants | {prefill} <= compiled, m.name
        if m.name == "qwen3-30b-a3b":
            assert len(splits) >= 8  # the split count does vary: it is the runtime argument now


class _Recorder:
    """Stands in for a @triton.jit kernel: records each launch's arguments and runs nothing."""

    def __init__(self, kernel):
        self.names = list(inspect.signature(getattr(kernel, "fn", kernel)).parameters)
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((dict(zip(self.names, args)), kwargs))
        return launch


def _do_not_specialize(kernel) -> tuple:
    """The do_not_specialize list a kernel was decorated with (compiled or interpreted)."""
    if hasattr(kernel, "kwargs"):  # InterpretedFunction keeps the decorator's arguments
        return tuple(kernel.kwargs.get("do_not_specialize") or ())
    return tuple(kernel.do_not_specialize or ())


def _compile_keys(launches: list, unspecialised) -> set:
    """What selects a compiled variant, by Triton's rules: the constexprs and launch options, and for
    each specialised integer argument whether it is 1 and whether it is divisible by 16."""
    keys = set()
    for args, kwargs in launches:
        ints = tuple((n, v == 1, v % 16 == 0) for n, v in args.items()
                     if isinstance(v, int) and not isinstance(v, bool) and n not in unspecialised)
        keys.add((tuple(sorted(kwargs.items())), ints))
    return keys


def test_serving_sweep_launches_few_compiled_variants(monkeypatch):
    """The launchers themselves, over decode batches of mixed contexts (1..32k, batch 1..256, split
    counts as on a 132-SM H200) and mixed prefill chunks: the kernels record their arguments
    instead of running, and the compile keys Triton would derive stay few."""
    from attention.backends import triton_paged as tp
    from attention.metadata import AttentionMetadata
    from kernels.grouped_gemm import config as gcfg
    from kernels.grouped_gemm import triton_kernel as tk

    if not tp.INTERPRETED:
        pytest.skip("CPU tensors reach the launchers only under the interpreter")
    # The kernels are decorated with the argument lists this test treats as unspecialised.
    for kernel, names in ((tp._paged_attn_kernel, tp._PER_STEP_ATTN_ARGS), (tp._reduce_splits_kernel,
                          tp._PER_STEP_REDUCE_ARGS), (tk._grouped_gemm_kernel, ("num_pairs",))):
        assert set(_do_not_specialize(kernel)) == set(names)
    attn, red = _Recorder(tp._paged_attn_kernel), _Recorder(tp._reduce_splits_kernel)
    monkeypatch.setattr(tp, "_paged_attn_kernel", attn)
    monkeypatch.setattr(tp, "_reduce_splits_kernel", red)
    monkeypatch.setattr(tp, "_device_sms", lambda device: 132)
    rng = random.Random(1)
    bs, N, G, H, L, R = 16, 8, 2, 16, 32, 16
    kc = torch.zeros(4, bs, G, H)
    lat = torch.zeros(4, bs, L + R)

    def meta(q_lens, ctx_lens):
        return AttentionMetadata.build(q_lens, ctx_lens, [[0] * -(-c // bs) for c in ctx_lens], bs)

    splits = set()
    for B in (1, 2, 3, 8, 33, 64, 128, 256):
        for _ in range(4):
            ctx = [rng.choice([rng.randint(1, 300), rng.randint(1, 32768)]) for _ in range(B)]
            m = meta([1] * B, ctx)
            tp.paged_attention(torch.zeros(B, N, H), kc, kc, m, 1.0)
            tp.mla_paged_attention(torch.zeros(B, N, L), torch.zeros(B, N, R), lat, m, 1.0)
            splits.add(attn.launches[-1][0]["num_splits"])
    decode_launches = len(attn.launches)
    for _ in range(12):  # prefill / chunked prefill with decodes mixed in
        q = [rng.randint(2, 200)] + [rng.choice([1, rng.randint(1, 200)]) for _ in range(rng.randint(0, 5))]
        ctx = [ql + rng.choice([0, rng.randint(0, 5000)]) for ql in q]
        tp.paged_attention(torch.zeros(sum(q), N, H), kc, kc, meta(q, ctx), 1.0)
        tp.mla_paged_attention(torch.zeros(sum(q), N, L), torch.zeros(sum(q), N, R), lat, meta(q, ctx), 1.0)
    assert len(splits) >= 4  # the split count does vary with the batch...
    decode, prefill = attn.launches[:decode_launches], attn.launches[decode_launches:]
    # ...but decode compiles 2 variants per attention kind (GQA, MLA: split or not), the reduce 1 per
    # kind, and prefill 1 per kind.
    assert len(_compile_keys(decode, tp._PER_STEP_ATTN_ARGS)) <= 2 * MAX_DECODE_VARIANTS
    assert len(_compile_keys(red.launches, tp._PER_STEP_REDUCE_ARGS)) <= 2
    assert len(_compile_keys(prefill, tp._PER_STEP_ATTN_ARGS)) <= 2

    gemm, topk = _Recorder(tk._grouped_gemm_kernel), _Recorder(tk._topk_sum_kernel)
    monkeypatch.setattr(tk, "_grouped_gemm_kernel", gemm)
    monkeypatch.setattr(tk, "_topk_sum_kernel", topk)
    E, K, D, F = 8, 2, 32, 16
    w13, w2 = torch.zeros(E, 2 * F, D), torch.zeros(E, D, F)
    for T in list(range(1, 40)) + [64, 100, 255, 256, 1000, 4096]:
        ids = torch.randint(-1, E, (T, K), generator=torch.Generator().manual_seed(T))
        tk.fused_experts_triton(torch.zeros(T, D), w13, w2, torch.rand(T, K), ids)
    # One variant per default config and GEMM (gate/up, down); one top-k sum.
    assert len(_compile_keys(gemm.launches, ("num_pairs",))) <= 2 * len(gcfg.DEFAULT_CONFIGS)
    assert len(_compile_keys(topk.launches, ())) == 1
