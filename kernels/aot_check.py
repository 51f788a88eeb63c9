"""Compile every Triton kernel configuration the engine can choose, ahead of time, for NVIDIA GPUs.

    python -m kernels.aot_check --arch 90 100      # sm_90 (H100/H200) and sm_100 (B200/GB200)
    python -m kernels.aot_check --only attn        # kernels or configurations whose name has "attn"
    python -m kernels.aot_check --list             # what would be compiled, without compiling
    python -m kernels.aot_check --quick --dtype bf16   # one per kernel / dtype / code path (the test suite's)

No GPU is needed: `triton.compile` takes an `ASTSource` and a `GPUTarget`, and Triton's bundled
ptxas turns the PTX into a cubin for the named architecture. What is compiled is what the launchers
can pick, taken from the same functions they call (`gemm_launch`, `topk_sum_launch`,
`attention_launch`, `reduce_launch`, `write_launch`):
  - grouped GEMM: each default config (decode / middle / prefill) and each entry of each tuned file
    in kernels/grouped_gemm/configs/, gated (gate/up) and ungated (down), for bf16, fp16 and fp32;
    the masked grouped GEMM (DeepEP's low-latency layout, kernels/grouped_gemm/masked.py) likewise;
  - top-k sum, KV / latent writes, paged attention (decode with and without split-K, prefill) and
    the split reduce, for the head and hidden shapes of the models in MODELS (plus --model files),
    in the dtypes each is served in (bf16 / fp16; fp32 too for the small fp32 test checkpoint and
    for --model files).
Identical configurations (same kernel, signature, constexprs, launch options) are compiled once.

Each line gives registers per thread and spill-store bytes (ptxas -v: the numbers a GPU later
reports as n_regs / n_spills) and the shared memory in the compiled kernel's metadata (`shared`);
a kernel needing more shared memory than the architecture has counts as failed, since it would
fail at its first launch. The last line is
    aot: N configurations compiled for sm_90, sm_100; F failed
where N counts configurations that compiled for every listed architecture and F those that failed
for at least one; the exit status is 1 if F > 0. A grouped-GEMM configuration (default or tuned) or
a decode configuration spilling more than --max-spill bytes per thread (64) on any architecture
counts as failed, named on a SPILL line; the line before the compile time counts every spilling
configuration and names the worst. Compiles run in a pool of --jobs processes, each
into a fresh Triton cache (so nothing is a cache hit).
"""
from __future__ import annotations

import os

if __name__ in ("__main__", "__mp_main__"):  # the command and its compile workers, not an importer
    # Compiled kernels, not the interpreter: @triton.jit reads this when the kernel modules load.
    os.environ.pop("TRITON_INTERPRET", None)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
import multiprocessing  # noqa: E402

import torch  # noqa: E402

DTYPE_SIG = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
DTYPES = tuple(DTYPE_SIG)
# Shared memory a block may use (the opt-in maximum): 227 KiB on both Hopper and Blackwell.
MAX_SHARED = {90: 232448, 100: 232448}
GEMM = "kernels.grouped_gemm.triton_kernel:_grouped_gemm_kernel"
TOPK = "kernels.grouped_gemm.triton_kernel:_topk_sum_kernel"
ATTN = "attention.backends.triton_paged:_paged_attn_kernel"
REDUCE = "attention.backends.triton_paged:_reduce_splits_kernel"
WRITE = "attention.backends.triton_paged:_write_rows_kernel"
FP8_LINEAR = "kernels.fp8_linear:_fp8_linear_kernel"
MASKED = "kernels.grouped_gemm.masked:_masked_gemm_kernel"
# Spill-store bytes per thread above which a grouped-GEMM or decode configuration fails the check
# (--max-spill): a few words spilled around the epilogue cost nothing measurable, a register file's
# worth of accumulator spilled in the main loop does.
DEFAULT_MAX_SPILL = 64
QUANT = "kernels.fp8_quant:_quant_kernel"


