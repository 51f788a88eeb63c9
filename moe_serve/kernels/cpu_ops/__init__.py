"""Our C kernels for the CPU, compiled on first use for the processor at hand.

- `moe.c`: a layer's routed experts in one call: decode-sized batches (weights streamed once), and
  prefill-sized ones over float32 weights (an outer-product micro-kernel; see its header for why);
- `attention.c`: paged attention reading keys and values in place from the cache: decodes, and
  the causal query chunks of prefills; float32 or FP8 caches (`fp8.h`: e4m3fn / e5m2 bytes widened
  exactly in registers, written as torch's clamp-then-cast);
- `norm.c`: RMSNorm, optionally fused with the residual add before it; q/k per-head RMSNorm
  and RoPE in one pass;
- `gated_delta.c`: a Gated DeltaNet layer's decode step (the short convolution and the gated
  delta rule), every state read and written once in place in its slot.
- `quant.c`: linear layers and experts over int4/int8 packed weights
  (`moe_serve.quantization.packed.PackedWeight`: per-group scales and offsets): decode-sized calls
  with the codes widened in registers, prefill-sized ones by the panel GEMM over weight blocks
  widened from the codes; its wrappers are `cpu_ops/quant.py`;
- `replay.c`: a CPU decode graph's recorded kernel calls run from C, a run of them a ctypes call
  (moe_serve/cpu_graph.py).

What moe.c and quant.c share is in two headers: `panel.h`, the panel GEMM (the outer-product
micro-kernel over packed activation panels, for weights read in place or widened a block of rows at
a time) and `common.h` (scratch memory, the threads' row blocks, SiLU-and-mul, routed pairs sorted by
expert).

They are written once over vec.h's 16-lane vectors, whose implementation the build picks for the
target: AVX-512, AVX2 + FMA, NEON (aarch64), or plain C anywhere else; bf16 weights stay bf16 in
memory and are widened in registers. They are built with the system C compiler (`$CC`, else `cc`)
at `-O3 -march=native -fopenmp`, each source in a process of its own (as many as there are cores), into one library in a cache directory
(`$MOE_SERVE_CACHE`, else `~/.cache/moe-serve`), keyed by the sources, the flags, the compiler and
this CPU's feature flags, so a second start loads it in milliseconds; a build takes a few seconds.
They are called through ctypes with the tensors' data pointers (a few microseconds per call), with
no torch headers to compile against. `status()` names the ISA built ("isa").

`MOE_SERVE_CPU_ISA` picks another build target than the CPU at hand (for tests and comparisons):
`avx2` (`-march=x86-64-v3`), `generic` (the plain-C path, `-march=x86-64` on x86), `avx512`, `neon`,
or `native` (the default); one this CPU cannot execute is refused. `load_variant(isa)` builds and
loads such a variant as a library of its own, leaving the process's default alone.

Where no compiler is found, or the build fails, `available()` is False, the reason is logged once,
and moe_serve/platform.py picks the torch backends instead. `MOE_SERVE_CPU_OPS=0` turns the
kernels off (for comparisons); the "torch" backends never call them.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from moe_serve.kernels import cpu_gemm

log = logging.getLogger("moe_serve.cpu_ops")

_SRCS = sorted(Path(__file__).parent.glob("*.c"))  # attention.c, gated_delta.c, moe.c, norm.c, quant.c: one library
_HDRS = sorted(Path(__file__).parent.glob("*.h"))
_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")  # and the target's (`target_flags`)

# vec.h's implementations, widest first.
ISAS = ("avx512", "avx2", "neon", "generic")


def cache_dir() -> Path:
    root = os.environ.get("MOE_SERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "moe-serve")
    return Path(root) / "cpu_ops"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return os.uname().machine


def _arch() -> str:
    m = os.uname().machine.lower()
    if m in ("x86_64", "amd64", "x64"):
        return "x86_64"
    if m in ("aarch64", "arm64"):
        return "aarch64"
    return m


def runnable_isas() -> list[str]:
    """The ISAs of vec.h this CPU executes, widest first (the first is what `native` builds):
    avx512 (AVX-512 F, BW and VL), avx2 (AVX2 and FMA), neon (aarch64), and always generic."""
    arch = _arch()
    if arch == "aarch64":
        return ["neon", "generic"]
    if arch != "x86_64":
        return ["generic"]
    flags = set(_cpu_flags().split(":", 1)[-1].split())
    out = []
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        out.append("avx512")
    if {"avx2", "fma"} <= flags:
        out.append("avx2")
    return out + ["generic"]


def native_isa() -> str:
    """The ISA a `-march=native` build of vec.h picks on this CPU."""
    return runnable_isas()[0]


def target_flags(isa: str = "native") -> tuple[str, ...]:
    """The compiler's target flags for a build of `isa` ("native" or one of ISAS): the CPU at hand's
    own (`-march=native`) for its widest ISA, a baseline of that ISA otherwise."""
    arch = _arch()
    if isa not in ("native", *ISAS):
        raise ValueError(f"unknown ISA {isa!r}: one of native, {', '.join(ISAS)}")
    if isa in ("native", native_isa()):
        march = ("-march=native",) if arch in ("x86_64", "aarch64") else ()
        return march + (("-DCPU_OPS_GENERIC",) if native_isa() == "generic" else ())
    if isa == "generic":
        base = {"x86_64": ("-march=x86-64",), "aarch64": ("-march=armv8-a",)}.get(arch, ())
        return base + ("-DCPU_OPS_GENERIC",)
    return {"avx512": ("-march=x86-64-v4",), "avx2": ("-march=x86-64-v3",), "neon": ("-march=armv8-a",)}[isa]


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or shutil.which("gcc") or shutil.which("clang")


def _build(cc: str, target: tuple[str, ...] = ("-march=native",)) -> Path:
    flags = (*_FLAGS, *target)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([*(p.read_text() for p in _SRCS + _HDRS), " ".join(flags), cc, version,
                                     _cpu_flags()]).encode())
    out = cache_dir() / f"cpu_ops-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # Built under a unique name, then renamed: ranks starting together never load a half-written file.
    # Each source compiles in a process of its own (as many at once as there are cores), then one link.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    objs = tempfile.mkdtemp(dir=out.parent)
    try:
        compile_flags = [f for f in flags if f != "-shared"]
        jobs = [(src, os.path.join(objs, src.stem + ".o")) for src in _SRCS]
        running: list[tuple[Path, subprocess.Popen]] = []
        for i, (src, obj) in enumerate(jobs):
            running.append((src, subprocess.Popen([cc, *compile_flags, "-c", "-o", obj, str(src)],
                                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
            if len(running) >= (os.cpu_count() or 1) or i == len(jobs) - 1:
                errors = [(name, proc.communicate(timeout=300)[1], proc.returncode) for name, proc in running]
                running = []
                for name, err, rc in errors:
                    if rc:
                        raise RuntimeError(f"{cc} {' '.join(target)} failed on {name.name}: {err.strip()[-2000:]}")
        res = subprocess.run([cc, *flags, "-o", tmp, *(obj for _, obj in jobs), "-lm"], capture_output=True,
                             text=True, timeout=300)
        if res.returncode:
            raise RuntimeError(f"{cc} {' '.join(target)} failed: {res.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        shutil.rmtree(objs, ignore_errors=True)
    log.info("cpu_ops: compiled %s (%s) in %.1f s -> %s", " ".join(p.name for p in _SRCS), " ".join(target),
             time.perf_counter() - t0, out)
    return out


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set the entry points' signatures on a loaded library; returns it."""
    lib.cpu_ops_isa.restype = ctypes.c_char_p
    lib.cpu_ops_isa.argtypes = []
    lib.cpu_ops_replay_sig.restype = ctypes.c_int64
    lib.cpu_ops_replay_sig.argtypes = [ctypes.c_char_p]
    lib.cpu_ops_replay_call_bytes.restype = ctypes.c_int64
    lib.cpu_ops_replay_call_bytes.argtypes = []
    lib.cpu_ops_replay.restype = ctypes.c_int64
    lib.cpu_ops_replay.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.cpu_ops_vectorized.restype = ctypes.c_int
    f = lib.moe_experts_f32
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                  ctypes.c_int]
    lib.moe_panel_groups_run.restype = ctypes.c_int64
    lib.moe_experts_by_thread_run.restype = ctypes.c_int64
    f = lib.decode_attention_f32
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                  ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 6, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    f = lib.prefill_attention_f32
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                  ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 2, ctypes.c_void_p, *[ctypes.c_int64] * 5,
                  ctypes.c_float, ctypes.c_int, ctypes.c_int]
    f = lib.linear_panels_f32
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                  ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    f = lib.moe_experts_pairs_f32
    f.restype = ctypes.c_int
    f.argtypes = lib.moe_experts_f32.argtypes
    f = lib.linear_invariant_f32
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                  ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    f = lib.linear_f32
    f.restype = None
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                  ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    f = lib.mark_slots_i32
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    f = lib.write_kv_f32
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_void_p] * 3,
                  *[ctypes.c_int64] * 4, ctypes.c_int]
    f = lib.topk_softmax_f32
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    f = lib.norm_rope_f32
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 4, ctypes.c_void_p, ctypes.c_float, ctypes.c_int64,
                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    f = lib.rms_norm_f32
    f.restype = None
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                  ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int]
    f = lib.gated_delta_step_f32
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_void_p] * 6,
                  *[ctypes.c_int64] * 4, ctypes.c_float, ctypes.c_int, ctypes.c_float, ctypes.c_int]
    f = lib.conv_step_f32
    f.restype = None
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_void_p] * 6, *[ctypes.c_int64] * 3, ctypes.c_int,
                  ctypes.c_int]
    return lib


