"""EngineCore: one per data-parallel rank. Its loop is schedule -> run -> sample -> emit."""
from __future__ import annotations

import logging
import time

from attention.blocks import BlockAllocator
from expert_parallel.dispatch import make_dispatcher
from expert_parallel.layer import MoEContext, num_default_slots
from moe_serve.config import EngineConfig
from moe_serve.model_runner import ModelRunner
from moe_serve.protocol import EngineOutput, TokenLogprob
from moe_serve.request import Request, RequestStatus
from moe_serve.sampling_params import SamplingParams
from moe_serve.scheduler import Scheduler
from moe_serve.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("moe_serve.engine")


class EngineCore:
    def __init__(self, cfg: EngineConfig, kv_cache_memory: int | None = None, memory_fraction: float = 0.9,
                 ep_group=None, physical_to_logical=None, show_progress: bool = True):
        self.cfg = cfg
        mc, par = cfg.model, cfg.parallel
        from moe_serve.models.registry import num_logical_experts

        num_slots = (len(physical_to_logical[0]) if physical_to_logical else
                     num_default_slots(num_logical_experts(mc.architecture, mc.hf), par.world_size))
        dispatcher = make_dispatcher(par.all2all_backend, num_slots, par.rank, par.world_size, ep_group)
        self.moe_ctx = MoEContext(dispatcher, cfg.moe_backend, physical_to_logical)
        self.load_recorder = None  # set by enable_load_recording
        self.runner = ModelRunner(cfg, self.moe_ctx, kv_cache_memory, memory_fraction, show_progress)
        self.tokenizer = Tokenizer(mc.path)
        # The context cannot be longer than the cache can hold for one request.
        capacity = self.runner.num_blocks * cfg.cache.block_size
        self.max_model_len = min(mc.max_model_len, capacity)
        if self.max_model_len < mc.max_model_len:
            log.warning("max_model_len lowered from %d to %d: the KV cache holds %d tokens",
                        mc.max_model_len, self.max_model_len, capacity)
        self.allocator = BlockAllocator(self.runner.num_blocks, cfg.cache.block_size, cfg.cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.allocator, cfg.scheduler.max_num_batched_tokens,
                                   cfg.scheduler.max_num_seqs, self.max_model_len)
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.vocab_size = mc.hf["vocab_size"]
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._emitted: dict[str, int] = {}  # characters of text already emitted per request
        # Counters for /metrics and logs.
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_steps = 0

    # --- requests -------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request against this engine's limits; returns its max new tokens."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty")
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or t < 0 or t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids contains {bad!r}, outside the vocabulary [0, {self.vocab_size})")
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens; max_model_len={self.max_model_len} leaves no room "
                             f"for output (the prompt must be shorter than max_model_len)")
        if params.max_tokens is None:
            return self.max_model_len - n
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens={params.max_tokens} plus the prompt's {n} tokens exceeds "
                             f"max_model_len={self.max_model_len}")
        return params.max_tokens

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        max_new = self.validate(prompt_token_ids, params)
        req = Request(request_id, list(prompt_token_ids), params, max_new, frozenset(self.eos_token_ids))
        self.scheduler.add_request(req)
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                         params.skip_special_tokens)
        self._emitted[request_id] = 0

    def abort_request(self, request_id: str) -> EngineOutput | None:
        req = self.scheduler.abort_request(request_id)
        self._detok.pop(request_id, None)
        self._emitted.pop(request_id, None)
        if req is None:
            return None
        return EngineOutput(request_id, [], "", True, "abort", num_prompt_tokens=req.num_prompt_tokens,
                            num_output_tokens=req.num_output_tokens)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # --- one step -------------------------------------------------------------------------------
    def step(self, lockstep: bool = False) -> list[EngineOutput]:
        """One engine step. With lockstep (expert parallelism), a rank with nothing scheduled still
        runs an empty forward so that every rank enters every MoE layer's collectives."""
        out = self.scheduler.schedule()
        if out.is_empty:
            if lockstep:
                self.runner.execute_empty()
                if self.load_recorder is not None:
                    self.load_recorder.end_step()
            return []
        self.num_steps += 1
        result = self.runner.execute(out)
        sampled_reqs = [s.request for s in out.scheduled if s.samples]
        sampled = {r.request_id: t for r, t in zip(sampled_reqs, result.token_ids)}
        for s in out.scheduled:
            if s.request.num_computed_tokens < s.request.num_prompt_tokens:
                self.num_prompt_tokens += min(s.num_tokens, s.request.num_prompt_tokens - s.request.num_computed_tokens)
        now = time.monotonic()
        self.scheduler.update(out, sampled)
        if self.load_recorder is not None:
            self.load_recorder.end_step()
        outputs = []
        for r, lp in zip(sampled_reqs, result.logprobs):
            if r.status == RequestStatus.FINISHED_ABORTED:
                continue
            self.num_generation_tokens += 1
            if r.first_token_time is None:
                r.first_token_time = now
            outputs.append(self._emit(r, sampled[r.request_id], lp))
        return outputs

    def _emit(self, r: Request, token: int, lp) -> EngineOutput:
        detok = self._detok[r.request_id]
        detok.add(token)
        finished = r.is_finished
        if finished:
            detok.flush()
        text = detok.text
        stop_str = self._find_stop(r, text, self._emitted[r.request_id])
        if stop_str is not None:
            idx, s = stop_str
            text = text[: idx + (len(s) if r.params.include_stop_str_in_output else 0)]
            self.scheduler.finish_request(r.request_id, RequestStatus.FINISHED_STOPPED)
            r.status, r.stop_reason = RequestStatus.FINISHED_STOPPED, s
            finished = True
        elif not finished and r.params.stop_strings:
            # Hold back a tail that could be the start of a stop string.
            hold = max(len(s) for s in r.params.stop_strings) - 1
            text = text[: max(self._emitted[r.request_id], len(text) - hold)]
        start = self._emitted[r.request_id]
        self._emitted[r.request_id] = len(text)
        logprobs = [TokenLogprob(token, lp[0], lp[1])] if lp is not None else None
        o = EngineOutput(r.request_id, [token], text[start:], finished,
                         r.status.value if finished else None, r.stop_reason if finished else None, logprobs,
                         r.num_prompt_tokens, r.num_cached_prompt_tokens, r.num_output_tokens)
        if finished:
            self._detok.pop(r.request_id, None)
            self._emitted.pop(r.request_id, None)
        return o

    @staticmethod
    def _find_stop(r: Request, text: str, emitted: int) -> tuple[int, str] | None:
        best = None
        for s in r.params.stop_strings:
            i = text.find(s, max(0, emitted - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        return best

    # --- expert load ----------------------------------------------------------------------------
    def enable_load_recording(self, window_steps: int, ep_group=None, start: bool = False):
        """Count routed tokens per (MoE layer, logical expert) in windows of `window_steps` steps.
        With expert parallelism every window is summed over the ranks (one all_reduce per window,
        at the same step on every rank)."""
        from expert_parallel.load_stats import ExpertLoadRecorder
        from moe_serve.models.registry import num_logical_experts

        reduce_fn = None
        if self.cfg.parallel.world_size > 1:
            import torch.distributed as dist

            reduce_fn = lambda t: dist.all_reduce(t, group=ep_group)  # noqa: E731
        rec = ExpertLoadRecorder(self.moe_ctx.moe_layer_count[0], num_logical_experts(self.cfg.model.architecture,
                                 self.cfg.model.hf), window_steps, reduce_fn=reduce_fn, device=self.cfg.device)
        self.load_recorder = rec
        self.moe_ctx.load_recorder = rec.record
        if start:
            rec.start()
        return rec

    # --- stats ----------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": self.allocator.usage,
            "prefix_cache_hit_rate": self.allocator.hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
        }
