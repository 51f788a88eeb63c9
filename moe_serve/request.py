"""A request as the scheduler sees it: token ids and counters, no tensors.

Invariant: the first `num_computed_tokens` of `all_token_ids` have their K/V in the request's cache
blocks. A step schedules `num_scheduled` more; when those include the last known token, the step
produces one new token for the request.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

from moe_serve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)  # cache group 0's block table
    # The other cache groups' tables (sliding / chunked layers: attention/kv_manager.py), the live
    # state slot (linear attention) and a prefix-cache state snapshot lent until it is restored.
    group_block_ids: list[list[int]] = field(default_factory=list)
    state_slot: int | None = None
    restore_from: int | None = None
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    logprobs: list = field(default_factory=list)  # per output token: (chosen logprob, {id: logprob})
    # Prompt logprobs (params.prompt_logprobs): how many prompt tokens after the first have theirs
    # (tokens 1 .. num_prompt_logprobs; token j's comes from position j - 1's hidden state), and
    # those not yet sent (protocol.TokenLogprob), which go out with the request's first new token.
    num_prompt_logprobs: int = 0
    pending_prompt_logprobs: list = field(default_factory=list)
    # structured_output.GrammarState when the output is constrained: it has accepted exactly
    # output_token_ids (so preemption, which recomputes the same tokens, leaves it valid).
    grammar: object | None = None
    # Draft tokens for the next step (speculative decoding, moe_serve/spec_decode): proposed after a
    # step, scheduled after the last known token, dropped once verified or when the request is preempted.
    spec_token_ids: list[int] = field(default_factory=list)
    # Disaggregated prefill (moe_serve/disagg): "decode" (its prompt's cache comes from a prefill
    # instance: the first kv_end tokens) or "prefill" (its cache is written to kv_target, a
    # decode instance's blocks, once computed); None: computed and decoded here.
    kv_role: str | None = None
    kv_target: object | None = None
    kv_end: int = 0
    # A step feature's bound on prefix-cache hits: given the request's chained full-block hashes,
    # how many leading blocks it may take from the cache (routed experts: only blocks whose routing
    # it kept). None: no bound.
    prefix_hit_limit: Callable[[list[bytes]], int] | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some prompt position still has to be computed for its prompt logprobs."""
        return self.params.prompt_logprobs is not None and self.num_prompt_logprobs < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def check_stop_token(self) -> bool:
        """Set the finish status from the newest token and the length limit; True if finished."""
        if not self.output_token_ids:
            return False
        last = self.output_token_ids[-1]
        if self.grammar is not None:
            if self.grammar.rejected:
                self.status, self.stop_reason = RequestStatus.FINISHED_ABORTED, \
                    f"the structured-output grammar rejected token {last}"
                return True
            if self.grammar.terminated:  # the grammar ended on a stop token (EOS)
                self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, None
                return True
        enough = self.num_output_tokens >= self.params.min_tokens
        if enough and not self.params.ignore_eos and last in self.eos_token_ids:
            self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, None
            return True
        if enough and last in self.params.stop_token_ids:
            self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, last
            return True
        if self.num_output_tokens >= self.max_new_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
