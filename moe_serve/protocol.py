"""Every message that crosses a process boundary (front end <-> engine-core processes) is a typed
msgspec Struct declared here, sent as msgpack. Nothing is pickled.

Direction front end -> core: one `CoreInput` per wake-up of the front end's sender, carrying every
new request, abort and control that arrived since the previous one.
Direction core -> front end: `CoreReady` once at start-up, then one `CoreOutputs` per engine step
(the new tokens of every request that got one), `UtilityResult` for a utility call, and
`CoreFatal` when the core fails.

Importing this module does not import torch.
"""
from __future__ import annotations

from typing import Any

import msgspec

from moe_serve.sampling_params import SamplingParams


# --- front end -> engine core ---------------------------------------------------------------------
class CacheLayout(msgspec.Struct, array_like=True):
    """Where one engine core's cache lives, for a peer that writes into it (moe_serve/disagg): its
    transfer engine's metadata, and per block group and per cache tensor of the group's layers (in
    layer order) the tensor's base address and bytes per block; the same for the state pool's
    tensors (bytes per slot). `signature` names the model, dtype, block size and tensor shapes:
    a writer refuses a peer whose signature differs from its own."""

    engine: str
    agent: bytes
    signature: str
    groups: list[list[tuple[int, int]]]
    state: list[tuple[int, int]] = []


class KVTarget(msgspec.Struct, array_like=True):
    """Blocks a decode instance reserved for a request's prompt: a prefill instance computes the
    prompt's first `end` tokens and writes positions start .. end - 1 (start: what the decode side
    had cached, a block boundary) into them. tables: per block group, the decode side's block ids
    for logical blocks start // block_size onwards (-1 where that side needs none: before a window);
    state_slot: its live state slot (-1: no state layers)."""

    layout: CacheLayout
    start: int
    end: int
    tables: list[list[int]]
    state_slot: int = -1


class KVParams(msgspec.Struct, array_like=True):
    """Disaggregated prefill (moe_serve/disagg). role "decode": reserve the prompt's blocks and wait
    for a prefill instance to fill them (the core answers with the blocks in
    `EngineCoreOutput.kv_target`, the front end says when they are filled with a `KVDone`); role
    "prefill": compute the prompt and write its cache into `target`, then end the request."""

    role: str
    target: KVTarget | None = None


class NewRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv: KVParams | None = None
    # Tokens the request has already generated and streamed (a request moved off a lost rank by
    # elastic EP): the core recomputes prompt + these and goes on from there, as after a preemption.
    output_token_ids: list[int] = []


class KVDone(msgspec.Struct, array_like=True):
    """The prefill instance has written (ok) or failed to write a decode-side request's blocks.
    ended: no write into them can still land (the prefill side answered, or is gone). A failure
    not known to have ended (this side stopped waiting) is followed by a KVDone with ended=True:
    until then the blocks stay out of use, and the request is computed here in others."""

    request_id: str
    ok: bool
    error: str = ""
    ended: bool = True
    # ok, for a request with params.return_routed_experts: the prefill instance's rows of the
    # positions it computed for this side, 0 .. KVTarget.end - 1 (moe_serve/disagg/messages.py).
    routed_experts: RoutedExpertRows | None = None


class UtilityCall(msgspec.Struct, array_like=True):
    """A call answered by one `UtilityResult` with the same call_id.
    method: "load_start" | "load_stop" (applied by every rank at the same step) | "load_dump" |
    "scale" (elastic EP: regroup to `arg` ranks at a step boundary)."""

    call_id: int
    method: str
    arg: int = 0
    data: bytes = b""  # the call's JSON arguments, where an int is not enough (weight updates)


class CoreInput(msgspec.Struct, tag="in", array_like=True):
    new: list[NewRequest] = []
    aborts: list[str] = []
    calls: list[UtilityCall] = []
    shutdown: bool = False
    kv_done: list[KVDone] = []
    # The EP membership generation the front end knew when it queued these (elastic EP): a core of
    # a later generation drops the requests, aborts and KV answers of an earlier one, which the
    # front end resubmits after a regroup.
    generation: int = 0


# --- engine core -> front end ---------------------------------------------------------------------
class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens there, best first
    rank: int | None = None  # prompt logprobs: 1 + the tokens more likely than token_id (None: not computed)


