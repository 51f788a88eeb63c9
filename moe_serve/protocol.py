"""Every message that crosses a process boundary (engine <-> front end, rank 0 <-> other ranks) is a
typed msgspec Struct declared here. Nothing is pickled."""
from __future__ import annotations

import msgspec

from moe_serve.sampling_params import SamplingParams


class NewRequest(msgspec.Struct, tag="new"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class AbortRequest(msgspec.Struct, tag="abort"):
    request_id: str


class LoadRecordControl(msgspec.Struct, tag="load"):
    """Start or stop expert-load recording; applied by every rank at the same turn."""

    action: str  # "start" | "stop"


class Shutdown(msgspec.Struct, tag="shutdown"):
    reason: str = ""


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


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


ControlMessage = NewRequest | AbortRequest | LoadRecordControl | Shutdown


class StepPlan(msgspec.Struct):
    """Rank 0 -> every rank, once per engine-loop turn: what each rank must apply, and whether the
    turn runs a model step (all ranks together, lockstep) or is only a heartbeat."""

    per_rank: list[list[NewRequest | AbortRequest | LoadRecordControl]]
    run_step: bool
    shutdown: bool = False


class StepReport(msgspec.Struct):
    """Every rank -> rank 0 after a plan: its new outputs, load and state."""

    rank: int
    outputs: list[EngineOutput]
    stats: dict[str, float]
    has_work: bool
    wants_shutdown: bool = False
