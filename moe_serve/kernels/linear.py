"""Linear-layer backends: one object per way of running y = x W^T (+ b), chosen once at start-up
by moe_serve/platform.py and bound to every Linear and the LM head.

- `TorchLinear` ("torch"): torch ops (moe_serve/kernels/cpu_gemm.linear: half precision upcast on CPUs
  without half-precision matrix instructions); block-FP8 weights dequantized per call;
- `CpuCLinear` ("cpu_c"): our C GEMMs (moe_serve/kernels/cpu_ops/moe.c) for the decode-sized float32 calls
  they take, torch ops otherwise; the routers' top-k and softmax in one C call;
- `TritonLinear` ("triton"): block-FP8 weights through the Triton W8A16/W8A8 kernel
  (moe_serve/kernels/fp8_linear.py, tiles dequantized as they load), packed int4 / int8 weights through
  the packed kernel (moe_serve/kernels/packed_linear.py: W4A16 / W8A16, codes decoded in registers);
  dense weights through torch (cuBLAS).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from expert_parallel.runtime import router
from moe_serve.kernels import cpu_ops
from moe_serve.kernels import cpu_gemm
from moe_serve.kernels.cpu_gemm import linear as torch_linear
from moe_serve.kernels.cpu_ops import quant as cpu_quant


class TorchLinear:
    name = "torch"

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        # half precision without matrix instructions runs element by element: computed in float32
        self.upcast_half = self.device.type == "cpu" and not cpu_gemm.cpu_has_half_matmul()

    def capturable(self) -> "TorchLinear":
        return TorchLinear(self.device)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return torch_linear(x, w, b, self.upcast_half)

    def topk_softmax(self, logits_TE: torch.Tensor, k: int, over_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A router's choice from its logits (the GEMM before it runs on this backend too): each
        row's k largest, largest first, weighted by the softmax over those k (over_topk) or over
        the whole row."""
        return router.topk_softmax(logits_TE, k, over_topk)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up: a dense MLP's activation (here so that a batch-invariant backend can
        run it in its own form)."""
        return F.silu(gate) * up

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        """A sigmoid router's scores from its logits (here for the same reason as silu_mul)."""
        return torch.sigmoid(x)

    def per_head(self, x_TNK: torch.Tensor, w_NOK: torch.Tensor) -> torch.Tensor:
        """y[t, n] = w[n] @ x[t, n]: one product per head (MLA's absorbed W_UK and W_UV), (T, N, O)."""
        return torch.einsum("tnk,nok->tno", x_TNK, w_NOK)

    def pointwise(self, fn, *xs: torch.Tensor) -> torch.Tensor:
        """fn(*xs) for an elementwise fn over tensors of one shape (DeepSeek-V4's softplus router
        scores, RoPE angles): here for the same reason as silu_mul."""
        return fn(*xs)

    def fp8(self, layer, x: torch.Tensor) -> torch.Tensor:
        """A block-FP8 Linear: its weight dequantized now, for this call only."""
        return self(x, layer.dense_weight(layer.dequant_dtype or x.dtype), layer.bias)

    def packed(self, layer, x: torch.Tensor) -> torch.Tensor:
        """A Linear with a packed int4 / int8 weight (moe_serve/quantization/packed.py): dequantized
        now, for this call only (the reference the kernels are tested against)."""
        return self(x, layer.dense_weight(layer.dequant_dtype or x.dtype), layer.bias)

    def warm_up(self, layer, dtype: torch.dtype) -> None:
        """Compile what this backend can launch for the layer ahead of serving: nothing for torch ops."""

    def __repr__(self) -> str:
        return type(self).__name__ + "()"


class CpuCLinear(TorchLinear):
    name = "cpu_c"

    def capturable(self) -> TorchLinear:  # the torch ops a GPU would run
        return TorchLinear(self.device)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if cpu_ops.linear_fits(x, w):
            y = cpu_ops.linear(x, w, b)
            return y if y.dtype == x.dtype else y.to(x.dtype)
        return torch_linear(x, w, b, self.upcast_half)

    def packed(self, layer, x: torch.Tensor) -> torch.Tensor:
        """A packed weight in our C kernel (cpu_ops/quant.c: decode-sized calls stream the packed bytes
        once, prefill-sized ones run its panel GEMM over weight blocks widened from the codes)."""
        w = layer.packed()
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows > 0 and cpu_quant.quant_linear_fits(x, w):
            y = cpu_quant.quant_linear(x, w, layer.bias)
            return y if y.dtype == x.dtype else y.to(x.dtype)
        return super().packed(layer, x)

    def topk_softmax(self, logits_TE, k, over_topk):
        if cpu_ops.topk_softmax_fits(logits_TE, k):  # one C call for the top-k and the softmax
            return cpu_ops.topk_softmax(logits_TE, k, over_topk)
        return super().topk_softmax(logits_TE, k, over_topk)


class TritonLinear(TorchLinear):
    name = "triton"
    ROW_TILES = (1, 32, 4096)  # rows that pick each of the FP8 kernel's row tiles (moe_serve/kernels/fp8_linear.py)
    packed_tile_rows: int | None = None  # the packed kernel's row tile as for this many rows (None: by M)

    def capturable(self) -> "TritonLinear":
        return self

    def fp8(self, layer, x: torch.Tensor) -> torch.Tensor:
        from moe_serve.kernels.fp8_linear import fp8_linear_triton  # lazy: triton is heavy

        return fp8_linear_triton(x, layer.weight, layer.weight_scale_inv, layer.fp8_block, layer.bias,
                                 layer.fp8_act_quant)

    def packed(self, layer, x: torch.Tensor) -> torch.Tensor:
        """A packed int4 / int8 layer: its codes read as they are, decoded tile by tile in registers."""
        from moe_serve.kernels.packed_linear import packed_linear_triton  # lazy: triton is heavy

        return packed_linear_triton(x, layer.packed(), layer.bias, act_quant=layer.packed_act_quant,
                                    tile_rows=self.packed_tile_rows)

    def launch(self, layer, dtype: torch.dtype, M: int) -> None:
        """The block-FP8 or packed layer over M "meta" rows: compiled, not run."""
        x = torch.empty(M, layer.in_features, dtype=dtype, device="meta")
        if getattr(layer, "weight_scale_inv", None) is not None:
            self.fp8(layer, x)
        else:
            self.packed(layer, x)

    def warm_up(self, layer, dtype: torch.dtype) -> None:
        """Every variant a block-FP8 or packed layer launches: one per row tile (its ROW_TILES; dense
        layers run in torch). The packed kernel's row tiles are the FP8 kernel's."""
        if getattr(layer, "weight_scale_inv", None) is None and getattr(layer, "qweight", None) is None:
            return
        for M in self.ROW_TILES:
            self.launch(layer, dtype, M)
