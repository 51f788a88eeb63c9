"""Limits an OpenAI request must meet before the server spends anything on it.

Everything here is cheap and runs on the event loop before tokenization: counts and sizes of the
request's lists, its sampling fields (`sampling_params`), and lower bounds on its prompt's token
count from its length in characters (no token stands for more than `chars_per_token` characters,
so a text of c characters has at least c / chars_per_token tokens). A request that could never run
(too long for max_model_len, or for the KV cache of every rank) is refused with a 400 that names
the field, in OpenAI's error shape. The request runner (runner.py) applies `PromptLimits` to the
tokens once they are known.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from moe_serve.routed_experts import FORMATS as ROUTED_EXPERTS_FORMATS
from moe_serve.sampling_params import SamplingParams

# Sizes of lists in a request. Beyond these a request is refused with a 400 naming the field; each
# is far above what a real client sends and low enough that checking the rest stays cheap.
MAX_MESSAGES = 4096
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024  # per stop string (the output processor holds back that many characters)
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_TOOLS = 128
MAX_TOOL_SCHEMA_BYTES = 64 << 10  # one tool's definition, as JSON
MAX_N = 16
# A template may leave out part of what it is given (e.g. earlier turns' reasoning), so the messages'
# characters are only bounded loosely before templating; the rendered text is bounded exactly.
CHAT_CHARS_SLACK = 4


class BadRequest(ValueError):
    """A refusal: status, message and the OpenAI error fields (type, param, code)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.code, self.type = param, status, code, type_


def field_of(msg: str) -> str | None:
    """The parameter a validation message names (the first word before '=' / ' must')."""
    for token in msg.replace("=", " ").split():
        token = token.split("[", 1)[0]
        if token.isidentifier() and token not in ("the", "a", "an", "max"):
            return token
    return None


def check_count(name: str, n: int, most: int, what: str = "entries") -> None:
    if n > most:
        raise BadRequest(f"{name} has {n} {what}; at most {most} are allowed", name, code="too_many_" + what)


def check_stop(stop) -> None:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    check_count("stop", len(strings), MAX_STOP_STRINGS, "strings")
    long = next((s for s in strings if isinstance(s, str) and len(s) > MAX_STOP_CHARS), None)
    if long is not None:
        raise BadRequest(f"stop strings must be at most {MAX_STOP_CHARS} characters, got one of {len(long)}", "stop")


