"""The only place a scheduled batch becomes tensors: `ModelRunner` runs steps on this rank's model
with its persistent input batch (`input_batch.py`): one host->device copy in, one read out. Its
parts (model, KV cache, decode graphs) are made by the steps in moe_serve/runner/, which
`build_engine` calls in order."""
from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from expert_parallel.runtime.layer import MoEContext
from expert_parallel.runtime.step import MoEStep
from moe_serve.config import EngineConfig
from moe_serve.cuda_graph import DecodeGraphs, padded_size
from moe_serve.input_batch import InputBatch, Piece, StepInputs
from moe_serve.protocol import TokenLogprob
from moe_serve.runner.loading import warm_up_kernels
from moe_serve.runner.memory import KVCacheSize
from moe_serve.sampler import Sampler, SampleResult, prompt_logprobs
from moe_serve.scheduler import SchedulerOutput
from moe_serve.structured_output.bitmask import BitmaskFiller

log = logging.getLogger("moe_serve.model_runner")


def make_input_batch(cfg: EngineConfig, kv: KVCacheSize) -> InputBatch:
    """One row per running request; no request outgrows the model's context or the whole cache
    (the engine lowers max_model_len to the latter the same way). Once the cache is sized, before
    the decode graphs, which hold its buffers."""
    capacity = kv.token_capacity(cfg.cache.block_size)
    max_len = cfg.model.max_model_len if capacity is None else min(cfg.model.max_model_len, capacity)
    return InputBatch(cfg.scheduler.max_num_seqs, max_len, cfg.cache.block_size, cfg.model.hf["vocab_size"],
                      cfg.device, kv.group_scratch, kv.state_scratch)