@dataclass(frozen=True)
class ModelShape:
    """What the kernel configurations depend on: hidden size D, top-k K, and the attention heads
    (GQA: N query heads over G kv heads of H (values Hv); MLA: N heads over a latent of L + R)."""
    name: str
    D: int
    K: int
    N: int
    G: int = 1
    H: int = 0
    Hv: int = 0
    L: int = 0
    R: int = 0
    # The engine serves a checkpoint in its own dtype (dtype="auto") or the one asked for. These
    # checkpoints are bf16, and half precision is the only sensible request at their size; fp32 is
    # what the small float32 test checkpoints are served in (see ModelConfig / parse_dtype).
    dtypes: tuple = (torch.bfloat16, torch.float16)
    sinks: bool = False  # GPT-OSS: attention sinks in every layer, sliding-window and full layers

    @property
    def mla(self) -> bool:
        return self.L > 0


MODELS = (
    ModelShape("qwen3-30b-a3b", D=2048, K=8, N=32, G=4, H=128, Hv=128),
    ModelShape("qwen3-235b-a22b", D=4096, K=8, N=64, G=4, H=128, Hv=128),
    ModelShape("mixtral-8x7b", D=4096, K=2, N=32, G=8, H=128, Hv=128),
    ModelShape("deepseek-v3", D=7168, K=8, N=128, L=512, R=64),
    ModelShape("deepseek-v2-lite", D=2048, K=6, N=16, L=512, R=64),
    ModelShape("gpt-oss-120b", D=2880, K=4, N=64, G=8, H=64, Hv=64, sinks=True),
    ModelShape("moe-tiny", D=64, K=2, N=4, G=2, H=16, Hv=16, dtypes=DTYPES),  # the built-in test checkpoint
)


def model_from_hf_config(path: str) -> ModelShape:
    """The shape of a Hugging Face config.json (Qwen3-MoE / Mixtral GQA, or DeepSeek MLA)."""
    with open(path) as f:
        hf = json.load(f)
    D, N = hf["hidden_size"], hf["num_attention_heads"]
    K = hf.get("num_experts_per_tok", 2)
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    dtypes = DTYPES  # whatever the file says, --model compiles every dtype
    if "kv_lora_rank" in hf:
        return ModelShape(name, D=D, K=K, N=N, L=hf["kv_lora_rank"], R=hf["qk_rope_head_dim"], dtypes=dtypes)
    H = hf.get("head_dim") or D // N
    return ModelShape(name, D=D, K=K, N=N, G=hf.get("num_key_value_heads", N), H=H, Hv=H, dtypes=dtypes,
                      sinks=hf.get("model_type") == "gpt_oss")


@dataclass
class Job:
    """One configuration: kernel ("module:function"), pointer/scalar types of its runtime arguments
    (anything else not constexpr is an i32), constexprs, launch options, the users that chose it."""
    kernel: str
    types: dict
    constexprs: dict
    options: dict
    users: list = field(default_factory=list)

    @property
    def short(self) -> str:
        return self.kernel.split(":")[1].strip("_").replace("_kernel", "")

    def key(self) -> tuple:
        return (self.kernel, tuple(sorted(self.types.items())), tuple(sorted(self.constexprs.items())),
                tuple(sorted(self.options.items())))

    @property
    def dtype(self) -> str:
        """The activation / cache dtype of this configuration (bf16, fp16 or fp32)."""
        for arg in ("a_ptr", "q_ptr", "y_ptr", "src_ptr", "out_ptr"):
            if arg in self.types:
                return self.types[arg].lstrip("*")
        return "?"

    def describe(self) -> str:
        hidden = {"UPCAST", "PREC"}
        cx = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.constexprs.items()
                      if k not in hidden)
        if "ids_ptr" in self.types:
            cx += f" ids={self.types['ids_ptr'].lstrip('*')}"
        return f"{self.short} {cx} w{self.options.get('num_warps', 4)} s{self.options.get('num_stages', 3)}"


def _split_options(launch: dict) -> tuple[dict, dict]:
    launch = dict(launch)
    options = {k: launch.pop(k) for k in ("num_warps", "num_stages") if k in launch}
    if "UPCAST" in launch:
        launch["UPCAST"] = False  # compiled code never upcasts (that is for the interpreter)
    return launch, options


