"""Weights prepared once, at load, for the device the platform chose: a forward never converts a
weight.

On a CPU without bf16/fp16 matrix instructions (no AVX512-BF16, no AMX), half-precision GEMMs run
element by element, many times slower than float32 (kernels/cpu_gemm.py). There the GEMM weights
(linear layers, the stacked expert weights, an untied LM head) of a half-precision model are kept
in float32, converted once here, and the GEMMs run in float32 on upcast activations; embeddings,
norms, activations and the KV cache stay in the model's dtype. The memory cost is logged. On CUDA,
and on CPUs with half-precision matrix instructions, nothing changes.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("moe_serve.prepare")


def gemm_weight_dtype(model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype GEMM weights are stored in on this device (the platform's decision)."""
    from kernels.cpu_gemm import cpu_has_half_matmul

    if device.type == "cpu" and model_dtype in (torch.bfloat16, torch.float16) and not cpu_has_half_matmul():
        return torch.float32
    return model_dtype


def prepare_gemm_weights(model: nn.Module, model_dtype: torch.dtype, device: torch.device) -> int:
    """Convert GEMM weights to `gemm_weight_dtype` once; returns the bytes this adds."""
    from expert_parallel.layer import GroupedExperts
    from moe_serve.layers.embedding import LMHead
    from moe_serve.layers.linear import Linear

    from moe_serve.platform import fp8_activation_quant, fp8_linear_backend

    target = gemm_weight_dtype(model_dtype, device)
    for m in model.modules():  # block-FP8 layers: which kernel runs them is the platform's decision
        if isinstance(m, Linear) and m.weight_scale_inv is not None:
            m.fp8_backend = fp8_linear_backend(device)
            m.fp8_act_quant = fp8_activation_quant(device) and m.fp8_block[1] % 16 == 0  # W8A8's k tiles
        elif isinstance(m, GroupedExperts) and m.fp8_block is not None:
            m.fp8_act_quant = fp8_activation_quant(device) and m.fp8_block[1] % 16 == 0
    if target == model_dtype:
        return 0
    added = 0

    def convert(module: nn.Module, name: str) -> None:
        nonlocal added
        p = getattr(module, name)
        if p is None or p.dtype == target or p.dtype == torch.float8_e4m3fn:  # FP8 stays FP8
            return
        added += p.numel() * (torch.empty((), dtype=target).element_size() - p.element_size())
        setattr(module, name, nn.Parameter(p.detach().to(target), requires_grad=False))

    for m in model.modules():
        if isinstance(m, Linear) and not getattr(m, "weight_used_directly", False):
            if m.weight_scale_inv is not None:
                m.dequant_dtype = target  # its FP8 blocks dequantize straight to the GEMM dtype
            convert(m, "weight")
            convert(m, "bias")
        elif isinstance(m, GroupedExperts):
            convert(m, "w13")  # None for MXFP4 experts, whose uint8 blocks stay as they are
            convert(m, "w2")
            convert(m, "w13_bias")  # GPT-OSS's expert biases (None elsewhere)
            convert(m, "w2_bias")
        elif isinstance(m, LMHead):
            # A head tied to the embedding gets its own float32 copy; the embedding keeps its dtype.
            convert(m, "weight")
    log.info("GEMM weights kept in %s on this CPU (no %s matrix instructions): +%.1f MiB, converted once at load",
             str(target).replace("torch.", ""), str(model_dtype).replace("torch.", ""), added / 2**20)
    return added