class RoutedExpertRows(msgspec.Struct, array_like=True):
    """Routed experts of positions start .. start + n - 1 of one request (SamplingParams.
    return_routed_experts; moe_serve/routed_experts.py): `data` is n * num_layers * top_k
    little-endian int16 logical expert ids, position-major, then MoE layer, then the k ids in
    ascending order. A later chunk may start below an earlier one's end (positions recomputed
    after a preemption): its rows replace those."""

    start: int
    num_layers: int
    top_k: int
    data: bytes


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """The new token of one request in one step (none when it ends without one: an abort or a
    request the core refused). Token-level stops are decided in the core; stop strings in the
    front end's OutputProcessor."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    # Decode side of a disaggregated request: its blocks are reserved, a prefill instance is to fill them.
    kv_target: KVTarget | None = None
    # With the request's first new token, when params.prompt_logprobs is set: the entries of prompt
    # tokens 1 .. n - 1, in order (the first prompt token has none).
    prompt_logprobs: list[TokenLogprob] | None = None
    # params.return_routed_experts: the rows of positions computed since the request's last output.
    routed_experts: RoutedExpertRows | None = None


class SchedulerStats(msgspec.Struct, array_like=True):
    """The scheduler's and the cache's state after a step; counts since start."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # share of KV blocks in use
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    # Prefix cache, counts since start in prompt tokens (a prompt once, however often it is preempted).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_blocks_in_use: int = 0  # blocks and state slots held by requests, every pool (0: nothing held)


class EplbStats(msgspec.Struct, array_like=True):
    """Expert rebalancing (every rank holds the same figures; the front end reads rank 0's)."""

    rebalances: int = 0
    balancedness: float = 0.0  # mean / max tokens per rank over the last window (0: not measured)
    last_transfer_s: float = 0.0  # the last rebalance, from tuning to its last layer's switch


class SpeedOfLightStats(msgspec.Struct, array_like=True):
    """Decode speed of light (moe_serve/speed_of_light.py), this rank's last closed window (0: none yet)."""

    fraction: float = 0.0
    tokens_per_s: float = 0.0
    memory_bandwidth: float = 0.0  # bytes/s


class SpecDecodeStats(msgspec.Struct, array_like=True):
    """Speculative decoding (moe_serve/spec_decode), counts since start: pieces verified with drafts,
    draft tokens, accepted ones, and acceptances per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = []


class KVTransferStats(msgspec.Struct, array_like=True):
    """Disaggregation (moe_serve/disagg), counts since start. Prefill side: requests whose cache was
    written to a decode instance, bytes written, writes that failed, seconds from post to done.
    Decode side: requests whose prompt cache arrived, and those computed here after a prefill failed."""

    sent_requests: int = 0
    sent_bytes: int = 0
    send_failures: int = 0
    send_seconds: float = 0.0
    received_requests: int = 0
    fallbacks: int = 0


# The flat names of the one-struct era (metric docs, older readers): name -> (part, field).
_FLAT_NAMES = {
    **{f: ("scheduler", f) for f in SchedulerStats.__struct_fields__},
    "eplb_rebalances": ("eplb", "rebalances"), "expert_balancedness": ("eplb", "balancedness"),
    "eplb_last_transfer_s": ("eplb", "last_transfer_s"),
    "decode_sol_fraction": ("speed_of_light", "fraction"), "decode_tokens_per_s": ("speed_of_light", "tokens_per_s"),
    "memory_bandwidth": ("speed_of_light", "memory_bandwidth"),
    **{f"spec_{f}": ("spec_decode", f) for f in SpecDecodeStats.__struct_fields__},
    **{f"kv_{f}": ("kv_transfer", f) for f in KVTransferStats.__struct_fields__},
}


class EngineStats(msgspec.Struct, array_like=True):
    """One rank's figures after a step, one named part per concern; the front end combines them over
    ranks (`combine_rank_stats`). A step feature's stats() lands in the part named as the feature
    (`eplb`, `speed_of_light`) or, for any other feature, in `features` under its name."""

    scheduler: SchedulerStats = msgspec.field(default_factory=SchedulerStats)
    spec_decode: SpecDecodeStats = msgspec.field(default_factory=SpecDecodeStats)
    kv_transfer: KVTransferStats = msgspec.field(default_factory=KVTransferStats)
    eplb: EplbStats = msgspec.field(default_factory=EplbStats)
    speed_of_light: SpeedOfLightStats = msgspec.field(default_factory=SpeedOfLightStats)
    features: dict[str, Any] = {}  # other features' stats by feature name (plain dicts once decoded)

    def __getattr__(self, name: str):
        """A flat name of the one-struct era (`num_waiting`, `kv_sent_bytes`, `decode_sol_fraction`)
        reads its named part's field."""
        try:
            part, field = _FLAT_NAMES[name]
        except KeyError:
            raise AttributeError(name) from None
        return getattr(getattr(self, part), field)


