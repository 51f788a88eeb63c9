"""Compile, before serving, every Triton kernel variant the model's layers can launch.

Triton compiles a kernel when a launch brings a compile key it has not seen (its constexprs, launch
options and argument marks: moe_serve/kernels/specialization.py), which takes seconds and, under expert
parallelism, stalls every rank. Decode CUDA graphs compile their variants at capture, and the
profiling step compiles one prefill; every other variant (eager decode under DeepEP, EPLB or
--enforce-eager, the split-K attention of the first long context, the grouped GEMM's other tiles,
FP8 linear layers' row buckets) would compile mid-serving on first use.

What a layer can launch is declared by its backend object (`warm_up` on the classes of
moe_serve/platform.py's OPS: attention/backends, moe_serve/kernels/grouped_gemm, moe_serve/kernels/linear,
moe_serve/kernels/gated_delta); this module
only walks the layers, one call per distinct layer shape, with the kernels standing in for
themselves: the launch is compiled (`kernel.warmup`) and nothing runs. Activations, caches and
metadata are "meta" tensors (shapes, strides and dtypes without memory); weights are the layer's
own, so their alignment marks are the real ones.
"""
from __future__ import annotations

import logging
import time

import torch

from moe_serve.kernels import specialization

log = logging.getLogger("moe_serve.kernel_warmup")


def _weight_key(w) -> tuple:
    """A weight's shape and kind, with a packed weight's bits and group size (its kernel's constexprs)."""
    return (tuple(w.shape), str(getattr(w, "dtype", type(w))), getattr(w, "bits", None), getattr(w, "group_size", None),
            getattr(w, "act_quant", False))


def _shape_key(module) -> tuple:
    """Layers with the same key launch the same variants (one warm-up call serves them all)."""
    kind = module.op_kind
    if kind == "attention":
        return (type(module), tuple(module.cache_shape(1, 1)), module.sliding_window, module.attention_chunk,
                module.sinks is not None)
    if kind == "experts":
        # Both weights: packed experts' gate/up and down may have their own widths and groups (a
        # Q4_K_M file's 4-bit gate/up beside 8-bit down in some layers), each a variant of its own.
        w13, w2 = module.experts.op_weights()[:2]
        return (_weight_key(w13), _weight_key(w2), module.experts.op_kwargs() != {})
    if kind == "linear":
        w = module.weight if getattr(module, "qweight", None) is None else module.qweight  # packed: Linear.to_packed
        return (type(module), tuple(w.shape), w.dtype, getattr(module, "bias", None) is not None,
                getattr(module, "weight_scale_inv", None) is not None, getattr(module, "fp8_act_quant", False),
                getattr(module, "packed_bits", None), getattr(module, "packed_group", None),
                getattr(module, "packed_act_quant", False))
    if kind == "linear_attention":
        return (type(module), getattr(module, "linear_attention_shape", None))
    return (type(module),)


def warm_up(model: torch.nn.Module, *, dtype: torch.dtype, device: torch.device, block_size: int,
            max_model_len: int, num_heads: int, dispatcher=None, kv_cache_dtype: torch.dtype | None = None) -> set:
    """Compile every Triton variant the model's attention, expert, linear and linear-attention
    layers' backends can launch on `device`; returns their compile keys
    (moe_serve/kernels/specialization.Launch). Backends of torch ops or C kernels launch nothing here. A
    variant that fails to compile is logged and left to its first launch. kv_cache_dtype: the element
    type of the attention layers' K/V caches (--kv-cache-dtype fp8*: an FP8 type; None: dtype), which
    selects the attention kernels' variants."""
    from attention.backends import triton_paged as tp  # lazy: triton is heavy (this runs on CUDA only)

    t0 = time.perf_counter()
    split = tp._device_sms(device) > 0  # the engine splits decode keys only where it counts SMs (CUDA)
    rows = 0
    if dispatcher is not None and getattr(dispatcher, "max_low_latency_tokens", 0):
        rows = dispatcher.max_low_latency_tokens * dispatcher.world_size
    seen = set()
    with specialization.record(warmup=True) as launches:
        for module in model.modules():
            kind = getattr(type(module), "op_kind", None)
            if kind is None:
                continue
            key = (kind, module.ops.name, _shape_key(module))
            if key in seen:
                continue
            seen.add(key)
            if kind == "attention":
                module.ops.warm_up(module, num_heads, dtype, block_size, max_model_len, split,
                                   cache_dtype=kv_cache_dtype)
            elif kind == "experts":
                module.ops.warm_up(module, dtype, rows)
            elif kind in ("linear", "linear_attention"):
                module.ops.warm_up(module, dtype)
    variants = set(launches)
    if variants:
        log.info("Triton: %d kernel variants compiled before serving in %.1f s", len(variants),
                 time.perf_counter() - t0)
    return variants
