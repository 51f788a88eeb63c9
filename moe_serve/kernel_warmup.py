"""Compile, before serving, every Triton kernel variant the model's layers can launch.

Triton compiles a kernel when a launch brings a compile key it has not seen (its constexprs, launch
options and argument marks: kernels/specialization.py), which takes seconds and, under expert
parallelism, stalls every rank. Decode CUDA graphs compile their variants at capture, and the
profiling step compiles one prefill; every other variant (eager decode under DeepEP, EPLB or
--enforce-eager, the split-K attention of the first long context, the grouped GEMM's other tiles,
FP8 linear layers' row buckets) would compile mid-serving on first use. `warm_up` runs each layer's
Triton entry point once per kind of step with the kernels standing in for themselves: the launch
is compiled (`kernel.warmup`) and nothing runs. Activations, caches and metadata are "meta" tensors
(shapes, strides and dtypes without memory); weights are the layer's own, so their alignment marks
are the real ones.
"""
from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("moe_serve.kernel_warmup")

META = torch.device("meta")


def _t(shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=META)


def _attention(layer, num_heads: int, dtype: torch.dtype, block_size: int, max_len: int, split: bool) -> None:
    """Decode (one query token per sequence; with split, also split-K over a long context) and a
    chunked prefill through the layer's backend, as its forward calls it."""
    from attention.layer import PagedMLAAttention
    from attention.metadata import AttentionMetadata

    ops = layer.ops
    steps = [([1, 1], [1, 2], 1)]
    if split:
        steps.append(([1, 1], [max_len, max_len], 2))
    steps.append(([4, 1], [4, 9], 1))  # a prefill chunk beside a decode
    mla = isinstance(layer, PagedMLAAttention)
    for q_lens, seq_lens, S in steps:
        tables = [[0] * -(-s // block_size) for s in seq_lens]
        meta = AttentionMetadata.build(q_lens, seq_lens, tables, block_size, device=META)
        T = sum(q_lens)
        caches = [_t(s, dtype) for s in layer.cache_shape(1, block_size)]
        if mla:
            L, R = layer.kv_lora_rank, layer.rope_dim
            ops.write_latent(_t((T, L + R), dtype), caches[0], meta.slot_mapping)
            ops.mla_paged_attention(_t((T, num_heads, L), dtype), _t((T, num_heads, R), dtype), caches[0], meta,
                                    layer.scale, num_splits=S)
        else:
            G, H, Hv = layer.num_kv_heads, layer.head_dim, layer.v_head_dim
            ops.write_kv(_t((T, G, H), dtype), _t((T, G, Hv), dtype), caches[0], caches[1], meta.slot_mapping)
            ops.paged_attention(_t((T, layer.num_heads, H), dtype), caches[0], caches[1], meta, layer.scale,
                                num_splits=S, sliding_window=layer.sliding_window, sinks=layer.sinks)


def _experts(moe, dtype: torch.dtype, device: torch.device, low_latency_rows: int) -> None:
    """The grouped GEMM with every config the layer can pick (the defaults and this shape's tuned
    entries for this device), router ids as int64 and remapped int32; the masked GEMM over DeepEP's
    low-latency layout when the dispatcher may use it (low_latency_rows: its rows per expert)."""
    from kernels.grouped_gemm import config as gcfg
    from kernels.grouped_gemm.masked import masked_experts_triton
    from kernels.grouped_gemm.triton_kernel import fused_experts_triton

    w13, w2 = moe.experts.op_weights()
    if moe.experts.op_kwargs():  # biases or another activation: torch ops on either backend
        return
    scales = {}
    if not isinstance(w13, torch.Tensor):
        if not hasattr(w13, "scale_inv"):  # MXFP4: dequantized per step, torch ops
            return
        scales = dict(w13_scale=w13.scale_inv, w2_scale=w2.scale_inv, scale_block=w13.block)
        act_quant = getattr(w13, "act_quant", False)
        w13, w2 = w13.q, w2.q
    E, F2, D = w13.shape
    K = moe.gate.top_k
    tuned = gcfg.load_configs(E, F2 // 2, D, dtype, gcfg.device_name(device)) if dtype in gcfg.DTYPE_NAMES else None
    configs = [dict(c) for c in gcfg.DEFAULT_CONFIGS] + [dict(c) for c in (tuned or {}).values()]
    for cfg in configs:
        for ids in (torch.int64, torch.int32):
            fused_experts_triton(_t((4, D), dtype), w13, w2, _t((4, K)), _t((4, K), ids), cfg, **scales,
                                 **(dict(act_quant=act_quant) if scales else {}))
        if low_latency_rows:
            masked_experts_triton(_t((E, low_latency_rows, D), dtype), _t((E,), torch.int32), w13, w2, cfg, **scales)


def warm_up(model: torch.nn.Module, *, dtype: torch.dtype, device: torch.device, block_size: int,
            max_model_len: int, num_heads: int, dispatcher=None) -> set:
    """Compile every Triton variant the model's attention, expert and FP8 linear layers can launch
    on `device`; returns their compile keys (kernels/specialization.Launch). Layers on torch backends
    are skipped. A variant that fails to compile is logged and left to its first launch."""
    from attention.backends import triton_paged as tp
    from attention.layer import PagedAttention, PagedMLAAttention
    from expert_parallel.runtime.layer import MoE
    from kernels import specialization
    from moe_serve.layers.linear import Linear

    t0 = time.perf_counter()
    split = tp._device_sms(device) > 0  # the engine splits decode keys only where it counts SMs (CUDA)
    rows = 0
    if dispatcher is not None and getattr(dispatcher, "max_low_latency_tokens", 0):
        rows = dispatcher.max_low_latency_tokens * dispatcher.world_size
    seen_attention, seen_experts, seen_linear = set(), set(), set()
    with specialization.record(warmup=True) as launches:
        for module in model.modules():
            if isinstance(module, (PagedAttention, PagedMLAAttention)) and module.ops is tp:
                key = (type(module), tuple(module.cache_shape(1, block_size)), module.sliding_window if
                       isinstance(module, PagedAttention) else None, getattr(module, "sinks", None) is not None)
                if key not in seen_attention:  # layers of one shape compile the same variants
                    seen_attention.add(key)
                    _attention(module, num_heads, dtype, block_size, max_model_len, split)
            elif isinstance(module, MoE) and module.ctx.moe_backend == "triton":
                w13 = module.experts.op_weights()[0]
                key = (tuple(w13.shape), str(getattr(w13, "dtype", type(w13))))
                if key not in seen_experts:
                    seen_experts.add(key)
                    _experts(module, dtype, device, rows)
            elif isinstance(module, Linear) and module.weight_scale_inv is not None and module.fp8_backend == "triton":
                key = (module.out_features, module.in_features, module.bias is not None, module.fp8_act_quant)
                if key not in seen_linear:
                    seen_linear.add(key)
                    for M in (1, 32, 4096):  # the kernel's three row tiles
                        module(_t((M, module.in_features), dtype))
    variants = set(launches)
    if variants:
        log.info("Triton: %d kernel variants compiled before serving in %.1f s", len(variants),
                 time.perf_counter() - t0)
    return variants
