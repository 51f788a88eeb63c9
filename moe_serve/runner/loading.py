"""This rank's model: built on the device, its weights loaded from the checkpoint (or drawn, for
load_format="dummy") and prepared for the GEMMs that run them, then, on CUDA, every Triton kernel
variant its layers can launch compiled before serving. Steps of `build_engine`, in its order."""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from expert_parallel.runtime.dispatch import Dispatcher
from expert_parallel.runtime.layer import MoEContext
from moe_serve import kernel_warmup, platform
from moe_serve.config import EngineConfig
from moe_serve.models.registry import model_class
from moe_serve.prepare import (compact_packed_weights, fuse_projections, gemm_weight_dtype, int8_activations_on,
                               log_float_w8a8, narrow_before_load, place_weights_on_huge_pages, prepare_gemm_weights)
from moe_serve.quantization import fp8, gguf_file
from moe_serve.weights import init_dummy_weights, load_weights

# Every runner module logs under the runner's name: operators and the launcher tests look for it.
log = logging.getLogger("moe_serve.model_runner")


def build_model(cfg: EngineConfig, moe_ctx: MoEContext, ops: platform.Ops) -> nn.Module:
    """The architecture's modules on the device, in eval mode and without gradients. First of the
    runner's steps (the MoE layers take the context made just before); torch is seeded here so that
    initial and dummy weights are the same on every start."""
    mc = cfg.model
    torch.manual_seed(mc.seed)
    cls = model_class(mc.architecture)
    dtype = cfg.activation_dtype
    with torch.device(cfg.device):
        model = cls(mc.hf, moe_ctx, dtype)
        spec = cfg.speculative
        if spec is not None and spec.method == "mtp":
            if not hasattr(model, "add_mtp_layers"):
                raise ValueError(f"speculative_config.method='mtp': {mc.architecture} has no multi-token-prediction "
                                 "layers the engine can run (DeepSeek-V3/V3.2/V4, GLM-5 and Kimi-K2 checkpoints do); use "
                                 "method 'ngram'")
            model.add_mtp_layers(moe_ctx, dtype)
            log.info("speculative decoding: the checkpoint's multi-token-prediction layer drafts %d token(s) per step",
                     spec.num_speculative_tokens)
    if dtype != mc.dtype:  # float32 activations: the GEMM weights are made in the model's dtype now
        narrow_before_load(model, gemm_weight_dtype(mc.dtype, cfg.device, serves_bf16_in_c(cfg)), dtype)
    platform.bind_ops(model, ops)  # each layer holds the backend object of its kind of op
    n_moe = model.num_moe_layers
    if moe_ctx.physical_to_logical is not None and n_moe != len(moe_ctx.physical_to_logical):
        raise ValueError(f"expert placement has {len(moe_ctx.physical_to_logical)} layers; "
                         f"the model has {n_moe} MoE layers")
    model.requires_grad_(False)
    model.eval()
    return model


def load_model_weights(model: nn.Module, cfg: EngineConfig, show_progress: bool = True) -> None:
    """The checkpoint's weights into the built model, or seeded dummy ones for load_format="dummy"
    (kept in FP8 when asked, so that sizes are those of an FP8 model). Right after the build: every
    later step reads the weights."""
    mc = cfg.model
    if mc.load_format == "dummy":
        if mc.weight_quantization == "fp8":  # the sizes of an FP8 model: its weights kept in FP8
            fp8.to_block_fp8(model, (fp8.checkpoint_config(mc.hf) or fp8.BlockFp8Config()).block, None)
        init_dummy_weights(model, mc.seed)
    elif (gguf := gguf_file.gguf_path(mc.path)) is not None:  # a GGUF file (or a directory holding one)
        from moe_serve.quantization.gguf_load import load_gguf

        load_gguf(model, gguf, cfg.activation_dtype, show_progress)
    else:
        load_weights(model, mc.path, cfg.activation_dtype, show_progress=show_progress, quantization=mc.quantization)
    check = getattr(model, "check_loaded", None)
    if check is not None:  # tables a forward indexes with (DeepSeek-V4's tid2eid), checked once here
        check()


def serves_bf16_in_c(cfg: EngineConfig) -> bool:
    """Whether our C kernels run the experts and the linear layers (they take bfloat16 weights)."""
    return cfg.device.type == "cpu" and cfg.moe_backend == "cpu_c" and cfg.linear_backend == "cpu_c"


def prepare_weights(model: nn.Module, cfg: EngineConfig, started: float) -> int:
    """The loaded weights in the layout and memory the GEMMs run from (moe_serve/prepare.py); returns
    this rank's weight bytes (parameters and block-FP8 scales), logged with the time since `started`
    (the build). After loading, whose tensors it converts; before the warm-up and the KV-cache
    sizing, which must see the weights as they are served."""
    mc = cfg.model
    prepare_gemm_weights(model, mc.dtype, cfg.device, c_kernels=serves_bf16_in_c(cfg),
                         params_dtype=cfg.activation_dtype)
    compact_packed_weights(model, cfg.device)
    if serves_bf16_in_c(cfg) and not cfg.batch_invariant:
        int8_activations_on(model, cfg.cpu_int8_activations, mc.weight_quantization == "gguf")
    log_float_w8a8(model)
    place_weights_on_huge_pages(model, cfg.device)
    fuse_projections(model, cfg.device)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    weight_bytes += sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                        if n.endswith("scale_inv"))  # block-FP8 scales
    log.info("model %s loaded in %.1fs: %.1f MiB of weights on this rank (%s)", mc.architecture,
             time.perf_counter() - started, weight_bytes / 2**20, mc.dtype)
    return weight_bytes


def warm_up_kernels(model: nn.Module, cfg: EngineConfig, dispatcher: Dispatcher) -> set:
    """Compile every Triton kernel variant this model's layers can launch (moe_serve/kernel_warmup.py);
    their compile keys."""
    mc = cfg.model
    return kernel_warmup.warm_up(model, dtype=cfg.activation_dtype, device=cfg.device, block_size=cfg.cache.block_size,
                                 max_model_len=mc.max_model_len, num_heads=mc.hf["num_attention_heads"],
                                 dispatcher=dispatcher, kv_cache_dtype=cfg.kv_cache_dtype)


def warm_up_before_serving(model: nn.Module, cfg: EngineConfig, moe_ctx: MoEContext, ops: platform.Ops) -> None:
    """On CUDA, `warm_up_kernels` now; a fault only costs the compile at first launch. After the
    weights are prepared (the compile keys include their alignment), before the profiling forward
    and the graph captures, so that no step compiles while the other ranks wait."""
    if ops.compiles_kernels:  # no Triton compile in the middle of serving
        try:
            warm_up_kernels(model, cfg, moe_ctx.dispatcher)
        except Exception as e:  # noqa: BLE001 - a warm-up fault must not stop serving: kernels then JIT
            log.warning("Triton warm-up stopped (%s: %s); kernels not compiled yet compile at their first "
                        "launch", type(e).__name__, str(e)[:300])
