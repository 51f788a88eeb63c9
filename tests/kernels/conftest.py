"""Kernel tests: compiled kernels on a CUDA GPU when there is one, else the Triton interpreter.

Triton picks compile or interpret per function when it is decorated: @triton.jit reads
TRITON_INTERPRET at that moment (Triton 3.6 and 3.9 alike). That happens for our kernels when their
module is imported, and for triton.language's own @jit helpers (tl.cdiv, tl.max, tl.sum, tl.zeros,
...) when triton is first imported. pytest imports this conftest before the test modules of this
folder, so normally setting the variable here is enough. If a module collected earlier (another
test folder) already imported triton or a kernel module without it, `_switch_to_interpreter`
re-decorates what was decorated too early, so the result holds whatever order pytest imports in.
TRITON_INTERPRET=1 forces the interpreter on a GPU machine too (Triton 3.6's interpreter needs
numpy < 2.4 for kernels with runtime loop bounds).
"""
import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_KERNEL_MODULES = ("moe_serve.kernels.grouped_gemm.triton_kernel", "moe_serve.kernels.grouped_gemm.masked", "attention.backends.triton_paged",
                   "moe_serve.kernels.gated_delta.triton_kernels", "moe_serve.kernels.triton_invariant")


def _switch_to_interpreter() -> None:
    if "triton" in sys.modules:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        # Swap triton.language's compiled-mode helpers for interpreted ones, in every namespace a
        # kernel or another helper looks them up in.
        for mod in (tl, tl.standard, tl.core, tl.math):
            for name, obj in list(vars(mod).items()):
                if isinstance(obj, JITFunction):
                    setattr(mod, name, InterpretedFunction(obj.fn))
    for name in _KERNEL_MODULES:
        mod = sys.modules.get(name)
        if mod is not None and not mod.INTERPRETED:
            importlib.reload(mod)


if os.environ.get("TRITON_INTERPRET") == "1":
    _switch_to_interpreter()
