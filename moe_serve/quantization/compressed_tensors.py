"""compressed-tensors checkpoints (quant_method "compressed-tensors", as llm-compressor writes them):
int4 / int8 weights kept packed (moe_serve/quantization/packed.py).

What is served:
- format "pack-quantized", weight-only integer schemes (W4A16 and W8A16), symmetric or asymmetric
  (a zero point), per group (`strategy: "group"`, a group size dividing the input dimension) or per
  channel (`strategy: "channel"`);
- format "int-quantized", 8-bit integer weights per channel or group (W8A8 int8, llm-compressor's
  INT8 schemes), with activations int8 per token, dynamic, symmetric or none. The weights are kept
  int8. Where the Triton packed kernels run them on CUDA (moe_serve/prepare.py, per-channel weights)
  the activations are quantized per token as the scheme says; elsewhere they stay float (torch ops
  and cpu_ops/quant.c dequantize the weights and multiply float activations: the package's own
  decompression, what transformers computes from the decompressed checkpoint).
- format "float-quantized", FP8 e4m3 weights per channel (FP8_DYNAMIC: activations FP8 per token,
  dynamic, or none): kept FP8 in block-FP8 storage (moe_serve/quantization/fp8.py) with one block a
  row, (1, K) for a linear layer and (1, max(D, F)) for experts, whose float32 scale is the row's
  scale: exact. Activations stay float in the torch and C paths and the experts (the block-FP8
  ops' weight-only path); the Triton block-FP8 linear kernel quantizes them per token on sm_89+
  (moe_serve/prepare.py's choice for every block-FP8 layer), which is this checkpoint's scheme.
Anything else in the config (another format; static, per-tensor or per-group activation
quantization; an activation order that needs g_idx; a KV cache scheme; a sparsity or transform
config; formats mixed across groups) is refused at start-up, naming the field and the format.

On disk, for each quantized module <m> (a linear layer, or one expert's gate_proj / up_proj /
down_proj):
- pack-quantized:
  <m>.weight_packed      int32 (N, ceil(K * bits / 32)): code i at bits [i * bits, (i + 1) * bits)
                         of the little-endian words, the signed value plus 2 ** (bits - 1);
  <m>.weight_scale       (N, K / G) in the model's dtype (per channel: (N, 1));
  <m>.weight_zero_point  int32, asymmetric only: the signed zero points (N, K / G) packed the same
                         way along N (ceil(N * bits / 32), K / G);
  <m>.weight_shape       int64 (2,): (N, K).
- int-quantized:
  <m>.weight             int8 (N, K), the signed values;
  <m>.weight_scale       (N, K / G) float;
  <m>.weight_zero_point  int8 (N, K / G), asymmetric only.
- float-quantized: <m>.weight float8_e4m3fn (N, K), <m>.weight_scale float (N, 1); the value is
  weight * scale (`Fp8ChannelWeight`).
The value is (signed q - zero point) * scale, so in PackedWeight's terms the code is the stored
unsigned code u = q + 2 ** (bits - 1), the scale as given, and offsets = -(2 ** (bits - 1) + z) *
scale (symmetric: z = 0). Which modules are quantized is read from the tensors (a module with a
`weight_packed`, or for int- and float-quantized a `weight_scale`) and checked against the config's
config_groups targets and `ignore` list: a packed module that no group targets, or that the config
ignores, is an error naming it.
"""
from __future__ import annotations

import logging
import re
import sys
from dataclasses import dataclass

import torch

from moe_serve.quantization.parts import PartsCollector, name_list
from moe_serve.quantization.packed import PackedWeight

log = logging.getLogger("moe_serve.quantization")

METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
INT_FORMAT = "int-quantized"
FLOAT_FORMAT = "float-quantized"
FORMATS = (FORMAT, INT_FORMAT, FLOAT_FORMAT)
SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
# scales rounded to one of these before saving are read as stored (the default: the model's dtype)
_FLOAT_DTYPES = (None, "torch.float32", "torch.bfloat16", "torch.float16", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class WeightScheme:
    """One config group's weight quantization, as served."""
    bits: int
    symmetric: bool
    strategy: str  # "group" | "channel"
    group_size: int | None  # strategy "group" only
    format: str = FORMAT  # how the weight is stored: FORMAT, INT_FORMAT or FLOAT_FORMAT
    activations: str | None = None  # "int8 / fp8 per token, dynamic" (applied where a kernel has the form)


@dataclass(frozen=True)
class CompressedTensorsConfig:
    groups: tuple[tuple[str, tuple[str, ...], WeightScheme], ...]  # (group name, targets, scheme)
    ignore: tuple[str, ...]

    @staticmethod
    def from_hf(q: dict) -> "CompressedTensorsConfig":
        """Validate a checkpoint's quantization_config; errors name the field and the format."""
        top = q.get("format")
        if top not in FORMATS + ("mixed-precision", None):
            raise ValueError(f"quantization_config.format={top!r} (compressed-tensors): only {FORMAT!r} (int4 / "
                             f"int8 weights packed in int32 words), {INT_FORMAT!r} (int8 weights) and "
                             f"{FLOAT_FORMAT!r} (FP8 weights per channel) are supported")
        status = q.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"quantization_config.quantization_status={status!r} (compressed-tensors): only "
                             f"'compressed' checkpoints are supported")
        for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
            if q.get(field):
                raise ValueError(f"quantization_config.{field}={q[field]!r} (compressed-tensors): not supported yet")
        groups = q.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError("quantization_config.config_groups (compressed-tensors) is missing or empty")
        parsed = []
        for name, scheme in groups.items():
            where = f"quantization_config.config_groups.{name}"
            if not isinstance(scheme, dict):
                raise ValueError(f"{where}={scheme!r} (compressed-tensors): only explicit schemes (targets, weights) "
                                 f"are supported, not preset names")
            parsed.append((name, _targets(scheme, where), _weight_scheme(scheme, where, top)))
        formats = {scheme.format for _, _, scheme in parsed}
        if len(formats) > 1:
            raise ValueError(f"quantization_config.config_groups (compressed-tensors) mix the formats "
                             f"{sorted(formats)}: one format a checkpoint is supported")
        return CompressedTensorsConfig(tuple(parsed), name_list(q, "ignore", METHOD))

    @property
    def format(self) -> str:
        return self.groups[0][2].format

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme of the first group that targets `module` (our checkpoint-named module), or None
        when none does or the config ignores it."""
        if any(_matches(t, module) for t in self.ignore):
            return None
        for _, targets, scheme in self.groups:
            if any(_matches(t, module) for t in targets):
                return scheme
        return None


def _targets(scheme: dict, where: str) -> tuple[str, ...]:
    targets = scheme.get("targets")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{where}.targets={targets!r} (compressed-tensors) must be a non-empty list of names")
    for t in targets:
        if not (t == "Linear" or t.startswith("re:") or "." in t or t == "lm_head"):
            raise ValueError(f"{where}.targets contains {t!r} (compressed-tensors): only 'Linear', 're:<regex>' "
                             f"and module names are supported as targets")
    return tuple(targets)


def _weight_scheme(scheme: dict, where: str, top_format) -> WeightScheme:
    fmt = scheme.get("format") or top_format
    if fmt not in FORMATS:
        raise ValueError(f"{where}.format={fmt!r} (compressed-tensors): only {', '.join(map(repr, FORMATS))} are "
                         f"supported")
    if scheme.get("output_activations") is not None:
        raise ValueError(f"{where}.output_activations={scheme['output_activations']!r} (compressed-tensors, {fmt}): "
                         f"output activation quantization is not supported")
    activations = _activations(scheme.get("input_activations"), f"{where}.input_activations", fmt)
    w = scheme.get("weights")
    if not isinstance(w, dict):
        raise ValueError(f"{where}.weights={w!r} (compressed-tensors): a weight scheme is required")
    w_where = f"{where}.weights"
    bits = (4, 8) if fmt == FORMAT else (8,)
    kind = "float" if fmt == FLOAT_FORMAT else "int"
    strategies = ("channel",) if fmt == FLOAT_FORMAT else ("group", "channel")
    checks = [("type", w.get("type", "int") == kind, f"only {kind!r}"),
              ("num_bits", w.get("num_bits") in bits, f"only {' and '.join(map(str, bits))}"),
              ("strategy", w.get("strategy") in strategies, f"only {' and '.join(map(repr, strategies))}"),
              ("dynamic", not w.get("dynamic", False), "only static (false)"),
              ("actorder", w.get("actorder") in (None, "static", "weight"),
               "only none, 'static' or 'weight' (a 'group' order needs g_idx, not supported yet)"),
              ("scale_dtype", w.get("scale_dtype") in _FLOAT_DTYPES, "only float scales (or the default) are"),
              ("zp_dtype", w.get("zp_dtype") in (None, "torch.int8", "int8"), "only int8 zero points (the default)")]
    for field, ok, allowed in checks:
        if not ok:
            raise ValueError(f"{w_where}.{field}={w.get(field)!r} (compressed-tensors, {fmt}): {allowed} supported")
    gs = w.get("group_size")
    if w["strategy"] == "group" and (not isinstance(gs, int) or gs <= 0):
        raise ValueError(f"{w_where}.group_size={gs!r} (compressed-tensors): strategy 'group' needs a positive int")
    return WeightScheme(int(w["num_bits"]), bool(w.get("symmetric", True)), w["strategy"],
                        int(gs) if w["strategy"] == "group" else None, fmt, activations)


def _activations(a, where: str, fmt: str) -> str | None:
    """The input activations' scheme as served: none, or (int- / float-quantized weights) 8-bit of the
    weights' type per token, dynamic and symmetric, which our kernels compute on float activations
    (module docstring)."""
    if a is None:
        return None
    if fmt == FORMAT:
        raise ValueError(f"{where}={a!r} (compressed-tensors, {fmt}): activation quantization over {fmt} weights "
                         f"(e.g. W4A8) is not supported; weight-only schemes (W4A16, W8A16), {INT_FORMAT!r} W8A8 "
                         f"and {FLOAT_FORMAT!r} FP8 dynamic are")
    if not isinstance(a, dict):
        raise ValueError(f"{where}={a!r} (compressed-tensors): an activation scheme (a dict) is expected")
    kind = "float" if fmt == FLOAT_FORMAT else "int"
    checks = [("type", a.get("type", "int") == kind, f"only {kind!r}"), ("num_bits", a.get("num_bits") == 8, "only 8"),
              ("strategy", a.get("strategy") == "token", "only 'token'"),
              ("dynamic", a.get("dynamic") is True, "only dynamic (true: no input_scale tensors)"),
              ("symmetric", a.get("symmetric", True) is True, "only symmetric")]
    for field, ok, allowed in checks:
        if not ok:
            raise ValueError(f"{where}.{field}={a.get(field)!r} (compressed-tensors, {fmt}, 8-bit activations): "
                             f"{allowed} supported")
    return f"{'fp8' if kind == 'float' else 'int8'} per token, dynamic"


def _matches(target: str, module: str) -> bool:
    """compressed-tensors' target rule on a module name: 're:<regex>' matched from the start, a
    name equal to the module's or to its last component(s), 'Linear' any module given to us."""
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)