def enumerate_jobs(models=MODELS, dtypes=DTYPES, inject_broken: bool = False, quick: bool = False) -> list[Job]:
    """Every configuration the launchers can choose for these models and dtypes, deduplicated; with
    quick, only `quick_jobs` of them."""
    from attention.backends import triton_paged as tp
    from kernels.grouped_gemm import config as gcfg
    from kernels.grouped_gemm import triton_kernel as tk

    jobs: dict[tuple, Job] = {}

    def add(kernel, types, launch, user):
        constexprs, options = _split_options(launch)
        job = Job(kernel, types, constexprs, options)
        jobs.setdefault(job.key(), job).users.append(user)

    # Each default config is named after the batches it serves (decode / middle / prefill).
    default_names = ("default decode", "default middle", "default prefill")
    gemm_cfgs = [(dt, cfg, name) for dt in dtypes for cfg, name in zip(gcfg.DEFAULT_CONFIGS, default_names)]
    gemm_cfgs += [(dt, cfg, "tuned") for dt, cfg in gcfg.tuned_configs() if dt in dtypes]
    if inject_broken:  # a config tl.dot cannot compile (K tile < 16): must be reported as failed
        gemm_cfgs.append((torch.bfloat16, {**gcfg.DECODE_CONFIG, "BLOCK_SIZE_K": 8}, "broken"))
        # and the decode gate/up tile before its K tile was capped (spills ~4.7 KB): over --max-spill
        add(GEMM, dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", weights_ptr="*fp32", sorted_ids_ptr="*i32",
                       expert_ids_ptr="*i32", num_padded_ptr="*i32", s_ptr="*fp32", as_ptr="*fp32"),
            {**tk.gemm_launch(gcfg.DECODE_CONFIG, torch.bfloat16, True), "BLOCK_SIZE_K": 128, "GATED": True,
             "MUL_WEIGHT": False}, "broken spilling w13 bf16")
    for dt, cfg, origin in gemm_cfgs:
        d = DTYPE_SIG[dt]
        types = dict(a_ptr=f"*{d}", b_ptr=f"*{d}", c_ptr=f"*{d}", weights_ptr="*fp32", sorted_ids_ptr="*i32",
                     expert_ids_ptr="*i32", num_padded_ptr="*i32", s_ptr="*fp32", as_ptr="*fp32")
        for gated in (True, False):
            add(GEMM, types, {**tk.gemm_launch(cfg, dt, gated), "GATED": gated, "MUL_WEIGHT": not gated},
                f"{origin} {'w13' if gated else 'w2'} {d}")
            if dt == torch.bfloat16 and origin != "broken":  # block-FP8 experts (weight-only), bf16 activations
                add(GEMM, {**types, "b_ptr": "*fp8e4nv"},
                    {**tk.fp8_gemm_launch(cfg, dt, (128, 128), gated), "GATED": gated, "MUL_WEIGHT": not gated},
                    f"{origin} {'w13' if gated else 'w2'} {d} fp8-weights")
                add(GEMM, {**types, "a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv"},
                    {**tk.w8a8_gemm_launch(cfg, dt, (128, 128), gated), "GATED": gated, "MUL_WEIGHT": not gated},
                    f"{origin} {'w13' if gated else 'w2'} {d} fp8-w8a8")

    # Masked grouped GEMM (DeepEP low-latency layout): the configs masked_config picks (the default
    # configs) and the tuned entries, gate/up and down, each dtype; block-FP8 weights with bf16.
    from kernels.grouped_gemm import masked

    for dt, cfg, origin in gemm_cfgs:
        if origin == "broken":
            continue
        d = DTYPE_SIG[dt]
        types = dict(a_ptr=f"*{d}", b_ptr=f"*{d}", c_ptr=f"*{d}", count_ptr="*i32", s_ptr="*fp32")
        for gated in (True, False):
            which = 'w13' if gated else 'w2'
            add(MASKED, types, masked.masked_launch(cfg, dt, None, gated), f"{origin} masked {which} {d}")
            if dt == torch.bfloat16:
                add(MASKED, {**types, "b_ptr": "*fp8e4nv"}, masked.masked_launch(cfg, dt, (128, 128), gated),
                    f"{origin} masked {which} {d} fp8-weights")

    if torch.bfloat16 in dtypes:  # block-FP8 dense layers (kernels/fp8_linear.py): each M bucket, bias or not
        from kernels import fp8_linear

        ltypes = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", b_ptr="*bf16", y_ptr="*bf16", xs_ptr="*fp32")
        for M in (1, 64, 4096):
            for bias in (False, True):
                for aq in (False, True):
                    add(FP8_LINEAR, {**ltypes, "x_ptr": "*fp8e4nv"} if aq else ltypes,
                        {**fp8_linear.fp8_linear_launch(M, torch.bfloat16, (128, 128), aq), "HAS_BIAS": bias},
                        f"fp8 linear{' decode' if M == 1 else ''} M={M} bias={int(bias)} {'w8a8' if aq else 'w8a16'} bf16")
        add(QUANT, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32"), dict(GROUP=128, FP8_MAX_C=448.0),
            "fp8 activation quant bf16")

    for m in models:
        for dt in (dt for dt in dtypes if dt in m.dtypes):
            d = DTYPE_SIG[dt]
            for ids in ("*i64", "*i32"):  # router ids are int64; remapped placements give int32
                add(TOPK, dict(y_ptr=f"*{d}", ids_ptr=ids, out_ptr=f"*{d}"), tk.topk_sum_launch(m.K, m.D),
                    f"{m.name} {d}")
            wtypes = dict(src_ptr=f"*{d}", cache_ptr=f"*{d}", slot_ptr="*i64")
            rows = [(1, m.L + m.R)] if m.mla else [(m.G, m.H), (m.G, m.Hv)]
            for R, C in rows:
                add(WRITE, wtypes, tp.write_launch(R, C), f"{m.name} {d}")
            QH, HD, HR, HV = (m.N, m.L, m.R, m.L) if m.mla else (m.N // m.G, m.H, 0, m.Hv)
            for decode, split_k in ((True, False), (True, True), (False, False)):
                out = "*fp32" if split_k else f"*{d}"
                types = dict(q_ptr=f"*{d}", qr_ptr=f"*{d}", k_ptr=f"*{d}", kr_ptr=f"*{d}", v_ptr=f"*{d}",
                             out_ptr=out, lse_ptr=out, sinks_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32",
                             query_start_ptr="*i32", scale_log2="fp32")
                for sliding in ((False, True) if m.sinks else (False,)):
                    launch = tp.attention_launch(decode, QH, HD, HR, HV, dt, m.mla, m.mla, split_k, sliding, m.sinks)
                    add(ATTN, types, launch, f"{m.name} {'decode' if decode else 'prefill'}"
                        f"{' split' if split_k else ''}{' sliding' if sliding else ''} {d}")
            add(REDUCE, dict(ws_ptr="*fp32", lse_ptr="*fp32", out_ptr=f"*{d}", sinks_ptr="*fp32"),
                tp.reduce_launch(HV, m.sinks), f"{m.name} {d}")
    return quick_jobs(list(jobs.values())) if quick else list(jobs.values())


def is_decode(job: Job) -> bool:
    """A configuration some decode step launches (the decode-default grouped GEMM tile, decode
    attention, the M=1 FP8 linear), by the users enumerate_jobs gave it."""
    return any("decode" in u for u in job.users)


def spill_checked(job: Job) -> bool:
    """Held to --max-spill: every grouped-GEMM configuration (default or tuned, plain or masked)
    and every decode configuration."""
    return job.kernel in (GEMM, MASKED) or is_decode(job)


def quick_jobs(jobs: list[Job]) -> list[Job]:
    """One configuration per kernel, dtype and code path (gate/up or down, split-K or not, MLA or
    GQA, the weight and activation types): the first enumerated, which is the decode default where
    the kernel has one (jobs are enumerated decode default first), plus every tuned entry. The
    default of `--quick`, what the test suite compiles on each change."""
    by_path: dict[tuple, Job] = {}
    for j in jobs:
        c = j.constexprs
        path = (j.kernel, j.dtype, j.types.get("a_ptr") or j.types.get("x_ptr"), j.types.get("b_ptr"), c.get("GATED"),
                c.get("SPLIT_K"), c.get("HAS_ROPE"))
        if j.kernel in (GEMM, MASKED) and any(u.startswith("tuned") for u in j.users):
            path += (j.key(),)  # every tuned entry
        by_path.setdefault(path, j)
    return list(by_path.values())


# ---- compiling (in worker processes) ---------------------------------------------------------------

_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas_usage(log: str) -> tuple[int, int] | None:
    regs, spills = _PTXAS_REGS.search(log), _PTXAS_SPILLS.search(log)
    if not regs:
        return None
    return int(regs.group(1)), int(spills.group(1)) if spills else 0


def _ptxas_rerun(ptx: str, arch: int) -> tuple[int, int]:
    """ptxas -v on the kernel's PTX: for Triton versions that cannot print the log of their own run."""
    import subprocess

    from triton.backends.nvidia import compiler as nv

    try:
        ptxas = nv.get_ptxas(arch).path
    except TypeError:  # older signature without the arch
        ptxas = nv.get_ptxas().path
    gpu = nv.sm_arch_from_capability(arch) if hasattr(nv, "sm_arch_from_capability") else f"sm_{arch}a"
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True, timeout=300)
    usage = _ptxas_usage(r.stderr + r.stdout)
    if usage is None:
        raise RuntimeError(f"ptxas -v printed no register count: {r.stderr[-500:]}")
    return usage


