"""EngineCore: one per data-parallel rank. Its loop is schedule -> run -> sample -> emit token ids.

The core knows nothing of text: detokenization, stop strings and streaming live in the front end's
`OutputProcessor`. Token-level stops (EOS, stop_token_ids, max_tokens) are decided here, where the
blocks are freed. `build_engine(config)` is the one way to make a core (offline `LLM`, the
single-process server's core process and every rank of a torchrun job).
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, wait

import torch.distributed as dist

from attention.kv_manager import KVCacheManager
from attention.state import StateCache
from expert_parallel.placement.load_stats import ExpertLoadRecorder
from expert_parallel.placement.map import load_placement as read_placement
from expert_parallel.rebalance.eplb import EplbManager, tuner_fn
from expert_parallel.runtime.dispatch import make_dispatcher
from expert_parallel.runtime.layer import MoE, MoEContext, default_physical_to_logical, num_default_slots
from moe_serve.config import EngineConfig
from moe_serve.limits import check_request
from moe_serve.model_runner import ModelRunner, make_input_batch
from moe_serve.models.registry import num_logical_experts
from moe_serve import platform
from moe_serve.platform import deepep_support
from moe_serve.protocol import EngineCoreOutput, EngineStats, NewRequest, TokenLogprob
from moe_serve.request import Request, RequestStatus
from moe_serve.runner.graphs import capture_decode_graphs, capture_verify_graphs, captures_graphs
from moe_serve.runner.loading import build_model, load_model_weights, prepare_weights, warm_up_before_serving
from moe_serve.runner.memory import KVCacheSize, attention_layers, init_kv_cache, profile_memory, size_kv_cache
from moe_serve.sampler import Sampler
from moe_serve.speed_of_light import DecodeMeter, device_bandwidth
from moe_serve.spec_decode import Speculator, accept
from moe_serve.scheduler import Scheduler, SchedulerOutput
from moe_serve.structured_output.grammar import GrammarManager
from moe_serve.tokenizer import Tokenizer

log = logging.getLogger("moe_serve.engine")
SEND_WAIT_S = 0.05  # prefill side: how long a step waits for the KV writes it posted before going on


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
                               cfg.norm_backend, cfg.linear_attention_backend)
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
    runner.verify_q, runner.verify_pad_sizes, runner.verify_graphs = \
        capture_verify_graphs(model, cfg, moe_ctx, batch, kv, capture and graphs is not None)
    max_model_len = serving_max_model_len(cfg, kv.token_capacity(cfg.cache.block_size))
    scheduler = make_scheduler(cfg, kv, max_model_len)
    eos = eos_token_ids(cfg)
    grammars = GrammarManager(cfg.model.path, cfg.model.hf["vocab_size"], eos)
    core = EngineCore(cfg, moe_ctx, runner, scheduler, eos, grammars, max_model_len, meter)
    core.connector = make_kv_connector(cfg, *bound)
    if par.expert_load_record or par.expert_load_window:
        core.enable_load_recording(par.expert_load_window or 100, ep_group, start=bool(par.expert_load_record))
    if par.eplb is not None:
        core.enable_eplb(make_eplb(cfg, model, moe_ctx, num_slots))
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


def make_kv_connector(cfg: EngineConfig, groups: list, state: list):
    """A disaggregated instance's cache registered with the transfer engine (None otherwise). After
    the cache is allocated: it registers the tensors bound."""
    if cfg.disaggregation_mode == "none":
        return None
    from moe_serve.disagg.connector import KVConnector, layout_signature

    mc = cfg.model
    sig = layout_signature(f"{mc.architecture}:{mc.hf.get('num_hidden_layers')}", cfg.activation_dtype, cfg.cache.block_size,
                           groups, state)
    conn = KVConnector(cfg.disaggregation_transfer_backend, groups, state, sig, str(cfg.device),
                       cfg.disaggregation_timeout_s)
    log.info("disaggregation: %s instance, KV over %s", cfg.disaggregation_mode, cfg.disaggregation_transfer_backend)
    return conn


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


def make_eplb(cfg: EngineConfig, model, moe_ctx: MoEContext, num_slots: int) -> EplbManager:
    """The online rebalancer over the model's MoE layers. Last: it makes a process group (a
    collective) and its load hook goes after the recorder's."""
    E = num_logical_experts(cfg.model.architecture, cfg.model.hf)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    rows = moe_ctx.physical_to_logical or [default_physical_to_logical(E, num_slots) for _ in moes]
    par = cfg.parallel
    # Nodes (torchrun's LOCAL_WORLD_SIZE ranks each) and the router's expert groups, so the
    # tuner also keeps tokens near their node on a multi-node job.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", par.world_size) or par.world_size)
    nodes = par.world_size // local if par.world_size % local == 0 else 1
    groups = cfg.model.hf.get("n_group")
    groups = groups if nodes > 1 and isinstance(groups, int) and groups > 0 and E % groups == 0 else None
    return EplbManager(moes, rows, E, par.eplb, par.rank, par.world_size, cfg.device,
                       tune_fn=tuner_fn(nodes, groups, par.replica_split))


