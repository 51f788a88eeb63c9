"""Grouped GEMM for MoE experts: one public op, the backend chosen by name.

`fused_experts(...)` takes the same arguments whatever the backend; `moe_serve.platform` decides which
backend a model uses ("torch" on CPU, "triton" on CUDA unless overridden) and models never name one.
"""
from __future__ import annotations

import torch

import contextlib

from kernels.grouped_gemm.grouped_mm import (fused_experts_grouped, fused_experts_single_token, grouped_mm_available,
                                             grouped_mm_fits)
from kernels import cpu_ops
from kernels.grouped_gemm.mxfp4 import Mxfp4Weight
from kernels.grouped_gemm.reference import fused_experts_reference

BACKENDS = ("torch", "triton")


def _as_f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


_host_reads_ok = [True]


@contextlib.contextmanager
def device_side_only():
    """Within: the CPU experts take only paths with no host read of routing ids, as a CUDA graph
    would need (the capturability tests check the model's decode forward under it)."""
    _host_reads_ok.append(False)
    try:
        with cpu_ops.suspended():
            yield
    finally:
        _host_reads_ok.pop()


def fused_experts(
    x_TD: torch.Tensor,
    w13_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    backend: str = "torch",
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation="silu",
    all_local: bool = False,
) -> torch.Tensor:
    """Weighted sum over each token's top-k experts of SwiGLU(x @ w13^T) @ w2^T.

    See `kernels.grouped_gemm.reference.fused_experts_reference` for shapes; ids of -1 are skipped
    (`all_local=True` promises there are none: one EP rank, so the CPU path skips their masking).
    GPT-OSS's variant: optional biases (E, 2F) / (E, D), an activation other than "silu"
    (reference.ClampedSwiGLU), and w13 / w2 given as quantized weights (mxfp4.Mxfp4Weight, or
    block FP8's BlockFp8Experts: anything with `shape` and `dequantize(dtype, experts)`),
    dequantized per step for the routed experts only. The variant runs the torch ops of either
    backend (the Triton kernel fuses plain SwiGLU); the default call is unchanged.
    """
    if w13_bias is not None or w2_bias is not None or activation != "silu" or not isinstance(w13_EFD, torch.Tensor):
        return _fused_experts_variant(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, backend,
                                      w13_bias, w2_bias, activation)
    if backend == "torch":
        # Two grouped GEMMs where torch has them for this dtype (float32 on CPU: half precision
        # there would run element by element without bf16 matrix instructions); else the loop.
        # (Half-precision models on such CPUs keep their expert weights in float32: prepare.py.)
        # One token on the CPU: only its K experts run (the grouped GEMM visits every expert).
        # Decode-sized batches on the CPU: our C kernel (kernels/cpu_ops), one call for the layer,
        # float32 or bf16 weights read once (no GPU path comes here: it is opaque to capture).
        if x_TD.is_cpu and _host_reads_ok[-1] and cpu_ops.use_for(x_TD, w13_EFD, w2_EDF, topk_ids_TK):
            out = cpu_ops.moe_experts(_as_f32(x_TD), w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK)
            return out if out.dtype == x_TD.dtype else out.to(x_TD.dtype)
        if (x_TD.shape[0] == 1 and x_TD.is_cpu and w13_EFD.dtype == torch.float32
                and _host_reads_ok[-1]):
            return fused_experts_single_token(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK)
        if (x_TD.shape[0] and w13_EFD.dtype == torch.float32 and grouped_mm_available(torch.float32, x_TD.device.type)
                and grouped_mm_fits(x_TD, w13_EFD, w2_EDF)):
            return fused_experts_grouped(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, all_local=all_local)
        return fused_experts_reference(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK)
    if backend == "triton":
        from kernels.grouped_gemm.triton_kernel import fused_experts_triton  # lazy: triton is heavy

        return fused_experts_triton(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK)
    raise ValueError(f"moe_backend={backend!r} is not one of {BACKENDS}")


def _fused_experts_variant(x_TD, w13, w2, topk_weights_TK, topk_ids_TK, backend, w13_bias, w2_bias, activation):
    if backend not in BACKENDS:
        raise ValueError(f"moe_backend={backend!r} is not one of {BACKENDS}")
    if (backend == "triton" and hasattr(w13, "scale_inv") and w13_bias is None and w2_bias is None
            and activation == "silu"):  # block FP8: the Triton kernel dequantizes each weight tile as it loads it
        from kernels.grouped_gemm.triton_kernel import fused_experts_triton

        return fused_experts_triton(x_TD, w13.q, w2.q, topk_weights_TK, topk_ids_TK, w13_scale=w13.scale_inv,
                                    w2_scale=w2.scale_inv, scale_block=w13.block,
                                    act_quant=getattr(w13, "act_quant", False))
    if not isinstance(w13, torch.Tensor):  # quantized: Mxfp4Weight, or block FP8 (moe_serve/quantization/fp8.py)
        from kernels.grouped_gemm.mxfp4 import fused_experts_mxfp4

        dtype = w13_bias.dtype if w13_bias is not None else torch.float32
        return fused_experts_mxfp4(x_TD, w13, w2, topk_weights_TK, topk_ids_TK, w13_bias=w13_bias,
                                   w2_bias=w2_bias, activation=activation, backend=backend, dtype=dtype,
                                   host_reads=_host_reads_ok[-1])
    kw = dict(w13_bias=w13_bias, w2_bias=w2_bias, activation=activation)
    dev = x_TD.device.type
    if (x_TD.shape[0] and (w13.dtype == torch.float32 or dev == "cuda") and grouped_mm_available(w13.dtype, dev)
            and grouped_mm_fits(x_TD, w13, w2)):
        return fused_experts_grouped(x_TD, w13, w2, topk_weights_TK, topk_ids_TK, **kw)
    return fused_experts_reference(x_TD, w13, w2, topk_weights_TK, topk_ids_TK, **kw)
