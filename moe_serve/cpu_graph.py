"""Decode steps on the CPU replayed from a recording: the CPU's counterpart of a CUDA graph.

On the CPU a decode step of a small batch is mostly host work, not arithmetic: every layer walks
its modules in Python, checks what each kernel accepts, allocates its outputs and converts the
arguments of each C call (about 200 us a layer on a 2-core Xeon, against a few us of C kernel time
for a tiny model). A `CpuGraph` runs the forward once while recording what it executes, in order:

- every call into our C kernels (moe_serve/kernels/cpu_ops), with its converted arguments: the
  tensors' addresses, the shapes and the scalars;
- every torch op, seen by a dispatch mode: ops that write into an argument (index_copy_ into the
  KV cache, add_) are kept as they were called; ops that make a new tensor are kept as "compute
  this again into the tensor the recording made" (their `out=` form where torch has one, else the
  op and a copy); views and `empty` need nothing at replay.

Every tensor the recording made is kept alive with it, so the addresses in the recorded calls stay
valid; `replay()` runs the list again, with no module, check or allocation in between. Each run of
consecutive C calls is replayed from C (cpu_ops/replay.c): one ctypes call for the run, not one a
kernel (a Q4_0 decode step of a 16-layer MoE records 193 C calls and 4 torch ops: 5 calls from
Python). Like a CUDA graph it holds the addresses of its inputs, weights and KV cache: the runner
copies each step's inputs into the static buffers it was recorded over (moe_serve/cuda_graph.py
DecodeGraphs), and what the forward decided on the host during the recording is fixed. That is why
it is used only where every such decision depends on shapes alone (moe_serve/runner/graphs.py
`cpu_graphs_apply`): our C kernels read sequence lengths, block tables, positions and routing from
tensors at replay. A host read of a tensor's value during the recording (`.item()`, `.tolist()`,
`int(t)`), or an op whose output shape depends on the values (nonzero, boolean-mask indexing,
bincount), fails the capture with `CaptureError`, and the steps then run eagerly.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_serve.kernels import cpu_ops

# Factories whose contents are undefined: nothing to redo at replay.
_UNINITIALISED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_HOST_READS = {"_local_scalar_dense", "item"}


class CaptureError(RuntimeError):
    """The forward did something a recording cannot hold (a host read of a tensor's value)."""


def _aliases_input(outs: tuple, args, kwargs) -> bool:
    """Whether every output shares its storage with an input: a view, or an op that may return its
    input (`to`, `contiguous`, `reshape` in inference mode) and did. Decided by the storages, not
    the schema: such an op's schema marks an alias even when it copied."""
    ins = set()
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor):
                ins.add(t.untyped_storage().data_ptr())
    return all(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in ins for o in outs)


def _writes_argument(func) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _out_form(func):
    """(overload, names of its out arguments) computing func into given tensors, or None: the
    overload of the same op whose inputs are func's, names and types (where.ScalarOther has no out
    form: where.self_out takes a tensor), and whose keyword-only outputs match func's returns
    (add.Tensor -> add.out, topk.default -> topk.values)."""
    ins = [(a.name, str(a.type)) for a in func._schema.arguments]
    n_out = len(func._schema.returns)
    packet = func.overloadpacket
    for name in packet.overloads():
        ov = getattr(packet, name)
        args = ov._schema.arguments
        outs = [a.name for a in args if a.is_out]
        if len(outs) == n_out and [(a.name, str(a.type)) for a in args if not a.is_out] == ins:
            return ov, outs
    return None