def _load(isa: str) -> tuple[ctypes.CDLL, str]:
    """Build (or find in the cache) and load the library for `isa` ("native" or one of ISAS); the
    bound library and the ISA vec.h chose in it. Raises ValueError for an ISA this CPU cannot
    execute, RuntimeError without a compiler, OSError / RuntimeError / SubprocessError when the
    build or the load fails."""
    if isa != "native" and isa not in runnable_isas():
        if isa not in ISAS:
            raise ValueError(f"unknown ISA {isa!r}: one of native, {', '.join(ISAS)}")
        raise ValueError(f"this CPU cannot execute {isa} code (it runs {', '.join(runnable_isas())})")
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found ($CC, cc, gcc, clang)")
    lib = _bind(ctypes.CDLL(str(_build(cc, target_flags(isa)))))
    return lib, lib.cpu_ops_isa().decode()


@functools.lru_cache(maxsize=None)
def load_variant(isa: str) -> ctypes.CDLL:
    """The kernels built for `isa` ("native" or one of ISAS this CPU executes) as a library of their
    own, bound like the default one (the module's functions run on it when `_lib` returns it; the
    tests swap it in). The process-wide default (`_lib`, `status`) is left alone. Raises where the
    variant cannot be had (see `_load`)."""
    lib, got = _load(isa)
    if isa != "native" and got != isa:
        raise RuntimeError(f"a build for {isa} ({' '.join(target_flags(isa))}) chose vec.h's {got} path")
    return lib


