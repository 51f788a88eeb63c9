"""How much memory the KV cache gets, and the cache itself.

On CUDA, without --kv-cache-memory or a block count, the largest step the scheduler can hand out
runs once (the profiling forward) and, where decode graphs are captured, the ladder's largest and
smallest graphs are captured for trial; the cache gets a fraction of what is free then, less that
step's peak and the graphs' estimate. The CPU keeps a fixed rule and runs no profiling forward
(`memory_probe` is replaceable, so tests run the profiling path on the CPU). Steps of
`build_engine`, in its order.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from attention.layer import PagedAttention, PagedMLAAttention
from attention.metadata import AttentionMetadata
from expert_parallel.runtime.layer import MoEContext
from expert_parallel.runtime.step import MoEStep
from moe_serve import cuda_graph
from moe_serve.config import EngineConfig

# Every runner module logs under the runner's name: operators and the launcher tests look for it.
log = logging.getLogger("moe_serve.model_runner")


def default_kv_cache_memory(device: torch.device, weight_bytes: int, fraction: float) -> int:
    """Bytes for the KV cache when none is given: on CUDA a fraction of what is free after the
    weights; on CPU a fraction of the machine's available memory, capped at 4 GiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 8 << 30
    return int(min(avail * fraction * 0.25, 4 << 30))


