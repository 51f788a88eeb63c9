"""EngineCore: one per data-parallel rank. Its loop is schedule -> run -> sample -> emit token ids.

The core knows nothing of text: detokenization, stop strings and streaming live in the front end's
`OutputProcessor`. Token-level stops (EOS, stop_token_ids, max_tokens) are decided here, where the
blocks are freed. `build_engine(config)` is the one way to make a core (offline `LLM`, the
single-process server's core process and every rank of a torchrun job).

A step: schedule (features' after_schedule) -> before_forward -> the model's forward ->
after_forward -> keep the accepted tokens, update the scheduler, build the outputs, propose drafts
-> on_outputs. Capabilities that act per step (the speed-of-light meter, expert-load recording,
EPLB, the KV connector of disaggregated prefill and decode, a test's own) are step features
(moe_serve/engine/features/): the core calls them at those points, and on requests, aborts and
outputs between steps, and never names one.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, wait

from attention.kv_manager import KVCacheManager
from attention.state import StateCache
from expert_parallel.placement.map import load_placement as read_placement
from expert_parallel.runtime.dispatch import make_dispatcher
from expert_parallel.runtime.layer import MoEContext, num_default_slots
from moe_serve.config import EngineConfig
from moe_serve.engine.features import FeatureContext, FeatureSet, build_features
from moe_serve.engine.features.access import FeatureAccess
from moe_serve.engine.step_parts import accept_sampled, keep_prompt_logprobs, request_output
from moe_serve.limits import check_request
from moe_serve.model_runner import ModelRunner, make_input_batch
from moe_serve.models.registry import num_logical_experts
from moe_serve import platform
from moe_serve.platform import deepep_support
from moe_serve.protocol import CacheEvents, EngineCoreOutput, EngineStats, NewRequest, SchedulerStats
from moe_serve.request import Request, RequestStatus
from moe_serve.runner.graphs import capture_decode_graphs, captures_graphs
from moe_serve.runner.loading import build_model, load_model_weights, prepare_weights, warm_up_before_serving
from moe_serve.runner.memory import KVCacheSize, attention_layers, init_kv_cache, profile_memory, size_kv_cache
from moe_serve.sampler import Sampler
from moe_serve.speed_of_light import DecodeMeter, device_bandwidth
from moe_serve.spec_decode import Speculator
from moe_serve.spec_decode.verify import attach_verify_graphs
from moe_serve.scheduler import Scheduler, SchedulerOutput
from moe_serve.structured_output.grammar import GrammarManager
from moe_serve.tokenizer import Tokenizer

log = logging.getLogger("moe_serve.engine")
FEATURE_PARTS = tuple(f for f in EngineStats.__struct_fields__ if f not in ("scheduler", "features"))


def build_engine(cfg: EngineConfig, ep_group=None, show_progress: bool = True) -> EngineCore:
    """The engine core for a fully resolved config, step by step. Every rank of an expert-parallel
    job runs these steps in this order: making the dispatcher, the profiling forward, the graph
    captures' agreement and EPLB's process group are collectives the ranks enter together."""
    par = cfg.parallel
    platform.use_device(cfg.device)  # before anything touches the GPU
    placement = load_placement(par.expert_placement, par.world_size)
    num_slots = expert_slots(cfg, placement)
    moe_ctx = make_moe_context(cfg, num_slots, placement, ep_group)
    ops = platform.resolve_ops(cfg.device, cfg.moe_backend, cfg.attention_backend, cfg.linear_backend,
                               cfg.norm_backend, cfg.linear_attention_backend, cfg.batch_invariant)
    started = time.perf_counter()
    model = build_model(cfg, moe_ctx, ops)
    load_model_weights(model, cfg, show_progress)
    weight_bytes = prepare_weights(model, cfg, started)
    warm_up_before_serving(model, cfg, moe_ctx, ops)
    capture = captures_graphs(cfg, moe_ctx, ops)
    bandwidth = device_bandwidth(cfg.device, cfg.memory_bandwidth_gbps)  # before the KV cache takes the memory
    attn_layers = attention_layers(model)
    profile = profile_memory(model, attn_layers, cfg, moe_ctx, capture)
    kv = size_kv_cache(attn_layers, cfg, weight_bytes, profile)
    bound = init_kv_cache(attn_layers, cfg, kv)
    meter = make_decode_meter(model, attn_layers, cfg, moe_ctx, bandwidth)  # before graphs: they mark its hits
    sampler = Sampler(cfg.device, cfg.model.seed)
    batch = make_input_batch(cfg, kv)
    pad_sizes, graphs = capture_decode_graphs(model, cfg, moe_ctx, batch, kv, capture)
    runner = ModelRunner(cfg, moe_ctx, model, weight_bytes, attn_layers, kv, sampler, batch, pad_sizes, graphs)
    attach_verify_graphs(runner, kv, capture and graphs is not None)  # speculative decoding's verify steps
    max_model_len = serving_max_model_len(cfg, kv.token_capacity(cfg.cache.block_size))
    scheduler = make_scheduler(cfg, kv, max_model_len)
    eos = eos_token_ids(cfg)
    grammars = GrammarManager(cfg.model.path, cfg.model.hf["vocab_size"], eos)
    core = EngineCore(cfg, moe_ctx, runner, scheduler, eos, grammars, max_model_len)
    # Last: a feature may enter a collective (EPLB makes a process group); registered in features/__init__.py.
    core.features = build_features(FeatureContext(cfg, model, moe_ctx, runner, num_slots, ep_group, meter,
                                                  scheduler, bound))
    return core


# --- assembly steps owned by the engine (the runner's are in moe_serve/runner/) -------------------
def make_decode_meter(model, attn_layers: list, cfg: EngineConfig, moe_ctx: MoEContext,
                      bandwidth: tuple[float, str]) -> DecodeMeter:
    """The decode speed-of-light meter: the model's byte count per step, the device's bandwidth."""
    meter = DecodeMeter(model, attn_layers, moe_ctx, cfg.device, *bandwidth, cfg.speed_of_light_window_s,
                        cfg.parallel.rank)
    b = meter.bytes
    log.info("speed of light: %.1f GB/s memory bandwidth (%s); a decode step reads %.1f MB of weights outside the "
             "experts, %.2f MB per expert slot hit, and each sequence's cache", meter.bandwidth / 1e9, meter.source,
             b.non_expert_bytes / 1e6, (sum(b.slot_bytes) / len(b.slot_bytes) if b.slot_bytes else 0) / 1e6)
    return meter


def load_placement(path: str | None, world_size: int) -> list[list[int]] | None:
    """--expert-placement: per MoE layer, the logical expert of every physical slot (or None).
    First: the slot count and the dispatcher follow from it."""
    if not path:
        return None
    p = read_placement(path)
    if p.slots % world_size:
        raise ValueError(f"expert placement {path}: slots={p.slots} is not divisible by the {world_size} ranks")
    if p.gpus != world_size:
        log.warning("expert placement %s was tuned for gpus=%d; serving it on %d ranks (%d slots each)", path,
                    p.gpus, world_size, p.slots // world_size)
    log.info("expert placement %s: %d MoE layers, %d slots", path, p.num_layers, p.slots)
    return [list(map(int, layer)) for layer in p.physical_to_logical]


def eplb_slots(eplb, num_experts: int, world_size: int, physical_to_logical) -> int:
    """Physical slots with rebalancing on: one per expert plus the redundant ones, a multiple of
    the EP size; a placement file given as well must have as many."""
    slots = num_experts + eplb.num_redundant_experts
    if slots % world_size:
        raise ValueError(f"num_redundant_experts={eplb.num_redundant_experts}: {num_experts} experts + "
                         f"{eplb.num_redundant_experts} = {slots} slots is not divisible by the {world_size} ranks")
    if physical_to_logical and len(physical_to_logical[0]) != slots:
        raise ValueError(f"num_redundant_experts={eplb.num_redundant_experts} gives {slots} slots but the expert "
                         f"placement has {len(physical_to_logical[0])}")
    return slots


def expert_slots(cfg: EngineConfig, physical_to_logical) -> int:
    """Physical expert slots in the EP group: the placement's, else one per expert (or as many as
    EPLB asks for). Before the dispatcher, which is made for that many."""
    mc, par = cfg.model, cfg.parallel
    num_slots = (len(physical_to_logical[0]) if physical_to_logical else
                 num_default_slots(num_logical_experts(mc.architecture, mc.hf), par.world_size))
    if par.eplb is not None:
        num_slots = eplb_slots(par.eplb, num_logical_experts(mc.architecture, mc.hf), par.world_size,
                               physical_to_logical)
    return num_slots


def make_moe_context(cfg: EngineConfig, num_slots: int, physical_to_logical, ep_group=None) -> MoEContext:
    """The dispatcher (collective set-up under expert parallelism: DeepEP's buffers) and the
    context the MoE layers share. Before the model, whose MoE layers are built with it."""
    mc, par = cfg.model, cfg.parallel
    options = {}
    if par.all2all_backend == "deepep":  # low-latency kernels only where DeepEP has them for this size
        options["mode"] = "auto" if deepep_support(mc.hf.get("hidden_size"), par.world_size)[1] else "normal"
    dispatcher = make_dispatcher(par.all2all_backend, num_slots, par.rank, par.world_size, ep_group, **options)
    return MoEContext(dispatcher, physical_to_logical, replica_split=par.replica_split)


def serving_max_model_len(cfg: EngineConfig, capacity: int | None) -> int:
    """The context limit: no longer than the cache can hold for one request (capacity tokens;
    None: unbounded, every layer keeps a window or a state). Once the cache is sized; before the
    scheduler, which enforces it."""
    mc = cfg.model
    if capacity is None:
        return mc.max_model_len
    max_model_len = min(mc.max_model_len, capacity)
    if max_model_len < mc.max_model_len:
        log.warning("max_model_len lowered from %d to %d: the KV cache holds %d tokens",
                    mc.max_model_len, max_model_len, capacity)
    return max_model_len


def make_scheduler(cfg: EngineConfig, kv: KVCacheSize, max_model_len: int) -> Scheduler:
    """The cache manager over the sized cache (a block allocator per group, the state slots) and the
    scheduler that hands out its blocks."""
    manager = KVCacheManager(cfg.cache.block_size, kv.manager_groups(),
                             kv.state.num_blocks if kv.state is not None else 0, cfg.cache.enable_prefix_caching)
    return Scheduler(manager, cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs, max_model_len)


def eos_token_ids(cfg: EngineConfig) -> frozenset[int]:
    """The config's EOS ids and the tokenizer's; before the grammar manager, which stops on them."""
    eos = set(cfg.model.eos_token_ids)
    tok_eos = Tokenizer(cfg.model.path).eos_token_id
    if tok_eos is not None:
        eos.add(tok_eos)
    return frozenset(eos)


class EngineCore(FeatureAccess):
    """The schedule -> run -> sample loop of one rank over the parts `build_engine` made; making one
    does no work. Per-step capabilities plug in as step features (moe_serve/engine/features/): the
    core calls their hooks at fixed points and never names one."""

    def __init__(self, cfg: EngineConfig, moe_ctx: MoEContext, runner: ModelRunner, scheduler: Scheduler,
                 eos_token_ids: frozenset[int], grammars: GrammarManager, max_model_len: int,
                 features=()):
        self.cfg = cfg
        self.moe_ctx = moe_ctx
        self.runner = runner
        self.scheduler = scheduler
        self.allocator = scheduler.alloc
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.vocab_size = cfg.model.hf["vocab_size"]
        # Structured outputs: grammars compile in a background thread; a request waits here, not
        # in the scheduler, until its grammar is ready (in arrival order among those waiting).
        self.grammars = grammars
        self._awaiting_grammar: list[tuple[Request, Future]] = []
        self._early_outputs: list[EngineCoreOutput] = []  # requests ended before being scheduled
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_steps = 0
        self.features = FeatureSet(features)  # the step features (moe_serve/engine/features/)
        self.spec = Speculator(cfg.speculative, max_model_len, runner)  # speculative decoding (spec_decode/)
        scheduler.lookahead_tokens = self.spec.lookahead_tokens

    def set_max_model_len(self, n: int) -> None:
        """Every rank serves the same context limit (the smallest any rank's cache allows)."""
        self.max_model_len = self.scheduler.max_model_len = self.spec.max_model_len = n

    # --- requests -------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params) -> int:
        """Check a request against this engine's limits; returns its max new tokens."""
        return check_request(prompt_token_ids, params, self.max_model_len, self.vocab_size)

    def add_request(self, new: NewRequest) -> EngineCoreOutput | None:
        """Queue a request; a request that fails its checks here (limits can race with the front
        end's validation) ends at once, the reason in stop_reason."""
        try:
            max_new = self.validate(new.prompt_token_ids, new.params)
            req = Request(new.request_id, list(new.prompt_token_ids), new.params, max_new, self.eos_token_ids)
            if new.output_token_ids:  # moved here from a lost rank: recomputed, then continued
                if len(new.output_token_ids) >= max_new:
                    raise ValueError("a resumed request must have tokens left to generate and no KV transfer")
                req.output_token_ids = list(new.output_token_ids)
                req.num_prompt_logprobs = req.num_prompt_tokens - 1  # sent with its first token already
            self.features.admit(req, new)  # a feature may mark the request, or refuse it
            if new.params.structured_outputs is not None:
                if new.request_id in self.scheduler.requests or \
                        any(r.request_id == new.request_id for r, _ in self._awaiting_grammar):
                    raise ValueError(f"request_id {new.request_id!r} is already in use")
                self._awaiting_grammar.append((req, self.grammars.compiled(new.params.structured_outputs)))
            else:
                self._queue(req)
        except ValueError as e:
            return EngineCoreOutput(new.request_id, [], True, "abort", str(e))
        return None

    def _queue(self, req: Request) -> None:
        self.scheduler.add_request(req)
        for hook in self.features.hooks.on_request_added:
            hook(req)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        outs = []
        for rid in request_ids:
            if self.scheduler.abort_request(rid) is not None:
                outs.append(EngineCoreOutput(rid, [], True, "abort"))
            elif self.features.claims_abort(rid):
                pass  # answered by the feature (take_outputs) once its work on the request has ended
            elif any(r.request_id == rid for r, _ in self._awaiting_grammar):
                self._awaiting_grammar = [(r, f) for r, f in self._awaiting_grammar if r.request_id != rid]
                outs.append(EngineCoreOutput(rid, [], True, "abort"))
        return outs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._awaiting_grammar) or bool(self._early_outputs)

    def take_early_outputs(self) -> list[EngineCoreOutput]:
        """Outputs made outside a step's own: requests that ended before they were scheduled (a
        grammar that failed to compile) and the features' (take_outputs). The loop takes them every
        turn, before and after scheduling; the caller sends them with the step's outputs."""
        outs, self._early_outputs = self._early_outputs + self.features.take_outputs(), []
        return outs

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar has compiled, each with its own matcher. With nothing
        else to run, wait a little for a compile rather than spin."""
        if not self.scheduler.has_work() and not any(f.done() for _, f in self._awaiting_grammar):
            wait([f for _, f in self._awaiting_grammar], timeout=0.005, return_when="FIRST_COMPLETED")
        still = []
        for req, fut in self._awaiting_grammar:
            if not fut.done():
                still.append((req, fut))
                continue
            try:
                req.grammar = self.grammars.state(fut.result())
                for t in req.output_token_ids:  # a resumed request: what it already generated
                    req.grammar.accept(t)
                self._queue(req)
            except Exception as e:  # the front end checks specs first, so this is not expected
                log.warning("request %s: structured output grammar failed: %s", req.request_id, e)
                self._early_outputs.append(EngineCoreOutput(
                    req.request_id, [], True, "abort", f"structured_outputs could not be compiled: {e}"))
        self._awaiting_grammar = still

    # --- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self._awaiting_grammar:
            self._admit_compiled()
        out = self.scheduler.schedule()
        for hook in self.features.hooks.after_schedule:
            hook(out)
        return out

    def step(self, lockstep: bool = False) -> list[EngineCoreOutput]:
        if not lockstep:  # one process: its own agreement
            self.features.agree_alone()
        out = self.schedule()
        return self.take_early_outputs() + self.execute(out, lockstep)

    def execute(self, out: SchedulerOutput, lockstep: bool = False,
                max_tokens_any_rank: int | None = None, uniform_len: int | bool | None = None) -> list[EngineCoreOutput]:
        """Run a scheduled batch and advance its requests. With lockstep (expert parallelism), an
        empty batch still runs an empty forward so that every rank enters every MoE collective;
        max_tokens_any_rank (from the ranks' per-step agreement) decides the overlap split and,
        with uniform_len (the tokens every sequence of every rank has this step: 1 decode, 1 + K
        verify; False when mixed; None: this rank's own step decides), the padding to a ladder size."""
        if out.is_empty:
            if lockstep:
                self._forward(out, max_tokens_any_rank, uniform_len)
                self.spec.propose_empty()  # a proposer that runs the model enters its collectives
            return []
        self._count_step(out)
        self.spec.before_forward(out)
        result = self._forward(out, max_tokens_any_rank, uniform_len)
        sampled, logprobs, sampled_reqs, last_accepted = accept_sampled(out, result, self.spec)
        rollback = self.spec.rollback(out, sampled)
        keep_prompt_logprobs(out, result)  # before the update: a request that ends in this step sends them now
        now = time.monotonic()
        self.scheduler.update(out, sampled, rollback)
        outputs = self._outputs(sampled_reqs, logprobs, now)
        self.spec.after_step(self.scheduler.running, out, result, last_accepted)  # the next step's drafts
        for hook in self.features.hooks.on_outputs:
            outputs = hook(outputs)
        return outputs

    def _count_step(self, out: SchedulerOutput) -> None:
        self.num_steps += 1
        for s in out.scheduled:
            r = s.request
            if r.num_computed_tokens < r.num_prompt_tokens:
                self.num_prompt_tokens += min(s.num_tokens, r.num_prompt_tokens - r.num_computed_tokens)

    def _forward(self, out: SchedulerOutput, max_tokens_any_rank, uniform_len):
        """The model's forward with the features' hooks around it (an empty lockstep one too)."""
        for hook in self.features.hooks.before_forward:
            hook(out)
        t0 = time.perf_counter()
        if out.is_empty:
            result = None
            self.runner.execute_empty(max_tokens_any_rank, uniform_len)
        else:
            result = self.runner.execute(out, max_tokens_any_rank, uniform_len)
        seconds = time.perf_counter() - t0
        for hook in self.features.hooks.after_forward:
            hook(out, result, seconds)
        return result

    def _outputs(self, sampled_reqs: list, logprobs: dict, now: float) -> list[EngineCoreOutput]:
        outputs = []
        for r, before in sampled_reqs:
            if r.status == RequestStatus.FINISHED_ABORTED and r.stop_reason is None:  # aborted during the step
                continue
            new = r.output_token_ids[before:]  # the sampled tokens it kept (all, unless one stopped it)
            self.num_generation_tokens += len(new)
            outputs.append(request_output(r, new, logprobs[r.request_id][:len(new)], before, now))
        return outputs

    # --- stats ----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s, a = self.scheduler, self.allocator
        sched = SchedulerStats(
            num_running=len(s.running), num_waiting=len(s.waiting) + len(self._awaiting_grammar),
            kv_cache_usage=a.usage, prefix_cache_hit_rate=a.hit_rate, num_preemptions=s.num_preemptions,
            prompt_tokens=self.num_prompt_tokens, generation_tokens=self.num_generation_tokens,
            num_steps=self.num_steps, prefix_cache_queries=a.lookup_tokens, prefix_cache_hits=a.hit_tokens,
            kv_blocks_in_use=s.kv.in_use)
        parts, others = self.features.stats(FEATURE_PARTS)
        return EngineStats(scheduler=sched, spec_decode=self.spec.stats(), features=others, **parts)

    def track_cache_events(self) -> None:
        """Keep the prefix cache's changes for take_cache_events (a data-parallel rank's reports)."""
        self.allocator.track_events()

    def take_cache_events(self):
        """The prefix cache's net changes since the last call (None: none, or not tracked)."""
        if self.allocator.events is None or not self.allocator.events:
            return None
        return CacheEvents(*self.allocator.take_events())
