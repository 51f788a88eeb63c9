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

from attention.cache_kinds import FULL, CacheKind
from attention.state import StateCache
from attention.layer import PagedAttention, PagedMLAAttention, PagedRows
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
class CacheGroupSize:
    """One cache group: its kind, its layers, and its blocks (or, for the state group, slots)."""
    kind: CacheKind
    layers: tuple
    num_blocks: int  # blocks (state: slots) the allocator hands out; one more is the scratch one
    block_bytes: int  # one block of every layer of the group (state: one slot)

    @property
    def bytes(self) -> int:
        return (self.num_blocks + 1) * self.block_bytes


@dataclass(frozen=True)
class KVCacheSize:
    """The cache's size per group and what it was sized from. Group 0 is `groups[0]`; `state` is
    the per-sequence state pool of linear-attention layers (None without)."""
    groups: tuple[CacheGroupSize, ...]
    state: CacheGroupSize | None
    profile_peak_bytes: int | None  # None: sized without a profiling forward
    graph_estimate_bytes: int

    @property
    def num_blocks(self) -> int:
        return self.groups[0].num_blocks

    @property
    def block_bytes(self) -> int:
        return self.groups[0].block_bytes

    @property
    def scratch_block(self) -> int:
        """One block more than the allocator hands out: the block padded decode rows write to."""
        return self.num_blocks

    @property
    def group_scratch(self) -> list[int]:
        """The scratch block of each group after group 0 (its null block as well)."""
        return [g.num_blocks for g in self.groups[1:]]

    @property
    def state_scratch(self) -> int | None:
        return None if self.state is None else self.state.num_blocks

    @property
    def kv_cache_bytes(self) -> int:
        return sum(g.num_blocks * g.block_bytes for g in self.groups) + \
            (self.state.num_blocks * self.state.block_bytes if self.state is not None else 0)

    def token_capacity(self, block_size: int) -> int | None:
        """Tokens one request can hold, when the cache bounds it (a full-attention group); None
        when every group keeps a bounded window or state."""
        grows = [g for g in self.groups if g.kind == FULL]
        return min(g.num_blocks for g in grows) * block_size if grows else None

    def manager_groups(self) -> list[tuple[CacheKind, int]]:
        return [(g.kind, g.num_blocks) for g in self.groups]


def attention_layers(model: nn.Module) -> list:
    """The model's cache-owning layers: paged attention (every kind) and per-sequence state."""
    return [m for m in model.modules() if isinstance(m, (PagedAttention, PagedMLAAttention, PagedRows, StateCache))]


def group_layers(layers: list) -> tuple[list[tuple[CacheKind, list]], list]:
    """Block groups (kind, layers), full attention first, and the state layers; each attention
    layer's `cache_group` is set to its group's index."""
    groups: dict[CacheKind, list] = {}
    state = []
    for layer in layers:
        if isinstance(layer, StateCache):
            state.append(layer)
        else:
            groups.setdefault(layer.cache_kind, []).append(layer)
    ordered = sorted(groups.items(), key=lambda kv: (kv[0] != FULL, str(kv[0])))
    for g, (_, members) in enumerate(ordered):
        for layer in members:
            layer.cache_group = g
    return ordered, state


def _cache_tensors(layer, n: int, cfg: EngineConfig) -> list[torch.Tensor]:
    """Zeroed cache tensors of one layer for n blocks (state layers: n slots, in their own dtypes);
    every K/V kind in cfg.kv_cache_dtype (FP8 under --kv-cache-dtype fp8*)."""
    if isinstance(layer, StateCache):
        return [torch.zeros(s, dtype=d, device=cfg.device) for s, d in layer.cache_shapes(n)]
    return [torch.zeros(s, dtype=cfg.kv_cache_dtype, device=cfg.device)
            for s in layer.cache_shape(n, cfg.cache.block_size)]


def _bind_temporary(attn_layers: list, num_blocks: int, cfg: EngineConfig) -> None:
    for layer in attn_layers:
        layer.bind(_cache_tensors(layer, num_blocks, cfg))