class CudaMemoryProbe:
    """Peak and free device memory around the profiling forward (torch's allocator statistics)."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)

    def peak_bytes(self) -> int:
        """Bytes above what was allocated at reset() at the highest point since."""
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.base

    def free_bytes(self) -> int:
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]


def memory_probe(device: torch.device):
    """The probe the KV-cache sizing profiles with: CUDA's allocator statistics; None elsewhere (the
    CPU keeps its sizing rule and start-up time: no profiling forward). Replaceable, so the CPU can
    run the profiling path with a probe of its own."""
    return CudaMemoryProbe(device) if device.type == "cuda" else None


def graph_memory_estimate(largest_bytes: int, smallest_bytes: int, num_graphs: int) -> int:
    """Device memory the decode graphs of a ladder will take, from trial captures of its largest
    and smallest sizes: the largest's private pool holds the activations every smaller graph
    reuses (one pool for all), and each further graph costs about what the smallest did (its
    executable graph and its output)."""
    return largest_bytes + max(0, num_graphs - 1) * smallest_bytes


def kv_budget_after_profile(free_bytes: int, peak_bytes: int, fraction: float) -> int:
    """KV-cache bytes once the largest step has run: `fraction` of what is free then (weights and
    persistent buffers such as DeepEP's already taken), less the step's peak activations, which
    every later step of that size needs again."""
    return max(0, int(free_bytes * fraction) - peak_bytes)


@dataclass(frozen=True)
class MemoryProfile:
    """What the profiling forward and the trial graph captures measured."""
    peak_bytes: int  # the largest step's peak above the weights
    graph_estimate_bytes: int  # the decode graphs' estimate (0 where none are captured)
    free_bytes: int  # free device memory after both


@dataclass(frozen=True)
class KVCacheSize:
    """The KV cache's size in blocks and what it was sized from."""
    num_blocks: int  # blocks the allocator hands out
    block_bytes: int  # one block of every attention layer
    profile_peak_bytes: int | None  # None: sized without a profiling forward
    graph_estimate_bytes: int

    @property
    def scratch_block(self) -> int:
        """One block more than the allocator hands out: the block padded decode rows write to."""
        return self.num_blocks

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def attention_layers(model: nn.Module) -> list:
    """The model's paged attention layers, the owners of the KV cache."""
    return [m for m in model.modules() if isinstance(m, (PagedAttention, PagedMLAAttention))]


def _bind_temporary(attn_layers: list, num_blocks: int, cfg: EngineConfig) -> None:
    bs, dtype = cfg.cache.block_size, cfg.model.dtype
    for layer in attn_layers:
        layer.bind([torch.zeros(s, dtype=dtype, device=cfg.device) for s in layer.cache_shape(num_blocks, bs)])


def _unbind(attn_layers: list, cfg: EngineConfig) -> None:
    for layer in attn_layers:
        layer.bind([None] * len(layer.cache_shape(1, cfg.cache.block_size)))


def profile_memory(model: nn.Module, attn_layers: list, cfg: EngineConfig, moe_ctx: MoEContext,
                   captures_graphs: bool) -> MemoryProfile | None:
    """On CUDA, unless the cache size is given: run the largest step once (`profile_step_memory`)
    and, where decode graphs will be captured, trial-capture them (`profile_graph_memory`); None
    otherwise. After the warm-up (the forward then compiles nothing) and before the KV cache is
    sized from it. Collective under expert parallelism: every rank runs it at this point."""
    probe = None if cfg.cache.kv_cache_memory or cfg.cache.num_blocks else memory_probe(cfg.device)
    if probe is None:
        return None
    peak = profile_step_memory(model, attn_layers, cfg, probe)
    graphs = profile_graph_memory(model, attn_layers, cfg, moe_ctx, probe) if captures_graphs else 0
    return MemoryProfile(peak, graphs, probe.free_bytes())


@torch.inference_mode()
def profile_step_memory(model: nn.Module, attn_layers: list, cfg: EngineConfig, probe) -> int:
    """Run the largest step the scheduler can hand out (max_num_batched_tokens dummy tokens, as
    prefills of up to max_model_len tokens each, plus logits for max_num_seqs rows)
    against a temporary KV cache just big enough for it, and return the probe's peak bytes.
    Collective under expert parallelism (every rank runs it once, at the same point of start-up,
    and the step's MoE layers dispatch like any step's); the caches are unbound afterwards."""
    sc, bs = cfg.scheduler, cfg.cache.block_size
    N = max(1, sc.max_num_batched_tokens)
    L = max(1, min(cfg.model.max_model_len, N))
    q_lens = [L] * (N // L) + ([N % L] if N % L else [])
    blocks = [-(-q // bs) for q in q_lens]
    W = max(blocks)
    bt = torch.zeros((len(q_lens), W), dtype=torch.int32)
    slots, first = [], 0
    for b, (q, nb) in enumerate(zip(q_lens, blocks)):
        bt[b, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
        pos = torch.arange(q)
        slots.append(bt[b, pos // bs].to(torch.int64) * bs + pos % bs)
        first += nb
    dev = cfg.device
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0, out=qsl[1:])
    meta = AttentionMetadata.from_tensors(qsl.to(dev), torch.tensor(q_lens, dtype=torch.int32, device=dev),
                                          bt.to(dev), torch.cat(slots).to(dev), bs, q_lens, list(q_lens))
    ids = torch.zeros(N, dtype=torch.int64, device=dev)
    positions = torch.cat([torch.arange(q) for q in q_lens]).to(dev)
    _bind_temporary(attn_layers, first, cfg)
    probe.reset()
    h = model(ids, positions, meta, MoEStep(max_tokens_any_rank=N))  # the same N on every rank
    model.compute_logits(h[: min(N, sc.max_num_seqs)])  # the most rows a step samples
    peak = probe.peak_bytes()
    _unbind(attn_layers, cfg)
    del h
    return peak


@torch.inference_mode()
def profile_graph_memory(model: nn.Module, attn_layers: list, cfg: EngineConfig, moe_ctx: MoEContext,
                         probe) -> int:
    """Before the KV cache is sized: capture the ladder's largest and smallest decode graphs
    against a one-block temporary KV cache (every row of a capture reads and writes the scratch
    block only), measure the device memory each took, free them, and return the estimate for
    the whole ladder (`graph_memory_estimate`). The warm-up runs of these captures also compile
    and autotune what the real captures then find cached."""
    bs, dev = cfg.cache.block_size, cfg.device
    sizes = cuda_graph.capture_sizes(cfg.scheduler.max_num_seqs, cfg.graphs.max_capture_size)
    max_len = cfg.model.max_model_len
    took = []
    for B in sorted({sizes[-1], sizes[0]}, reverse=True):
        _bind_temporary(attn_layers, 1, cfg)
        free0 = probe.free_bytes()
        trial = cuda_graph.DecodeGraphs(model, [B], -(-max_len // bs), bs, max_len, 0, dev)
        try:
            trial.capture(cuda_graph.capture_agreement(moe_ctx.dispatcher))
            took.append(max(0, free0 - probe.free_bytes()))
        except RuntimeError as e:  # the real capture will fail the same way and run eagerly
            log.warning("trial decode graph capture failed (no graph memory reserved): %s", str(e)[:300])
            return 0
        finally:
            del trial
            _unbind(attn_layers, cfg)
    return graph_memory_estimate(took[0], took[-1], len(sizes))


def size_kv_cache(attn_layers: list, cfg: EngineConfig, weight_bytes: int,
                  profile: MemoryProfile | None) -> KVCacheSize:
    """KV blocks this rank gets: --num-kv-blocks; else the profiled budget (logged); else
    --kv-cache-memory or the default rule. After the profile it is sized from and before any
    allocation that the budget would otherwise miss."""
    cc, fraction = cfg.cache, cfg.cache.memory_fraction
    elem = torch.empty((), dtype=cfg.model.dtype).element_size()
    per_block = sum(elem * math.prod(s) for layer in attn_layers for s in layer.cache_shape(1, cc.block_size))
    if profile is not None:
        peak, graphs = profile.peak_bytes, profile.graph_estimate_bytes
        budget = kv_budget_after_profile(profile.free_bytes, peak + graphs, fraction)
        log.info("memory profile: a %d-token step peaks at %.1f MiB above the weights, decode graphs are "
                 "estimated at %.1f MiB; %.1f MiB free after them; KV cache gets %.2f x free - peak - graphs "
                 "= %.1f MiB", cfg.scheduler.max_num_batched_tokens, peak / 2**20,
                 graphs / 2**20, profile.free_bytes / 2**20, fraction, budget / 2**20)
    else:
        budget = cc.kv_cache_memory or default_kv_cache_memory(cfg.device, weight_bytes, fraction)
    num_blocks = cc.num_blocks or int(budget // per_block)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory={budget} bytes holds no KV block ({per_block} bytes per block)")
    return KVCacheSize(num_blocks, per_block, profile.peak_bytes if profile is not None else None,
                       profile.graph_estimate_bytes if profile is not None else 0)


def init_kv_cache(attn_layers: list, cfg: EngineConfig, kv: KVCacheSize) -> None:
    """Allocate the KV cache and bind it to the attention layers: num_blocks blocks plus the scratch
    block. Once sized; before the decode graphs are captured, which read the bound cache."""
    bs = cfg.cache.block_size
    for layer in attn_layers:
        layer.bind([torch.zeros(s, dtype=cfg.model.dtype, device=cfg.device)
                    for s in layer.cache_shape(kv.num_blocks + 1, bs)])
    log.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%d bytes per token)",
             kv.num_blocks, bs, kv.num_blocks * bs, kv.kv_cache_bytes / 2**20, kv.block_bytes // bs)
