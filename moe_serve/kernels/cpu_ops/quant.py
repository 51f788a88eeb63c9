"""Linear layers and MoE experts over packed int8 / int4 weights (`PackedWeight`) in our C kernels
(quant.c), on every ISA of vec.h (AVX-512, AVX2, NEON, plain C). Activations float32 (bf16 / float16
are widened first); outputs float32. Two paths, by the number of activation rows (`panel_min_rows()`,
per linear call or per expert):

- decode and small batches: the dot-product tiles, the packed bytes streamed once and widened to
  float32 in registers;
- prefill: panel.h's panel GEMM, each block of 8 weight rows widened from its codes once into L1/L2
  and run against panels of up to 48 activation rows by the outer-product micro-kernel (the packed
  bytes still read once), the same kernel as float32 weights (moe.c). Measured on this project's
  Xeon (AVX-512, 1 thread, warm weights, a loaded machine): 1.0-1.2x the float32 kernel's time (the
  widening: 16% at 48 rows, 1536 x 2048 int8, 2.15 / 1.83 ms; 2048 x 768 at 128 rows 2.6-2.9 / 2.5-2.6
  ms; 2048 x 2048 at 512 rows 56-64 / 50-59 ms), and 1.1-3.8x faster than dequantizing the weight
  per call for torch's GEMM (bench/results/cpu_quant_prefill_*.json).

Each weight is checked before a call: `weight_problem` names what the kernels do not take (a field
of the wrong dtype, shape or layout, an odd group size for int4), `*_fits` says whether a call
runs here, and the wrappers raise ValueError naming the problem for anything else.

Not here: moe_experts' batch-invariant `pairs` form. With `act8` on a weight (the engine sets it for
GGUF files by default, and for every packed layer with --cpu-int8-activations), calls round each
activation row to int8 per weight group and take integer products, as llama.cpp's Q8_0 activations
do: decode-sized calls in the dot-product tiles (u8 codes x s8 activations: vpdpbusd on AVX-512
VNNI, vpmaddubsw on AVX-512 without it and on AVX2, plain C elsewhere: `act8_vector()`), calls of
`act8_panel_min_rows()` rows or more in an int8 panel (AVX-512 VNNI only; other builds keep the
float panel). Measured on this project's Xeon (AVX-512 VNNI, 2 threads, 16 layers of E64 D1024 F512
experts cold, float16 scales and a zero code, ms a layer, float / int8 activations): int4 G32 T=1
0.42 / 0.28, T=32 4.41 / 3.63; int8 G32 T=1 0.61 / 0.48, T=32 5.95 / 5.65. On the float path, int4's
lookup (a widen, two vpermps) keeps port 5 busy: that is what the integer path relieves. The int8
panel: 2.2-2.7x quant.c's float panel from 32 to 512 rows (bench/results/cpu_quant_prefill_*.json).
The engine's cpu_c backends (kernels/linear.py,
grouped_gemm/__init__.py) call these for packed layers, prefill included (experts: where
`panels_fit`, else decode-sized batches only).

Measured (bench/cpu_quant_gemv.py, bench/results/cpu_quant_gemv_*.json): a single-row GEMV reads its
packed bytes at 81-102% of the machine's read bandwidth on AVX-512 (1 and 2 threads); on the AVX2
build int8 84-90%, int4 75-81% (near its compute bound: warm in cache the same GEMV reads ~12.5 GB/s
of packed bytes, against a read bandwidth of 10-12 GB/s).
"""
from __future__ import annotations

import ctypes

import torch

from moe_serve.kernels import cpu_ops
from moe_serve.quantization.packed import PackedWeight

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _bind(raw: ctypes.CDLL) -> None:
    """quant.c's entry points' signatures on a loaded library (once)."""
    if raw.__dict__.get("_quant_bound"):
        return
    f = raw.quant_linear_f32
    f.restype = _INT
    f.argtypes = [_P, _I64, _I64, _P, _INT, _P, _INT, _P, _INT, _I64, _I64, _I64, _P, _I64, _INT, _INT]
    f = raw.quant_experts_f32
    f.restype = _INT
    f.argtypes = [_P, _I64, _I64, _P, _P, _I64, _P, _INT, _P, _INT, _P, _INT, _I64, _P, _INT, _P, _INT, _P, _INT, _I64,
                  _I64, _I64, _P, _INT, _INT]
    for name in ("quant_panels_run", "quant_panel_min_rows", "quant_experts_by_thread_run", "quant_act8_run",
                 "quant_act8_panels_run", "quant_act8_panel_min_rows"):
        getattr(raw, name).restype = _I64
        getattr(raw, name).argtypes = []
    raw.quant_act8_vector.restype = _INT
    raw.quant_act8_vector.argtypes = []
    raw.__dict__["_quant_bound"] = True


