"""GEMM on the CPU in half precision, done the fast way for the processor at hand.

Processors without bf16/fp16 matrix instructions (no AVX512-BF16, no AMX) run half-precision GEMMs
element by element: measured here (AVX2), a bf16 (64 x 512) @ (512 x 2048) takes 6x as long as
the same in float32 including the casts. For two or more rows we therefore cast to float32,
multiply, and cast back; a single row (memory-bound decode of one sequence) stays in half
precision, where the cast would only add traffic. Accumulation in float32 is also what the GPU
kernels do, so results only get closer to the float64 references.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

_HALF = (torch.bfloat16, torch.float16)


# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) below its first bf16 matrix instructions (AVX512_CORE_BF16)
_ONEDNN_NO_HALF = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI"}


@functools.lru_cache(maxsize=None)
def cpu_has_half_matmul() -> bool:
    """Whether torch's half-precision GEMMs run on matrix instructions here: the CPU has AVX512-BF16,
    AMX or AVX512-FP16, and ONEDNN_MAX_CPU_ISA, where set, does not cap oneDNN below them."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).strip().upper()
    if cap in _ONEDNN_NO_HALF:
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return True  # unknown: leave half-precision GEMMs to the library
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16"))


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, upcast_half: bool = False) -> torch.Tensor:
    """F.linear(x, w, b) in torch ops. upcast_half: compute two or more half-precision rows in
    float32 (a CPU without half-precision matrix instructions: `cpu_has_half_matmul`). A weight
    already stored in float32 for such a CPU (moe_serve/prepare.py) is used as it is: only the
    activations are cast, never the weight."""
    if w.dtype != x.dtype:
        if upcast_half and w.dtype in _HALF and x.dtype == torch.float32:
            # float32 activations over half weights (a model run by our C kernels, for the rows they
            # leave to torch): widened for this call, not the activations rounded to half precision
            # for a GEMM this CPU runs element by element
            return F.linear(x, w.float(), None if b is None else b.float())
        return F.linear(x.to(w.dtype), w, b).to(x.dtype)
    if upcast_half and x.dtype in _HALF and x.dim() >= 2 and x.shape[-2] >= 2:
        return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    return F.linear(x, w, b)