class _Recompute:
    """A recorded op that made new tensors, done again into those tensors."""

    __slots__ = ("func", "args", "kwargs", "outs")

    def __init__(self, func, args, kwargs, outs: tuple):
        form = _out_form(func)
        if form is not None:
            ov, names = form
            self.func, self.kwargs = ov, {**kwargs, **dict(zip(names, outs))}
            self.outs = None
        else:
            self.func, self.kwargs, self.outs = func, kwargs, outs
        self.args = args

    def __call__(self) -> None:
        r = self.func(*self.args, **self.kwargs)
        if self.outs is not None:
            for o, x in zip(self.outs, (r,) if isinstance(r, torch.Tensor) else r):
                o.copy_(x)


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: "CpuGraph"):
        super().__init__()
        self.graph = graph

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No: a recording never runs under torch.compile. Left True, torch wraps __torch_dispatch__
        to keep dynamo out of it, and that wrapper's first call imports torch._dynamo: as long as
        importing torch itself, paid by every engine process at its first recording."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _HOST_READS:
            raise CaptureError(f"the forward reads a tensor's value on the host ({func})")
        if torch.Tag.dynamic_output_shape in func.tags:  # nonzero, masked_select, bincount, unique ...
            raise CaptureError(f"{func}'s output shape depends on the values (a replay would keep the recorded one)")
        out = func(*args, **kwargs)
        g = self.graph
        g.keep.append(out)
        if _writes_argument(func):
            g.calls.append((func, args, kwargs))
            return out
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise CaptureError(f"{func} returns {type(out).__name__}, not tensors")
        if name in _UNINITIALISED or all(o.numel() == 0 for o in outs) or _aliases_input(outs, args, kwargs):
            return out
        g.made.extend(outs)
        g.calls.append((_Recompute(func, args, kwargs, outs), (), {}))
        return out


class _RecordingLib:
    """The C kernels' library as the wrappers see it while recording: each call recorded, then made."""

    def __init__(self, lib, graph: "CpuGraph"):
        self._lib, self._graph = lib, graph

    def __getattr__(self, name: str):
        fn = getattr(self._lib, name)
        calls = self._graph.calls

        def call(*args):
            calls.append((_CCall(name, fn), args, {}))
            return fn(*args)

        return call


class _CCall:
    __slots__ = ("name", "fn")

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn

    def __call__(self, *args) -> None:
        if self.fn(*args):  # our kernels return 0, or an error code (no scratch memory, a bad position)
            raise RuntimeError(f"cpu_ops.{self.name} failed during a decode graph replay")


# replay.c's recorded call: the function, its signature's index, its arguments (see replay.c).
_KIND = {ctypes.c_void_p: "p", ctypes.c_int64: "l", ctypes.c_int: "i", ctypes.c_float: "f"}


class _Arg(ctypes.Union):
    _fields_ = [("p", ctypes.c_void_p), ("l", ctypes.c_int64), ("f", ctypes.c_double)]


def _call_type(lib):
    """replay.c's call struct, sized as the library says (None: the library has no replay)."""
    if not hasattr(lib, "cpu_ops_replay_call_bytes"):
        return None
    n = (lib.cpu_ops_replay_call_bytes() - 16) // ctypes.sizeof(_Arg)

    class Call(ctypes.Structure):
        _fields_ = [("fn", ctypes.c_void_p), ("sig", ctypes.c_int64), ("a", _Arg * n)]

    return Call if ctypes.sizeof(Call) == lib.cpu_ops_replay_call_bytes() else None


def _native(lib, Call, call: "_CCall", args) -> bool | tuple:
    """(address, signature index, arguments) of a recorded C call replay.c can make, or False."""
    fn = call.fn
    types = getattr(fn, "argtypes", None)
    if not types or len(types) != len(args) or len(args) > Call._fields_[2][1]._length_:
        return False
    kinds = [_KIND.get(t) for t in types]
    if None in kinds:
        return False
    sig = lib.cpu_ops_replay_sig((("v" if fn.restype is None else "i" if fn.restype is ctypes.c_int else "?")
                                  + "".join(kinds)).encode())
    if sig < 0:
        return False
    vals = []
    for k, v in zip(kinds, args):
        if isinstance(v, ctypes.c_void_p):
            v = v.value
        if k == "p" and (v is None or type(v) is int):
            vals.append(("p", v))
        elif k in "li" and type(v) in (int, bool):
            vals.append(("l", int(v)))
        elif k == "f" and type(v) in (int, float):
            vals.append(("f", float(v)))
        else:
            return False
    return ctypes.cast(fn, ctypes.c_void_p).value, sig, vals


