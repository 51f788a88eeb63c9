"""The compiled variant a Triton launch selects, by Triton's rules, recorded from real launches.

Triton compiles a kernel once per distinct key: its constexprs and launch options, and for every
other argument the type plus what Triton reads off the value unless the argument is listed in
`do_not_specialize`: an integer equal to 1 becomes the constant 1, and an integer divisible by 16
or a pointer aligned to 16 bytes is marked divisible. Those marks decide, among other things,
whether a load along a unit-stride dimension is vectorised, and so the registers a kernel needs: a
variant compiled without them is not the one a GPU runs. `moe_serve/kernels/aot_check.py` therefore builds
its configurations by running the launchers themselves under `record`, on "meta" tensors (shapes,
strides and dtypes without memory), and the tests compare what it compiles with what an engine run
launches.

A recorded launch is a `Launch`: the kernel ("module:function"), each runtime argument's type and
mark ("1", "D" or ""), the constexprs (defaults filled in) and the launch options.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Iterator

import torch

# Every Triton kernel the engine launches, as "module:function".
GEMM = "moe_serve.kernels.grouped_gemm.triton_kernel:_grouped_gemm_kernel"
TOPK = "moe_serve.kernels.grouped_gemm.triton_kernel:_topk_sum_kernel"
ATTN = "attention.backends.triton_paged:_paged_attn_kernel"
REDUCE = "attention.backends.triton_paged:_reduce_splits_kernel"
WRITE = "attention.backends.triton_paged:_write_rows_kernel"
FP8_LINEAR = "moe_serve.kernels.fp8_linear:_fp8_linear_kernel"
MASKED = "moe_serve.kernels.grouped_gemm.masked:_masked_gemm_kernel"
QUANT = "moe_serve.kernels.fp8_quant:_quant_kernel"
GDN_CONV = "moe_serve.kernels.gated_delta.triton_kernels:_conv1d_kernel"
GDN_CONV_STATE = "moe_serve.kernels.gated_delta.triton_kernels:_conv_state_kernel"
GDN_RECURRENT = "moe_serve.kernels.gated_delta.triton_kernels:_recurrent_kernel"
GDN_INVERSE = "moe_serve.kernels.gated_delta.triton_kernels:_chunk_inverse_kernel"
GDN_SCAN = "moe_serve.kernels.gated_delta.triton_kernels:_chunk_scan_kernel"
LINEAR_ATTENTION = (GDN_CONV, GDN_CONV_STATE, GDN_RECURRENT, GDN_INVERSE, GDN_SCAN)
INDEX = "attention.backends.triton_dsa:_index_scores_kernel"
LINEAR = "moe_serve.kernels.triton_invariant:_linear_kernel"  # --batch-invariant's dense linear
PACKED_GEMM = "moe_serve.kernels.grouped_gemm.triton_packed:_packed_grouped_gemm_kernel"  # int4 / int8 experts
PACKED_LINEAR = "moe_serve.kernels.packed_linear:_packed_linear_kernel"
INT8_QUANT = "moe_serve.kernels.int8_quant:_int8_quant_kernel"  # W8A8's per-token activations
KERNELS = (GEMM, TOPK, ATTN, REDUCE, WRITE, FP8_LINEAR, MASKED, QUANT, *LINEAR_ATTENTION, INDEX, LINEAR, PACKED_GEMM,
           PACKED_LINEAR, INT8_QUANT)

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
           torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5", torch.int64: "i64", torch.int32: "i32",
           torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
log = logging.getLogger("moe_serve.kernels")


def argument_spec(value, specialize: bool) -> tuple[str, str]:
    """(type, mark) of one runtime argument as Triton keys it: mark "1" (the integer became the
    constant 1), "D" (divisible by 16 / 16-byte aligned) or "". Triton's own function where this
    Triton has it; the same rules written out otherwise."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        kind, mark = native_specialize_impl(BaseBackend, value, False, specialize, True)[:2]
        if kind == "constexpr":
            return "i32", "1"
        return kind, mark or ""
    except (ImportError, TypeError):  # a Triton without it (or another signature): the same rules here
        pass
    if isinstance(value, bool):
        return "u1", ""
    if isinstance(value, int):
        kind = "i32" if -2**31 <= value < 2**31 else "i64"
        if not specialize:
            return kind, ""
        return (kind, "1") if value == 1 else (kind, "D" if value % 16 == 0 else "")
    if isinstance(value, float):
        return "fp32", ""
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype], "D" if specialize and value.data_ptr() % 16 == 0 else ""
    raise TypeError(f"no Triton type for a {type(value).__name__} argument")