class EngineCore:
    """The schedule -> run -> sample loop of one rank over the parts `build_engine` made; making one
    does no work."""

    def __init__(self, cfg: EngineConfig, moe_ctx: MoEContext, runner: ModelRunner, scheduler: Scheduler,
                 eos_token_ids: frozenset[int], grammars: GrammarManager, max_model_len: int,
                 meter: DecodeMeter | None = None):
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
        self.load_recorder: ExpertLoadRecorder | None = None  # enable_load_recording
        self.eplb: EplbManager | None = None  # enable_eplb
        self.meter = meter  # decode speed of light (moe_serve/speed_of_light.py)
        self.spec = Speculator(cfg.speculative, max_model_len)  # speculative decoding's drafts and counts
        scheduler.lookahead_tokens = self.spec.lookahead_tokens
        self.connector = None  # disagg.connector.KVConnector in a disaggregated instance (make_kv_connector)
        self.kv_sent_requests = self.kv_sent_bytes = self.kv_send_failures = 0
        self.kv_send_seconds = 0.0

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
                if new.kv is not None or len(new.output_token_ids) >= max_new:
                    raise ValueError("a resumed request must have tokens left to generate and no KV transfer")
                req.output_token_ids = list(new.output_token_ids)
                req.num_prompt_logprobs = req.num_prompt_tokens - 1  # sent with its first token already
            if new.kv is not None:
                self._disaggregated(req, new.kv)
            if new.params.structured_outputs is not None:
                if new.request_id in self.scheduler.requests or \
                        any(r.request_id == new.request_id for r, _ in self._awaiting_grammar):
                    raise ValueError(f"request_id {new.request_id!r} is already in use")
                self._awaiting_grammar.append((req, self.grammars.compiled(new.params.structured_outputs)))
            else:
                self.scheduler.add_request(req)
        except ValueError as e:
            return EngineCoreOutput(new.request_id, [], True, "abort", str(e))
        return None

    def _disaggregated(self, req: Request, kv) -> None:
        """Mark a request whose prompt cache moves between instances (moe_serve/disagg); ValueError
        when this instance cannot take that part."""
        mode = self.cfg.disaggregation_mode
        if kv.role not in ("prefill", "decode"):
            raise ValueError(f"kv role {kv.role!r} is not prefill or decode")
        if req.params.prompt_logprobs is not None:
            # The prompt's hidden states exist only on the prefill instance, which returns no tokens.
            raise ValueError("prompt_logprobs cannot be computed for a disaggregated request: its prompt is "
                             "computed on a prefill instance")
        if mode != kv.role:
            raise ValueError(f"this instance was started with --disaggregation-mode {mode}: it does not take "
                             f"the {kv.role} side of a disaggregated request")
        req.kv_role = kv.role
        if kv.role == "decode":
            req.kv_end = req.num_prompt_tokens - 1  # the last prompt token is computed here, where it samples
            return
        from moe_serve.disagg.connector import LayoutMismatch

        t = kv.target
        if t is None or not 0 <= t.start < t.end == req.num_prompt_tokens - 1:
            raise ValueError("a prefill request needs the whole prompt and a target that ends before its last token")
        if t.layout.signature != self.connector.layout.signature:
            raise LayoutMismatch(f"the decode instance's cache layout ({t.layout.signature}) differs from this "
                                 f"instance's ({self.connector.layout.signature}): both must serve the same model, "
                                 "dtype, block size and speculative layers")
        req.kv_target = t
        req.max_new_tokens = 1
        # The whole prompt is computed (the MTP layer's entry of a position reads the next token), but
        # per-sequence state must stop before the last token, which the decode side computes.
        if self.scheduler.kv.has_state:
            req.prompt_token_ids = req.prompt_token_ids[:t.end]

    def kv_done(self, done: list) -> None:
        """Decode side: prefill instances wrote (or failed to write) these requests' blocks."""
        for d in done:
            req = self.scheduler.kv_done(d.request_id, d.ok, d.ended)
            if req is not None and not d.ok:
                log.warning("request %s: its prompt's KV did not arrive (%s): computing it here", d.request_id,
                            d.error or "no reason given")

    def _report_reserved(self) -> None:
        """Decode side: tell the front end which blocks each newly reserved request holds."""
        from moe_serve.protocol import KVTarget

        sched = self.scheduler
        bs = sched.block_size
        for req in sched.take_kv_reserved():
            start, end = req.num_computed_tokens, req.kv_end
            tables = [[-1 if b == sched.kv.null_block(g) else b for b in t[start // bs:-(-end // bs)]]
                      for g, t in enumerate(sched.kv.tables(req))]
            slot = -1 if req.state_slot is None else req.state_slot
            self._early_outputs.append(EngineCoreOutput(
                req.request_id, [], kv_target=KVTarget(self.connector.layout, start, end, tables, slot)))

    def _send_kv(self, held: list[Request], outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Prefill side: post the writes of the requests that finished computing; their outputs
        wait for the writes (poll_kv). Returns the outputs of the other requests."""
        from moe_serve.disagg.transfer import TransferError

        ids = {r.request_id: r for r in held}
        sched, rest = self.scheduler, []
        if self.cfg.device.type == "cuda":  # the step's kernels have written the cache before it is read
            import torch

            torch.cuda.current_stream(self.cfg.device).synchronize()
        nulls = [sched.kv.null_block(g) for g in range(len(sched.kv.allocs))]
        for o in outputs:
            req = ids.pop(o.request_id, None)
            if req is None:
                rest.append(o)
                continue
            try:
                self.connector.post(req, req.kv_target, sched.kv.tables(req), nulls, req.state_slot, sched.block_size,
                                    o)
            except (TransferError, ValueError) as e:
                sched.free_held(req)
                self.kv_send_failures += 1
                log.warning("request %s: its KV could not be sent: %s", req.request_id, e)
                rest.append(EngineCoreOutput(req.request_id, [], True, "abort", f"KV transfer failed: {e}"))
        for req in ids.values():  # finished without an output of this step (not expected): give back
            sched.free_held(req)
        # A write of a few MB takes milliseconds: wait for it (briefly) rather than leave its request's
        # answer until after the next step, which may be a long prefill.
        deadline = time.monotonic() + SEND_WAIT_S
        while self.connector.sending and time.monotonic() < deadline:
            rest += self.poll_kv()
            if self.connector.sending:
                time.sleep(0.0002)
        return rest

    def poll_kv(self) -> list[EngineCoreOutput]:
        """Prefill side: the outputs of requests whose KV write ended (blocks given back)."""
        if self.connector is None or not self.connector.sending:
            return []
        outs = []
        for send, state in self.connector.poll():
            self.scheduler.free_held(send.req)
            if send.aborted:  # aborted while its write was posted: answered now that the write has ended
                if state == "DONE":
                    self.kv_sent_requests += 1
                    self.kv_sent_bytes += send.nbytes
                else:
                    self.kv_send_failures += 1
                outs.append(EngineCoreOutput(send.req.request_id, [], True, "abort",
                                             f"aborted; its KV write has ended ({state})"))
            elif state == "DONE":
                self.kv_sent_requests += 1
                self.kv_sent_bytes += send.nbytes
                self.kv_send_seconds += time.monotonic() - send.t0
                outs.append(send.output)
            else:
                self.kv_send_failures += 1
                log.warning("request %s: %s", send.req.request_id, state)
                outs.append(EngineCoreOutput(send.req.request_id, [], True, "abort", f"KV transfer failed: {state}"))
        return outs

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        outs = []
        for rid in request_ids:
            if self.scheduler.abort_request(rid) is not None:
                outs.append(EngineCoreOutput(rid, [], True, "abort"))
            elif self.connector is not None and self.connector.abort(rid):
                pass  # its KV write is posted: answered (poll_kv) once the write has ended, never before
            elif any(r.request_id == rid for r, _ in self._awaiting_grammar):
                self._awaiting_grammar = [(r, f) for r, f in self._awaiting_grammar if r.request_id != rid]
                outs.append(EngineCoreOutput(rid, [], True, "abort"))
        return outs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._awaiting_grammar) or bool(self._early_outputs)

    def has_transfers(self) -> bool:
        """KV writes in flight (prefill side): the transfer engine's own thread moves them."""
        return self.connector is not None and bool(self.connector.sending)

    def take_early_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests that ended before they were scheduled (a grammar that failed to
        compile); the caller sends them with the step's outputs."""
        outs, self._early_outputs = self._early_outputs, []
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
                self.scheduler.add_request(req)
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
        if self.scheduler._kv_reserved:
            self._report_reserved()
        return out

    def step(self, lockstep: bool = False) -> list[EngineCoreOutput]:
        if self.eplb is not None and not lockstep:  # one process: its own agreement
            self.eplb_boundary(self.eplb_flag())
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
                t0 = time.perf_counter()
                if self.meter is not None:
                    self.meter.begin_step()
                self.runner.execute_empty(max_tokens_any_rank, uniform_len)
                if self.meter is not None:
                    self.meter.end_step(None)
                if self.runner.drafter is not None:
                    self.runner.propose_drafts([], [])
                if self.load_recorder is not None:
                    self.load_recorder.end_step()
                if self.eplb is not None:
                    self.eplb.end_step(time.perf_counter() - t0)
            return []
        self.num_steps += 1
        for s in out.scheduled:
            r = s.request
            if r.num_computed_tokens < r.num_prompt_tokens:
                self.num_prompt_tokens += min(s.num_tokens, r.num_prompt_tokens - r.num_computed_tokens)
        meter = self.meter
        decode_lens = None  # a decode-only step: each sequence's cache length with its new token
        if meter is not None:
            meter.begin_step()
            if all(s.num_tokens == 1 and s.request.num_computed_tokens == s.request.num_tokens - 1
                   for s in out.scheduled):
                decode_lens = [s.request.num_tokens for s in out.scheduled]
        t0 = time.perf_counter()
        result = self.runner.execute(out, max_tokens_any_rank, uniform_len)
        seconds = time.perf_counter() - t0
        if meter is not None:  # the step's turn of the loop, since the step before ended
            meter.end_step(decode_lens)
        if self.eplb is not None:
            self.eplb.end_step(seconds)
        # Each sampling piece's rows: one, or with k draft tokens k + 1 (spec_decode.accept verifies).
        sampled, logprobs, sampled_reqs, i = {}, {}, [], 0
        last_accepted = {}  # request id -> the sampling row of its last accepted token
        for s in out.scheduled:
            if not s.samples:
                continue
            k = len(s.draft_ids)
            rows = result.token_ids[i:i + k + 1]
            keep = accept(rows, s.draft_ids) if k else rows
            sampled[s.request.request_id] = keep
            logprobs[s.request.request_id] = result.logprobs[i:i + len(keep)]
            sampled_reqs.append((s.request, s.request.num_output_tokens))
            last_accepted[s.request.request_id] = i + len(keep) - 1
            i += k + 1
            if k:
                self.spec.record(k, len(keep) - 1)
        # Per-sequence state (linear attention) advanced over rejected drafts: restore it to before
        # the step and recompute the accepted tokens in the next one (ModelRunner.restore_states).
        rollback = {s.request.request_id for s in out.scheduled
                    if s.samples and s.draft_ids and len(sampled[s.request.request_id]) <= len(s.draft_ids)}
        if rollback and self.runner.state_layers:
            self.runner.restore_states(rollback)
        else:
            rollback = set()
        for s in out.scheduled:  # before the update: a request that ends in this step sends them now
            lps = result.prompt_logprobs.get(s.request.request_id)
            if lps:
                s.request.pending_prompt_logprobs += lps
                s.request.num_prompt_logprobs += len(lps)
        now = time.monotonic()
        self.scheduler.update(out, sampled, rollback)
        if self.load_recorder is not None:
            self.load_recorder.end_step()
        outputs = []
        for r, before in sampled_reqs:
            if r.status == RequestStatus.FINISHED_ABORTED and r.stop_reason is None:  # aborted during the step
                continue
            new = r.output_token_ids[before:]  # the sampled tokens it kept (all, unless one stopped it)
            self.num_generation_tokens += len(new)
            if r.first_token_time is None:
                r.first_token_time = now
            fin = r.is_finished
            lps = logprobs[r.request_id][:len(new)]
            prompt_lps = None
            if r.params.prompt_logprobs is not None and before == 0:  # its first token: the prompt's entries
                prompt_lps, r.pending_prompt_logprobs = r.pending_prompt_logprobs, []
            outputs.append(EngineCoreOutput(
                r.request_id, new, fin, r.status.value if fin else None, r.stop_reason if fin else None,
                [TokenLogprob(t, lp[0], lp[1]) for t, lp in zip(new, lps)] if lps and lps[0] else None,
                r.num_cached_prompt_tokens, prompt_logprobs=prompt_lps))
        if self.runner.drafter is not None:
            self._mtp_drafts(out, result.token_ids, last_accepted)
        elif self.spec.proposer is not None:
            self.spec.propose(self.scheduler.running)
        held = self.scheduler.take_kv_outbox()
        if held:  # after the MTP pass, which writes its layer's cache of this step's tokens
            outputs = self._send_kv(held, outputs)
        return outputs

    def _mtp_drafts(self, out: SchedulerOutput, sampled: list[int], last_accepted: dict[str, int]) -> None:
        """Run the MTP drafter after a step (every step: its passes are collective under EP) and
        give each request that decodes next its drafts."""
        batch = self.runner.batch
        rows, reqs = [], []
        for s in out.scheduled:
            r = s.request
            j = last_accepted.get(r.request_id)
            if j is None or r.is_finished or r.num_computed_tokens != r.num_tokens - 1:
                continue
            row = batch.row_of[r.request_id]
            rows.append((row, batch.last_logits_idx[j], r.num_computed_tokens - 1))
            reqs.append((r, row))
        drafts = self.runner.propose_drafts(rows, sampled)
        for r, row in reqs:
            self.spec.set_drafts(r, drafts.get(row, []))

    # --- expert load ----------------------------------------------------------------------------
    def enable_load_recording(self, window_steps: int, ep_group=None, start: bool = False):
        """Count routed tokens per (MoE layer, logical expert) in windows of `window_steps` steps.
        With expert parallelism every window is summed over the ranks (one all_reduce per window,
        at the same step on every rank)."""
        reduce_fn = None
        if self.cfg.parallel.world_size > 1:
            reduce_fn = lambda t: dist.all_reduce(t, group=ep_group)  # noqa: E731
        rec = ExpertLoadRecorder(self.runner.model.num_moe_layers, num_logical_experts(self.cfg.model.architecture,
                                 self.cfg.model.hf), window_steps, reduce_fn=reduce_fn, device=self.cfg.device)
        self.load_recorder = rec
        self.runner.load_hooks.append(rec.record)
        if start:
            rec.start()
        return rec

    def stop_load_recording(self) -> None:
        """Stop the HTTP-controlled recording, keeping its partial window (at shutdown, on every
        rank at the same turn: the window's reduction is collective)."""
        if self.load_recorder is not None:
            self.load_recorder.stop()

    def dump_load(self, path: str | None = None) -> dict:
        if self.load_recorder is None:
            return {}
        return self.load_recorder.dump(path, metadata={"model": self.cfg.model.path})

    # --- expert rebalancing ---------------------------------------------------------------------
    def enable_eplb(self, mgr: EplbManager) -> None:
        """Rebalance experts online with `mgr` (make_eplb); its load hook sits beside the
        HTTP-controlled recorder, if any: both count."""
        self.eplb = mgr
        self.runner.load_hooks.append(mgr.record)

    def eplb_flag(self) -> int:
        """What this rank adds to the per-turn agreement: 1 while its part of the pending
        rebalancing step is not done (0 without rebalancing)."""
        return self.eplb.local_flag() if self.eplb is not None else 0

    def eplb_state(self) -> tuple[int, int]:
        """eplb_flag and the digest of a tuned placement waiting to be taken up (0 if none), read
        together: the per-turn agreement carries both (EplbManager.local_state)."""
        return self.eplb.local_state() if self.eplb is not None else (0, 0)

    def eplb_boundary(self, agreed_flag: int, sync_group=None, digests: tuple[int, int] | None = None) -> None:
        """Between steps, at the same turn on every rank: advance the rebalancing (tune, post
        transfers, switch a layer whose transfer every rank finished). digests: the agreed
        (MAX digest, MAX -digest), which must match when a tuned placement is taken up."""
        if self.eplb is not None:
            self.eplb.boundary(agreed_flag, sync_group, digests)

    # --- stats ----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting) + len(self._awaiting_grammar), self.allocator.usage,
                           self.allocator.hit_rate,
                           s.num_preemptions, self.num_prompt_tokens, self.num_generation_tokens, self.num_steps,
                           *((self.eplb.rebalances, self.eplb.balancedness, self.eplb.last_transfer_s)
                             if self.eplb is not None else (0, 0.0, 0.0)),
                           *((self.meter.fraction, self.meter.last["tokens_per_s"], self.meter.bandwidth)
                             if self.meter is not None else (0.0, 0.0, 0.0)),
                           self.spec.num_drafts, self.spec.num_draft_tokens, self.spec.num_accepted_tokens,
                           list(self.spec.accepted_per_pos), self.allocator.lookup_tokens,
                           self.allocator.hit_tokens, s.kv.in_use, self.kv_sent_requests, self.kv_sent_bytes,
                           self.kv_send_failures, self.kv_send_seconds, s.kv_received, s.kv_fallbacks)

    def track_cache_events(self) -> None:
        """Keep the prefix cache's changes for take_cache_events (a data-parallel rank's reports)."""
        self.allocator.track_events()

    def take_cache_events(self):
        """The prefix cache's net changes since the last call (None: none, or not tracked)."""
        from moe_serve.protocol import CacheEvents

        if self.allocator.events is None or not self.allocator.events:
            return None
        return CacheEvents(*self.allocator.take_events())
