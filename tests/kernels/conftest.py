"""Kernel tests run the Triton kernels on the CPU through the Triton interpreter.

Triton decides between compiling and interpreting when a kernel is decorated (@triton.jit runs at
module import), reading TRITON_INTERPRET then. pytest imports this conftest before any test module in
this folder, so setting the variable here covers every kernel module the tests import afterwards; a
kernel module imported earlier without it (by another test folder) is reloaded so its kernels are
decorated again in interpreter mode. Set TRITON_INTERPRET=0 on a GPU machine to test compiled kernels.
"""
import importlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

_KERNEL_MODULES = ("kernels.grouped_gemm.triton_kernel", "attention.backends.triton_paged")

if os.environ["TRITON_INTERPRET"] == "1":
    for _name in _KERNEL_MODULES:
        _mod = sys.modules.get(_name)
        if _mod is not None and not _mod.INTERPRETED:
            importlib.reload(_mod)
