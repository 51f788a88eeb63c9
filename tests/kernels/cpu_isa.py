"""What the CPU kernel tests share: the `isa` fixture (each test once per vec.h build this CPU runs)
and `threads` (torch's, and so the kernels', thread count within a block)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from moe_serve.kernels import cpu_ops


@pytest.fixture(params=cpu_ops.runnable_isas())
def isa(request, monkeypatch):
    """The test runs on vec.h's `request.param` build: its own library, swapped in for the process's
    default within the test (cpu_ops's functions and the cpu_c backends all call `_lib()`)."""
    lib = cpu_ops.load_variant(request.param)
    assert lib.cpu_ops_isa().decode() == request.param
    monkeypatch.setattr(cpu_ops, "_lib", lambda: lib)
    return request.param


@contextlib.contextmanager
def threads(n: int):
    """torch's (and so the kernels') thread count set to n within."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