class _NativeRun:
    """Consecutive recorded C calls replayed by one call of replay.c's cpu_ops_replay."""

    __slots__ = ("lib", "calls", "n", "names", "rc")

    def __init__(self, lib, Call, made: list, names: list[str]):
        self.lib, self.n, self.names = lib, len(made), names
        self.calls = (Call * len(made))()
        for c, (fn, sig, vals) in zip(self.calls, made):
            c.fn, c.sig = fn, sig
            for i, (k, v) in enumerate(vals):
                setattr(c.a[i], k, v)
        self.rc = ctypes.c_int(0)

    def __call__(self) -> None:
        failed = self.lib.cpu_ops_replay(ctypes.addressof(self.calls), self.n, ctypes.addressof(self.rc))
        if failed:
            raise RuntimeError(f"cpu_ops.{self.names[failed - 1]} failed during a decode graph replay "
                               f"(code {self.rc.value})")


def _plan(calls: list) -> list:
    """The recorded calls with each run of C calls replay.c can make as one _NativeRun."""
    lib = cpu_ops._loaded_lib()
    Call = _call_type(lib) if lib is not None else None
    if Call is None:
        return calls
    out, run, names = [], [], []

    def flush():
        if run:
            out.append((_NativeRun(lib, Call, list(run), list(names)), (), {}))
            run.clear()
            names.clear()

    for entry in calls:
        fn, args, kwargs = entry
        made = isinstance(fn, _CCall) and not kwargs and _native(lib, Call, fn, args)
        if made:
            run.append(made)
            names.append(fn.name)
            continue
        flush()
        out.append(entry)
    flush()
    return out


def _guarded(plain, thread: int):
    """Tensor.tolist / numpy while a recording runs on `thread`: refused there, as they were elsewhere
    (a dispatch mode does not see these reads of a CPU tensor)."""

    def method(self, *args, **kwargs):
        if threading.get_ident() == thread:
            raise CaptureError(f"the forward reads a tensor's values on the host (.{plain.__name__}())")
        return plain(self, *args, **kwargs)

    return method


class CpuGraph:
    """A forward recorded once (`capture`) and replayed (`replay`) over the same tensors."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.plan: list[tuple] | None = None  # `calls` with runs of C calls made native (_plan), at the first replay
        self.keep: list = []  # every tensor the recording made or viewed: their addresses are in `calls`
        self.made: list[torch.Tensor] = []
        self.out = None

    @property
    def memory_bytes(self) -> int:
        """Bytes of the tensors the recorded ops made (the graph's own buffers)."""
        seen, total = set(), 0
        for t in self.made:
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        return total

    def capture(self, fn):
        """Run fn() (a forward over static buffers) while recording it; returns its output, which
        every replay overwrites in place."""
        self.calls, self.keep, self.made, self.plan = [], [], [], None
        with self._recording(), _Recorder(self):
            self.out = fn()
        return self.out

    @contextlib.contextmanager
    def _recording(self):
        lib = cpu_ops._loaded_lib()
        cpu_ops._recording.lib = None if lib is None else _RecordingLib(lib, self)
        tolist, numpy = torch.Tensor.tolist, torch.Tensor.numpy
        me = threading.get_ident()
        torch.Tensor.tolist, torch.Tensor.numpy = _guarded(tolist, me), _guarded(numpy, me)
        try:
            yield
        finally:
            cpu_ops._recording.lib = None
            torch.Tensor.tolist, torch.Tensor.numpy = tolist, numpy

    def replay(self, native: bool = True):
        """Run the recording again; native=False: every C call through ctypes, as recorded."""
        if native and self.plan is None:
            self.plan = _plan(self.calls)
        for fn, args, kwargs in self.plan if native else self.calls:
            fn(*args, **kwargs)
        return self.out