def sampling_params(req, max_tokens: int | None, logprobs: int | None, max_tokens_field: str = "max_tokens",
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The sampling parameters of a completions or chat request (protocol._Common), checked.
    prompt_logprobs: what the engine computes (default: the request's field)."""
    if req.prompt_logprobs is not None and req.stream:  # as vLLM: they would come only at the end
        raise BadRequest("prompt_logprobs is not available with stream=true", "prompt_logprobs")
    if req.n is None or req.n < 1:
        raise BadRequest(f"n must be >= 1, got {req.n}", "n")
    if req.n > MAX_N:
        raise BadRequest(f"n must be <= {MAX_N}, got {req.n}", "n")
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(f"{max_tokens_field} must be >= 1, got {max_tokens}", max_tokens_field)
    if req.temperature is not None and not 0 <= req.temperature <= 2:  # OpenAI's range
        raise BadRequest(f"temperature must be in [0, 2], got {req.temperature}", "temperature")
    if req.stream_options is not None and not req.stream:
        raise BadRequest("stream_options is only allowed with stream=true", "stream_options")
    for name in ("seed", "top_k", "min_tokens"):  # integers cross to the core as 64-bit msgpack
        v = getattr(req, name)
        if v is not None and not -(1 << 63) <= v < (1 << 63):
            raise BadRequest(f"{name} must fit in a signed 64-bit integer, got {v}", name)
    check_stop(req.stop)
    if req.routed_experts_format not in ROUTED_EXPERTS_FORMATS:
        raise BadRequest(f"routed_experts_format must be one of {', '.join(ROUTED_EXPERTS_FORMATS)}, got "
                         f"{req.routed_experts_format!r}", "routed_experts_format")
    check_count("stop_token_ids", len(req.stop_token_ids or ()), MAX_STOP_TOKEN_IDS, "ids")
    check_count("logit_bias", len(req.logit_bias or ()), MAX_LOGIT_BIAS, "entries")
    bias = None
    if req.logit_bias:
        try:
            bias = {int(k): v for k, v in req.logit_bias.items()}
        except ValueError:
            raise BadRequest(f"logit_bias keys must be token ids, got {sorted(req.logit_bias)[:5]}",
                             "logit_bias") from None
    try:
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p, seed=req.seed, max_tokens=max_tokens,
            min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
            logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            frequency_penalty=req.frequency_penalty or 0.0, presence_penalty=req.presence_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty, logit_bias=bias,
            prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            return_routed_experts=req.return_routed_experts)
    except ValueError as e:
        raise BadRequest(str(e), field_of(str(e))) from None


@dataclass(frozen=True)
class PromptLimits:
    """What a prompt must fit: the context length and the smallest rank's KV cache.

    chars_per_token: no token of this tokenizer stands for more characters (None: the tokenizer
    gives no such guarantee, so texts are measured only by tokenizing them).
    """

    max_model_len: int
    chars_per_token: float | None
    kv_block_size: int
    kv_blocks: int

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_blocks * self.kv_block_size

    def min_tokens(self, chars: int, slack: float = 1.0) -> int:
        """The fewest tokens a text of this many characters can have (divided by slack)."""
        if self.chars_per_token is None or chars == 0:
            return 0
        return math.ceil(chars / (self.chars_per_token * slack))

    def check_chars(self, chars: int, max_tokens: int | None, param: str = "prompt", slack: float = 1.0) -> None:
        """Refuse a text that is too long by its length alone, without tokenizing it."""
        least = self.min_tokens(chars, slack)
        if least == 0:
            return
        allowance = "" if slack == 1.0 else f", allowing {slack:g}x for the chat template"
        why = (f"{chars} characters, so at least {least} tokens (no token of this model is longer than "
               f"{self.chars_per_token:g} characters{allowance})")
        if least >= self.max_model_len:
            raise BadRequest(f"the {param} is too long for max_model_len={self.max_model_len}: {why}", param,
                             code="context_length_exceeded")
        self.check_tokens(least, max_tokens, param, why)

    def check_tokens(self, n: int, max_tokens: int | None, param: str = "prompt", why: str | None = None) -> None:
        """Refuse a prompt of n tokens (plus max_tokens) that no rank's KV cache could ever hold, or
        that max_model_len does not allow."""
        desc = why or f"{n} tokens"
        need_tokens = n + (max_tokens or 1)
        need = math.ceil(need_tokens / self.kv_block_size)
        if need > self.kv_blocks:
            field = param if max_tokens is None or n + 1 > self.kv_capacity_tokens else "max_tokens"
            extra = "" if max_tokens is None else f" plus max_tokens={max_tokens}"
            raise BadRequest(f"the {param} ({desc}){extra} needs {need} KV cache blocks of {self.kv_block_size} "
                             f"tokens, but the KV cache holds {self.kv_blocks} blocks ({self.kv_capacity_tokens} "
                             "tokens): it could never run", field, code="context_length_exceeded")
        if n >= self.max_model_len:
            raise BadRequest(f"the {param} has {desc}; max_model_len={self.max_model_len} leaves no room for output "
                             "(the prompt must be shorter than max_model_len)", param, code="context_length_exceeded")
        if max_tokens is not None and n + max_tokens > self.max_model_len:
            raise BadRequest(f"max_tokens={max_tokens} plus the {param}'s {desc} exceeds "
                             f"max_model_len={self.max_model_len}", "max_tokens", code="context_length_exceeded")


def default_max_body_bytes(max_model_len: int, max_token_bytes: int, vocab_size: int) -> int:
    """Room for the longest prompt max_model_len allows, as text (4x for JSON escapes and several
    messages) or as token ids, plus 1 MiB for everything else in a request."""
    per_token = max(max_token_bytes, len(str(vocab_size)) + 2)
    return (1 << 20) + 4 * max_model_len * per_token
