"""Grouped GEMM for MoE experts: one backend object per way of running them.

`moe_serve.platform` picks one at start-up ("cpu_c" on CPUs where our C kernels built, else
"torch"; "triton" on CUDA) and binds it to every MoE layer; the layer calls it and never asks
which device it is on. Every backend takes the same arguments (see `ExpertsBackend.__call__`).
"""
from __future__ import annotations

import torch

from moe_serve.kernels import cpu_ops
from moe_serve.kernels.cpu_ops import quant as cpu_quant
from moe_serve.kernels.grouped_gemm.grouped_mm import (fused_experts_grouped, fused_experts_single_token, grouped_mm_available,
                                             grouped_mm_fits)
from moe_serve.kernels.grouped_gemm.mxfp4 import Mxfp4Weight, fused_experts_mxfp4
from moe_serve.kernels.grouped_gemm.reference import fused_experts_reference, kernel_activation
from moe_serve.kernels.linear import CpuCLinear, TorchLinear
from moe_serve.quantization.packed import PackedWeight


def _as_f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


class TorchExperts:
    """torch ops only: two grouped GEMMs where torch has them for the weights' dtype on this device
    (float32 on the CPU: half precision there would run element by element without bf16 matrix
    instructions), a single token's K experts alone on the CPU, else a loop over the experts.

    host_reads=False: only paths with no host read of the routing ids, as a CUDA graph needs (the
    capturability checks bind such a backend: `capturable()`)."""

    name = "torch"
    has_masked = False  # runs the masked GEMM over DeepEP's expert-major layout (Triton only)

    def __init__(self, device: torch.device | str = "cpu", host_reads: bool = True):
        self.device = torch.device(device)
        self.host_reads = host_reads
        # one token, float32: only its K experts run (the grouped GEMM visits every expert); the
        # host read of its ids is a memory load on the CPU, a sync elsewhere
        self.single_token = self.device.type == "cpu" and host_reads
        self.linear = self.linear_backend(self.device)  # the GEMM of the per-expert loop

    linear_backend = TorchLinear

    def capturable(self) -> "TorchExperts":
        return TorchExperts(self.device, host_reads=False)

    def mark_slots(self, hits_S1: torch.Tensor, topk_ids_RK: torch.Tensor) -> None:
        """The speed-of-light meter's marks (expert_parallel/runtime/layer.py mark_slots_hit):
        hits_S1[1 + s] non-zero for each slot s the ids route a row to, ids of -1 into hits_S1[0]."""
        flat = topk_ids_RK.reshape(-1).to(torch.int64) + 1
        hits_S1.index_fill_(0, flat.clamp_(min=0), 1)

    def grouped(self, dtype: torch.dtype) -> bool:
        """Whether torch's grouped GEMM runs this dtype on this device (probed once: lru_cache)."""
        return grouped_mm_available(dtype, self.device.type)

    def __call__(self, x_TD: torch.Tensor, w13_EFD, w2_EDF, topk_weights_TK: torch.Tensor,
                 topk_ids_TK: torch.Tensor, *, w13_bias: torch.Tensor | None = None,
                 w2_bias: torch.Tensor | None = None, activation="silu", all_local: bool = False) -> torch.Tensor:
        """Weighted sum over each token's top-k experts of SwiGLU(x @ w13^T) @ w2^T.

        See `moe_serve.kernels.grouped_gemm.reference.fused_experts_reference` for shapes; ids of -1 are
        skipped (`all_local=True` promises there are none: one EP rank, so masking is skipped).
        GPT-OSS's variant: optional biases (E, 2F) / (E, D), an activation other than "silu"
        (reference.ClampedSwiGLU), and w13 / w2 given as quantized weights (mxfp4.Mxfp4Weight, or
        block FP8's BlockFp8Experts: anything with `shape` and `dequantize(dtype, experts)`),
        dequantized per step for the routed experts only."""
        if w13_bias is not None or w2_bias is not None or activation != "silu" or not isinstance(w13_EFD, torch.Tensor):
            return self.variant(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, w13_bias, w2_bias, activation)
        return self.plain(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, all_local)

    def plain(self, x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, all_local: bool) -> torch.Tensor:
        """Dense SwiGLU experts without biases."""
        if x_TD.shape[0] == 1 and self.single_token and w13_EFD.dtype == torch.float32:
            return fused_experts_single_token(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK)
        if (x_TD.shape[0] and w13_EFD.dtype == torch.float32 and self.grouped(torch.float32)
                and grouped_mm_fits(x_TD, w13_EFD, w2_EDF)):
            return fused_experts_grouped(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, all_local=all_local)
        return fused_experts_reference(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, linear=self.linear)

    def variant(self, x_TD, w13, w2, topk_weights_TK, topk_ids_TK, w13_bias, w2_bias, activation) -> torch.Tensor:
        """Biases, another activation or quantized weights: torch ops (dequantized per step)."""
        if not isinstance(w13, torch.Tensor):  # quantized: Mxfp4Weight, or block FP8 (moe_serve/quantization/fp8.py)
            dtype = w13_bias.dtype if w13_bias is not None else torch.float32
            return fused_experts_mxfp4(x_TD, w13, w2, topk_weights_TK, topk_ids_TK, w13_bias=w13_bias,
                                       w2_bias=w2_bias, activation=activation, dense=self, dtype=dtype,
                                       host_reads=self.host_reads)
        return self.dense_variant(x_TD, w13, w2, topk_weights_TK, topk_ids_TK, w13_bias=w13_bias, w2_bias=w2_bias,
                                  activation=activation)

    def dense_variant(self, x_TD, w13, w2, topk_weights_TK, topk_ids_TK, **kw) -> torch.Tensor:
        # half precision runs torch's grouped GEMM where the device has matrix units for it (not the CPU)
        if (x_TD.shape[0] and (w13.dtype == torch.float32 or self.device.type == "cuda") and self.grouped(w13.dtype)
                and grouped_mm_fits(x_TD, w13, w2)):
            return fused_experts_grouped(x_TD, w13, w2, topk_weights_TK, topk_ids_TK, **kw)
        return fused_experts_reference(x_TD, w13, w2, topk_weights_TK, topk_ids_TK, linear=self.linear, **kw)

    def warm_up(self, moe, dtype: torch.dtype, low_latency_rows: int) -> None:
        """Compile what this backend can launch for the layer ahead of serving: nothing for torch ops."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device}{'' if self.host_reads else ', host_reads=False'})"


class CpuCExperts(TorchExperts):
    """Our C kernel (moe_serve/kernels/cpu_ops/moe.c) for the layer's routed experts in one call where it
    takes the batch (decode-sized batches; prefill-sized ones over float32 weights whose panels
    fit), float32 or bf16 weights read once; the torch ops otherwise. CPU only."""

    name = "cpu_c"
    linear_backend = CpuCLinear

    def capturable(self) -> TorchExperts:  # the torch ops a GPU would run: the C call is opaque to capture
        return TorchExperts(self.device, host_reads=False)

    def mark_slots(self, hits_S1, topk_ids_RK):
        if cpu_ops.mark_slots_fits(hits_S1, topk_ids_RK):  # one C call, not three ops
            cpu_ops.mark_slots(hits_S1, topk_ids_RK)
        else:
            super().mark_slots(hits_S1, topk_ids_RK)

    def plain(self, x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, all_local: bool) -> torch.Tensor:
        if cpu_ops.use_for(x_TD, w13_EFD, w2_EDF, topk_ids_TK):
            out = cpu_ops.moe_experts(_as_f32(x_TD), w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK)
            return out if out.dtype == x_TD.dtype else out.to(x_TD.dtype)
        return super().plain(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, all_local)

    def variant(self, x_TD, w13, w2, topk_weights_TK, topk_ids_TK, w13_bias, w2_bias, activation) -> torch.Tensor:
        """Packed int4 / int8 SwiGLU experts (moe_serve/quantization/packed.py) in a decode-sized
        batch, or any batch where quant.c's panel path takes their shapes: our C kernel (cpu_ops/quant.c),
        each routed expert's packed bytes streamed once."""
        T, K = topk_ids_TK.shape
        if (w13_bias is None and w2_bias is None and activation == "silu" and isinstance(w13, cpu_quant.PackedWeight)
                and (T * K <= cpu_ops.MAX_ROWS_PER_EXPERT * w13.shape[0] or cpu_quant.panels_fit(w13, w2))
                and cpu_quant.quant_experts_fits(x_TD, w13, w2, topk_weights_TK, topk_ids_TK)):
            out = cpu_quant.quant_experts(x_TD, w13, w2, topk_weights_TK, topk_ids_TK)
            return out if out.dtype == x_TD.dtype else out.to(x_TD.dtype)
        return super().variant(x_TD, w13, w2, topk_weights_TK, topk_ids_TK, w13_bias, w2_bias, activation)


