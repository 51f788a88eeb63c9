"""Block-scaled FP8 weights, as DeepSeek-V3 put them on the Hub.

quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}: each quantized linear weight (out, in) is float8_e4m3fn, with a
float32 `<name>_scale_inv` of shape (ceil(out / 128), ceil(in / 128)); the real weight is
q * scale_inv of its block (blocks at the right and bottom edges are partial). The router, norms,
embeddings and LM head stay unquantized; which tensors are FP8 is read from the checkpoint (a
weight with a `_scale_inv` beside it).

Weights stay FP8 in memory (half of bf16's bytes). Weight-only compute: a linear or expert op
dequantizes the blocks it needs into the activations' dtype when it runs (one layer's weights, or
one step's routed experts, at a time), never a dequantized copy of the model. `--quantization fp8`
quantizes an unquantized checkpoint to the same layout while it loads, tensor by tensor.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

log = logging.getLogger("moe_serve.quantization")

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


@dataclass(frozen=True)
class BlockFp8Config:
    block: tuple[int, int] = (128, 128)
    # "float" (float32 scale_inv, DeepSeek-V3) or "ue8m0" (one exponent byte per block: 2 ** (b - 127),
    # DeepSeek-V4; stored as float8_e8m0fnu or uint8)
    scale_fmt: str = "float"
    expert_dtype: str = "fp8"  # "fp4": the routed experts are MXFP4-packed instead (DeepSeek-V4)

    @staticmethod
    def from_hf(q: dict) -> "BlockFp8Config":
        """Validate a checkpoint's quantization_config; errors name the field."""
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt={fmt!r}: only 'e4m3' FP8 is supported")
        scheme = q.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"quantization_config.activation_scheme={scheme!r}: only 'dynamic' is supported "
                             "(weights carry their scales; activations are not pre-scaled)")
        block = q.get("weight_block_size")
        if block is None:
            raise ValueError("quantization_config.weight_block_size is missing: only block-scaled FP8 "
                             "(e.g. [128, 128]) is supported, not per-tensor FP8")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"quantization_config.weight_block_size={block!r} must be two positive ints")
        scale_fmt = q.get("scale_fmt") or "float"
        if scale_fmt not in ("float", "ue8m0"):
            raise ValueError(f"quantization_config.scale_fmt={scale_fmt!r} must be 'float' or 'ue8m0'")
        expert_dtype = q.get("expert_dtype") or "fp8"
        if expert_dtype not in ("fp8", "fp4"):
            raise ValueError(f"quantization_config.expert_dtype={expert_dtype!r} must be 'fp8' or 'fp4'")
        return BlockFp8Config((int(block[0]), int(block[1])), scale_fmt, expert_dtype)


def scale_to_float32(t: torch.Tensor) -> torch.Tensor:
    """A checkpoint's block scales as float32 values: float8_e8m0fnu and raw e8m0 bytes (uint8) are
    powers of two, 2 ** (b - 127); float scales as they are."""
    if t.dtype == torch.uint8:
        return torch.exp2(t.to(torch.float32) - 127.0)
    return t.to(torch.float32)


def scale_to_e8m0(t: torch.Tensor) -> torch.Tensor:
    """Block scales as e8m0 bytes (uint8): float8_e8m0fnu's bits, raw bytes, or float32 powers of two
    (anything else is refused: MXFP4 keeps one exponent per 32 values)."""
    if t.dtype == torch.uint8:
        return t
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if e8m0 is not None and t.dtype == e8m0:
        return t.view(torch.uint8)
    f = t.to(torch.float32)
    exp = torch.log2(f).round()
    if not torch.equal(torch.exp2(exp), f) or exp.min() < -127 or exp.max() > 127:
        raise ValueError("FP4 expert scales must be powers of two (e8m0)")
    return (exp + 127).to(torch.uint8)


