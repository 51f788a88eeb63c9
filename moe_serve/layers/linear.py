"""Linear layers and the dense SwiGLU MLP. The one place a quantized or fused GEMM would plug in."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_serve.kernels.linear import TorchLinear
from moe_serve.quantization.fp8 import FP8, dequantize_blocks, scale_shape
from moe_serve.quantization.packed import PackedWeight, compact_zero, compacted_as, half_scales


class Linear(nn.Module):
    """y = x W^T (+ b). Weight layout (out_features, in_features), as in checkpoints. The GEMM is
    the linear backend bound by moe_serve/platform.py (`ops`; torch ops until then)."""

    op_kind = "linear"
    ops = TorchLinear()

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        self.register_buffer("weight_scale_inv", None)  # block FP8's scales (to_block_fp8)
        for name in ("qweight", "qscales", "qoffsets"):  # a packed int4 / int8 weight (to_packed)
            self.register_parameter(name, None)

    # Block FP8 (moe_serve/quantization/fp8.py): set by `to_block_fp8` before loading.
    fp8_block: tuple[int, int] | None = None
    dequant_dtype: torch.dtype | None = None  # what the blocks dequantize to (prepare.py); None: x's dtype
    fp8_act_quant: bool = False  # W8A8 in the Triton kernel (sm_89+; the platform's decision)

    fp8_checkpoint_suffix = ".weight"  # the checkpoint names this layer's FP8 weight <name>.weight

    def to_block_fp8(self, block: tuple[int, int]) -> None:
        """Keep this weight in block FP8: an FP8 weight and its float32 block scales (filled by the
        loader, which quantizes an unquantized tensor itself). Dequantized per call in forward."""
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, dtype=FP8,
                                               device=self.weight.device), requires_grad=False)
        self.weight_scale_inv = torch.ones(scale_shape(self.out_features, self.in_features, block),
                                           dtype=torch.float32, device=self.weight.device)
        self.fp8_block = block

    # Packed int4 / int8 (moe_serve/quantization/packed.py): set by `to_packed` before loading.
    packed_group: int | None = None
    packed_bits: int | None = None
    packed_zero = 0  # the zero code once the offsets are compacted away (`compact_packed`; qoffsets then None)
    cpu_int8_act = False  # our C kernels round the activations to int8 (GGUF files, --cpu-int8-activations)
    int8_activations = False  # the checkpoint's scheme quantizes this layer's inputs to int8 per token (W8A8)
    packed_act_quant = False  # ... and its kernel does so (moe_serve/prepare.py: the Triton kernel on CUDA)
    dequantized_at_load = False  # a packed checkpoint's weight held dense (weight_used_directly)

    def to_packed(self, bits: int, group_size: int) -> None:
        """Keep this weight packed (PackedWeight's codes, float32 scales and offsets as parameters,
        filled by `load_packed`): the dense weight is dropped before the load, never filled.
        Dequantized per call in forward. A layer whose weight the model reads directly
        (`weight_used_directly`: MLA's kv_b_proj, read per head as W_UK / W_UV) keeps its dense
        weight instead, and `load_packed` dequantizes into it once (as block FP8 does for it)."""
        N, K = self.out_features, self.in_features
        # the shapes are valid (group size divides K, K even for 4 bits), or the error names them
        PackedWeight(bits, torch.empty(N, K // 2 if bits == 4 else K, dtype=torch.uint8, device="meta"),
                     torch.empty(N, K // group_size, device="meta"), None, group_size, (N, K))
        if getattr(self, "weight_used_directly", False):
            self.packed_bits, self.packed_group, self.dequantized_at_load = bits, group_size, True
            return
        dev = self.weight.device

        def param(*shape, dtype=torch.float32):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=dev), requires_grad=False)

        self.weight = None
        self.qweight = param(N, K // 2 if bits == 4 else K, dtype=torch.uint8)
        self.qscales, self.qoffsets = param(N, K // group_size), param(N, K // group_size)
        self.packed_bits, self.packed_group = bits, group_size

    def packed(self) -> PackedWeight:
        """The packed weight (views of this layer's parameters)."""
        w = PackedWeight(self.packed_bits, self.qweight, self.qscales, self.qoffsets, self.packed_group,
                         (self.out_features, self.in_features), self.packed_zero)
        if self.cpu_int8_act:
            w.act8 = True  # (cpu_ops/quant.py reads it)
        return w

    def compact_packed(self) -> int:
        """PackedWeight.compact in place: drop the offsets array where the loaded offsets are exactly
        -z * scales for one code z (symmetric formats), keeping z, and keep the scales in float16
        where float16 holds them all exactly: the bytes freed."""
        if self.qweight is None:
            return 0
        freed = 0
        z = None if self.qoffsets is None else compact_zero(self.packed_bits, self.qscales.data, self.qoffsets.data,
                                                            self.packed_zero)
        if z is not None:
            freed += self.qoffsets.numel() * self.qoffsets.element_size()
            self.qoffsets, self.packed_zero = None, z
        h = half_scales(self.qscales.data)
        if h is not None:
            freed += h.numel() * h.element_size()
            self.qscales = nn.Parameter(h, requires_grad=False)
        return freed

    def load_packed(self, w) -> None:
        """A PackedWeight into the packed storage; or an FP8 weight with one scale a row
        (compressed_tensors.Fp8ChannelWeight, into the storage made for 8 bits per channel): kept as
        block FP8 with one block a row, (1, K), its bytes in the codes' storage, its scales the
        row scales (exact); forward then takes the block-FP8 path."""
        shape = (self.out_features, self.in_features)
        if w.group_size is None:  # FP8 per channel
            if (w.bits, w.shape, self.packed_bits, self.packed_group) != (8, shape, 8, self.in_features):
                raise ValueError(f"FP8 weight {w.shape} per channel does not match the layer's {self.packed_bits}-bit "
                                 f"group {self.packed_group} {shape}")
            if self.dequantized_at_load:
                self.weight.data.copy_(w.dequantize(torch.float32).to(self.weight.dtype))
                return
            from moe_serve.quantization.fp8 import FP8

            self.qweight.data.copy_(w.q.view(torch.uint8))
            self.weight = nn.Parameter(self.qweight.data.view(FP8), requires_grad=False)
            self.weight_scale_inv = self.qscales.data
            self.weight_scale_inv.copy_(w.scales)
            self.fp8_block = (1, self.in_features)
            self.qweight = self.qscales = self.qoffsets = None
            self.packed_bits = self.packed_group = None
            return
        if (w.bits, w.group_size, w.shape) != (self.packed_bits, self.packed_group, shape):
            raise ValueError(f"packed weight {w.bits}-bit group {w.group_size} {w.shape} does not match the layer's "
                             f"{self.packed_bits}-bit group {self.packed_group} {shape}")
        if self.dequantized_at_load:
            self.weight.data.copy_(w.dequantize(torch.float32).to(self.weight.dtype))
            return
        if self.qoffsets is None or self.qscales.dtype == torch.float16:  # compacted at load: so must w be
            w = compacted_as(w, self.qoffsets is None, self.packed_zero, self.qscales.dtype == torch.float16,
                             f"packed weight {w.shape}")
        self.qweight.data.copy_(w.qweight)
        self.qscales.data.copy_(w.scales)
        if self.qoffsets is None:
            return
        if w.offsets is None:
            self.qoffsets.data.zero_()
        else:
            self.qoffsets.data.copy_(w.offsets)
        if w.zero:
            self.qoffsets.data.sub_(float(w.zero) * self.qscales.data.float())

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a dense tensor (dequantized when it is FP8 or packed)."""
        if self.qweight is not None:
            return self.packed().dequantize(dtype)
        if self.weight_scale_inv is None:
            return self.weight
        return dequantize_blocks(self.weight, self.weight_scale_inv, self.fp8_block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale_inv is not None:  # block FP8
            return self.ops.fp8(self, x)
        if self.qweight is not None:  # packed int4 / int8: the backend's kernel, or dequantized per call
            return self.ops.packed(self, x)
        return self.ops(x, self.weight, self.bias)


class DenseMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)). Used for dense layers and shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype=torch.float32):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, dtype=dtype)
        self.up_proj = Linear(hidden_size, intermediate_size, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, ops = self.gate_proj(x), self.up_proj(x), self.gate_proj.ops
        # on the linear backend: its batch-invariant form pads rows so no element takes torch's scalar tail
        return self.down_proj(F.silu(gate) * up if ops is None else ops.silu_mul(gate, up))