def _lib():
    """cpu_ops' library as its wrappers get it (a CPU graph's recording view included), bound."""
    lib = cpu_ops._lib()
    if lib is None:
        raise RuntimeError("cpu_ops.quant: the C kernels are not available here (see cpu_ops.status())")
    raw = lib if isinstance(lib, ctypes.CDLL) else getattr(lib, "_lib", None)
    if isinstance(raw, ctypes.CDLL):
        _bind(raw)
    return lib


def weight_problem(w, ndim: int = 2) -> str | None:
    """Why the kernels cannot take `w` as a packed weight of `ndim` logical dims, or None."""
    if not isinstance(w, PackedWeight):
        return f"a {type(w).__name__}, not a PackedWeight"
    if len(w.shape) != ndim:
        return f"a PackedWeight of shape {w.shape}: {ndim} dims wanted"
    K, G = w.shape[-1], w.group_size
    qshape = tuple(w.shape[:-1]) + ((K // 2) if w.bits == 4 else K,)
    sshape = tuple(w.shape[:-1]) + (K // G if G > 0 else -1,)
    if w.bits not in (4, 8):
        return f"bits={w.bits}: the kernels take 4 or 8"
    if G <= 0 or K % G:
        return f"group_size={G} does not divide K={K}"
    if w.bits == 4 and G % 2:
        return f"an int4 weight with an odd group_size={G}: the kernels take even group sizes"
    for name, t, dtypes, shape in (("qweight", w.qweight, (torch.uint8,), qshape),
                                   ("scales", w.scales, (torch.float32, torch.float16), sshape),
                                   ("offsets", w.offsets, (torch.float32,), sshape)):
        if t is None:
            continue
        if t.dtype not in dtypes or tuple(t.shape) != shape:
            return f"{name} {t.dtype} {tuple(t.shape)}: {' or '.join(map(str, dtypes))} {shape} wanted"
        if not t.is_cpu or not t.is_contiguous():
            return f"{name} must be a contiguous CPU tensor"
    return None


_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _x_problem(x: torch.Tensor, K: int) -> str | None:
    if not isinstance(x, torch.Tensor) or not x.is_cpu or x.dtype not in _X_DTYPES:
        return "activations must be a float32, bfloat16 or float16 CPU tensor"
    if x.dim() < 1 or x.shape[-1] != K:
        return f"activations of shape {tuple(x.shape)}: last dim {K} wanted"
    return None


def panels_run() -> int:
    """Panel GEMMs quant.c has run in this process (linear calls and expert panel groups): which path
    a call took, for the tests."""
    return _lib().quant_panels_run()


def experts_by_thread_run() -> int:
    """Calls of quant_experts that gave whole experts to each thread (decode-sized, routed to at least
    as many experts as threads, evenly: see quant.c `qexperts_by_thread`), in this process."""
    return _lib().quant_experts_by_thread_run()


def act8(w: PackedWeight) -> bool:
    """Whether calls over w round their activations to int8 (`act8` set on the weight
    by its layer: the engine's --cpu-int8-activations; quant.c's int8-activation tiles)."""
    return bool(getattr(w, "act8", False))


def act8_panels_run() -> int:
    """Calls quant.c's int8 panel took in this process (many rows with int8 activations, AVX-512 VNNI)."""
    return _lib().quant_act8_panels_run()


def act8_panel_min_rows() -> int | None:
    """The activation rows from which int8-activation calls take quant.c's int8 panel (None: this
    build has none, its prefill-sized calls take the float panel GEMM)."""
    return _lib().quant_act8_panel_min_rows() or None


def act8_vector() -> bool:
    """Whether this build's int8-activation tiles are vector code (AVX-512, AVX2), not plain C: the
    engine rounds activations by default only where they are."""
    return bool(_lib().quant_act8_vector())


def act8_run() -> int:
    """Calls quant.c ran with int8 activations in this process (the tests check which path ran)."""
    return _lib().quant_act8_run()


def panel_min_rows() -> int:
    """Activation rows (of a linear call, or of one expert) from which quant.c runs its panel GEMM on
    the ISA built (fewer: the dot-product tiles)."""
    return _lib().quant_panel_min_rows()


def quant_linear_fits(x: torch.Tensor, w: PackedWeight) -> bool:
    return (weight_problem(w) is None and _x_problem(x, w.shape[-1]) is None and cpu_ops.available())


def _rc(rc: int, op: str, rows: int) -> None:
    if rc == -1:
        raise MemoryError(f"cpu_ops.quant.{op}: no scratch memory for {rows} rows")
    if rc:
        raise ValueError(f"cpu_ops.quant.{op}: the kernel refused the weight (code {rc})")


def quant_linear(x: torch.Tensor, w: PackedWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ b) for a packed W (N, K), accumulated in float32: (..., N) float32. Raises
    ValueError naming what the kernels do not take."""
    problem = weight_problem(w) or _x_problem(x, w.shape[-1])
    if problem:
        raise ValueError(f"cpu_ops.quant.quant_linear: {problem}")
    N, K = w.shape
    x2 = x.reshape(-1, K)
    if x2.dtype != torch.float32 or x2.stride(-1) != 1:
        x2 = x2.float().contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    if M:
        _rc(_lib().quant_linear_f32(x2.data_ptr(), x2.stride(0), M, w.qweight.data_ptr(), w.bits,
                                    w.scales.data_ptr(), int(w.scales.dtype == torch.float16),
                                    w.offsets.data_ptr() if w.offsets is not None else None, w.zero, w.group_size,
                                    K, N, y.data_ptr(), N, int(act8(w)), torch.get_num_threads()), "quant_linear", M)
    if b is not None:
        y += b
    return y.view(*x.shape[:-1], N)


def experts_problem(x_TD: torch.Tensor, w13: PackedWeight, w2: PackedWeight, topk_weights_TK: torch.Tensor,
                    topk_ids_TK: torch.Tensor) -> str | None:
    """Why quant_experts cannot run these operands, or None."""
    for name, w in (("gate_up", w13), ("down", w2)):
        p = weight_problem(w, 3)
        if p:
            return f"{name}: {p}"
    E, F2, D = w13.shape
    if F2 % 2 or w2.shape != (E, D, F2 // 2):
        return f"gate_up {w13.shape} and down {w2.shape}: (E, 2F, D) and (E, D, F) wanted"
    p = _x_problem(x_TD, D)
    if p or x_TD.dim() != 2:
        return p or f"activations of shape {tuple(x_TD.shape)}: (T, {D}) wanted"
    T = x_TD.shape[0]
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != T or topk_weights_TK.shape != topk_ids_TK.shape:
        return (f"topk ids {tuple(topk_ids_TK.shape)} and weights {tuple(topk_weights_TK.shape)}: both (T={T}, "
                f"top_k) wanted")
    if topk_ids_TK.dtype.is_floating_point or topk_ids_TK.dtype == torch.bool:
        return f"topk ids of {topk_ids_TK.dtype}: an integer dtype wanted"
    return None


def panels_fit(w13: PackedWeight, w2: PackedWeight) -> bool:
    """Whether quant_experts' panel path takes experts of these shapes (gate_up (E, 2F, D), down
    (E, D, F): D a multiple of 8, F of 4), so that a prefill-sized batch runs there as fast as it does
    for float32 weights; otherwise many rows go through the decode tiles (correct, slower)."""
    return len(w13.shape) == 3 and w13.shape[2] % 8 == 0 and (w13.shape[1] // 2) % 4 == 0


def quant_experts_fits(x_TD, w13, w2, topk_weights_TK, topk_ids_TK) -> bool:
    return experts_problem(x_TD, w13, w2, topk_weights_TK, topk_ids_TK) is None and cpu_ops.available()


def quant_experts(x_TD: torch.Tensor, w13: PackedWeight, w2: PackedWeight, topk_weights_TK: torch.Tensor,
                  topk_ids_TK: torch.Tensor) -> torch.Tensor:
    """cpu_ops.moe_experts' contract (plain SwiGLU experts; ids outside [0, E) contribute nothing)
    over packed gate_up (E, 2F, D) (gate rows then up rows) and down (E, D, F): (T, D) float32, each
    routed expert's packed weights streamed once. Raises ValueError naming what it does not take."""
    problem = experts_problem(x_TD, w13, w2, topk_weights_TK, topk_ids_TK)
    if problem:
        raise ValueError(f"cpu_ops.quant.quant_experts: {problem}")
    E, F2, D = w13.shape
    T, K = topk_ids_TK.shape
    x = x_TD.float().contiguous()
    ids = topk_ids_TK.to(torch.int64).contiguous()
    wts = topk_weights_TK.float().contiguous()
    out = torch.empty(T, D, dtype=torch.float32)
    if T == 0:
        return out

    def ptr(t):
        return t.data_ptr() if t is not None else None

    def half(w):
        return int(w.scales.dtype == torch.float16)

    _rc(_lib().quant_experts_f32(x.data_ptr(), T, D, ids.data_ptr(), wts.data_ptr(), K,
                                 w13.qweight.data_ptr(), w13.bits, w13.scales.data_ptr(), half(w13), ptr(w13.offsets),
                                 w13.zero, w13.group_size, w2.qweight.data_ptr(), w2.bits, w2.scales.data_ptr(),
                                 half(w2), ptr(w2.offsets), w2.zero, w2.group_size, E, F2 // 2, out.data_ptr(),
                                 int(act8(w13) or act8(w2)), torch.get_num_threads()), "quant_experts", T * K)
    return out