def scale_shape(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., R, C) float -> (FP8 values, float32 scale_inv (..., ceil(R/b0), ceil(C/b1))) with each
    block scaled so its largest magnitude maps to FP8's largest value (DeepSeek's recipe)."""
    *lead, R, C = w.shape
    b0, b1 = block
    nr, nc = scale_shape(R, C, block)
    wf = w.to(torch.float32)
    padded = torch.zeros(*lead, nr * b0, nc * b1, dtype=torch.float32, device=w.device)
    padded[..., :R, :C] = wf
    blocks = padded.view(*lead, nr, b0, nc, b1)
    amax = blocks.abs().amax(dim=(-3, -1))  # (..., nr, nc)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(*lead, nr * b0, nc * b1)[..., :R, :C].contiguous(), scale


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """(..., R, C) FP8 values times their blocks' scale_inv, in `dtype` (computed in float32)."""
    R, C = q.shape[-2:]
    s = scale_inv.repeat_interleave(block[0], dim=-2)[..., :R, :].repeat_interleave(block[1], dim=-1)[..., :C]
    return (q.to(torch.float32) * s).to(dtype)


class BlockFp8Experts:
    """A stacked expert projection in block FP8, for the expert op: values (E, R, C) and scale_inv
    (E, sum of the parts' row blocks, ceil(C/b1)). `parts` are the row counts quantized separately:
    w13 stacks gate then up (F rows each, their own block grids, as in the checkpoint), w2 is one
    part. Same interface as the MXFP4 weights (`shape`, `dequantize`)."""

    def __init__(self, q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], parts: tuple[int, ...],
                 act_quant: bool = False):
        self.q, self.scale_inv, self.block, self.parts = q, scale_inv, block, parts
        self.act_quant = act_quant  # the Triton kernel quantizes activations too (W8A8)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.q.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    def dequantize(self, dtype: torch.dtype, experts: torch.Tensor | None = None,
                   workspace: str | None = None) -> torch.Tensor:
        del workspace  # the MXFP4 interface's buffer reuse; FP8 dequantizes into a fresh tensor
        q, s = self.q, self.scale_inv
        if experts is not None:
            q, s = q.index_select(0, experts), s.index_select(0, experts)
        if len(self.parts) == 1:
            return dequantize_blocks(q, s, self.block, dtype)
        out, r0, s0 = [], 0, 0
        for rows in self.parts:
            nr = math.ceil(rows / self.block[0])
            out.append(dequantize_blocks(q[:, r0:r0 + rows], s[:, s0:s0 + nr], self.block, dtype))
            r0, s0 = r0 + rows, s0 + nr
        return torch.cat(out, dim=1)


def checkpoint_config(hf: dict) -> BlockFp8Config | None:
    q = hf.get("quantization_config") or {}
    return BlockFp8Config.from_hf(q) if q.get("quant_method") == "fp8" else None


def to_block_fp8(model: torch.nn.Module, block: tuple[int, int], weight_names: set[str] | None) -> int:
    """Give FP8 storage to the weights that will be loaded as FP8: `weight_names` (our names of the
    checkpoint's weights that have a `_scale_inv`, expert weights as `<prefix>.experts`), or, for
    `--quantization fp8` (None), every quantizable linear layer and every expert stack. Returns the
    number of modules converted. Modules are converted before any tensor is read, so the
    unquantized allocation they replace was never filled."""
    # Duck-typed, so this module needs neither layers nor expert_parallel (both import it): a module
    # that can hold FP8 weights has `to_block_fp8` and names its checkpoint key's suffix.
    n = 0
    for name, m in model.named_modules():
        if not hasattr(m, "to_block_fp8"):
            continue
        if weight_names is None:
            if getattr(m, "weight_used_directly", False) or not getattr(m, "quantizable", True):
                continue
        elif name + m.fp8_checkpoint_suffix not in weight_names:
            continue
        m.to_block_fp8(block)
        n += 1
    return n


def dequantized_at_load(m: torch.nn.Module) -> bool:
    """Whether `m` holds its weight dense though a block-FP8 checkpoint may give it in FP8 blocks
    (`finish_block_fp8` dequantized them, or will): a layer whose weight the model reads directly."""
    return getattr(m, "weight_used_directly", False) and hasattr(m, "dense_weight")


def finish_block_fp8(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """After loading: a layer whose weight the model reads directly (MLA's kv_b_proj, split into
    its absorbed halves) is dequantized once into the model's dtype (it is small). Weights replaced
    later take the same dequantization on arrival (moe_serve/weights.py, `_TensorLoader`)."""
    for m in model.modules():
        if getattr(m, "weight_scale_inv", None) is not None and dequantized_at_load(m):
            dense = m.dense_weight(dtype)
            m.weight = torch.nn.Parameter(dense, requires_grad=False)
            m.weight_scale_inv = None
            m.fp8_block = None
