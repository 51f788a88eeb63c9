"""AutoAWQ checkpoints (quant_method "awq", version "gemm") and GPTQ checkpoints (quant_method "gptq",
without activation order: `GptqScheme`), kept packed (moe_serve/quantization/packed.py).

quantization_config = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true,
"version": "gemm", "modules_to_not_convert": [...]}. Each quantized linear module <m> (attention
projections, per-expert gate/up/down) has, for a weight of logical shape (N out, K in):
  <m>.qweight  int32 (K, N / 8): eight 4-bit codes a word along N, in AutoAWQ's interleaved order:
               the code at bits [4p, 4p + 4) of word c is column 8c + ORDER[p], ORDER = 0 2 4 6 1 3 5 7;
  <m>.qzeros   int32 (K / G, N / 8): the unsigned zero points, packed the same way;
  <m>.scales   (K / G, N) float16.
The value is (q - z) * scale (zero_point false: (q - 8) * scale), so in PackedWeight's terms the
code is q, offsets = -z * scale. Anything else in the config (another version, bits, a group size
that does not divide K) is refused, naming the field and the format.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from moe_serve.quantization.parts import PartsCollector, name_list
from moe_serve.quantization.packed import PackedWeight, pack_nibbles, unpack_nibbles

METHOD = "awq"
FORMAT = "gemm"
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
REVERSE = tuple(ORDER.index(j) for j in range(8))  # column j of a word sits at position REVERSE[j]
SUFFIXES = ("qweight", "qzeros", "scales")


@dataclass(frozen=True)
class AwqScheme:
    bits: int
    group_size: int  # -1 (per channel) is resolved per module
    zero_point: bool
    not_converted: tuple[str, ...]

    @staticmethod
    def from_hf(q: dict) -> "AwqScheme":
        version = str(q.get("version", "gemm")).lower()
        if version != FORMAT:
            raise ValueError(f"quantization_config.version={q.get('version')!r} (awq): only 'gemm' is supported")
        bits = q.get("bits", q.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"quantization_config.bits={bits!r} (awq, gemm): only 4 is supported")
        gs = _group_size(q.get("group_size", q.get("q_group_size", 128)), "awq")
        return AwqScheme(4, gs, bool(q.get("zero_point", True)), name_list(q, "modules_to_not_convert", METHOD))


def _group_size(gs, method: str) -> int:
    """quantization_config.group_size: a positive int, or -1 (per channel)."""
    if not isinstance(gs, int) or (gs <= 0 and gs != -1):
        raise ValueError(f"quantization_config.group_size={gs!r} ({method}): a positive int or -1 is needed")
    return gs


def _group_of(scales: torch.Tensor, N: int, K: int, group_size: int, module: str, method: str) -> int:
    """The group size scales (K / G, N) give a weight (N out, K in), checked against the config's."""
    groups = scales.shape[0]
    if tuple(scales.shape) != (groups, N) or groups == 0 or K % groups:
        raise ValueError(f"tensor {module}.scales has shape {tuple(scales.shape)}: (K / group, {N}) with K = {K} "
                         f"expected ({method})")
    if group_size not in (-1, K // groups):
        raise ValueError(f"{module}: scales give group size {K // groups}, quantization_config.group_size is "
                         f"{group_size} ({method})")
    return K // groups


def _unpack_columns(t: torch.Tensor, what: str) -> torch.Tensor:
    """int32 (R, C / 8) in AWQ's order -> unsigned codes uint8 (R, C) in column order."""
    if t.dtype != torch.int32:
        raise ValueError(f"tensor {what} has dtype {t.dtype}, expected torch.int32")
    nib = unpack_nibbles(t.contiguous().view(torch.uint8))  # (R, 8 * words): position order
    if __import__("sys").byteorder == "big":
        nib = nib.view(t.shape[0], -1, 4, 2).flip(-2).reshape(t.shape[0], -1)
    R, C = nib.shape
    return nib.view(R, C // 8, 8)[..., list(REVERSE)].reshape(R, C)


def to_packed(parts: dict[str, torch.Tensor], scheme: AwqScheme, module: str) -> PackedWeight:
    qweight, scales = parts["qweight"], parts["scales"]
    if qweight.dim() != 2 or scales.dim() != 2:
        raise ValueError(f"{module}: qweight {tuple(qweight.shape)} and scales {tuple(scales.shape)} must be 2-D (awq)")
    K, N = qweight.shape[0], qweight.shape[1] * 8
    G = _group_of(scales, N, K, scheme.group_size, module, METHOD)
    groups = K // G
    q = _unpack_columns(qweight, f"{module}.qweight")  # (K, N)
    codes = pack_nibbles(q.t().contiguous())  # (N, K / 2)
    s = scales.t().to(torch.float32).contiguous()  # (N, K / G)
    if scheme.zero_point:
        z = parts["qzeros"]
        if tuple(z.shape) != (groups, N // 8):
            raise ValueError(f"tensor {module}.qzeros has shape {tuple(z.shape)}, expected {(groups, N // 8)} (awq)")
        zero = _unpack_columns(z, f"{module}.qzeros").t().to(torch.float32)
    else:
        zero = torch.full_like(s, 8.0)
    return PackedWeight(4, codes, s, (-zero * s).contiguous(), G, (N, K))


class AwqTensors(PartsCollector):
    """Collects each AWQ module's tensors (parts.PartsCollector)."""

    method, format = METHOD, FORMAT
    needed = "qweight and scales (and qzeros with zero_point)"

    @staticmethod
    def split_name(name: str) -> tuple[str, str] | None:
        module, _, suffix = name.rpartition(".")
        return (module, suffix) if suffix in SUFFIXES and module else None

    @staticmethod
    def is_weight(suffix: str) -> bool:
        return suffix == "qweight"

    def scheme(self, raw: str) -> AwqScheme:
        module = raw.rpartition(".")[0]
        if any(re.search(rf"(^|\.){re.escape(s)}(\.|$)", module) for s in self.cfg.not_converted):
            raise ValueError(f"tensor {raw!r} is quantized (awq, gemm), but quantization_config.modules_to_not_convert "
                             f"names module {module!r}")
        return self.cfg

    def needs(self, scheme: AwqScheme) -> set[str]:
        return {"qweight", "scales"} | ({"qzeros"} if scheme.zero_point else set())

    def convert(self, parts: dict[str, torch.Tensor], scheme: AwqScheme, module: str) -> PackedWeight:
        return to_packed(parts, scheme, module)


# --- GPTQ (AutoGPTQ / GPTQModel) ---------------------------------------------------------------------
GPTQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class GptqScheme:
    """quantization_config = {"quant_method": "gptq", "bits": 4 | 8, "group_size": G | -1, "sym": ...,
    "desc_act": ..., "checkpoint_format": "gptq" | "gptq_v2"}. Per module <m>, weight (N out, K in):
      <m>.qweight  int32 (K * bits / 32, N): codes packed along K, row k of word column n at bits
                   bits * (k % (32 / bits)) of word k // (32 / bits);
      <m>.qzeros   int32 (K / G, N * bits / 32): zero points packed along N the same way, stored minus
                   one ("gptq", v1: read back as (stored + 1) mod 2 ** bits) or as they are ("gptq_v2");
      <m>.scales   (K / G, N) float16;  <m>.g_idx  int32 (K,): each input's group.
    The value is scale * (q - z): code q, offsets = -z * scale. An activation order (g_idx other
    than k // G) is refused, naming the module."""
    bits: int
    group_size: int  # -1: per channel
    v2: bool

    @staticmethod
    def from_hf(q: dict) -> "GptqScheme":
        bits = q.get("bits")
        if bits not in (4, 8):
            raise ValueError(f"quantization_config.bits={bits!r} (gptq): only 4 and 8 are supported")
        gs = _group_size(q.get("group_size", 128), "gptq")
        fmt = q.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config.checkpoint_format={fmt!r} (gptq): only 'gptq' and 'gptq_v2' "
                             f"are supported")
        for field in ("modules_in_block_to_quantize", "dynamic"):
            if q.get(field):
                raise ValueError(f"quantization_config.{field}={q[field]!r} (gptq): not supported yet")
        return GptqScheme(int(bits), gs, fmt == "gptq_v2")


def _unpack_rows(t: torch.Tensor, bits: int, what: str) -> torch.Tensor:
    """int32 (R, C) holding 32 / bits codes a word along R -> uint8 (R * 32 / bits, C) in order."""
    if t.dtype != torch.int32:
        raise ValueError(f"tensor {what} has dtype {t.dtype}, expected torch.int32")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (t.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)  # (R, 32 / bits, C)
    return codes.reshape(-1, t.shape[1]).to(torch.uint8)


def gptq_to_packed(parts: dict[str, torch.Tensor], scheme: GptqScheme, module: str) -> PackedWeight:
    bits, per = scheme.bits, 32 // scheme.bits
    qweight, scales = parts["qweight"], parts["scales"]
    if qweight.dim() != 2 or scales.dim() != 2:
        raise ValueError(f"{module}: qweight {tuple(qweight.shape)} and scales {tuple(scales.shape)} must be 2-D "
                         f"(gptq)")
    K, N = qweight.shape[0] * per, qweight.shape[1]
    G = _group_of(scales, N, K, scheme.group_size, module, "gptq")
    groups = K // G
    g_idx = parts.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(K) // G):
        raise ValueError(f"tensor {module}.g_idx is not k // group_size: activation-ordered GPTQ (desc_act with "
                         f"permuted groups) is not supported yet")
    z = parts["qzeros"]
    if tuple(z.shape) != (groups, N // per):
        raise ValueError(f"tensor {module}.qzeros has shape {tuple(z.shape)}, expected {(groups, N // per)} (gptq)")
    zero = _unpack_rows(z.t().contiguous(), bits, f"{module}.qzeros").t().to(torch.int32)  # (groups, N)
    if not scheme.v2:
        zero = (zero + 1) & ((1 << bits) - 1)
    q = _unpack_rows(qweight, bits, f"{module}.qweight").t().contiguous()  # (N, K)
    s = scales.t().to(torch.float32).contiguous()
    codes = pack_nibbles(q) if bits == 4 else q
    return PackedWeight(bits, codes, s, (-zero.t().to(torch.float32) * s).contiguous(), G, (N, K))


class GptqTensors(AwqTensors):
    """Collects each GPTQ module's tensors (parts.PartsCollector)."""

    method, format = "gptq", "gptq"
    needed = "qweight, qzeros, scales and g_idx"

    @staticmethod
    def split_name(name: str) -> tuple[str, str] | None:
        module, _, suffix = name.rpartition(".")
        return (module, suffix) if suffix in GPTQ_SUFFIXES and module else None

    def scheme(self, raw: str) -> GptqScheme:
        return self.cfg

    def needs(self, scheme: GptqScheme) -> set[str]:
        return {"qweight", "scales", "qzeros", "g_idx"}

    def convert(self, parts: dict[str, torch.Tensor], scheme: GptqScheme, module: str) -> PackedWeight:
        return gptq_to_packed(parts, scheme, module)