# Why the kernels are or are not available, the library's path and the ISA built: set by _lib.
_STATUS = {"reason": "not loaded yet", "path": None, "isa": None}


def status() -> dict:
    """{"available", "reason", "path", "sources", "compiler", "isa"}: whether the C kernels run here and
    why, and the ISA of vec.h built (`moe-serve env` prints it). Builds them on first call, as
    `available()` does."""
    ok = _lib() is not None
    return {"available": ok, "reason": _STATUS["reason"], "path": _STATUS["path"],
            "sources": [p.name for p in _SRCS], "compiler": _compiler(), "isa": _STATUS["isa"] if ok else None}


# While a decode graph records a forward on this thread (moe_serve/cpu_graph.py), the library as
# the wrappers get it there: every call recorded, then made.
_recording = threading.local()


def _lib():
    """The loaded library (None where the kernels are unavailable); while a CPU graph records on
    this thread, its recording view of it."""
    rec = getattr(_recording, "lib", None)
    return rec if rec is not None else _loaded_lib()


@functools.lru_cache(maxsize=None)
def _loaded_lib() -> ctypes.CDLL | None:
    if os.environ.get("MOE_SERVE_CPU_OPS", "1") == "0":
        _STATUS["reason"] = "off (MOE_SERVE_CPU_OPS=0)"
        log.info("cpu_ops: off (MOE_SERVE_CPU_OPS=0); the CPU runs torch ops only")
        return None
    cc = _compiler()
    if cc is None:
        _STATUS["reason"] = "no C compiler found ($CC, cc, gcc, clang)"
        log.warning("cpu_ops: no C compiler found ($CC, cc, gcc, clang); the CPU runs torch ops only (slower)")
        return None
    want = os.environ.get("MOE_SERVE_CPU_ISA", "").strip().lower() or "native"
    try:
        lib, isa = _load(want)
    except ValueError as e:
        _STATUS["reason"] = f"MOE_SERVE_CPU_ISA={want}: {e}"
        log.warning("cpu_ops: MOE_SERVE_CPU_ISA=%s: %s; the CPU runs torch ops only", want, e)
        return None
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _STATUS["reason"] = f"the build failed: {e}"[:500]
        log.warning("cpu_ops: could not build the CPU kernels (%s); the CPU runs torch ops only (slower)", e)
        return None
    _STATUS["path"] = lib._name
    _STATUS["isa"] = isa
    if want == "native":
        _STATUS["reason"] = f"built with {os.path.basename(cc)} for this CPU ({isa})"
    else:
        _STATUS["reason"] = (f"built with {os.path.basename(cc)} for {isa} (MOE_SERVE_CPU_ISA={want}; this CPU's "
                             f"widest: {native_isa()})")
    log.info("cpu_ops: %s", _STATUS["reason"])
    return lib


def available() -> bool:
    """Whether the C kernels built and loaded here (the first call builds them)."""
    return _lib() is not None


def _rows(t: torch.Tensor) -> int | None:
    """The row stride of t seen as (rows, last dim) with contiguous rows, or None."""
    if t.stride(-1) != 1:
        return None
    if t.dim() == 2:
        return t.stride(0)
    return t.shape[-1] if t.is_contiguous() else None