def compile_job(job: Job, arch: int) -> dict:
    """Compile one configuration for sm_<arch>; a record with regs, spills, shared, or the error."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import warnings

    # Triton 3.9 warns once per process that its FP-fusion default will change; the engine's launches
    # get the same default as these compiles, so it says nothing about this check.
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    t0 = time.perf_counter()
    rec = {"arch": arch, "ok": False}
    try:
        module, name = job.kernel.split(":")
        fn = getattr(importlib.import_module(module), name)
        signature, constexprs, attrs = {}, {}, {}
        for i, arg in enumerate(fn.arg_names):
            if arg in job.constexprs:
                signature[arg] = "constexpr"
                constexprs[(i,)] = job.constexprs[arg]
            elif arg in job.types:
                signature[arg] = job.types[arg]
                if job.types[arg].startswith("*"):
                    attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
            elif arg.endswith("_ptr"):
                raise TypeError(f"aot_check gives no type for pointer argument {arg!r} of {job.kernel}")
            else:
                signature[arg] = "i32"  # sizes and strides
        unknown = set(job.constexprs) - set(fn.arg_names)
        if unknown:
            raise TypeError(f"{job.kernel} has no arguments {sorted(unknown)}")
        knobs = getattr(triton, "knobs", None)
        if knobs is not None and hasattr(knobs.nvidia, "dump_ptxas_log"):
            knobs.nvidia.dump_ptxas_log = True  # ptxas -v of the real compile, printed to stdout
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                                    options=dict(job.options))
        usage = _ptxas_usage(log.getvalue()) or _ptxas_rerun(kernel.asm["ptx"], arch)
        rec.update(regs=usage[0], spills=usage[1], shared=int(kernel.metadata.shared))
        limit = MAX_SHARED.get(arch)
        if limit is not None and rec["shared"] > limit:
            raise RuntimeError(f"needs {rec['shared']} bytes of shared memory; sm_{arch} has {limit}")
        rec["ok"] = True
    except Exception as e:  # any failure to compile is a result, not a crash of the whole check
        # Triton's CompilationError quotes the source first and ends with the reason: keep both ends.
        msg = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        parts = msg if len(msg) <= 3 else [msg[0], "...", *msg[-2:]]
        rec["error"] = f"{type(e).__name__}: " + " | ".join(parts)[-600:]
    rec["seconds"] = time.perf_counter() - t0
    return rec


def _cost(job: Job) -> int:
    """Rough compile cost, to start the slow ones first."""
    c = job.constexprs
    tile = 1
    for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "BLOCK_Q", "BLOCK_QH", "BLOCK_N", "BLOCK_HD"):
        tile *= c.get(k, 1)
    return tile * job.options.get("num_warps", 4) * (2 if c.get("GATED") else 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.aot_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, nargs="+", default=[90, 100], help="CUDA compute capabilities")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compile processes")
    p.add_argument("--only", nargs="+", default=None,
                   help="only configurations whose kernel, description or user contains one of these")
    p.add_argument("--model", action="append", default=[], help="also a model's config.json (repeatable)")
    p.add_argument("--dtype", nargs="+", choices=[DTYPE_SIG[d] for d in DTYPES], default=None)
    p.add_argument("--inject-broken", action="store_true",
                   help="add a grouped-GEMM config that cannot compile and one that spills (tests that both "
                        "are caught)")
    p.add_argument("--list", action="store_true", help="print the configurations, compile nothing")
    p.add_argument("--quick", action="store_true",
                   help="one configuration per kernel, dtype and code path (decode defaults first) plus every "
                        "tuned grouped-GEMM entry: what the test suite compiles")
    p.add_argument("--max-spill", type=int, default=DEFAULT_MAX_SPILL, metavar="BYTES",
                   help="fail a grouped-GEMM or decode configuration spilling more than this many bytes per "
                        f"thread on any architecture (default {DEFAULT_MAX_SPILL}; -1: report only)")
    args = p.parse_args(argv)

    models = MODELS + tuple(model_from_hf_config(m) for m in args.model)
    dtypes = tuple(d for d in DTYPES if args.dtype is None or DTYPE_SIG[d] in args.dtype)
    jobs = enumerate_jobs(models, dtypes, args.inject_broken, args.quick)
    if args.only:
        jobs = [j for j in jobs if any(o in j.kernel or o in j.describe() or any(o in u for u in j.users)
                                       for o in args.only)]
    jobs.sort(key=_cost, reverse=True)
    archs = list(dict.fromkeys(args.arch))
    names = ", ".join(f"sm_{a}" for a in archs)
    if args.list:
        for j in jobs:
            print(f"{j.dtype:4s} {j.describe():92s} [{'; '.join(j.users[:3])}{' ...' if len(j.users) > 3 else ''}]")
        print(f"aot: {len(jobs)} configurations for {names} (listed, not compiled)")
        return 0

    import triton

    print(f"aot_check: triton {triton.__version__}, {len(jobs)} configurations x {names}, {args.jobs} processes",
          flush=True)
    t0 = time.time()
    cache = tempfile.mkdtemp(prefix="aot-triton-cache-")
    os.environ["TRITON_CACHE_DIR"] = cache  # inherited by the workers: every compile is a real one
    tasks = [(j, a) for j in jobs for a in archs]
    failed: dict[tuple, list] = {}
    spills: dict[tuple, tuple[int, int, Job]] = {}  # job key -> (worst spill bytes, its arch, job)
    try:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=ctx) as pool:
            futures = [pool.submit(compile_job, j, a) for j, a in tasks]
            for (job, arch), fut in zip(tasks, futures):
                try:
                    rec = fut.result()
                except Exception as e:  # a worker died (e.g. a crash inside the compiler)
                    rec = {"arch": arch, "ok": False, "error": f"{type(e).__name__}: {e}", "seconds": 0.0}
                head = f"sm_{arch:<3d} {job.dtype:4s} {job.describe():92s}"
                if rec["ok"]:
                    print(f"  ok   {head} regs {rec['regs']:3d}  spills {rec['spills']:5d} B  "
                          f"shared {rec['shared']:6d} B  {rec['seconds']:5.1f} s", flush=True)
                    if rec["spills"] > spills.get(job.key(), (0,))[0]:
                        spills[job.key()] = (rec["spills"], arch, job)
                else:
                    failed.setdefault(job.key(), []).append(arch)
                    print(f"  FAIL {head} {rec['error']}  [used by: {'; '.join(job.users[:4])}]", flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    over = []
    for key, (b, arch, job) in sorted(spills.items(), key=lambda kv: -kv[1][0]):
        if args.max_spill >= 0 and b > args.max_spill and spill_checked(job) and key not in failed:
            over.append(key)
            print(f"  SPILL sm_{arch:<3d} {job.dtype:4s} {job.describe()} spills {b} B > --max-spill "
                  f"{args.max_spill} B  [used by: {'; '.join(job.users[:4])}]", flush=True)
    worst = max(spills.values(), key=lambda v: v[0], default=None)
    print(f"aot: {len(spills)} configurations spill registers" + (
        f" (most: {worst[0]} B on sm_{worst[1]}, {worst[2].describe()})" if worst else "")
        + f"; {len(over)} grouped-GEMM or decode configurations over {args.max_spill} B", flush=True)
    for key in over:
        failed.setdefault(key, [])
    n_ok = len(jobs) - len(failed)
    print(f"aot_check: {len(tasks)} compiles in {time.time() - t0:.0f} s", flush=True)
    print(f"aot: {n_ok} configurations compiled for {names}; {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