class ModelRunner:
    """Runs scheduled steps: decode padding, graph replay, overlap split, sampling. Holds parts
    already built (moe_serve/runner/); making one does no work."""

    def __init__(self, cfg: EngineConfig, moe_ctx: MoEContext, model: nn.Module, weight_bytes: int,
                 attn_layers: list, kv: KVCacheSize, sampler: Sampler, batch: InputBatch,
                 pad_sizes: list[int], graphs: DecodeGraphs | None):
        self.cfg = cfg
        self.moe_ctx = moe_ctx
        self.device = cfg.device
        self.model = model
        self.weight_bytes = weight_bytes
        self.attn_layers = attn_layers
        self.num_blocks = kv.num_blocks
        self.scratch_block = kv.scratch_block
        self.group_scratch = [kv.scratch_block, *kv.group_scratch]  # each cache group's scratch (= null) block
        self.kv_cache_bytes = kv.kv_cache_bytes
        self.profile_peak_bytes = kv.profile_peak_bytes
        self.graph_estimate_bytes = kv.graph_estimate_bytes
        self.state_layers = list(kv.state.layers) if kv.state is not None else []
        self.sampler = sampler
        self.batch = batch
        self.pad_sizes = pad_sizes  # the decode padding ladder ([] when decode steps are not padded)
        self.graphs = graphs  # one captured graph per ladder size, or None (eager)
        # Speculative decoding's verify steps (every sequence its last token and K drafts): their
        # tokens per sequence, ladder and graphs, set by spec_decode/verify.py (none: 0, [], None).
        self.verify_q, self.verify_pad_sizes, self.verify_graphs = 0, [], None
        # Expert-load hooks (moe_layer_index, logical top-k ids): the engine's recorder and the
        # online rebalancer add theirs; each step's MoEStep carries them to the MoE layers.
        self.load_hooks: list[Callable[[int, torch.Tensor], None]] = []
        self._bitmask = None  # BitmaskFiller, made on the first constrained step
        # A proposer that reads each step's hidden states and inputs (MTP's) sets keep_last_step.
        self.keep_last_step = False
        self._last_step = None
        self._state_snaps = {}  # speculative decoding's copies of per-sequence state (snapshot_states)

    def warm_up_kernels(self) -> set:
        """Compile every Triton kernel variant this model's layers can launch; their compile keys."""
        return warm_up_kernels(self.model, self.cfg, self.moe_ctx.dispatcher)

    # --- decode padding and expert load ---------------------------------------------------------
    def _pad_to(self, pieces: list[Piece], max_tokens_any_rank: int | None,
                uniform_len: int | bool | None) -> tuple[int, int] | None:
        """(ladder size, tokens per sequence) a step pads to when every sequence of every rank has
        the same number of tokens q (1: decode; 1 + K: speculative verify steps) and a ladder
        exists for q: the size of the most sequences any rank runs (so every EP rank runs the same
        shape); None when this or any rank's step is mixed, or above the ladder. uniform_len: that
        q as the ranks agreed it (True: 1, False: mixed), or None for one process (its own pieces
        decide). Nor while expert load is recorded: padded rows would count as routed tokens, and
        a graph replay skips the recorder's Python hook (recording starts and stops at the same
        turn on every rank, so the ranks still agree)."""
        lens = {p[2] for p in pieces}
        own = lens.pop() if len(lens) == 1 else (0 if lens else None)
        q = own if uniform_len is None else int(uniform_len)
        if not q or (own is not None and own != q) or self._recording_load():
            return None
        sizes = self.pad_sizes if q == 1 else (self.verify_pad_sizes if q == self.verify_q else None)
        if not sizes:
            return None
        B = padded_size(max(len(pieces), -(-(max_tokens_any_rank or 0) // q)), sizes)
        return None if B is None else (B, q)

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
                 uniform_len: int | bool | None = None) -> tuple[torch.Tensor, StepInputs]:
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
        pad = None if split else self._pad_to(pieces, max_tokens_any_rank, uniform_len)
        pad_to, pad_q = pad if pad is not None else (None, 1)
        rows = None if pad_to is None else pad_to * pad_q
        # Per-step decisions inside the MoE layers (DeepEP's normal vs low-latency kernels) take the
        # agreed maximum (a padded step runs pad_to * pad_q rows on every rank); None (not agreed
        # this step) makes them agree themselves. A padded step runs those rows on every rank: the
        # dispatcher's fixed-shape exchange.
        moe = MoEStep(None if max_tokens_any_rank is None else max(max_tokens_any_rank, rows or 0), rows,
                      self._load_recorder(), split)
        step = self.batch.prepare(pieces, split, pad_to, self.scratch_block, pad_q)
        graphs = self.graphs if pad_q == 1 else self.verify_graphs
        self._graph_logits = None  # every row's logits, where the step's recording computed them
        if split:
            h = self.model.forward_microbatches(step.batches, moe)
        elif pad_to is not None and graphs is not None:
            self._log_padding(len(pieces), pad_q, pad_to)
            # A captured graph reads every row's state (it holds no "fresh sequence" branch): a
            # one-token prompt starts from a zeroed slot instead.
            self._zero_states([self.batch.state_slot_R[p[0]] for p in pieces if p[1] == 0])
            h = graphs.replay(*step.batches[0])
            self._graph_logits = graphs.last_logits
        else:
            if pad_to is not None:
                self._log_padding(len(pieces), pad_q, pad_to)
            h = self.model(*step.batches[0], moe)
        if self.keep_last_step:
            self._last_step = (h, step, moe, pieces)
        return h, step

    @staticmethod
    def _log_padding(n: int, q: int, pad_to: int) -> None:
        if q == 1:
            log.debug("decode step of %d sequences padded to %d", n, pad_to)
        else:
            log.debug("verify step of %d sequences (%d tokens each) padded to %d", n, q, pad_to)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, max_tokens_any_rank: int | None = None,
                uniform_len: int | bool | None = None) -> SampleResult:
        """Run the model over the scheduled tokens and sample for requests that reached their end.
        uniform_len: see `_pad_to`."""
        pieces = self.batch.update(out)
        self._copy_states(out.state_copies)
        h, step = self._forward(pieces, max_tokens_any_rank, uniform_len)
        prompt_lps = self._prompt_logprobs(h, step) if step.prompt_lp_indices_P is not None else {}
        if step.sampling is None:
            return SampleResult([], [], prompt_lps)
        md = step.sampling
        if md.grammar_cpu is not None:
            # Host work that overlaps the forward already queued on an accelerator.
            if self._bitmask is None:
                self._bitmask = BitmaskFiller(self.cfg.scheduler.max_num_seqs, self.batch.sampling.V, self.device)
            md.grammar_rows_G, md.grammar_bitmask_GW = self._bitmask.fill(md.grammar_cpu)
        if self._graph_logits is not None:
            logits = self._graph_logits.index_select(0, step.logits_indices_S)
        else:
            logits = self.model.compute_logits(h.index_select(0, step.logits_indices_S))
        result = self.sampler(logits, md)
        result.prompt_logprobs = prompt_lps
        return result

    def _prompt_logprobs(self, h: torch.Tensor, step: StepInputs) -> dict[str, list[TokenLogprob]]:
        """The prompt logprobs of this step's positions that asked for them (the input batch's
        plan): only those rows go through the LM head. Request id -> entries, in prompt order."""
        plan = self.batch.prompt_logprob_plan
        n_top = max(p.num_top for p in plan)
        rows = prompt_logprobs(self.model.compute_logits, h.index_select(0, step.prompt_lp_indices_P),
                               step.prompt_lp_targets_P, n_top, self.batch.sampling.V)
        out = {}
        for p in plan:
            prompt = self.batch.req_at_row[self.batch.row_of[p.request_id]].prompt_token_ids
            entries = []
            for j in range(p.count):
                r = rows[p.first_index + j]
                top_v, top_i = r[2:2 + p.num_top], r[2 + n_top:2 + n_top + p.num_top]
                entries.append(TokenLogprob(prompt[p.first_token + j], r[0], [(int(t), v) for t, v in zip(top_i, top_v)],
                                            int(r[1])))
            out[p.request_id] = entries
        return out

    def _copy_states(self, copies: list[tuple[int, int]]) -> None:
        """The scheduler's state-slot copies (prefix-cache snapshots, then restores), in order."""
        for src, dst in copies:
            for layer in self.state_layers:
                for cache in layer.caches:
                    cache[dst].copy_(cache[src])

    @torch.inference_mode()
    def snapshot_states(self, requests) -> None:
        """Copies of these requests' per-sequence state (linear attention), in place of the last
        step's: taken before a forward advances it (spec_decode/rollback.py decides whose)."""
        self._state_snaps = {}
        for req in requests:
            slot = req.state_slot
            self._state_snaps[req.request_id] = (
                slot, [cache[slot].clone() for layer in self.state_layers for cache in layer.caches])

    def restore_states(self, request_ids) -> None:
        """Put back the states `snapshot_states` copied for these requests: each state is as it was
        before the step."""
        for rid in request_ids:
            slot, saved = self._state_snaps[rid]
            caches = [cache for layer in self.state_layers for cache in layer.caches]
            for cache, t in zip(caches, saved):
                cache[slot].copy_(t)

    def _zero_states(self, slots: list) -> None:
        for slot in slots:
            for layer in self.state_layers:
                for cache in layer.caches:
                    cache[int(slot)].zero_()

    def take_last_step(self) -> tuple:
        """The last step's (hidden states, StepInputs, MoEStep, pieces), empty step or not, kept
        where keep_last_step is set (a proposer reads them); given once."""
        last, self._last_step = self._last_step, None
        return last

    @torch.inference_mode()
    def execute_empty(self, max_tokens_any_rank: int | None = None, uniform_len: int | bool | None = True) -> None:
        """A step with no tokens: MoE layers still enter their collectives (expert-parallel lockstep);
        padded like the other ranks' decode or verify steps."""
        self._forward([], max_tokens_any_rank, uniform_len)