@dataclass(frozen=True)
class Launch:
    """One launch's compile key. args: ((name, type, mark), ...) of the runtime arguments in order;
    grid (the launch grid, where known) is not part of the key."""
    kernel: str
    args: tuple
    constexprs: tuple
    options: tuple
    grid: tuple | None = field(default=None, compare=False)

    @property
    def types(self) -> dict:
        return {n: t for n, t, _ in self.args}

    @property
    def marks(self) -> dict:
        return {n: m for n, _, m in self.args}


def _python_fn(kernel):
    return getattr(kernel, "fn", kernel)


def do_not_specialize(kernel) -> frozenset:
    """Names of the arguments a kernel was decorated to leave unspecialised (compiled or interpreted)."""
    names = inspect.signature(_python_fn(kernel)).parameters
    listed = kernel.kwargs.get("do_not_specialize") if hasattr(kernel, "kwargs") else kernel.do_not_specialize
    order = list(names)
    return frozenset(order[x] if isinstance(x, int) else x for x in (listed or ()))


def _is_constexpr(param: inspect.Parameter) -> bool:
    ann = param.annotation
    return ann is not inspect.Parameter.empty and "constexpr" in (ann if isinstance(ann, str) else repr(ann))


def launch_key(kernel_name: str, kernel, args: tuple, kwargs: dict, grid=None) -> Launch:
    """The compile key of `kernel[grid](*args, **kwargs)`."""
    params = inspect.signature(_python_fn(kernel)).parameters
    unspecialised = do_not_specialize(kernel)
    bound = dict(zip(params, args))
    bound.update((k, v) for k, v in kwargs.items() if k in params)
    runtime, constexprs = [], {}
    for name, p in params.items():
        if _is_constexpr(p):
            value = bound.get(name, p.default)
            if value is inspect.Parameter.empty:
                raise TypeError(f"{kernel_name}: constexpr {name} was not given")
            constexprs[name] = value
        elif name in bound:
            runtime.append((name, *argument_spec(bound[name], name not in unspecialised)))
        else:
            raise TypeError(f"{kernel_name}: argument {name} was not given")
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k in _LAUNCH_OPTIONS))
    return Launch(kernel_name, tuple(runtime), tuple(sorted(constexprs.items())), options,
                  tuple(grid) if isinstance(grid, (tuple, list)) else grid)


@dataclass
class _Proxy:
    """Stands in for a kernel in its module: `proxy[grid](...)` records the launch's key and, with
    run, launches the real kernel too; with warmup, compiles it for the current device without
    launching (once per key; a failure is logged and left to the first real launch)."""
    name: str
    kernel: object
    run: bool
    launches: list = field(default_factory=list)
    warmup: bool = False
    failed: list = field(default_factory=list)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            key = launch_key(self.name, self.kernel, args, kwargs, grid)
            new = key not in self.launches
            self.launches.append(key)
            if self.run:
                return self.kernel[grid](*args, **kwargs)
            if self.warmup and new:
                try:
                    self.kernel.warmup(*args, grid=grid, **kwargs)
                except Exception as e:  # noqa: BLE001 - compile errors of every kind are reported alike
                    self.failed.append(key)
                    log.warning("Triton: %s did not compile ahead of serving (%s: %s); it compiles at its "
                                "first launch", self.name, type(e).__name__, str(e)[:300])
        return launch

    # Attributes the launchers or tests read off a kernel object pass through.
    def __getattr__(self, attr):
        return getattr(self.kernel, attr)


@contextlib.contextmanager
def record(kernels=KERNELS, run: bool = False, warmup: bool = False) -> Iterator[list]:
    """Within the block, launches of these kernels append their `Launch` to the yielded list (in
    launch order) and, with run, still launch; with warmup, each new key is compiled for the current
    device instead (Triton's `kernel.warmup`: no memory is read, meta tensors are fine); with
    neither, nothing runs."""
    out: list[Launch] = []
    patched = []
    try:
        for name in kernels:
            module, attr = name.split(":")
            mod = importlib.import_module(module)
            proxy = _Proxy(name, getattr(mod, attr), run, out, warmup and not run)
            patched.append((mod, attr, proxy.kernel))
            setattr(mod, attr, proxy)
        yield out
    finally:
        for mod, attr, kernel in reversed(patched):
            setattr(mod, attr, kernel)