def _unbind(attn_layers: list, cfg: EngineConfig) -> None:
    for layer in attn_layers:
        layer.bind([None] * len(_cache_tensors(layer, 0, cfg)))


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
    # (CPU recordings hold a few buffers per size: nothing to reserve)
    graphs = profile_graph_memory(model, attn_layers, cfg, moe_ctx, probe) if captures_graphs and cfg.device.type == "cuda" else 0
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
    groups, _ = group_layers(attn_layers)
    for g in range(1, len(groups)):  # every group's temporary cache is as big as group 0's
        meta.group_tables[g] = (meta.block_tables, meta.slot_mapping)
    meta.state_slots = torch.arange(len(q_lens), device=dev)
    first = max(first, len(q_lens))
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
    ladders = [(1, cuda_graph.capture_sizes(cfg.scheduler.max_num_seqs, cfg.graphs.max_capture_size))]
    spec = cfg.speculative
    if spec is not None and 1 + spec.num_speculative_tokens <= bs:  # verify graphs (spec_decode/verify.py)
        q = 1 + spec.num_speculative_tokens
        ladders.append((q, cuda_graph.verify_capture_sizes(cfg.scheduler.max_num_seqs, cfg.graphs.max_capture_size,
                                                           q)))
    max_len = cfg.model.max_model_len
    total = 0
    for q, sizes in ladders:
        took = []
        for B in sorted({sizes[-1], sizes[0]}, reverse=True):
            _bind_temporary(attn_layers, 1, cfg)
            free0 = probe.free_bytes()
            trial = cuda_graph.DecodeGraphs(model, [B], -(-max_len // bs), bs, max_len, 0, dev, query_len=q)
            try:
                trial.capture(cuda_graph.capture_agreement(moe_ctx.dispatcher))
                took.append(max(0, free0 - probe.free_bytes()))
            except Exception as e:  # noqa: BLE001 - e.g. a Triton compile error: the real capture fails the same way
                log.warning("trial graph capture failed (no graph memory reserved): %s: %s", type(e).__name__,
                            str(e)[:300])
                return 0
            finally:
                del trial
                _unbind(attn_layers, cfg)
        total += graph_memory_estimate(took[0], took[-1], len(sizes))
    return total


def _window_blocks(kind: CacheKind, cfg: EngineConfig) -> int:
    """Blocks one request of a sliding or chunked group holds between steps: its window (or chunk)
    plus a partial block at each end; never more than its whole context."""
    bs = cfg.cache.block_size
    return min(kind.tokens // bs + 2, -(-cfg.model.max_model_len // bs))


def size_kv_cache(attn_layers: list, cfg: EngineConfig, weight_bytes: int,
                  profile: MemoryProfile | None) -> KVCacheSize:
    """Blocks (and state slots) per cache group from one budget: --num-kv-blocks (group 0's
    blocks); else the profiled budget (logged); else --kv-cache-memory or the default rule.

    Groups whose need per request is bounded (sliding, chunked, state: one live slot and, with
    prefix caching, one snapshot slot per request) are sized for max_num_seqs requests plus one
    step's new tokens (the token budget) in the windowed groups, at most half the budget when a
    full-attention group shares it: the step's share shrinks first (the scheduler then cuts
    prefill chunks to what a windowed group holds), then the requests (it admits only what every
    group has room for). The full-attention groups get the rest. After the
    profile it is sized from and before any allocation that the budget would otherwise miss."""
    cc, fraction = cfg.cache, cfg.cache.memory_fraction
    elem = torch.empty((), dtype=cfg.kv_cache_dtype).element_size()  # FP8: 1 byte a value
    groups, state_layers = group_layers(attn_layers)
    if not groups:
        raise ValueError("the model has no attention layer to keep a KV cache for")
    per_block = [sum(elem * math.prod(s) for layer in members for s in layer.cache_shape(1, cc.block_size))
                 for _, members in groups]
    slot_bytes = sum(layer.slot_bytes() for layer in state_layers)
    if profile is not None:
        peak, graphs = profile.peak_bytes, profile.graph_estimate_bytes
        budget = kv_budget_after_profile(profile.free_bytes, peak + graphs, fraction)
        log.info("memory profile: a %d-token step peaks at %.1f MiB above the weights, decode graphs are "
                 "estimated at %.1f MiB; %.1f MiB free after them; KV cache gets %.2f x free - peak - graphs "
                 "= %.1f MiB", cfg.scheduler.max_num_batched_tokens, peak / 2**20,
                 graphs / 2**20, profile.free_bytes / 2**20, fraction, budget / 2**20)
    else:
        budget = cc.kv_cache_memory or default_kv_cache_memory(cfg.device, weight_bytes, fraction)
    slots_per_seq = (2 if cc.enable_prefix_caching else 1) if state_layers else 0

    def bounded_blocks(kind: CacheKind, n_seqs: int, step_blocks: int) -> int:
        return n_seqs * _window_blocks(kind, cfg) + step_blocks

    def bounded_bytes(n_seqs: int, step_blocks: int) -> int:
        return sum(bounded_blocks(k, n_seqs, step_blocks) * b for (k, _), b in zip(groups, per_block) if k != FULL) \
            + n_seqs * slots_per_seq * slot_bytes

    n_seqs = cfg.scheduler.max_num_seqs
    step_blocks = -(-min(cfg.scheduler.max_num_batched_tokens, cfg.model.max_model_len) // cc.block_size)
    grows = any(k == FULL for k, _ in groups)
    if not cc.num_blocks:
        limit = budget // 2 if grows else budget
        while bounded_bytes(n_seqs, step_blocks) > limit and (n_seqs > 1 or step_blocks > 1):
            if step_blocks > 4 or n_seqs == 1:
                step_blocks = max(1, step_blocks // 2)
            else:
                n_seqs -= 1
        if n_seqs < cfg.scheduler.max_num_seqs:
            log.warning("the KV cache budget (%.1f MiB) holds the windows and states of %d requests at once, "
                        "fewer than max_num_seqs=%d", budget / 2**20, n_seqs, cfg.scheduler.max_num_seqs)
    left = budget - bounded_bytes(n_seqs, step_blocks)
    sized = []
    full_bytes = sum(b for (k, _), b in zip(groups, per_block) if k == FULL)
    for g, ((kind, members), b) in enumerate(zip(groups, per_block)):
        if kind == FULL:
            n = cc.num_blocks or int(left // full_bytes)
        else:
            n = cc.num_blocks if cc.num_blocks and g == 0 else bounded_blocks(kind, n_seqs, step_blocks)
        if n < 1:
            raise ValueError(f"kv_cache_memory={budget} bytes holds no KV block of the {kind} layers "
                             f"({b} bytes per block after the bounded groups' {bounded_bytes(n_seqs)} bytes)")
        sized.append(CacheGroupSize(kind, tuple(members), n, b))
    state = (CacheGroupSize(state_layers[0].cache_kind, tuple(state_layers), n_seqs * slots_per_seq, slot_bytes)
             if state_layers else None)
    return KVCacheSize(tuple(sized), state, profile.peak_bytes if profile is not None else None,
                       profile.graph_estimate_bytes if profile is not None else 0)


def init_kv_cache(attn_layers: list, cfg: EngineConfig, kv: KVCacheSize) -> tuple[list[list[torch.Tensor]], list]:
    """Allocate every group's cache (its blocks plus the scratch block; the state pool's slots plus
    a scratch slot), bind it to the group's layers, and log what each group keeps. Once sized;
    before the decode graphs are captured, which read the bound cache. Returns the tensors bound,
    per block group and the state pool's, in layer order (what a KV transfer registers)."""
    bs = cfg.cache.block_size
    bound: list[list[torch.Tensor]] = []
    state_bound: list[torch.Tensor] = []
    for g, group in enumerate(kv.groups):
        bound.append([])
        for layer in group.layers:
            tensors = _cache_tensors(layer, group.num_blocks + 1, cfg)
            layer.bind(tensors)
            bound[-1] += tensors
        per_seq = "" if group.kind == FULL else \
            f", at most {_window_blocks(group.kind, cfg) * group.block_bytes / 2**20:.2f} MiB per request between steps"
        log.info("KV cache group %d (%s, %d layers): %d blocks x %d tokens, %.1f MiB (%s, %d bytes per token%s)", g,
                 group.kind, len(group.layers), group.num_blocks, bs, group.bytes / 2**20,
                 str(cfg.kv_cache_dtype).removeprefix("torch."), group.block_bytes // bs, per_seq)
    if kv.state is not None:
        for layer in kv.state.layers:
            tensors = _cache_tensors(layer, kv.state.num_blocks + 1, cfg)
            layer.bind(tensors)
            state_bound += tensors
        log.info("state cache (%d linear-attention layers): %d slots of %.2f MiB per request (a live slot per "
                 "running request%s), %.1f MiB", len(kv.state.layers), kv.state.num_blocks,
                 kv.state.block_bytes / 2**20,
                 ", one prefix-cache snapshot per request" if cfg.cache.enable_prefix_caching else "",
                 kv.state.bytes / 2**20)
    log.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%d bytes per token)",
             kv.num_blocks, bs, kv.num_blocks * bs, kv.kv_cache_bytes / 2**20, kv.block_bytes // bs)
    apply_kv_scales([layer for group in kv.groups for layer in group.layers], cfg)
    return bound, state_bound


def apply_kv_scales(layers: list, cfg: EngineConfig) -> None:
    """With an FP8 cache, give every attention layer the k_scale / v_scale its checkpoint ships
    (weights.py leaves them in `checkpoint_kv_scales`), else 1.0; logged once. With "auto" the
    scales stay 1.0 whatever the checkpoint ships (vLLM ignores them there too)."""
    if cfg.cache.kv_cache_dtype == "auto":
        return
    name = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}[cfg.kv_cache_dtype]
    scaled = [layer for layer in layers if hasattr(layer, "k_scale")]
    shipped = [layer for layer in scaled if getattr(layer, "checkpoint_kv_scales", None) is not None]
    for layer in scaled:
        layer.k_scale, layer.v_scale = getattr(layer, "checkpoint_kv_scales", None) or (1.0, 1.0)
        layer.kv_scales_live = True  # a weight update may not change them (weights.py)
    if shipped:
        log.info("kv cache %s: k/v scales from the checkpoint for %d of %d attention layers (1.0 for the rest)",
                 name, len(shipped), len(scaled))
    else:
        log.info("kv cache %s: k/v scales 1.0 (the checkpoint ships none)", name)