def combine_rank_stats(rs: list[EngineStats]) -> EngineStats:
    """Every rank's stats summed (usage averaged; the hit rate over every rank's prompt tokens;
    rebalancing: the same on every rank, so rank 0's; speed of light: per rank only, left at 0)."""
    sched = [s.scheduler for s in rs]
    queries, hits = sum(s.prefix_cache_queries for s in sched), sum(s.prefix_cache_hits for s in sched)
    summed = SchedulerStats(**{f: sum(getattr(s, f) for s in sched) for f in SchedulerStats.__struct_fields__})
    summed.kv_cache_usage /= len(sched)
    summed.prefix_cache_hit_rate = hits / queries if queries else 0.0
    summed.num_steps = max(s.num_steps for s in sched)
    spec = [s.spec_decode for s in rs]
    kv = [s.kv_transfer for s in rs]
    return EngineStats(
        scheduler=summed,
        spec_decode=SpecDecodeStats(
            num_drafts=sum(s.num_drafts for s in spec), num_draft_tokens=sum(s.num_draft_tokens for s in spec),
            num_accepted_tokens=sum(s.num_accepted_tokens for s in spec),
            accepted_per_pos=[sum(col) for col in zip(*(s.accepted_per_pos for s in spec))]),
        kv_transfer=KVTransferStats(**{f: sum(getattr(s, f) for s in kv) for f in KVTransferStats.__struct_fields__}),
        eplb=rs[0].eplb)


class CoreReady(msgspec.Struct, tag="ready", array_like=True):
    rank: int
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    eos_token_ids: list[int]
    block_size: int = 16
    prefix_caching: bool = True
    disaggregation_mode: str = "none"
    kv_layout: CacheLayout | None = None  # where its cache lives (a decode-side rank)
    host: str = ""  # where the core runs, and its process (GET /ranks)
    pid: int = 0
    expert_slots: int = 0  # expert slots per MoE layer on this rank


class CacheEvents(msgspec.Struct, array_like=True):
    """A rank's prefix cache over one step: the block hashes that became findable and those that
    stopped being (net changes: moe_serve/engine/routing.py routes new requests by them)."""

    added: list[bytes] = []
    removed: list[bytes] = []


class CoreOutputs(msgspec.Struct, tag="out", array_like=True):
    rank: int
    outputs: list[EngineCoreOutput]
    stats: EngineStats
    # A rank that got SIGTERM (-1: none): the front end should drain and shut the job down.
    shutdown_asked_by: int = -1
    finished_shutdown: bool = False  # the core's last message before it exits
    cache_events: CacheEvents | None = None
    generation: int = 0  # the EP membership generation of the core that sent it (elastic EP)


class UtilityResult(msgspec.Struct, tag="util", array_like=True):
    call_id: int
    result: bytes = b""  # JSON
    error: str | None = None


class CoreFatal(msgspec.Struct, tag="fatal", array_like=True):
    rank: int
    error: str


class RankInfo(msgspec.Struct, array_like=True):
    rank: int  # the rank's id for the job's life (its torchrun RANK, or the id a joiner took)
    host: str
    pid: int  # of the process that runs its engine core
    expert_slots: int


class ElasticChange(msgspec.Struct, tag="elastic", array_like=True):
    """From the coordinating core (rank 0) of an elastic-EP job. phase "recovering": a rank was lost
    (`lost`) or the membership is changing and the survivors are regrouping; "serving": every
    member below has rebuilt its engine core for `generation` (their requests are gone: the front end
    resubmits every open one, with the tokens already streamed), in EP-rank order."""

    generation: int
    phase: str
    members: list[RankInfo] = []
    lost: list[int] = []
    reason: str = ""
    seconds: float = 0.0  # "serving": from the failure (or the planned change) to serving again
    max_model_len: int = 0


CoreMessage = CoreReady | CoreOutputs | UtilityResult | CoreFatal | ElasticChange


# --- the front end's own product (same process: handlers read it) -----------------------------
class EngineOutput(msgspec.Struct):
    """New tokens and text of one request since its previous output."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None  # see EngineCoreOutput.prompt_logprobs
    routed_experts: RoutedExpertRows | None = None  # see EngineCoreOutput.routed_experts
    # The weights that made these tokens: the front end stamps each output as it arrives (an
    # update's answer comes after the outputs of the steps before it and before those after it).
    weight_version: str | None = None


input_encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(CoreInput)
message_decoder = msgspec.msgpack.Decoder(CoreMessage)