class TritonExperts(TorchExperts):
    """The Triton grouped GEMM (moe_serve/kernels/grouped_gemm/triton_kernel.py) for experts in the
    activations' dtype, block FP8 or MXFP4 (quantized tiles decoded in registers as they load; MXFP4
    stays packed), with or without per-expert biases, SwiGLU or the clamped / limited variants
    (GPT-OSS, DeepSeek-V4); packed int4 / int8 experts (PackedWeight) in the packed form of the
    same launches (triton_packed.py: W4A16 / W8A16, codes decoded in registers, biases and
    activations alike); the masked GEMM over DeepEP's expert-major layout for plain SwiGLU experts in
    the activations' dtype or block FP8. What the kernel has no form for (another activation) runs
    torch ops."""

    name = "triton"
    has_masked = True

    def capturable(self) -> "TritonExperts":
        return TritonExperts(self.device, host_reads=False)

    def plain(self, x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, all_local: bool) -> torch.Tensor:
        return self._kernel(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK)

    @staticmethod
    def _kernel(x_TD, w13, w2, topk_weights_TK, topk_ids_TK, config=None, **kw) -> torch.Tensor:
        """The grouped GEMM for these weights' format: the packed int4 / int8 kernel for PackedWeight,
        triton_kernel.py's for the others (arguments as `kernel_args` gives them)."""
        if isinstance(w13, PackedWeight):  # lazy imports: triton is heavy
            from moe_serve.kernels.grouped_gemm.triton_packed import fused_experts_packed_triton

            return fused_experts_packed_triton(x_TD, w13, w2, topk_weights_TK, topk_ids_TK, config, **kw)
        from moe_serve.kernels.grouped_gemm.triton_kernel import fused_experts_triton

        return fused_experts_triton(x_TD, w13, w2, topk_weights_TK, topk_ids_TK, config, **kw)

    takes_packed = True  # packed int4 / int8 experts (PackedWeight) run in triton_packed.py's kernel

    @classmethod
    def kernel_args(cls, w13, w2, dtype: torch.dtype, w13_bias=None, w2_bias=None, activation="silu") -> tuple | None:
        """(w13, w2, keyword arguments) of `fused_experts_triton` for these experts with activations
        of `dtype`, or None when the kernel cannot run them (an activation it has no form for,
        dense weights of another dtype)."""
        if kernel_activation(activation) is None:
            return None
        variant = {} if w13_bias is None and w2_bias is None and activation == "silu" else dict(
            w13_bias=w13_bias, w2_bias=w2_bias, activation=activation)
        if isinstance(w13, Mxfp4Weight) and isinstance(w2, Mxfp4Weight):
            return w13, w2, variant  # packed: the kernel decodes each tile as it loads it
        if isinstance(w13, PackedWeight) and isinstance(w2, PackedWeight) and cls.takes_packed:
            # int4 / int8 codes, decoded in registers likewise (triton_packed.py); W8A8 where the
            # platform set it (moe_serve/prepare.py: a W8A8 int8 checkpoint on CUDA)
            act = getattr(w13, "act_quant", False)
            return w13, w2, dict(variant, act_quant=True) if act else variant
        if hasattr(w13, "scale_inv"):  # block FP8: each tile dequantized as it loads
            return w13.q, w2.q, dict(w13_scale=w13.scale_inv, w2_scale=w2.scale_inv, scale_block=w13.block,
                                     act_quant=getattr(w13, "act_quant", False), **variant)
        if isinstance(w13, torch.Tensor) and w13.dtype == w2.dtype == dtype:
            return w13, w2, variant
        return None

    def variant(self, x_TD, w13, w2, topk_weights_TK, topk_ids_TK, w13_bias, w2_bias, activation) -> torch.Tensor:
        args = self.kernel_args(w13, w2, x_TD.dtype, w13_bias, w2_bias, activation)
        if args is not None:
            k13, k2, kw = args
            return self._kernel(x_TD, k13, k2, topk_weights_TK, topk_ids_TK, **kw)
        return super().variant(x_TD, w13, w2, topk_weights_TK, topk_ids_TK, w13_bias, w2_bias, activation)

    def masked_applies(self, experts) -> bool:
        """Whether the masked GEMM serves the layer's experts: plain SwiGLU in the activations'
        dtype, or block FP8 (not MXFP4, biases or another activation: those take the generic
        grouped GEMM over the routed rows)."""
        if experts.op_kwargs():
            return False
        w13, _ = experts.op_weights()
        return isinstance(w13, torch.Tensor) or hasattr(w13, "scale_inv")

    def masked_experts(self, x_ECD: torch.Tensor, count_E: torch.Tensor, experts, num_tokens: int,
                       top_k: int) -> torch.Tensor:
        """(E*C, D) outputs of the masked GEMM over an expert-major layout (E experts, C rows each,
        count_E valid): only valid rows are computed; the tile is picked from the K * T / E rows
        each expert expects (num_tokens: this rank's T)."""
        from moe_serve.kernels.grouped_gemm.masked import masked_config, masked_experts_triton  # lazy: triton is heavy

        w13, w2 = experts.op_weights()
        E, C, D = x_ECD.shape
        cfg = masked_config(num_tokens * top_k / max(E, 1))
        if isinstance(w13, torch.Tensor):
            y_ECD = masked_experts_triton(x_ECD, count_E, w13, w2, cfg)
        else:  # block FP8, dequantized tile by tile
            y_ECD = masked_experts_triton(x_ECD, count_E, w13.q, w2.q, cfg, w13_scale=w13.scale_inv,
                                          w2_scale=w2.scale_inv, scale_block=w13.block)
        return y_ECD.view(E * C, D)

    @classmethod
    def in_kernel(cls, moe, dtype: torch.dtype | None = None) -> bool:
        """Whether the layer's experts run in the Triton grouped GEMM at all (see `kernel_args`;
        dense weights are in the activations' dtype, which is theirs when `dtype` is None)."""
        w13, w2 = moe.experts.op_weights()
        dtype = dtype or (w13.dtype if isinstance(w13, torch.Tensor) else None)
        return cls.kernel_args(w13, w2, dtype, **moe.experts.op_kwargs()) is not None

    def configs(self, moe, dtype: torch.dtype) -> list[dict]:
        """The grouped-GEMM configs the layer can pick on this device: the defaults, then this
        shape's tuned entries (moe_serve/kernels/grouped_gemm/configs/)."""
        from moe_serve.kernels.grouped_gemm import config as gcfg

        w13, _ = moe.experts.op_weights()
        E, F2, D = w13.shape
        tuned = (gcfg.load_configs(E, F2 // 2, D, dtype, gcfg.device_name(self.device))
                 if dtype in gcfg.DTYPE_NAMES else None)
        return [dict(c) for c in gcfg.DEFAULT_CONFIGS] + [dict(c) for c in (tuned or {}).values()]

    def _kernel_weights(self, moe, dtype: torch.dtype):
        """(w13, w2, keyword arguments) as the layer's forward passes them to the grouped GEMM."""
        w13, w2 = moe.experts.op_weights()
        args = self.kernel_args(w13, w2, dtype, **moe.experts.op_kwargs())
        if args is None:
            raise ValueError(f"the Triton grouped GEMM cannot run {type(moe.experts).__name__} in {dtype}")
        return args

    def launch(self, moe, dtype: torch.dtype, cfg: dict | None, ids: torch.dtype = torch.int64, T: int = 4) -> None:
        """One grouped-GEMM launch of the layer's experts with config `cfg` (None: the kernel's own
        choice) over "meta" activations of T tokens: compiled, not run. Router ids are int64;
        remapped placements give int32."""
        w13, w2, extra = self._kernel_weights(moe, dtype)
        meta, K, D = torch.device("meta"), moe.gate.top_k, w13.shape[2]
        self._kernel(torch.empty(T, D, dtype=dtype, device=meta), w13, w2, torch.empty(T, K, device=meta),
                     torch.empty(T, K, dtype=ids, device=meta), cfg, **extra)

    def launch_masked(self, moe, dtype: torch.dtype, cfg: dict, rows: int) -> None:
        """One masked-GEMM launch over DeepEP's expert-major layout, `rows` per expert ("meta")."""
        from moe_serve.kernels.grouped_gemm.masked import masked_experts_triton  # lazy: triton is heavy

        w13, w2, extra = self._kernel_weights(moe, dtype)
        extra.pop("act_quant", None)  # the masked GEMM is weight-only
        meta, E, D = torch.device("meta"), w13.shape[0], w13.shape[2]
        masked_experts_triton(torch.empty(E, rows, D, dtype=dtype, device=meta),
                              torch.empty(E, dtype=torch.int32, device=meta), w13, w2, cfg, **extra)

    def warm_up(self, moe, dtype: torch.dtype, low_latency_rows: int) -> None:
        """Every variant the layer can launch: each config it can pick, router ids as int64 and
        remapped int32, and the masked GEMM when the dispatcher may use DeepEP's low-latency
        layout (low_latency_rows: its rows per expert)."""
        if not self.in_kernel(moe, dtype):
            return
        for cfg in self.configs(moe, dtype):
            for ids in (torch.int64, torch.int32):
                self.launch(moe, dtype, cfg, ids)
            if low_latency_rows and self.masked_applies(moe.experts):
                self.launch_masked(moe, dtype, cfg, low_latency_rows)


# By name, for tests and benchmarks that call one op directly (the engine's table is in platform.py).
_BY_NAME = {cls.name: cls for cls in (TorchExperts, CpuCExperts, TritonExperts)}


def experts_backend(name: str, device: torch.device | str = "cpu") -> TorchExperts:
    if name not in _BY_NAME:
        raise ValueError(f"moe_backend={name!r} is not one of {tuple(_BY_NAME)}")
    return _BY_NAME[name](device)


def fused_experts(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, backend: "str | TorchExperts" = "torch",
                  **kw) -> torch.Tensor:
    """One call of an experts backend, given by name or as the object (see TorchExperts.__call__)."""
    if isinstance(backend, str):
        backend = experts_backend(backend, x_TD.device)
    return backend(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, **kw)
