"""The only place a scheduled batch becomes tensors: builds the model, owns the KV cache, runs steps."""
from __future__ import annotations

import logging
import time

import torch

from attention.layer import PagedAttention, PagedMLAAttention
from attention.metadata import AttentionMetadata
from expert_parallel.layer import MoEContext
from moe_serve.config import EngineConfig
from moe_serve.models.registry import model_class
from moe_serve.sampler import Sampler, SampleResult
from moe_serve.scheduler import SchedulerOutput
from moe_serve.weights import init_dummy_weights, load_weights
from expert_parallel.overlap import split_pieces, split_point

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
        if moe_ctx.physical_to_logical is not None and moe_ctx.moe_layer_count[0] != len(moe_ctx.physical_to_logical):
            raise ValueError(f"expert placement has {len(moe_ctx.physical_to_logical)} layers; "
                             f"the model has {moe_ctx.moe_layer_count[0]} MoE layers")
        self.model.requires_grad_(False)
        self.model.eval()
        if mc.load_format == "dummy":
            init_dummy_weights(self.model, mc.seed)
        else:
            load_weights(self.model, mc.path, mc.dtype, show_progress=show_progress)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        log.info("model %s loaded in %.1fs: %.1f MiB of weights on this rank (%s)", mc.architecture,
                 time.perf_counter() - t0, self.weight_bytes / 2**20, mc.dtype)
        self._init_kv_cache(kv_cache_memory, memory_fraction)
        self.sampler = Sampler(self.device, mc.seed)

    # --- KV cache -------------------------------------------------------------------------------
    def _init_kv_cache(self, kv_cache_memory: int | None, fraction: float) -> None:
        bs = self.cfg.cache.block_size
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, (PagedAttention, PagedMLAAttention))]
        elem = torch.empty((), dtype=self.cfg.model.dtype).element_size()
        per_block = sum(elem * _numel(s) for layer in self.attn_layers for s in layer.cache_shape(1, bs))
        budget = kv_cache_memory if kv_cache_memory else default_kv_cache_memory(self.device, self.weight_bytes, fraction)
        self.num_blocks = self.cfg.cache.num_blocks or int(budget // per_block)
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory={budget} bytes holds no KV block ({per_block} bytes per block)")
        for layer in self.attn_layers:
            layer.bind([torch.zeros(s, dtype=self.cfg.model.dtype, device=self.device)
                        for s in layer.cache_shape(self.num_blocks, bs)])
        self.kv_cache_bytes = self.num_blocks * per_block
        log.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%d bytes per token)",
                 self.num_blocks, bs, self.num_blocks * bs, self.kv_cache_bytes / 2**20, per_block // bs)

    # --- one step -------------------------------------------------------------------------------
    def _tensors(self, pieces: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(request, start, num_tokens, samples) pieces -> token ids, positions, attention metadata."""
        ids: list[int] = []
        positions: list[int] = []
        q_lens, seq_lens, tables = [], [], []
        for req, start, n, _ in pieces:
            ids.extend(req.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))
            q_lens.append(n)
            seq_lens.append(start + n)
            tables.append(req.block_ids)
        meta = AttentionMetadata.build(q_lens, seq_lens, tables, self.cfg.cache.block_size, self.device)
        return (torch.tensor(ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device), meta)

    def _forward(self, pieces: list[tuple]) -> torch.Tensor:
        """Hidden states of all scheduled tokens, in order; split into two overlapped micro-batches
        when overlap is on and every rank's batch is large enough (agreed over the EP group)."""
        par = self.cfg.parallel
        if par.enable_overlap:
            ntok = sum(p[2] for p in pieces)
            if self.moe_ctx.dispatcher.agree_max(ntok) >= par.overlap_min_tokens:
                positions = [pos for _, start, n, _ in pieces for pos in range(start, start + n)]
                a, b = split_pieces(pieces, split_point(positions))
                return self.model.forward_microbatches([self._tensors(a), self._tensors(b)])
        return self.model(*self._tensors(pieces))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> SampleResult:
        """Run the model over the scheduled tokens and sample for requests that reached their end."""
        pieces = [(s.request, s.request.num_computed_tokens, s.num_tokens, s.samples) for s in out.scheduled]
        h = self._forward(pieces)
        rows, sampling, pos = [], [], 0
        for s in out.scheduled:
            pos += s.num_tokens
            if s.samples:
                rows.append(pos - 1)
                sampling.append(s.request)
        if not rows:
            return SampleResult([], [])
        logits = self.model.compute_logits(h[torch.tensor(rows, device=self.device)])
        return self.sampler(logits, sampling)

    @torch.inference_mode()
    def execute_empty(self) -> None:
        """A step with no tokens: MoE layers still enter their collectives (expert-parallel lockstep)."""
        self._forward([])


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
