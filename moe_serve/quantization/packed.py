"""The packed integer weight every int4/int8 format is converted into at load (the contract between
the format loaders and the int4/int8 kernels).

A quantized weight W of logical shape (N out, K in) (experts: (E, N, K)) with group size G (G divides
K; G = K is per channel) is held as:

- `bits`: 4 or 8;
- `qweight`: uint8; bits=8: shape (..., N, K), the unsigned code q in 0..255; bits=4: shape
  (..., N, K // 2), element k in the low nibble of byte k // 2 when k is even, in the high nibble
  when k is odd (codes 0..15);
- `scales`: float32 (..., N, K // G), or float16 where every scale is one (`compact()`);
- `offsets`: float32 (..., N, K // G) or None (0);
- `zero`: an integer code z in 0 .. 2 ** bits - 1 (default 0);
- W[n, k] = scales[n, k // G] * (q[n, k] - z) + offsets[n, k // G].

Signed symmetric formats store q + 128 (bits 8) or q + 8 (bits 4) with offsets = -128 * scale
(resp. -8 * scale); a GPTQ/AWQ zero point z gives offsets = -z * scale; GGUF Q4_K's min gives
offsets = -min. The loaders write float32 scales and offsets; `compact()` turns offsets that are
exactly -z * scale for one z into `zero` = z and no offsets array, and scales that float16 holds
exactly (GGUF's Q4_0 / Q8_0 d, GPTQ's float16 scales) into float16: what the served layers keep on
a CPU, 0.5625 bytes a weight for Q4_0 instead of 0.75. `dequantize()` is the pure-torch float32 reference the kernels are tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 (..., K) with K even -> uint8 (..., K // 2): even k low nibble, odd k high."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: last dimension {q.shape[-1]} is odd")
    q = q.to(torch.uint8)
    if q.numel() and int(q.max()) > 15:
        raise ValueError("pack_nibbles: codes must be in 0..15")
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (..., K // 2) -> codes uint8 (..., K) (inverse of pack_nibbles)."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


@dataclass
class PackedWeight:
    bits: int
    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    group_size: int
    shape: tuple[int, ...]
    zero: int = 0

    def __post_init__(self):
        self.shape = tuple(int(s) for s in self.shape)
        if self.bits not in (4, 8):
            raise ValueError(f"PackedWeight.bits={self.bits}: only 4 and 8 are supported")
        if len(self.shape) < 2:
            raise ValueError(f"PackedWeight.shape={self.shape}: needs (..., N, K)")
        k = self.shape[-1]
        g = self.group_size
        if not isinstance(g, int) or g <= 0 or k % g:
            raise ValueError(f"PackedWeight.group_size={g} must be a positive divisor of K={k}")
        if self.bits == 4 and k % 2:
            raise ValueError(f"PackedWeight: 4-bit weights need an even K, got K={k}")
        if self.qweight.dtype != torch.uint8:
            raise ValueError(f"PackedWeight.qweight dtype {self.qweight.dtype}: must be uint8")
        qshape = self.shape[:-1] + (k // 2 if self.bits == 4 else k,)
        if tuple(self.qweight.shape) != qshape:
            raise ValueError(f"PackedWeight.qweight shape {tuple(self.qweight.shape)} != {qshape} "
                             f"for {self.bits}-bit weight of shape {self.shape}")
        sshape = self.shape[:-1] + (k // g,)
        if self.scales.dtype not in (torch.float32, torch.float16) or tuple(self.scales.shape) != sshape:
            raise ValueError(f"PackedWeight.scales {self.scales.dtype} {tuple(self.scales.shape)}: "
                             f"must be float32 (or float16) {sshape}")
        if not isinstance(self.zero, int) or not 0 <= self.zero < (1 << self.bits):
            raise ValueError(f"PackedWeight.zero={self.zero!r}: an integer code in 0..{(1 << self.bits) - 1} wanted")
        if self.offsets is not None and (self.offsets.dtype != torch.float32
                                         or tuple(self.offsets.shape) != sshape):
            raise ValueError(f"PackedWeight.offsets {self.offsets.dtype} {tuple(self.offsets.shape)}: "
                             f"must be float32 {sshape} or None")

    @property
    def nbytes(self) -> int:
        """Resident bytes: codes, scales and offsets."""
        n = self.qweight.numel() * self.qweight.element_size()
        n += self.scales.numel() * self.scales.element_size()
        if self.offsets is not None:
            n += self.offsets.numel() * self.offsets.element_size()
        return n

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def codes(self) -> torch.Tensor:
        """The unsigned codes q as uint8 of the logical shape."""
        return unpack_nibbles(self.qweight) if self.bits == 4 else self.qweight

    def dequantize(self, dtype: torch.dtype = torch.float32, experts: torch.Tensor | None = None,
                   workspace: str | None = None) -> torch.Tensor:
        """W = scales * (q - zero) + offsets per group, computed in float32 (the reference), cast to dtype.
        experts: for stacked (E, N, K) weights, the expert indices to dequantize (all when None), as
        the expert op asks (moe_serve/kernels/grouped_gemm: `shape` and `dequantize(dtype, experts)`);
        workspace: that interface's buffer name, unused (a fresh tensor each call)."""
        del workspace
        w = self if experts is None else self.index_select(experts)
        k, g = w.shape[-1], w.group_size
        q = w.codes().to(torch.float32).reshape(*w.shape[:-1], k // g, g)
        if w.zero:
            q = q - w.zero
        out = q * w.scales.float().unsqueeze(-1)
        if w.offsets is not None:
            out = out + w.offsets.unsqueeze(-1)
        return out.reshape(w.shape).to(dtype)

    def select(self, index) -> "PackedWeight":
        """Index the leading (expert) dimensions: e.g. w.select(e) is expert e's (N, K) weight."""
        q = self.qweight[index]
        s = self.scales[index]
        o = None if self.offsets is None else self.offsets[index]
        lead = tuple(q.shape[:-1])
        return PackedWeight(self.bits, q, s, o, self.group_size, lead + (self.shape[-1],), self.zero)

    def index_select(self, experts: torch.Tensor) -> "PackedWeight":
        """The given experts (indices into the leading dimension) of a stacked (E, N, K) weight, as
        index_select gathers them (a shape that does not depend on the values: CPU graphs record it)."""
        o = None if self.offsets is None else self.offsets.index_select(0, experts)
        return PackedWeight(self.bits, self.qweight.index_select(0, experts), self.scales.index_select(0, experts), o,
                            self.group_size, (experts.numel(),) + self.shape[1:], self.zero)

    def to(self, device) -> "PackedWeight":
        return PackedWeight(self.bits, self.qweight.to(device), self.scales.to(device),
                            None if self.offsets is None else self.offsets.to(device),
                            self.group_size, self.shape, self.zero)

    def compact(self) -> "PackedWeight":
        """The same values in fewer bytes (self where nothing changes): no offsets array where the
        offsets are exactly -z * scales (in float32, as the loaders compute them) for one code z
        (`zero` = z instead), and float16 scales where float16 holds every scale exactly."""
        z = compact_zero(self.bits, self.scales, self.offsets, self.zero)
        s16 = half_scales(self.scales)
        if z is None and s16 is None:
            return self
        return PackedWeight(self.bits, self.qweight, self.scales if s16 is None else s16,
                            self.offsets if z is None else None, self.group_size, self.shape,
                            self.zero if z is None else z)


def compacted_as(w: PackedWeight, offsets_dropped: bool, zero: int, scales16: bool, what: str) -> PackedWeight:
    """w in the form a layer compacted at load holds (`PackedWeight.compact`: offsets dropped for the
    code `zero`, float16 scales), or a ValueError naming `what` and the form it does not fit (a later
    load into that layer cannot change it)."""
    c = w.compact()
    if offsets_dropped and (c.offsets is not None or c.zero != zero):
        raise ValueError(f"{what}: its offsets are not -{zero} * scales, the zero code this layer was served with "
                         f"(its offsets were dropped at load); a weight update cannot change a symmetric format's "
                         f"zero point")
    if scales16 and c.scales.dtype != torch.float16:
        raise ValueError(f"{what}: its scales are not all exact in float16, as this layer's were at load (kept "
                         f"float16); a weight update cannot change that")
    return c


def half_scales(scales: torch.Tensor) -> torch.Tensor | None:
    """float32 scales as float16 where float16 holds each one exactly (an infinite or NaN scale is
    not equal to itself: None), else None (float16 ones: None, nothing to do)."""
    if scales.dtype != torch.float32 or scales.numel() == 0:
        return None
    h = scales.to(torch.float16)
    return h if bool(torch.equal(h.float(), scales)) else None


def compact_zero(bits: int, scales: torch.Tensor, offsets: torch.Tensor | None, zero: int = 0) -> int | None:
    """The code z for which offsets == -(z - zero) * scales holds exactly everywhere (offsets a
    multiple of the scales by one integer), or None (no offsets: nothing to compact; offsets of
    another form: GGUF Q4_K's mins, GPTQ's per-group zero points)."""
    if offsets is None or offsets.numel() == 0:
        return None
    s0, o0 = scales.reshape(-1), offsets.reshape(-1)
    i = int(torch.argmax(s0.abs()))
    if float(s0[i]) == 0.0:
        return None
    z = zero - round(float(o0[i]) / float(s0[i]))
    if not 0 <= z < (1 << bits):
        return None
    if not bool(torch.equal(offsets, -float(z - zero) * scales.float())):
        return None
    return z


def quantize_reference(w: torch.Tensor, bits: int, group_size: int, symmetric: bool = True
                       ) -> PackedWeight:
    """A float weight (..., N, K) rounded to a PackedWeight (for tests and tools): symmetric stores the
    signed code plus 2 ** (bits - 1) with offsets = -2 ** (bits - 1) * scale; asymmetric uses a min/max
    zero point."""
    shape = tuple(w.shape)
    k = shape[-1]
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size={group_size} must divide K={k}")
    wf = w.to(torch.float32).reshape(*shape[:-1], k // group_size, group_size)
    qmax = 2 ** bits - 1
    if symmetric:
        half = 2 ** (bits - 1)
        scale = wf.abs().amax(-1).clamp(min=1e-12) / (half - 1)
        q = torch.clamp(torch.round(wf / scale.unsqueeze(-1)) + half, 0, qmax)
        offsets = -half * scale
    else:
        lo, hi = wf.amin(-1).clamp(max=0), wf.amax(-1).clamp(min=0)
        scale = ((hi - lo) / qmax).clamp(min=1e-12)
        z = torch.clamp(torch.round(-lo / scale), 0, qmax)
        q = torch.clamp(torch.round(wf / scale.unsqueeze(-1)) + z.unsqueeze(-1), 0, qmax)
        offsets = -z * scale
    q = q.to(torch.uint8).reshape(shape)
    qweight = pack_nibbles(q) if bits == 4 else q.contiguous()
    return PackedWeight(bits, qweight, scale.contiguous(), offsets.contiguous(), group_size, shape)
