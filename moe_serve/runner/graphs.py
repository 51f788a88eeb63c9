"""Which decode steps are padded to the capture ladder, and the capture of one CUDA graph (on the
CPU a recording, moe_serve/cpu_graph.py) per ladder size (moe_serve/cuda_graph.py has the ladder,
the capture and the replay; `ModelRunner` pads and replays). Steps of `build_engine`, in its order.
Speculative decoding's verify steps get their own ladder and graphs: moe_serve/spec_decode/verify.py."""
from __future__ import annotations

import logging

import torch
from torch import nn

from attention.layer import PagedAttention
from expert_parallel.runtime.layer import MoEContext
from moe_serve import cuda_graph, platform
from moe_serve.config import EngineConfig
from moe_serve.input_batch import InputBatch
from moe_serve.kernels import cpu_ops
from moe_serve.runner.memory import KVCacheSize, attention_layers

# Every runner module logs under the runner's name: operators and the launcher tests look for it.
log = logging.getLogger("moe_serve.model_runner")


def captures_graphs(cfg: EngineConfig, moe_ctx: MoEContext, ops: platform.Ops) -> bool:
    """Whether decode graphs are captured (and so padding on unless pad_decode says otherwise).
    With expert parallelism only where the dispatcher has a fixed-shape exchange over NCCL for
    padded decode steps (all_to_all, allgather; not DeepEP, whose dispatch picks its mode and
    buffers per step). Not with EPLB: a rebalance swaps expert weight buffers, which a graph would
    keep reading. Nor with the torch attention backend: its single-decode path sizes its gather
    from host lengths. Decided before the memory profile, which reserves memory for the graphs."""
    gc, par = cfg.graphs, cfg.parallel
    capture = ((ops.captures_graphs or cpu_graphs_apply(cfg, moe_ctx, ops)) and not gc.enforce_eager
               and par.eplb is None and moe_ctx.dispatcher.captures_decode())
    return capture and (gc.pad_decode is None or gc.pad_decode)


def cpu_graphs_apply(cfg: EngineConfig, moe_ctx: MoEContext, ops: platform.Ops) -> bool:
    """Whether the CPU records its decode steps (moe_serve/cpu_graph.py): our C kernels built, the
    attention backend ours over float32 activations (its decode kernel reads lengths, block tables
    and positions from tensors, where the torch path sizes a gather from host lengths), and one
    rank (an expert-parallel step's collectives are not ops a recording sees; an elastic job that
    shrank to one rank records like any other). Which layers the model has is checked when the model
    is there (`cpu_graph_blocker`). An FP8 KV cache records only once the C decode kernel reads it
    (else the torch path would run, with its host-sized gathers)."""
    return (cfg.device.type == "cpu" and ops.attention.name == "cpu_c" and cfg.activation_dtype == torch.float32
            and moe_ctx.dispatcher.world_size == 1 and cpu_ops.available() and _c_decode_reads(cfg.kv_cache_dtype))


def _c_decode_reads(kv_dtype: torch.dtype) -> bool:
    """Whether the C decode kernel takes a cache of this dtype (asked with a one-slot example)."""
    q, cache = torch.zeros(1, 1, 1), torch.zeros(1, 1, 1, 1, dtype=kv_dtype)
    return cpu_ops.decode_attention_fits(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                         torch.ones(1, dtype=torch.int32))


def cpu_graph_blocker(model: nn.Module) -> str | None:
    """Why a CPU recording could not hold this model's decode step, or None: only full paged
    attention reads everything it depends on from tensors in our C decode kernel (sliding windows,
    sinks, chunks, MLA, sparse attention and per-sequence state take paths that decide on the host)."""
    for layer in attention_layers(model):
        if type(layer) is not PagedAttention:
            return f"its {type(layer).__name__} layers"
        if layer.sliding_window is not None or layer.sinks is not None or layer.attention_chunk is not None:
            return "its sliding-window, sink or chunked attention layers"
    return None


def capture_decode_graphs(model: nn.Module, cfg: EngineConfig, moe_ctx: MoEContext, batch: InputBatch,
                          kv: KVCacheSize, capture: bool) -> tuple[list[int], cuda_graph.DecodeGraphs | None]:
    """The ladder decode steps are padded to, and where `capture` one graph per size (None if not
    captured). Padding is on where graphs are captured, or where pad_decode forces it. Last of the
    runner's steps: a graph holds the bound KV cache and the input batch's buffers. Collective under
    expert parallelism (the ranks agree on every size: all keep their graphs or all run eagerly)."""
    gc = cfg.graphs
    cpu = cfg.device.type == "cpu"
    if capture and cpu and (blocker := cpu_graph_blocker(model)) is not None:
        log.info("decode steps run eagerly: a CPU recording cannot hold %s", blocker)
        capture = False
    pad = capture if gc.pad_decode is None else gc.pad_decode
    pad_sizes = cuda_graph.capture_sizes(cfg.scheduler.max_num_seqs, gc.max_capture_size, cpu=capture and cpu) if pad else []
    if not capture:
        return pad_sizes, None
    graphs = cuda_graph.DecodeGraphs(model, pad_sizes, batch.max_blocks, cfg.cache.block_size, batch.max_model_len,
                                     kv.scratch_block, cfg.device, kv.group_scratch, kv.state_scratch)
    try:
        graphs.capture(cuda_graph.capture_agreement(moe_ctx.dispatcher))
    except Exception as e:  # noqa: BLE001 - e.g. an op that syncs the host: decode steps stay eager
        # Padding was for the graphs (unless pad_decode asked for it): eager steps run unpadded. The
        # ranks of an expert-parallel job fail together (capture_agreement), so they agree on this too.
        pad_sizes = pad_sizes if gc.pad_decode else []
        log.warning("decode graph capture failed, running eagerly%s: %s: %s",
                    " (still padded: pad_decode)" if pad_sizes else " and unpadded", type(e).__name__, str(e)[:300])
        return pad_sizes, None
    est = kv.graph_estimate_bytes
    if est and graphs.memory_bytes > est:
        log.warning("decode graphs took %.1f MiB, above the %.1f MiB reserved for them before the KV cache "
                    "was sized (--kv-cache-memory sizes the cache explicitly if memory runs short)",
                    graphs.memory_bytes / 2**20, est / 2**20)
    return pad_sizes, graphs

