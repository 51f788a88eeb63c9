"""The only place a scheduled batch becomes tensors: builds the model, owns the KV cache and the
persistent input batch (`input_batch.py`), runs steps: one host->device copy in, one read out."""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from attention.layer import PagedAttention, PagedMLAAttention
from attention.metadata import AttentionMetadata
from expert_parallel.runtime.layer import MoEContext
from expert_parallel.runtime.step import MoEStep
from moe_serve.config import EngineConfig
from moe_serve.input_batch import InputBatch, Piece, StepInputs
from moe_serve.models.registry import model_class
from moe_serve.prepare import place_weights_on_huge_pages, prepare_gemm_weights
from moe_serve.sampler import Sampler, SampleResult
from moe_serve.scheduler import SchedulerOutput
from moe_serve.weights import init_dummy_weights, load_weights

log = logging.getLogger("moe_serve.model_runner")


def default_kv_cache_memory(device: torch.device, weight_bytes: int, fraction: float) -> int:
    """Bytes for the KV cache when none is given: on CUDA a fraction of what is free after the
    weights; on CPU a fraction of the machine's available memory, capped at 4 GiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    try:
        import os

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


class ModelRunner:
    def __init__(self, cfg: EngineConfig, moe_ctx: MoEContext, kv_cache_memory: int | None,
                 memory_fraction: float, show_progress: bool = True):
        self.cfg = cfg
        self.moe_ctx = moe_ctx
        self.device = cfg.device
        mc = cfg.model
        torch.manual_seed(mc.seed)
        t0 = time.perf_counter()
        cls = model_class(mc.architecture)
        with torch.device(self.device):
            self.model = cls(mc.hf, moe_ctx, cfg.attention_backend, mc.dtype)
        n_moe = self.model.num_moe_layers
        if moe_ctx.physical_to_logical is not None and n_moe != len(moe_ctx.physical_to_logical):
            raise ValueError(f"expert placement has {len(moe_ctx.physical_to_logical)} layers; "
                             f"the model has {n_moe} MoE layers")
        # Expert-load hooks (moe_layer_index, logical top-k ids): the engine's recorder and the
        # online rebalancer add theirs; each step's MoEStep carries them to the MoE layers.
        self.load_hooks: list[Callable[[int, torch.Tensor], None]] = []
        self.model.requires_grad_(False)
        self.model.eval()
        if mc.load_format == "dummy":
            if mc.weight_quantization == "fp8":  # the sizes of an FP8 model: its weights kept in FP8
                from moe_serve.quantization import fp8

                fp8.to_block_fp8(self.model, (fp8.checkpoint_config(mc.hf) or fp8.BlockFp8Config()).block, None)
            init_dummy_weights(self.model, mc.seed)
        else:
            load_weights(self.model, mc.path, mc.dtype, show_progress=show_progress, quantization=mc.quantization)
        prepare_gemm_weights(self.model, mc.dtype, self.device)
        place_weights_on_huge_pages(self.model, self.device)
        self.weight_bytes = sum(t.numel() * t.element_size() for t in self.model.parameters())
        self.weight_bytes += sum(b.numel() * b.element_size() for n, b in self.model.named_buffers()
                                 if n.endswith("scale_inv"))  # block-FP8 scales
        log.info("model %s loaded in %.1fs: %.1f MiB of weights on this rank (%s)", mc.architecture,
                 time.perf_counter() - t0, self.weight_bytes / 2**20, mc.dtype)
        if self.device.type == "cuda":  # no Triton compile in the middle of serving
            try:
                self.warm_up_kernels()
            except Exception as e:  # noqa: BLE001 - a warm-up fault must not stop serving: kernels then JIT
                log.warning("Triton warm-up stopped (%s: %s); kernels not compiled yet compile at their first "
                            "launch", type(e).__name__, str(e)[:300])
        self._init_kv_cache(kv_cache_memory, memory_fraction)
        self.sampler = Sampler(self.device, mc.seed)
        # One row per running request; no request outgrows the model's context or the whole cache
        # (the engine lowers max_model_len to the latter the same way).
        max_len = min(mc.max_model_len, self.num_blocks * cfg.cache.block_size)
        self.batch = InputBatch(cfg.scheduler.max_num_seqs, max_len, cfg.cache.block_size,
                                mc.hf["vocab_size"], self.device)
        self._init_decode_graphs(max_len)
        self._bitmask = None  # structured_output.bitmask.BitmaskFiller, made on the first constrained step

    def warm_up_kernels(self) -> set:
        """Compile every Triton kernel variant this model's layers can launch (moe_serve/kernel_warmup.py);
        their compile keys."""
        from moe_serve.kernel_warmup import warm_up

        mc = self.cfg.model
        return warm_up(self.model, dtype=mc.dtype, device=self.device, block_size=self.cfg.cache.block_size,
                       max_model_len=mc.max_model_len, num_heads=mc.hf["num_attention_heads"],
                       dispatcher=self.moe_ctx.dispatcher)

    # --- KV cache -------------------------------------------------------------------------------
    def _init_kv_cache(self, kv_cache_memory: int | None, fraction: float) -> None:
        bs = self.cfg.cache.block_size
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, (PagedAttention, PagedMLAAttention))]
        elem = torch.empty((), dtype=self.cfg.model.dtype).element_size()
        per_block = sum(elem * _numel(s) for layer in self.attn_layers for s in layer.cache_shape(1, bs))
        self.profile_peak_bytes = None
        self.graph_estimate_bytes = 0
        probe = None if kv_cache_memory or self.cfg.cache.num_blocks else memory_probe(self.device)
        if probe is not None:
            self.profile_peak_bytes = self.profile_step_memory(probe)
            if self._captures_graphs():
                self.graph_estimate_bytes = self.profile_graph_memory(probe)
            free = probe.free_bytes()
            budget = kv_budget_after_profile(free, self.profile_peak_bytes + self.graph_estimate_bytes, fraction)
            log.info("memory profile: a %d-token step peaks at %.1f MiB above the weights, decode graphs are "
                     "estimated at %.1f MiB; %.1f MiB free after them; KV cache gets %.2f x free - peak - graphs "
                     "= %.1f MiB", self.cfg.scheduler.max_num_batched_tokens, self.profile_peak_bytes / 2**20,
                     self.graph_estimate_bytes / 2**20, free / 2**20, fraction, budget / 2**20)
        else:
            budget = kv_cache_memory if kv_cache_memory else default_kv_cache_memory(self.device, self.weight_bytes,
                                                                                     fraction)
        self.num_blocks = self.cfg.cache.num_blocks or int(budget // per_block)
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory={budget} bytes holds no KV block ({per_block} bytes per block)")
        # One block more than the allocator hands out: the scratch block padded decode rows write to.
        self.scratch_block = self.num_blocks
        for layer in self.attn_layers:
            layer.bind([torch.zeros(s, dtype=self.cfg.model.dtype, device=self.device)
                        for s in layer.cache_shape(self.num_blocks + 1, bs)])
        self.kv_cache_bytes = self.num_blocks * per_block
        log.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%d bytes per token)",
                 self.num_blocks, bs, self.num_blocks * bs, self.kv_cache_bytes / 2**20, per_block // bs)

    @torch.inference_mode()
    def profile_step_memory(self, probe) -> int:
        """Run the largest step the scheduler can hand out (max_num_batched_tokens dummy tokens, as
        prefills of up to max_model_len tokens each, plus logits for max_num_seqs rows)
        against a temporary KV cache just big enough for it, and return the probe's peak bytes.
        Collective under expert parallelism (every rank runs it once, at the same point of start-up,
        and the step's MoE layers dispatch like any step's); the caches are unbound afterwards."""
        sc, bs, dtype = self.cfg.scheduler, self.cfg.cache.block_size, self.cfg.model.dtype
        N = max(1, sc.max_num_batched_tokens)
        L = max(1, min(self.cfg.model.max_model_len, N))
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
        dev = self.device
        qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0, out=qsl[1:])
        meta = AttentionMetadata.from_tensors(qsl.to(dev), torch.tensor(q_lens, dtype=torch.int32, device=dev),
                                              bt.to(dev), torch.cat(slots).to(dev), bs, q_lens, list(q_lens))
        ids = torch.zeros(N, dtype=torch.int64, device=dev)
        positions = torch.cat([torch.arange(q) for q in q_lens]).to(dev)
        for layer in self.attn_layers:
            layer.bind([torch.zeros(s, dtype=dtype, device=dev) for s in layer.cache_shape(first, bs)])
        probe.reset()
        h = self.model(ids, positions, meta, MoEStep(max_tokens_any_rank=N))  # the same N on every rank
        self.model.compute_logits(h[: min(N, sc.max_num_seqs)])  # the most rows a step samples
        peak = probe.peak_bytes()
        for layer in self.attn_layers:
            layer.bind([None] * len(layer.cache_shape(1, bs)))
        del h
        return peak

    @torch.inference_mode()
    def profile_graph_memory(self, probe) -> int:
        """Before the KV cache is sized: capture the ladder's largest and smallest decode graphs
        against a one-block temporary KV cache (every row of a capture reads and writes the scratch
        block only), measure the device memory each took, free them, and return the estimate for
        the whole ladder (`graph_memory_estimate`). The warm-up runs of these captures also compile
        and autotune what the real captures then find cached."""
        from moe_serve import cuda_graph

        bs, dtype, dev = self.cfg.cache.block_size, self.cfg.model.dtype, self.device
        sizes = cuda_graph.capture_sizes(self.cfg.scheduler.max_num_seqs, self.cfg.graphs.max_capture_size)
        max_len = self.cfg.model.max_model_len
        took = []
        for B in sorted({sizes[-1], sizes[0]}, reverse=True):
            for layer in self.attn_layers:
                layer.bind([torch.zeros(s, dtype=dtype, device=dev) for s in layer.cache_shape(1, bs)])
            free0 = probe.free_bytes()
            trial = cuda_graph.DecodeGraphs(self.model, [B], -(-max_len // bs), bs, max_len, 0, dev)
            try:
                trial.capture(self._agree_captured())
                took.append(max(0, free0 - probe.free_bytes()))
            except RuntimeError as e:  # the real capture will fail the same way and run eagerly
                log.warning("trial decode graph capture failed (no graph memory reserved): %s", str(e)[:300])
                return 0
            finally:
                del trial
                for layer in self.attn_layers:
                    layer.bind([None] * len(layer.cache_shape(1, bs)))
        return graph_memory_estimate(took[0], took[-1], len(sizes))

    # --- decode padding and CUDA graphs (moe_serve/cuda_graph.py) -------------------------------
    def _agree_captured(self):
        from moe_serve.cuda_graph import capture_agreement

        return capture_agreement(self.moe_ctx.dispatcher)

    def _captures_graphs(self) -> bool:
        """Whether decode graphs are captured (and so padding on unless pad_decode says otherwise).
        With expert parallelism only where the dispatcher has a fixed-shape exchange over NCCL for
        padded decode steps (all_to_all, allgather; not DeepEP, whose dispatch picks its mode and
        buffers per step). Not with EPLB: a rebalance swaps expert weight buffers, which a graph would
        keep reading. Nor with the torch attention backend: its single-decode path sizes its gather
        from host lengths."""
        gc, par = self.cfg.graphs, self.cfg.parallel
        capture = (self.device.type == "cuda" and not gc.enforce_eager and par.eplb is None
                   and self.moe_ctx.dispatcher.captures_decode() and self.cfg.attention_backend == "triton")
        return capture and (gc.pad_decode is None or gc.pad_decode)

    def _init_decode_graphs(self, max_len: int) -> None:
        """The ladder decode steps are padded to, and on CUDA one graph per size (captured now, the
        KV cache bound). Padding is on where graphs are captured, or where pad_decode forces it."""
        from moe_serve import cuda_graph

        gc = self.cfg.graphs
        capture = self._captures_graphs()
        pad = capture if gc.pad_decode is None else gc.pad_decode
        self.pad_sizes = cuda_graph.capture_sizes(self.cfg.scheduler.max_num_seqs, gc.max_capture_size) if pad else []
        self.graphs = None
        if capture:
            graphs = cuda_graph.DecodeGraphs(self.model, self.pad_sizes, self.batch.max_blocks,
                                             self.cfg.cache.block_size, max_len, self.scratch_block, self.device)
            try:
                graphs.capture(self._agree_captured())
                self.graphs = graphs
            except Exception as e:  # noqa: BLE001 - e.g. an op that syncs the host: decode steps stay eager
                log.warning("decode CUDA graph capture failed, running eagerly: %s: %s", type(e).__name__,
                            str(e)[:300])
                return
            est = self.graph_estimate_bytes
            if est and graphs.memory_bytes > est:
                log.warning("decode graphs took %.1f MiB, above the %.1f MiB reserved for them before the KV cache "
                            "was sized (--kv-cache-memory sizes the cache explicitly if memory runs short)", graphs.memory_bytes / 2**20,
                            est / 2**20)

    def _pad_to(self, pieces: list[Piece], max_tokens_any_rank: int | None, all_ranks_decode: bool) -> int | None:
        """The ladder size a decode-only step pads to: that of the most tokens any rank scheduled
        (so every EP rank runs the same size); None when this or any rank's step is not decode
        only, or the batch is above the ladder. Nor while expert load is recorded: padded rows would
        count as routed tokens, and a graph replay skips the recorder's Python hook (recording
        starts and stops at the same turn on every rank, so the ranks still agree)."""
        if not self.pad_sizes or not all_ranks_decode or self._recording_load() or any(p[2] != 1 for p in pieces):
            return None
        from moe_serve.cuda_graph import padded_size

        return padded_size(max(len(pieces), max_tokens_any_rank or 0), self.pad_sizes)

    def _recording_load(self) -> bool:
        """Whether the MoE layers' load hook counts this step: an ExpertLoadRecorder's bound
        `record` counts only while started; any other hook (EPLB's) always."""
        return any(getattr(getattr(h, "__self__", None), "active", True) for h in self.load_hooks)

    def _load_recorder(self) -> Callable[[int, torch.Tensor], None] | None:
        hooks = list(self.load_hooks)
        if len(hooks) <= 1:
            return hooks[0] if hooks else None
        return lambda layer, ids: [h(layer, ids) for h in hooks]

    # --- one step -------------------------------------------------------------------------------
    def _forward(self, pieces: list[Piece], max_tokens_any_rank: int | None = None,
                 all_ranks_decode: bool = True) -> tuple[torch.Tensor, StepInputs]:
        """Hidden states of all scheduled tokens, in order, and the step's inputs; split into two
        overlapped micro-batches when overlap is on and every rank's batch is large enough
        (agreed over the EP group, since it changes the order of collectives: the core loop's
        per-step all-reduce already carries the most tokens any rank scheduled; without it the
        dispatcher agrees here)."""
        par = self.cfg.parallel
        split = False
        dispatcher = self.moe_ctx.dispatcher
        if max_tokens_any_rank is None and (par.enable_overlap or dispatcher.world_size == 1):
            max_tokens_any_rank = dispatcher.agree_max(sum(p[2] for p in pieces))
        if par.enable_overlap:
            split = max_tokens_any_rank >= par.overlap_min_tokens
        pad_to = None if split else self._pad_to(pieces, max_tokens_any_rank, all_ranks_decode)
        # Per-step decisions inside the MoE layers (DeepEP's normal vs low-latency kernels) take the
        # agreed maximum (a padded decode step runs pad_to rows on every rank); None (not agreed
        # this step) makes them agree themselves. A padded decode step runs pad_to rows on every
        # rank: the dispatcher's fixed-shape exchange.
        moe = MoEStep(None if max_tokens_any_rank is None else max(max_tokens_any_rank, pad_to or 0), pad_to,
                      self._load_recorder(), split)
        step = self.batch.prepare(pieces, split, pad_to, self.scratch_block)
        if split:
            return self.model.forward_microbatches(step.batches, moe), step
        if pad_to is not None:
            log.debug("decode step of %d sequences padded to %d", len(pieces), pad_to)
        if pad_to is not None and self.graphs is not None:
            return self.graphs.replay(*step.batches[0]), step
        return self.model(*step.batches[0], moe), step

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, max_tokens_any_rank: int | None = None,
                all_ranks_decode: bool = True) -> SampleResult:
        """Run the model over the scheduled tokens and sample for requests that reached their end."""
        pieces = self.batch.update(out)
        h, step = self._forward(pieces, max_tokens_any_rank, all_ranks_decode)
        if step.sampling is None:
            return SampleResult([], [])
        md = step.sampling
        if md.grammar_cpu is not None:
            # Host work that overlaps the forward already queued on an accelerator.
            if self._bitmask is None:
                from moe_serve.structured_output.bitmask import BitmaskFiller

                self._bitmask = BitmaskFiller(self.cfg.scheduler.max_num_seqs, self.batch.sampling.V, self.device)
            md.grammar_rows_G, md.grammar_bitmask_GW = self._bitmask.fill(md.grammar_cpu)
        logits = self.model.compute_logits(h.index_select(0, step.logits_indices_S))
        return self.sampler(logits, md)

    @torch.inference_mode()
    def execute_empty(self, max_tokens_any_rank: int | None = None, all_ranks_decode: bool = True) -> None:
        """A step with no tokens: MoE layers still enter their collectives (expert-parallel lockstep);
        padded like the other ranks' decode steps."""
        self._forward([], max_tokens_any_rank, all_ranks_decode)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