def split_name(name: str) -> tuple[str, str] | None:
    """(module, suffix) of a compressed-tensors weight tensor's name, else None."""
    module, _, suffix = name.rpartition(".")
    return (module, suffix) if suffix in SUFFIXES and module else None


def unpack_codes(t: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """int32 words (..., W), codes packed along the last dimension from bit 0 of the little-endian
    words -> the bytes holding the first n codes, uint8 (..., ceil(n * bits / 8)): bits 8 one code
    a byte, bits 4 two (the even element in the low nibble: PackedWeight's layout)."""
    if t.dtype != torch.int32:
        raise ValueError(f"packed tensor has dtype {t.dtype}, expected torch.int32")
    b = t.contiguous().view(torch.uint8)
    if sys.byteorder == "big":  # the words' bytes in little-endian order
        b = b.view(*t.shape, 4).flip(-1).reshape(*t.shape[:-1], -1)
    per_byte = 8 // bits
    need = (n + per_byte - 1) // per_byte
    if b.shape[-1] < need:
        raise ValueError(f"packed tensor has {b.shape[-1]} bytes a row, fewer than {need} for {n} {bits}-bit codes")
    return b[..., :need]


def signed_codes(t: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """int32 words -> the signed values they pack (int32, (..., n))."""
    from moe_serve.quantization.packed import unpack_nibbles

    b = unpack_codes(t, bits, n)
    u = unpack_nibbles(b)[..., :n] if bits == 4 else b
    return u.to(torch.int32) - (1 << (bits - 1))


def to_packed(parts: dict[str, torch.Tensor], scheme: WeightScheme, module: str) -> PackedWeight:
    """One module's compressed-tensors tensors (by suffix) as a PackedWeight; errors name the module."""
    if scheme.format == INT_FORMAT:
        return int8_to_packed(parts, scheme, module)
    if scheme.format == FLOAT_FORMAT:
        return fp8_channel(parts, module)
    bits = scheme.bits
    shape = parts["weight_shape"].reshape(-1).tolist()
    if len(shape) != 2:
        raise ValueError(f"tensor {module}.weight_shape={shape}: expected (out, in)")
    N, K = int(shape[0]), int(shape[1])
    G, scale = _group_scales(parts, scheme, module, N, K)
    if bits == 4 and K % 2:
        raise ValueError(f"{module}: 4-bit weights need an even input dimension, got {K}")
    packed = parts["weight_packed"]
    words = -(-K * bits // 32)
    if tuple(packed.shape) != (N, words):
        raise ValueError(f"tensor {module}.weight_packed has shape {tuple(packed.shape)}, expected {(N, words)} for "
                         f"a {bits}-bit weight of shape {(N, K)}")
    qweight = unpack_codes(packed, bits, K).contiguous().clone()  # its own storage: the int32 words go
    z = parts.get("weight_zero_point")
    if scheme.symmetric and z is not None:
        raise ValueError(f"tensor {module}.weight_zero_point: the scheme is symmetric, no zero point expected")
    if not scheme.symmetric:
        if z is None:
            raise ValueError(f"{module}: asymmetric scheme without weight_zero_point")
        zw = -(-N * bits // 32)
        if tuple(z.shape) != (zw, K // G):
            raise ValueError(f"tensor {module}.weight_zero_point has shape {tuple(z.shape)}, expected {(zw, K // G)}")
        zero = signed_codes(z.t(), bits, N).t().to(torch.float32)  # packed along N
    else:
        zero = torch.zeros_like(scale)
    offsets = (-(float(1 << (bits - 1)) + zero) * scale).contiguous()
    return PackedWeight(bits, qweight, scale, offsets, G, (N, K))


def _group_scales(parts: dict[str, torch.Tensor], scheme: WeightScheme, module: str, N: int, K: int
                  ) -> tuple[int, torch.Tensor]:
    """The group size G of a weight (N, K) under `scheme`, and its weight_scale (N, K / G) as float32."""
    G = scheme.group_size if scheme.strategy == "group" else K
    if K % G:
        raise ValueError(f"{module}: group_size {G} does not divide the input dimension {K} (compressed-tensors "
                         f"{scheme.format}); only group sizes that divide it are supported")
    scale = parts["weight_scale"]
    if tuple(scale.shape) != (N, K // G):
        raise ValueError(f"tensor {module}.weight_scale has shape {tuple(scale.shape)}, expected {(N, K // G)}")
    return G, scale.to(torch.float32).contiguous()


def int8_to_packed(parts: dict[str, torch.Tensor], scheme: WeightScheme, module: str) -> PackedWeight:
    """An int-quantized module's int8 weight (N, K), scales and zero points as a PackedWeight."""
    q = parts["weight"]
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"tensor {module}.weight is {q.dtype} {tuple(q.shape)}: {INT_FORMAT} (compressed-tensors) "
                         f"stores a 2-D torch.int8 weight")
    N, K = q.shape
    G, scale = _group_scales(parts, scheme, module, N, K)
    z = parts.get("weight_zero_point")
    if scheme.symmetric:
        zero = torch.zeros_like(scale)
    elif z is None:
        raise ValueError(f"{module}: asymmetric scheme without weight_zero_point")
    elif tuple(z.shape) != (N, K // G):
        raise ValueError(f"tensor {module}.weight_zero_point has shape {tuple(z.shape)}, expected {(N, K // G)}")
    else:
        zero = z.to(torch.float32)
    codes = (q.to(torch.int16) + 128).to(torch.uint8).contiguous()
    return PackedWeight(8, codes, scale, (-(128.0 + zero) * scale).contiguous(), G, (N, K))


@dataclass
class Fp8ChannelWeight:
    """A float-quantized module's weight: FP8 e4m3 values (N, K) and float32 scales (N, 1), value =
    q * scale. Layers keep it as block FP8 with one block a row (Linear.load_packed,
    PackedExperts.load), in the storage made for an 8-bit per-channel packed weight (one byte a
    weight, one float32 scale a row)."""
    q: torch.Tensor
    scales: torch.Tensor

    bits, group_size = 8, None  # what the loader's storage pass asked for: 8 bits, one group a row

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.to(torch.float32) * self.scales).to(dtype)


def fp8_channel(parts: dict[str, torch.Tensor], module: str) -> Fp8ChannelWeight:
    """A float-quantized module's FP8 weight and per-row scales; errors name the tensor."""
    from moe_serve.quantization.fp8 import FP8

    q, scale = parts["weight"], parts["weight_scale"]
    if q.dtype != FP8 or q.dim() != 2:
        raise ValueError(f"tensor {module}.weight is {q.dtype} {tuple(q.shape)}: {FLOAT_FORMAT} (compressed-tensors) "
                         f"is served with 2-D torch.float8_e4m3fn weights")
    if tuple(scale.shape) != (q.shape[0], 1):
        raise ValueError(f"tensor {module}.weight_scale has shape {tuple(scale.shape)}, expected {(q.shape[0], 1)} "
                         f"(one scale a row: strategy 'channel')")
    return Fp8ChannelWeight(q.contiguous(), scale.to(torch.float32).contiguous())


class PackedTensors(PartsCollector):
    """Collects each quantized module's tensors as the checkpoint's files give them, in any order;
    `take` returns (module, PackedWeight or Fp8ChannelWeight) once a module has all of its parts,
    None before (module: our name of it)."""

    method = METHOD

    def __init__(self, cfg: CompressedTensorsConfig):
        super().__init__(cfg)
        self.format = cfg.format
        self.scaled: set[str] = set()  # int- / float-quantized: modules seen with a weight_scale
        self.needed = ("weight_packed, weight_scale and weight_shape" if self.format == FORMAT else
                       "weight and weight_scale") + " (and weight_zero_point for an asymmetric scheme)"

    def split_name(self, name: str) -> tuple[str, str] | None:
        """(module, suffix) of a quantized module's tensor, else None. An int- or float-quantized
        weight is named `<m>.weight` like any unquantized one: it is one of a module whose `weight_scale` was seen
        (the loader's storage pass sees every name before any tensor loads)."""
        split = split_name(name)
        if self.format == FORMAT:
            return split
        if split is not None and split[1] == "weight_scale":
            self.scaled.add(split[0])
        module, _, suffix = name.rpartition(".")
        if suffix == "weight" and module in self.scaled:
            return module, suffix
        return split

    def is_weight(self, suffix: str) -> bool:
        """Whether this part names a quantized module (one a module)."""
        return suffix == ("weight_packed" if self.format == FORMAT else "weight_scale")

    def scheme(self, raw: str) -> WeightScheme:
        """The scheme of tensor `raw`'s module, matched by its name in the checkpoint (the config's
        targets and ignore list name the checkpoint's modules)."""
        module = raw.rpartition(".")[0]
        scheme = self.cfg.scheme_for(module)
        if scheme is None:
            raise ValueError(f"tensor {raw!r} is quantized ({METHOD}, {self.format}), but quantization_config's "
                             f"config_groups do not target module {module!r} or its `ignore` list names it")
        return scheme

    def take(self, module: str, suffix: str, t: torch.Tensor, raw: str
             ) -> tuple[str, PackedWeight | Fp8ChannelWeight] | None:
        if suffix == "weight_g_idx":
            raise ValueError(f"tensor {raw!r}: activation-ordered groups (g_idx, {METHOD} {self.format}) are not "
                             f"supported yet")
        return super().take(module, suffix, t, raw)

    def needs(self, scheme: WeightScheme) -> set[str]:
        parts = ({"weight_packed", "weight_scale", "weight_shape"} if scheme.format == FORMAT else
                 {"weight", "weight_scale"})
        return parts | (set() if scheme.symmetric else {"weight_zero_point"})

    def convert(self, parts: dict[str, torch.Tensor], scheme: WeightScheme, module: str):
        return to_packed(parts, scheme, module)


def checkpoint_config(hf: dict) -> CompressedTensorsConfig | None:
    q = hf.get("quantization_config") or {}
    return CompressedTensorsConfig.from_hf(q) if q.get("quant_method") == METHOD else None
