"""A random packed step for the Gated DeltaNet tests: inputs of every op, and state caches whose
every slot holds random values (garbage a fresh sequence must not read)."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Dims:
    H: int = 3  # heads
    K: int = 16  # key head dim
    V: int = 8  # value head dim
    C: int = 12  # convolution channels
    KW: int = 4  # convolution width
    slots: int = 10


DIMS = Dims()


class Batch:
    def __init__(self, query_lens, context_lens, seed=0, dtype=torch.float32, state_dtype=torch.float32,
                 slots=None, dims: Dims = DIMS, device="cpu"):
        g = torch.Generator().manual_seed(seed)
        d = self.dims = dims
        T = sum(query_lens)
        self.query_lens, self.context_lens = list(query_lens), list(context_lens)
        if slots is None:
            slots = torch.randperm(d.slots, generator=g)[:len(query_lens)].tolist()
        self.slots = torch.tensor(slots, dtype=torch.int64, device=device)

        def rand(*shape, scale=1.0, to=dtype):
            return (scale * torch.randn(*shape, generator=g)).to(to).to(device)

        self.q, self.k, self.v = rand(T, d.H, d.K), rand(T, d.H, d.K), rand(T, d.H, d.V)
        # log decays as the model makes them (-A * softplus(a + dt_bias)): mostly mild, some strong
        A = torch.rand(d.H, generator=g) * 4
        self.g = (-A * torch.nn.functional.softplus(torch.randn(T, d.H, generator=g))).to(device)
        self.beta = torch.sigmoid(torch.randn(T, d.H, generator=g)).to(dtype).to(device)
        self.state = rand(d.slots, d.H, d.K, d.V, to=state_dtype)
        self.x = rand(T, d.C)
        self.w, self.bias = rand(d.C, d.KW, scale=0.5), rand(d.C, scale=0.1)
        self.conv_state = rand(d.slots, d.C, d.KW - 1)
        self._starts()

    def _starts(self):
        self.qsl = [0]
        for n in self.query_lens:
            self.qsl.append(self.qsl[-1] + n)

    def part(self, rows_T, query_lens, context_lens, slots=None) -> "Batch":
        """These inputs' rows rows_T as a step of the given lengths, sharing this batch's caches."""
        part = copy.copy(self)
        for name in ("q", "k", "v", "g", "beta", "x"):
            setattr(part, name, getattr(self, name)[rows_T.to(self.q.device)])
        part.query_lens, part.context_lens = list(query_lens), list(context_lens)
        part.slots = self.slots if slots is None else slots
        part._starts()
        return part

    def copy_caches(self) -> "Batch":
        """The same step over copies of the caches (so two backends start from the same state)."""
        twin = copy.copy(self)
        twin.state, twin.conv_state = self.state.clone(), self.conv_state.clone()
        return twin

    def rows(self, b):
        return slice(self.qsl[b], self.qsl[b + 1])

    def delta(self, fn, **kw):
        return fn(self.q, self.k, self.v, self.g, self.beta, self.state, self.slots, self.query_lens,
                  self.context_lens, self.dims.K ** -0.5, **kw)

    def conv(self, fn, activation="silu"):
        return fn(self.x, self.w, self.bias, self.conv_state, self.slots, self.query_lens, self.context_lens,
                  activation)
