"""What the OpenAI endpoints write, shared by completions and chat: usage, SSE events, the error
event a stream cut short ends with, and vLLM's `prompt_logprobs` field."""
from __future__ import annotations

from typing import NamedTuple

import msgspec

from moe_serve.entrypoints.openai import protocol as P


class StreamFailure(NamedTuple):
    """Why a stream ends early (its last event): _sse_error's arguments."""
    message: str
    status: int = 503
    type: str = "ServiceUnavailableError"
    code: str | int | None = None


def _continuous(req) -> bool:
    return bool(req.stream_options and req.stream_options.continuous_usage_stats)


def _error_of(out) -> str | None:
    """The reason a request was ended for it (server stopping, engine failure, refused by the
    core): an abort that carries a message."""
    if out.finished and out.finish_reason == "abort" and isinstance(out.stop_reason, str):
        return out.stop_reason
    return None


def _usage(stream, completion_tokens: int | None = None) -> P.UsageInfo:
    """completion_tokens: the count to report when it is not the tokens generated (0 for the
    prompt alone: echo with max_tokens 0 drops the one token it runs)."""
    done = stream.num_output_tokens if completion_tokens is None else completion_tokens
    return P.UsageInfo(stream.num_prompt_tokens, done, stream.num_prompt_tokens + done,
                       P.PromptTokensDetails(getattr(stream, "num_cached_tokens", 0)))


# U+0085, U+2028 and U+2029 as UTF-8: JSON lets them stand raw inside strings, but line readers built
# on str.splitlines (httpx's iter_lines, Python's io) end a line at each, cutting a data line's JSON
# in two; a token's text can hold any of them. Escaped, the JSON decodes to the same string, and only
# a string can hold them.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse_json(obj) -> bytes:
    """obj as the JSON of one server-sent event's data line: no byte a line reader could split on."""
    out = msgspec.json.encode(obj)
    for raw, escaped in _LINE_BREAKS:
        if raw in out:
            out = out.replace(raw, escaped)
    return out


def _sse(obj) -> bytes:
    return b"data: " + sse_json(obj) + b"\n\n"


def _sse_error(message: str, status: int = 503, type_: str = "ServiceUnavailableError",
               code: str | int | None = None) -> bytes:
    """A stream that cannot finish ends with an error event in OpenAI's error shape."""
    return _sse(P.ErrorResponse(P.ErrorInfo(message, type_, None, code if code is not None else status)))


def prompt_logprobs_field(tok, ids: list[int], entries: list | None, num_top: int | None):
    """vLLM's `prompt_logprobs` of one prompt (None when not asked for)."""
    if num_top is None or entries is None:
        return None
    out: list = [None]
    for e in entries:
        d = {t: P.PromptLogprob(v, i + 1, tok.decode([t], False)) for i, (t, v) in enumerate(e.top[:num_top])}
        d[e.token_id] = P.PromptLogprob(e.logprob, e.rank, tok.decode([e.token_id], False))
        out.append(d)
    return out


def routed_experts_field(req, stream, choice: int):
    """choices[i].routed_experts: every position the choice's rows cover (prompt + output - 1 once
    it has finished), in the request's format; absent (UNSET) when not asked for."""
    if not req.return_routed_experts:
        return msgspec.UNSET
    rows = stream.routed_experts[choice]
    if rows is None:
        return "" if req.routed_experts_format == "base64" else []
    return rows.encoded(rows.num_positions, req.routed_experts_format)
