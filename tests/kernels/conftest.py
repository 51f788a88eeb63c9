"""Kernel tests: compiled kernels on a CUDA GPU when there is one, else the Triton interpreter.

Triton decides between compiling and interpreting when a kernel is decorated (@triton.jit runs at
module import), reading TRITON_INTERPRET at that moment (checked for Triton 3.6 and 3.9). pytest
imports this conftest before any test module in this folder, so setting the variable here covers
every kernel module the tests import afterwards; a kernel module imported earlier without it (by
another test folder) is reloaded so its kernels are decorated again in interpreter mode.
TRITON_INTERPRET=1 forces the interpreter on a GPU machine too (Triton 3.6's interpreter needs
numpy < 2.4 for kernels with runtime loop bounds).
"""
import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_KERNEL_MODULES = ("kernels.grouped_gemm.triton_kernel", "attention.backends.triton_paged")

if os.environ.get("TRITON_INTERPRET") == "1":
    for _name in _KERNEL_MODULES:
        _mod = sys.modules.get(_name)
        if _mod is not None and not _mod.INTERPRETED:
            importlib.reload(_mod)