def rms_norm_fits(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    return (x.is_cpu and x.dtype == torch.float32 and w.dtype == torch.float32 and w.is_contiguous()
            and x.dim() >= 2 and x.shape[-1] == w.shape[0] and _rows(x) is not None
            and (residual is None or (residual.shape == x.shape and residual.dtype == torch.float32
                                      and _rows(residual) is not None))
            and available())


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x * rsqrt(mean(x^2) + eps) * w over the last dim; with residual, h = x + residual is normed and
    (h, norm(h)) returned. Check rms_norm_fits first."""
    D = x.shape[-1]
    T = x.numel() // D if D else 0
    out = torch.empty(x.shape, dtype=torch.float32)
    h = torch.empty(x.shape, dtype=torch.float32) if residual is not None else None
    _lib().rms_norm_f32(x.data_ptr(), _rows(x), residual.data_ptr() if residual is not None else None,
                        _rows(residual) if residual is not None else 0, h.data_ptr() if h is not None else None,
                        w.data_ptr(), out.data_ptr(), T, D, eps, torch.get_num_threads())
    return out if residual is None else (h, out)


def norm_rope_fits(x_THD: torch.Tensor, rot: int, cos_PR: torch.Tensor, w: torch.Tensor | None = None) -> bool:
    """float32 CPU (T, heads, hd) with heads contiguous in each token's row, hd <= 1024, an even
    rotary dim rot <= hd, float32 contiguous (P, rot) tables, a float32 (hd,) norm weight if any."""
    return (x_THD.is_cpu and x_THD.dtype == torch.float32 and x_THD.dim() == 3
            and x_THD.stride(2) == 1 and x_THD.stride(1) == x_THD.shape[2] and x_THD.shape[2] <= 1024
            and rot % 2 == 0 and 0 < rot <= x_THD.shape[2] and cos_PR.dtype == torch.float32
            and cos_PR.is_contiguous() and cos_PR.dim() == 2 and cos_PR.shape[1] == rot
            and (w is None or (w.dtype == torch.float32 and w.is_contiguous() and w.shape == (x_THD.shape[2],)))
            and available())


def norm_rope(x_THD: torch.Tensor, cos_PR: torch.Tensor, sin_PR: torch.Tensor, positions_T: torch.Tensor,
              w: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """RoPE (rotate_half form, the sign in sin_PR) over the first rot = cos_PR.shape[1] channels of
    each head at the given positions, after a per-head RMSNorm with weight w if given; a new
    contiguous float32 (T, heads, hd). Check norm_rope_fits first."""
    T, nh, hd = x_THD.shape
    pos = positions_T if positions_T.dtype == torch.int64 else positions_T.long()
    pos = pos.contiguous()
    out = torch.empty(T, nh, hd, dtype=torch.float32)
    rc = _lib().norm_rope_f32(x_THD.data_ptr(), T, nh, x_THD.stride(0), hd, w.data_ptr() if w is not None else None,
                              eps, cos_PR.shape[1], cos_PR.data_ptr(), sin_PR.contiguous().data_ptr(), cos_PR.shape[0],
                              pos.data_ptr(), out.data_ptr(), torch.get_num_threads())
    if rc:
        raise IndexError(f"a position is outside the rotary table's {cos_PR.shape[0]} positions")
    return out


# Rows per routed expert up to which the C kernel runs over bf16 weights, or float32 ones its panel
# path does not take (above it, torch's GEMMs, oneDNN's AMX in bf16, win: measured here, 1 thread,
# 32 experts of D=512/F=256 top-4, in bf16 against the per-expert bf16 GEMMs 6.3x at 1 token, 2.7x at
# 32, 1.2x at 128, 0.5x at 512). Float32 weights of the panel path's shapes run in C at any size:
# against torch's grouped GEMM with its gather/scale/index_add 1.4x at 16 tokens, 1.0-1.1x at 128-512
# and 1.1-1.15x at 2048 (the panel micro-kernel alone: ~105 GFLOPS, oneDNN's GEMMs here 76-95).
MAX_ROWS_PER_EXPERT = 16


def panels_fit(w13_EFD: torch.Tensor, w2_EDF: torch.Tensor) -> bool:
    """Whether experts with many rows (prefill) take the C kernel's panel path: float32 weights, or
    bf16 ones on a CPU whose torch GEMMs have no bf16 matrix instructions (there torch widens every
    expert's weights per call; measured, mid shapes at 512 tokens, a Xeon with oneDNN capped at AVX2:
    21 ms against torch's 99; with AMX torch's 12 ms beat the panels' 13), F a multiple of 4 and D of
    8 (see moe.c); other experts take it only for decode-sized batches."""
    bf16_here = w13_EFD.dtype == torch.bfloat16 and not cpu_gemm.cpu_has_half_matmul()
    return ((w13_EFD.dtype == torch.float32 or bf16_here)
            and (w13_EFD.shape[1] // 2) % 4 == 0 and w2_EDF.shape[1] % 8 == 0)


def use_for(x_TD: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor, topk_ids_TK: torch.Tensor) -> bool:
    """Whether the C kernel runs these experts: shapes it takes, built here, and a batch of decode
    size unless its panel path takes the weights (then any batch)."""
    if not isinstance(w13_EFD, torch.Tensor):
        return False
    T, K = topk_ids_TK.shape
    return ((T * K <= MAX_ROWS_PER_EXPERT * w13_EFD.shape[0] or panels_fit(w13_EFD, w2_EDF))
            and x_TD.dtype in (torch.float32, torch.bfloat16, torch.float16) and w13_EFD.dtype in (torch.float32, torch.bfloat16) and w2_EDF.dtype == w13_EFD.dtype
            and x_TD.is_cpu and w13_EFD.is_cpu and w13_EFD.is_contiguous()
            and w2_EDF.is_contiguous() and available())


def panel_groups_run() -> int:
    """How many expert panel groups (moe.c's prefill path) this process has run."""
    return _lib().moe_panel_groups_run()


def experts_by_thread_run() -> int:
    """How many moe_experts calls gave whole experts to each thread (decode-sized, routed to at least
    as many experts as threads, evenly: common.h `experts_by_thread`) in this process."""
    return _lib().moe_experts_by_thread_run()


def moe_experts(x_TD: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor, topk_weights_TK: torch.Tensor,
                topk_ids_TK: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """Same contract as `moe_serve.kernels.grouped_gemm.fused_experts_reference` for plain SwiGLU experts
    (ids outside [0, E) contribute nothing); float32 out. pairs: the batch-invariant form, (T, K, D)
    each (token, k) pair's weighted output (zero for ids outside [0, E)), bitwise the same whatever
    else the batch holds (every expert by the dot-product tiles), for the caller to sum in id order."""
    lib = _lib()
    assert lib is not None, "cpu_ops.moe_experts called without the kernels (check available())"
    T, D = x_TD.shape
    E, F2, _ = w13_EFD.shape
    K = topk_ids_TK.shape[1]
    x = x_TD.contiguous()
    ids = topk_ids_TK if topk_ids_TK.dtype == torch.int64 else topk_ids_TK.to(torch.int64)
    ids = ids.contiguous()
    wts = topk_weights_TK if topk_weights_TK.dtype == torch.float32 else topk_weights_TK.float()
    wts = wts.contiguous()
    out = torch.empty(T, K, D, dtype=torch.float32) if pairs else torch.empty(T, D, dtype=torch.float32)
    run = lib.moe_experts_pairs_f32 if pairs else lib.moe_experts_f32
    rc = run(x.data_ptr(), T, D, ids.data_ptr(), wts.data_ptr(), K, w13_EFD.data_ptr(),
                             w2_EDF.data_ptr(), int(w13_EFD.dtype == torch.bfloat16), E, F2 // 2, out.data_ptr(),
                             torch.get_num_threads())
    if rc:
        raise MemoryError(f"cpu_ops.moe_experts: no scratch memory for {T} tokens x {K} experts")
    return out


# The cache element types the attention kernels read and write (attention.c's kv_fmt, fp8.h): float32,
# and FP8 (--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2), whose bytes the kernels widen exactly to
# float32 as they read them and into which write_kv rounds (nearest even, saturating to the finite
# max) as torch's `x.clamp(-max, max).to(dtype)` does. Per-layer scales are the attention layer's.
KV_FORMATS = {torch.float32: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def _kv_format(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int | None:
    """attention.c's kv_fmt for caches of one element type it reads, else None."""
    return KV_FORMATS.get(k_cache.dtype) if k_cache.dtype == v_cache.dtype else None


def _kv_format_of(k_cache: torch.Tensor, v_cache: torch.Tensor, op: str) -> int:
    """_kv_format, or a ValueError naming the caches' dtypes (a caller that skipped the fits check)."""
    fmt = _kv_format(k_cache, v_cache)
    if fmt is None:
        raise ValueError(f"cpu_ops.{op}: key/value caches of {k_cache.dtype} / {v_cache.dtype}: the C kernels take "
                         f"both float32, both float8_e4m3fn or both float8_e5m2")
    return fmt


def decode_attention_fits(q_BNH: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor) -> bool:
    """float32 CPU queries (rows of N heads of H contiguous) over contiguous paged caches both float32,
    both float8_e4m3fn or both float8_e5m2, int32 block tables (rows contiguous) and sequence lengths."""
    return (q_BNH.is_cpu and q_BNH.dtype == torch.float32 and _kv_format(k_cache, v_cache) is not None
            and k_cache.is_cpu and k_cache.is_contiguous()
            and v_cache.is_contiguous() and q_BNH.stride(2) == 1 and q_BNH.stride(1) == q_BNH.shape[2]
            and block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
            and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
            and q_BNH.shape[1] % k_cache.shape[2] == 0 and available())


def _token_rows_of(x_TGH: torch.Tensor) -> bool:
    """Rows of G heads of H floats, each row contiguous (rows any stride apart)."""
    return x_TGH.dim() == 3 and x_TGH.stride(2) == 1 and x_TGH.stride(1) == x_TGH.shape[2]


def write_kv_fits(k_TGH: torch.Tensor, v_TGH: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping_T: torch.Tensor) -> bool:
    """float32 CPU key and value rows into contiguous caches both float32, both float8_e4m3fn or both
    float8_e5m2 (converted as torch's clamp-then-cast converts them), int64 slots."""
    return (k_TGH.is_cpu and k_TGH.dtype == torch.float32 and v_TGH.dtype == torch.float32
            and _kv_format(k_cache, v_cache) is not None and k_cache.is_contiguous()
            and v_cache.is_contiguous() and _token_rows_of(k_TGH) and _token_rows_of(v_TGH)
            and k_TGH.shape[1:] == k_cache.shape[2:] and v_TGH.shape[1:] == v_cache.shape[2:]
            and k_TGH.shape[0] == v_TGH.shape[0] == slot_mapping_T.shape[0]
            and slot_mapping_T.dtype == torch.int64 and slot_mapping_T.is_contiguous() and available())


def write_kv(k_TGH: torch.Tensor, v_TGH: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping_T: torch.Tensor) -> None:
    """Each new token's key and value rows into its cache slot, as index_copy_ would (into an FP8
    cache: as index_copy_ of `x.clamp(-max, max).to(dtype)` would). Check write_kv_fits first."""
    nb, bs = k_cache.shape[:2]
    dk, dv = k_TGH.shape[1] * k_TGH.shape[2], v_TGH.shape[1] * v_TGH.shape[2]
    fmt = _kv_format_of(k_cache, v_cache, "write_kv")
    if _lib().write_kv_f32(k_TGH.data_ptr(), k_TGH.stride(0), v_TGH.data_ptr(), v_TGH.stride(0), k_cache.data_ptr(),
                           v_cache.data_ptr(), slot_mapping_T.data_ptr(), k_TGH.shape[0], dk, dv, nb * bs, fmt):
        raise IndexError(f"cpu_ops.write_kv: a slot outside the cache's {nb * bs}")


def decode_attention(q_BNH: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence over its paged context, read in place: (B, N, Hv) float32. The first B
    rows of block_tables and seq_lens are used. Check decode_attention_fits first."""
    B, N, H = q_BNH.shape
    _, bs, G, Hv = v_cache.shape
    fmt = _kv_format_of(k_cache, v_cache, "decode_attention")
    out = torch.empty(B, N, Hv, dtype=torch.float32)
    rc = _lib().decode_attention_f32(q_BNH.data_ptr(), q_BNH.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                     block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
                                     out.data_ptr(), B, N, G, H, Hv, bs, scale, torch.get_num_threads(), fmt)
    if rc:
        raise MemoryError(f"cpu_ops.decode_attention: no scratch memory for a context of {int(seq_lens[:B].max())}")
    return out


def prefill_attention(q_TNH: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor, b0: int, b1: int, out_TNH: torch.Tensor,
                      scale: float) -> None:
    """Causal attention of sequences b0..b1-1 (their query rows per query_start_loc, the last tokens of
    their contexts) over their paged contexts, read in place, written into their rows of out_TNH
    (float32, contiguous). Check decode_attention_fits (same operands) and query_start_loc int32."""
    _, N, H = q_TNH.shape
    _, bs, G, Hv = v_cache.shape
    assert 0 <= b0 <= b1 <= min(seq_lens.shape[0], query_start_loc.shape[0] - 1, block_tables.shape[0])
    fmt = _kv_format_of(k_cache, v_cache, "prefill_attention")
    rc = _lib().prefill_attention_f32(q_TNH.data_ptr(), q_TNH.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                      block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
                                      query_start_loc.data_ptr(), b0, b1, out_TNH.data_ptr(), N, G, H, Hv, bs, scale,
                                      torch.get_num_threads(), fmt)
    if rc:
        raise MemoryError(f"cpu_ops.prefill_attention: no scratch memory for a context of {int(seq_lens[:b1].max())}")


# Rows up to which a linear layer runs in C on the CPU over bf16 weights: at decode sizes those read
# at a fraction of bandwidth through torch here (measured, 1 thread: a 576 x 576 bf16 GEMV 0.48 ms,
# 1.4 GB/s; the 576 x 49152 LM head 20.8 ms). Where torch's bf16 GEMMs have no matrix instructions
# (`cpu_gemm.cpu_has_half_matmul`: they widen the whole weight per call) bf16 weights also take the
# panel kernel up to LINEAR_PANEL_MAX_ROWS rows (N a multiple of 8), each block of 8 rows widened once
# into L1: measured on a Xeon with oneDNN capped at AVX2, 1 thread, 32 rows, the 4096 x 512 LM head
# 1.8 ms against torch's 5.0 (widened per call) or 7.6 (bf16 without matrix instructions); with AMX
# torch's bf16 GEMM is the faster (0.8 ms) and keeps them. Float32 weights run in C up to LINEAR_PANEL_MAX_ROWS
# rows: up to LINEAR_DOT_MAX_ROWS by the dot-product tiles (the weight streamed once), above by the
# panel micro-kernel of moe.c (N a multiple of 8; weight rows prefetched 8 blocks ahead). Measured
# here, 1 thread, cold weights, against torch's GEMM: a 512 x 512 weight 1.15x at 1 row, 1.4x at 4,
# 1.2-1.4x at 8, 1.5-2.3x at 32, 1.1x at 96; the mid model's 512 x 4096 LM head 1.1x at 1 row, 2-2.6x
# at 8, 1.7-2.2x at 32. More rows go to oneDNN, which packs its operands and wins at prefill sizes
# (0.8x at 2048 rows).
LINEAR_MAX_ROWS = 16
LINEAR_DOT_MAX_ROWS = 4
LINEAR_PANEL_MAX_ROWS = 96


def linear_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not (x.is_cpu and w.is_cpu and w.dim() == 2 and w.is_contiguous()
            and x.shape[-1] == w.shape[1] and x.stride(-1) == 1 and (x.dim() == 2 or x.is_contiguous())):
        return False
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if w.dtype == torch.bfloat16:
        return (x.dtype in (torch.float32, torch.bfloat16) and 0 < rows
                and (rows <= LINEAR_MAX_ROWS or (rows <= LINEAR_PANEL_MAX_ROWS and w.shape[0] % 8 == 0
                                                 and not cpu_gemm.cpu_has_half_matmul()))
                and available())
    return (w.dtype == torch.float32 and x.dtype == torch.float32 and 0 < rows <= LINEAR_PANEL_MAX_ROWS
            and (rows <= LINEAR_DOT_MAX_ROWS or w.shape[0] % 8 == 0) and available())


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (+ b), accumulated in float32: w (N, K) streamed once by the dot-product tiles (bf16
    up to LINEAR_MAX_ROWS rows, float32 up to LINEAR_DOT_MAX_ROWS), else by the panel kernel; out
    float32 of shape x.shape[:-1] + (N,). Check linear_fits first."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    M, N = x2.shape[0], w.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    bf16 = w.dtype == torch.bfloat16
    if M > (LINEAR_MAX_ROWS if bf16 else LINEAR_DOT_MAX_ROWS):
        bias = None if b is None else (b if b.dtype == torch.float32 else b.float()).contiguous()
        rc = _lib().linear_panels_f32(x2.data_ptr(), x2.stride(0), M, w.data_ptr(), int(bf16),
                                      bias.data_ptr() if bias is not None else None, K, N, y.data_ptr(), N,
                                      torch.get_num_threads())
        if rc:
            raise MemoryError(f"cpu_ops.linear: no scratch memory for {M} rows of {K}")
    else:
        _lib().linear_f32(x2.data_ptr(), x2.stride(0), M, w.data_ptr(), int(bf16), K, N,
                          y.data_ptr(), N, torch.get_num_threads())
        if b is not None:
            y += b
    return y.view(*x.shape[:-1], N)


def linear_invariant_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """What `linear_invariant` takes: float32 or bf16 activations over a contiguous float32 or bf16
    weight (any number of rows)."""
    return (x.is_cpu and w.is_cpu and w.dim() == 2 and w.is_contiguous() and x.shape[-1] == w.shape[1]
            and x.stride(-1) == 1 and (x.dim() == 2 or x.is_contiguous()) and x.dtype in (torch.float32, torch.bfloat16)
            and w.dtype in (torch.float32, torch.bfloat16) and available())


def linear_invariant(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (+ b) in float32, batch-invariant: every row by the dot-product tiles, whatever the
    number of rows, so a row's output is bitwise the same alone or in any batch. Check
    linear_invariant_fits first."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    M, N = x2.shape[0], w.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    if M and _lib().linear_invariant_f32(x2.data_ptr(), x2.stride(0), M, w.data_ptr(), int(w.dtype == torch.bfloat16),
                                         K, N, y.data_ptr(), N, torch.get_num_threads()):
        raise MemoryError(f"cpu_ops.linear_invariant: no scratch memory for {M} rows of {K}")
    if b is not None:
        y += b  # an add per element: the same whatever the batch
    return y.view(*x.shape[:-1], N)


def mark_slots_fits(hits_S1: torch.Tensor, ids: torch.Tensor) -> bool:
    return (hits_S1.is_cpu and hits_S1.dtype == torch.int32 and hits_S1.dim() == 1 and hits_S1.is_contiguous()
            and ids.is_cpu and ids.dtype == torch.int64 and ids.is_contiguous() and available())


def mark_slots(hits_S1: torch.Tensor, ids: torch.Tensor) -> None:
    """hits_S1[id + 1] = 1 for every id (ids below 0 mark hits_S1[0]). Check mark_slots_fits first."""
    if _lib().mark_slots_i32(hits_S1.data_ptr(), hits_S1.shape[0], ids.data_ptr(), ids.numel()):
        raise IndexError(f"cpu_ops.mark_slots: an id past the {hits_S1.shape[0] - 1} slots")


def topk_softmax_fits(logits_TE: torch.Tensor, k: int) -> bool:
    return (logits_TE.is_cpu and logits_TE.dtype == torch.float32 and logits_TE.dim() == 2
            and logits_TE.is_contiguous() and 1 <= k <= min(logits_TE.shape[1], 64) and available())


def topk_softmax(logits_TE: torch.Tensor, k: int, over_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights_TK, ids_TK) of each row's k largest logits, largest first: the softmax over those k
    (over_topk), or the softmax over the whole row at them. Check topk_softmax_fits first."""
    T = logits_TE.shape[0]
    w = torch.empty(T, k, dtype=torch.float32)
    ids = torch.empty(T, k, dtype=torch.int64)
    if _lib().topk_softmax_f32(logits_TE.data_ptr(), T, logits_TE.shape[1], k, int(over_topk), w.data_ptr(),
                               ids.data_ptr()):
        raise ValueError(f"cpu_ops.topk_softmax: k={k} outside [1, min({logits_TE.shape[1]}, 64)]")
    return w, ids


# Largest key / value head dim of gated_delta.c's per-head buffers.
GATED_DELTA_MAX_DIM = 512


def _token_rows(x: torch.Tensor) -> bool:
    """(B, H, d) with d contiguous and heads packed in each token's row (any token stride)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def gated_delta_step_fits(q_BHK: torch.Tensor, k_BHK: torch.Tensor, v_BHV: torch.Tensor,
                          state_SHKV: torch.Tensor) -> bool:
    """float32 CPU q, k (same strides) and v with heads packed per token, a float32 contiguous
    state pool, head dims up to GATED_DELTA_MAX_DIM."""
    return (q_BHK.is_cpu and all(t.dtype == torch.float32 for t in (q_BHK, k_BHK, v_BHV, state_SHKV))
            and _token_rows(q_BHK) and k_BHK.stride() == q_BHK.stride() and _token_rows(v_BHV)
            and state_SHKV.is_contiguous() and state_SHKV.shape[1:] == (q_BHK.shape[1], q_BHK.shape[2], v_BHV.shape[2])
            and max(q_BHK.shape[2], v_BHV.shape[2]) <= GATED_DELTA_MAX_DIM and available())


def _keep(context_lens_cpu) -> torch.Tensor | None:
    """uint8 (B,) 1 where the sequence continues from its slot; None when every one does."""
    if all(c > 0 for c in context_lens_cpu):
        return None
    return torch.tensor([c > 0 for c in context_lens_cpu], dtype=torch.uint8)


def gated_delta_step(q_BHK: torch.Tensor, k_BHK: torch.Tensor, v_BHV: torch.Tensor, g_BH: torch.Tensor,
                     beta_BH: torch.Tensor, state_SHKV: torch.Tensor, slots_B: torch.Tensor, context_lens_cpu,
                     scale: float, use_qk_l2norm: bool, eps: float) -> torch.Tensor:
    """One token per sequence through the gated delta rule, each sequence's state updated in place
    in its slot (a zero state where its context is 0): o (B, H, V) float32. Check
    gated_delta_step_fits first."""
    B, H, K = q_BHK.shape
    V = v_BHV.shape[2]
    g = g_BH.float().contiguous()
    beta = beta_BH.float().contiguous()
    slots = slots_B.to(torch.int64).contiguous()
    keep = _keep(context_lens_cpu)
    o = torch.empty(B, H, V, dtype=torch.float32)
    rc = _lib().gated_delta_step_f32(q_BHK.data_ptr(), k_BHK.data_ptr(), q_BHK.stride(0), v_BHV.data_ptr(),
                                     v_BHV.stride(0), g.data_ptr(), beta.data_ptr(), state_SHKV.data_ptr(),
                                     slots.data_ptr(), keep.data_ptr() if keep is not None else None, o.data_ptr(),
                                     B, H, K, V, scale, int(use_qk_l2norm), eps, torch.get_num_threads())
    if rc:
        raise ValueError(f"cpu_ops.gated_delta_step: head dims {K}, {V} over {GATED_DELTA_MAX_DIM}")
    return o


def conv_step_fits(x_BC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None,
                   conv_state_SCW: torch.Tensor) -> bool:
    """float32 CPU rows (channels contiguous), a float32 contiguous (C, W) filter, bias and window pool."""
    return (x_BC.is_cpu and x_BC.dim() == 2 and x_BC.stride(1) == 1
            and all(t.dtype == torch.float32 for t in (x_BC, weight_CK, conv_state_SCW))
            and weight_CK.is_contiguous() and conv_state_SCW.is_contiguous()
            and conv_state_SCW.shape[1:] == (x_BC.shape[1], weight_CK.shape[1] - 1)
            and (bias_C is None or (bias_C.dtype == torch.float32 and bias_C.is_contiguous()))
            and available())


def conv_step(x_BC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None, conv_state_SCW: torch.Tensor,
              slots_B: torch.Tensor, context_lens_cpu, silu: bool) -> torch.Tensor:
    """The depthwise causal convolution's one-token step for every sequence, each window shifted in
    place in its slot (zeros before a fresh sequence's token): y (B, C) float32. Check
    conv_step_fits first."""
    B, C = x_BC.shape
    slots = slots_B.to(torch.int64).contiguous()
    keep = _keep(context_lens_cpu)
    y = torch.empty(B, C, dtype=torch.float32)
    _lib().conv_step_f32(x_BC.data_ptr(), x_BC.stride(0), weight_CK.data_ptr(),
                         bias_C.data_ptr() if bias_C is not None else None, conv_state_SCW.data_ptr(), slots.data_ptr(),
                         keep.data_ptr() if keep is not None else None, y.data_ptr(), B, C, weight_CK.shape[1],
                         int(silu), torch.get_num_threads())
    return y
