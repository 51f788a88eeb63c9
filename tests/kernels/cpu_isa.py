"""What the CPU kernel tests share: the `isa` fixture (each test once per vec.h build this CPU runs)
and `threads` (torch's, and so the kernels', thread count within a block)."""
from __future__ import annotations

import contextlib
import ctypes
import functools

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


def _avx512_without_vnni() -> bool:
    return "avx512" in cpu_ops.runnable_isas() and "avx512_vnni" in cpu_ops._cpu_flags().split()


@functools.lru_cache(maxsize=None)
def _variant(name: str) -> ctypes.CDLL:
    if name != "avx512-no-vnni":
        return cpu_ops.load_variant(name)
    # the AVX-512 build of a CPU without VNNI (Skylake-X): quant.c's int8-activation tiles sum byte
    # products in 16 bits there (vpmaddubsw), a path of its own
    flags = (*cpu_ops.target_flags("avx512"), "-mno-avx512vnni")
    return cpu_ops._bind(ctypes.CDLL(str(cpu_ops._build(cpu_ops._compiler(), flags))))


@pytest.fixture(params=cpu_ops.runnable_isas() + (["avx512-no-vnni"] if _avx512_without_vnni() else []))
def isa_vnni(request, monkeypatch):
    """As `isa`, and on a CPU with AVX-512 VNNI also its AVX-512 build without VNNI (int8 products
    summed another way): for the int8-activation tests."""
    lib = _variant(request.param)
    assert lib.cpu_ops_isa().decode() == request.param.split("-")[0]
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


def by_thread_cases(run, ran, E: int, D: int, g: torch.Generator):
    """The whole-experts-per-thread cases (cpu_ops' common.h `experts_by_thread`) of an experts
    kernel `run(x, wts, ids)` whose counter of such calls is `ran()`: one token over 4 experts on 2
    threads (as many as a multiple of the threads), 9 tokens over all E = 12 experts, top 3, on 2 and
    on 3 threads (the cost split cuts the experts unevenly; one id held elsewhere), and 3 experts on 2
    threads (the row split). Each case's path is asserted; yields (ids, x, wts, out, one thread's
    out) for the caller's reference checks."""
    assert E == 12

    def every_expert(T):  # T >= 4 tokens, top 3, every expert routed to
        ids = torch.cat([torch.randperm(E, generator=g).view(4, 3),
                         torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(T - 4)])])
        return ids[torch.randperm(T, generator=g)]

    held = every_expert(9)
    twice = (torch.bincount(held.flatten(), minlength=E) >= 2)[held].nonzero()[0]
    held[tuple(twice)] = -1  # held elsewhere: a pair of an expert routed to again, so still all 12
    for ids, n, by_thread in [(torch.tensor([[3, 7, 0, 11]]), 2, True), (every_expert(9), 2, True),
                              (held, 3, True), (torch.tensor([[3, 7, 0]]), 2, False)]:
        x, wts = torch.randn(ids.shape[0], D, generator=g), torch.rand(ids.shape, generator=g)
        before = ran()
        with threads(n):
            out = run(x, wts, ids)
        assert ran() - before == int(by_thread), (ids.tolist(), n)
        with threads(1):
            serial = run(x, wts, ids)
        yield ids, x, wts, out, serial

