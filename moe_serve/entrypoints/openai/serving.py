"""OpenAI completions and chat completions over the AsyncEngine: request -> prompts and sampling
parameters (with errors that name the field), then whole responses or SSE streams."""
from __future__ import annotations

import asyncio
import functools
import json
import queue
import re
import threading
import time
from typing import AsyncIterator, NamedTuple

import msgspec

from moe_serve.engine.async_engine import AsyncEngine, QueueFullError
from moe_serve.entrypoints.openai import protocol as P
from moe_serve.entrypoints.openai import request_limits as L
from moe_serve.entrypoints.openai.reasoning import REASONING_PARSERS, ReasoningParser
from moe_serve.entrypoints.openai.request_limits import BadRequest, PromptLimits
from moe_serve.entrypoints.openai.structured import check_tool_choice, constrains_output, with_structured_outputs
from moe_serve.entrypoints.openai.tool_parsers import PARSERS, ParsedOutput, StreamDelta, ToolParser
from moe_serve.entrypoints.openai.tool_parsers.constrained import ConstrainedToolParser
from moe_serve.sampling_params import SamplingParams

__all__ = ["BadRequest", "OpenAIServing", "sampling_params"]


def _field_of(msg: str) -> str | None:
    """The parameter a validation message names (the first word before '=' / ' must')."""
    for token in msg.replace("=", " ").split():
        token = token.split("[", 1)[0]
        if token.isidentifier() and token not in ("the", "a", "an", "max"):
            return token
    return None


def sampling_params(req: P._Common, max_tokens: int | None, logprobs: int | None,
                    max_tokens_field: str = "max_tokens", prompt_logprobs: int | None = None) -> SamplingParams:
    """prompt_logprobs: what the engine computes (default: the request's field)."""
    if req.prompt_logprobs is not None and req.stream:  # as vLLM: they would come only at the end
        raise BadRequest("prompt_logprobs is not available with stream=true", "prompt_logprobs")
    if req.n is None or req.n < 1:
        raise BadRequest(f"n must be >= 1, got {req.n}", "n")
    if req.n > L.MAX_N:
        raise BadRequest(f"n must be <= {L.MAX_N}, got {req.n}", "n")
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
    L.check_stop(req.stop)
    L.check_count("stop_token_ids", len(req.stop_token_ids or ()), L.MAX_STOP_TOKEN_IDS, "ids")
    L.check_count("logit_bias", len(req.logit_bias or ()), L.MAX_LOGIT_BIAS, "entries")
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
            prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs)
    except ValueError as e:
        raise BadRequest(str(e), _field_of(str(e))) from None


class _TokenizerPool:
    """Worker threads for tokenization and chat templates. Daemon threads: a tokenization still
    running when the server stops does not hold up the process's exit. A job whose caller has gone
    (cancelled) before it starts is skipped."""

    def __init__(self, threads: int, name: str = "tokenize"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(threads):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future, fn, args) -> None:
        self._jobs.put((loop, fut, fn, args))

    def _work(self) -> None:
        while True:
            loop, fut, fn, args = self._jobs.get()
            if fut.cancelled():
                continue
            try:
                result, error = fn(*args), None
            except BaseException as e:  # handed to the awaiting handler
                result, error = None, e
            try:
                loop.call_soon_threadsafe(_resolve, fut, result, error)
            except RuntimeError:  # the loop has closed: the server is gone
                return


def _resolve(fut: asyncio.Future, result, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, served_model_name: str, max_model_len: int,
                 limits: PromptLimits | None = None, request_timeout_s: float | None = None,
                 tokenizer_threads: int = 2, max_pending_tokenizations: int = 256,
                 enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, api_key: str | None = None):
        self.engine = engine
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME "
                             f"(one of {', '.join(sorted(PARSERS))})")
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(f"--tool-call-parser={tool_call_parser!r} is not one of {', '.join(sorted(PARSERS))}")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser={reasoning_parser!r} is not one of "
                             f"{', '.join(sorted(REASONING_PARSERS))}")
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.model_name = served_model_name
        self.max_model_len = max_model_len
        self.tok = engine.tokenizer
        # Without the cores' KV sizes (tests building the app by hand): no KV bound, no character bound.
        self.limits = limits or PromptLimits(max_model_len, None, 1, 1 << 62)
        self.request_timeout_s = request_timeout_s
        self.api_key = api_key  # a decode instance sends it to its prefill instances
        # Tokenization and chat templating run here, never on the event loop: one huge prompt must
        # not stall /health or other streams. The queue in front of the pool is bounded (503).
        self._pool = _TokenizerPool(tokenizer_threads)
        self._pending = 0
        self._max_pending = max_pending_tokenizations

    def deadline(self) -> float | None:
        """The event-loop time by which a request arriving now must be done (--request-timeout)."""
        if self.request_timeout_s is None:
            return None
        return asyncio.get_running_loop().time() + self.request_timeout_s

    async def off_loop(self, fn, *args):
        """Run a tokenizer/template call in the bounded pool."""
        if self._pending >= self._max_pending:
            raise BadRequest(f"more than {self._max_pending} requests are waiting to be tokenized", None, 503,
                             "server_overloaded", "ServiceUnavailableError")
        self._pending += 1
        try:
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            self._pool.submit(loop, fut, fn, args)
            return await fut
        finally:
            self._pending -= 1

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise BadRequest(f"The model `{model}` does not exist.", "model", 404, "model_not_found",
                             "NotFoundError")

    # --- completions ----------------------------------------------------------------------------
    def check_completion_prompt(self, req: P.CompletionRequest, n: int, max_tokens: int | None) -> None:
        """Cheap checks of the prompt's shape and size, before anything is tokenized."""
        p = req.prompt
        if p is None or p == "" or p == []:
            raise BadRequest("prompt must not be empty", "prompt")
        if isinstance(p, str):
            self.limits.check_chars(len(p), max_tokens)
            return
        batch = not all(isinstance(x, int) for x in p)
        if batch:
            most = self.engine.max_waiting_requests
            if len(p) * n > most:
                raise BadRequest(f"{len(p)} prompts x n={n} is more than the {most} requests the server queues "
                                 "(--max-waiting-requests)", "n" if n > 1 else "prompt")
        for x in (p if batch else [p]):
            if isinstance(x, str):
                self.limits.check_chars(len(x), max_tokens)
            elif isinstance(x, list):
                self.limits.check_tokens(len(x), max_tokens)

    def completion_prompts(self, req: P.CompletionRequest) -> list[tuple[str | None, list[int]]]:
        p = req.prompt
        if isinstance(p, str):
            return [(p, self.tok.encode(p))]
        if all(isinstance(x, int) for x in p):
            return [(None, list(p))]
        if all(isinstance(x, str) for x in p):
            return [(s, self.tok.encode(s)) for s in p]
        if all(isinstance(x, list) for x in p):
            return [(None, list(x)) for x in p]
        raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a list of lists", "prompt")

    def completion_params(self, req: P.CompletionRequest) -> SamplingParams:
        """The sampling parameters of a completions request. `max_tokens: 0` with echo (OpenAI's
        legacy scoring: the prompt alone, with its logprobs) runs one step whose token is dropped;
        without echo it is refused, as in vLLM. echo with logprobs computes the prompt's logprobs
        (prompt_logprobs: the larger of the two counts)."""
        echo_only = req.max_tokens == 0
        if echo_only and not req.echo:
            raise BadRequest("max_tokens must be >= 1, got 0 (0 is taken only with echo=true: the prompt alone)",
                             "max_tokens")
        if echo_only and req.min_tokens:
            raise BadRequest(f"min_tokens={req.min_tokens} must not exceed max_tokens=0", "min_tokens")
        plp = req.prompt_logprobs
        if req.echo and isinstance(req.logprobs, int) and 0 <= req.logprobs <= 20:
            plp = max(req.logprobs, plp if isinstance(plp, int) else -1)
        return sampling_params(req, 1 if echo_only else (16 if req.max_tokens is None else req.max_tokens),
                               req.logprobs, prompt_logprobs=plp)

    async def completions(self, req: P.CompletionRequest, rid: str, deadline: float | None = None):
        """Returns a CompletionResponse, or an async iterator of SSE lines when streaming."""
        self.check_model(req.model)
        if req.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        params = self.completion_params(req)
        self.check_completion_prompt(req, params.n, params.max_tokens)
        params = await with_structured_outputs(self, req, params, deadline)
        prompts = await self._until(deadline, self.off_loop(self.completion_prompts, req))
        stream = self._submit(rid, [ids for _, ids in prompts], params, req.kv_transfer_params)
        if req.stream:
            return self._stream_completions(req, rid, prompts, params, stream, deadline)
        k = len(prompts) * params.n
        texts, lps, fins = await self._collect(stream, k, deadline)
        self._check_ended(fins)
        echo_only = req.max_tokens == 0
        choices = []
        for c in range(k):
            ptext, ids = prompts[c // params.n]
            prefix = (ptext if ptext is not None else self.tok.decode(ids)) if req.echo else ""
            plps = stream.prompt_logprobs[c]
            text, fin = (prefix, ("length", None)) if echo_only else (prefix + texts[c], fins[c])
            lp = None
            if req.logprobs is not None:
                lp = self._completion_logprobs([] if echo_only else lps[c], len(prefix), req.logprobs,
                                               (ids, plps) if req.echo else None)
            choices.append(P.CompletionChoice(c, text, lp, *fin, self._prompt_logprobs_field(
                ids, plps, req.prompt_logprobs if req.prompt_logprobs is not None else params.prompt_logprobs)))
        return P.CompletionResponse(rid, int(time.time()), self.model_name, choices,
                                    _usage(stream, 0 if echo_only else None))

    def _completion_logprobs(self, lps, offset: int, num_top: int | None = None,
                             prompt: tuple[list[int], list | None] | None = None) -> P.CompletionLogprobs:
        """OpenAI's legacy logprobs of the generated tokens `lps` (their text starting at offset);
        with prompt (echo: the prompt's ids and logprob entries) the prompt's tokens first, from
        offset 0, the first with none (null), as OpenAI and vLLM answer. num_top: top entries kept."""
        tokens, tlp, top, offs = [], [], [], []

        def add(token_id: int, logprob: float | None, top_pairs, at: int) -> int:
            t = self.tok.decode([token_id], False)
            offs.append(at)
            tokens.append(t)
            tlp.append(logprob)
            if top_pairs is None:
                top.append(None)
                return at + len(t)
            d: dict[str, float] = {}
            for i, v in top_pairs[:num_top]:  # two tokens that read the same: the likelier keeps the key
                d.setdefault(self.tok.decode([i], False), v)
            top.append(d or None)
            return at + len(t)

        if prompt is not None:
            ids, entries = prompt
            at = add(ids[0], None, None, 0)
            for e in entries or []:
                at = add(e.token_id, e.logprob, e.top, at)
        for lp in lps:
            offset = add(lp.token_id, lp.logprob, lp.top, offset)
        return P.CompletionLogprobs(tokens, tlp, top, offs)

    def _prompt_logprobs_field(self, ids: list[int], entries: list | None, num_top: int | None):
        """vLLM's `prompt_logprobs` of one prompt (None when not asked for)."""
        if num_top is None or entries is None:
            return None
        out: list = [None]
        for e in entries:
            d = {t: P.PromptLogprob(v, i + 1, self.tok.decode([t], False)) for i, (t, v) in enumerate(e.top[:num_top])}
            d[e.token_id] = P.PromptLogprob(e.logprob, e.rank, self.tok.decode([e.token_id], False))
            out.append(d)
        return out

    async def _stream_completions(self, req, rid, prompts, params, stream, deadline) -> AsyncIterator[bytes]:
        created = int(time.time())
        ended = None
        echo_only = req.max_tokens == 0
        # The echoed prompt goes first; with its logprobs (which come with a choice's first token)
        # or alone (max_tokens 0) it goes with the choice's first output.
        deferred = req.echo and (req.logprobs is not None or echo_only)

        def echo_chunk(c: int, entries=None, finish: str | None = None) -> bytes:
            ptext, ids = prompts[c // params.n]
            lp = self._completion_logprobs([], 0, req.logprobs, (ids, entries)) if req.logprobs is not None else None
            return _sse(P.CompletionResponse(rid, created, self.model_name, [P.CompletionChoice(
                c, ptext if ptext is not None else self.tok.decode(ids), lp, finish)],
                _usage(stream, 0 if echo_only else None) if _continuous(req) else None))

        try:
            if req.echo and not deferred:
                for c in range(len(prompts) * params.n):
                    yield echo_chunk(c)
            echoed = [False] * (len(prompts) * params.n)
            async for c, out in self._timed(stream, deadline):
                error = _error_of(out)
                ended = ended or error
                if deferred and not echoed[c] and error is None:
                    echoed[c] = True
                    yield echo_chunk(c, out.prompt_logprobs, "length" if echo_only else None)
                if echo_only or not (out.new_text or out.finished or out.logprobs):
                    continue
                lp = self._completion_logprobs(out.logprobs or [], 0, req.logprobs) if req.logprobs is not None \
                    else None
                yield _sse(P.CompletionResponse(rid, created, self.model_name, [P.CompletionChoice(
                    c, out.new_text, lp, out.finish_reason, out.stop_reason)],
                    _usage(stream) if _continuous(req) else None))
            if self.engine.dead or ended:
                yield self._ended_event(ended)
            elif req.stream_options and req.stream_options.include_usage:
                yield _sse(P.CompletionResponse(rid, created, self.model_name, [],
                                                _usage(stream, 0 if echo_only else None)))
        except BadRequest as e:  # the request timed out
            yield _sse_error(str(e), e.status, e.type, e.code)
        finally:
            await stream.aclose()
        yield b"data: [DONE]\n\n"

    # --- chat -----------------------------------------------------------------------------------
    def check_chat(self, req: P.ChatCompletionRequest, max_tokens: int | None) -> None:
        """Cheap checks of the messages and tools, before any template is rendered."""
        if not req.messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        L.check_count("messages", len(req.messages), L.MAX_MESSAGES, "messages")
        chars = 0
        for m in req.messages:
            if isinstance(m.content, str):
                chars += len(m.content)
            elif isinstance(m.content, list):
                chars += sum(len(p["text"]) for p in m.content if isinstance(p, dict) and isinstance(p.get("text"), str))
        self.limits.check_chars(chars, max_tokens, "messages", L.CHAT_CHARS_SLACK)
        if req.tools is not None:
            L.check_count("tools", len(req.tools), L.MAX_TOOLS, "tools")
            for i, tool in enumerate(req.tools):
                size = len(msgspec.json.encode(tool))
                if size > L.MAX_TOOL_SCHEMA_BYTES:
                    raise BadRequest(f"tools[{i}] is {size} bytes as JSON; at most {L.MAX_TOOL_SCHEMA_BYTES} are "
                                     "allowed per tool", "tools", code="tool_too_large")
        check_tool_choice(req)  # "required" and named functions are enforced by structured outputs
        if req.tools and req.tool_choice in (None, "auto") and not self.enable_auto_tool_choice:
            # Without a parser a call the model writes would come back as plain text (vLLM refuses too).
            raise BadRequest("tool_choice='auto' (the default when tools are given) needs the server started with "
                             "--enable-auto-tool-choice --tool-call-parser NAME; send tool_choice='none' to show "
                             "the tools to the model and get a text answer", "tool_choice")

    def tool_parser_for(self, req: P.ChatCompletionRequest) -> ToolParser | None:
        """The parser that turns this request's output into tool calls, or None (plain text)."""
        if not req.tools or req.tool_choice == "none":
            return None
        if req.tool_choice == "required" or isinstance(req.tool_choice, dict):
            return ConstrainedToolParser(self.tok, req.tools, req.tool_choice)
        if req.tool_choice in (None, "auto") and self.enable_auto_tool_choice:
            return PARSERS[self.tool_call_parser](self.tok, req.tools)
        return None

    def reasoning_parser_for(self, req: P.ChatCompletionRequest) -> ReasoningParser | None:
        if self.reasoning_parser is None:
            return None
        if constrains_output(req):  # the grammar holds from the first token: the output has no reasoning
            return None
        return REASONING_PARSERS[self.reasoning_parser](self.tok, req.chat_template_kwargs)

    def chat_messages(self, messages: list[P.ChatMessage], field: str = "messages") -> list[dict]:
        """The request's messages as Hugging Face chat templates expect them, in the shape vLLM hands
        them over: content always a string (null, as agent frameworks send beside tool_calls, is "";
        a list of text parts is their texts joined by newlines), an assistant's tool_calls with their
        arguments as objects (templates write them with tojson), a tool message's tool_call_id.
        Templates written for plain chat concatenate content as a string and rely on this."""
        msgs = []
        for k, m in enumerate(messages):
            if m.role not in ("system", "user", "assistant", "tool", "developer"):
                raise BadRequest(f"unknown message role {m.role!r}", field)
            content = m.content
            if isinstance(content, list):  # content parts: keep the text ones
                texts = []
                for j, part in enumerate(content):
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise BadRequest(f"{field}[{k}].content[{j}]: only text content parts are supported, not "
                                         f"type {part.get('type')!r} (image inputs are not served)", field)
                    texts.append(part["text"])
                content = "\n".join(texts)
            msg = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_calls:
                if m.role != "assistant":
                    raise BadRequest(f"{field}[{k}]: only assistant messages have tool_calls", field)
                msg["tool_calls"] = [self._history_call(c, f"{field}[{k}].tool_calls[{j}]", field)
                                     for j, c in enumerate(m.tool_calls)]
            if m.tool_call_id is not None:
                if m.role != "tool":
                    raise BadRequest(f"{field}[{k}]: only tool messages have a tool_call_id", field)
                msg["tool_call_id"] = m.tool_call_id
            if m.reasoning_content is not None:
                msg["reasoning_content"] = m.reasoning_content
            msgs.append(msg)
        return msgs

    def _history_call(self, call: dict, where: str, field: str) -> dict:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             "\"arguments\": ...}}}", field)
        args = fn.get("arguments", "{}")
        if isinstance(args, str) and self._template_wants_objects:
            try:
                args = json.loads(args)
            except ValueError:
                raise BadRequest(f"{where}.function.arguments is not JSON: {args[:80]!r}", field) from None
        out = {"type": call.get("type", "function"), "function": {"name": fn["name"], "arguments": args}}
        if "id" in call:
            out["id"] = call["id"]
        return out

    @functools.cached_property
    def _template_wants_objects(self) -> bool:
        """Whether the chat template writes tool-call arguments with tojson (Qwen, Hermes, Mistral):
        then they are handed over as objects, as vLLM does; templates that paste them as text
        (DeepSeek-V3's) get the JSON text."""
        return bool(re.search(r"arguments\s*\|\s*tojson", self.tok.chat_template or ""))

    def render_chat(self, msgs: list[dict], add_generation_prompt: bool, template_kwargs: dict | None,
                    tools: list[dict] | None, field: str = "messages") -> str:
        kwargs = dict(template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        try:
            text = self.tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # template errors (e.g. raise_exception on a role order) are the client's
            raise BadRequest(f"the chat template rejected the messages: {e}", field) from None
        if not isinstance(text, str):
            raise BadRequest("the chat template did not produce text", field)
        return text

    def chat_prompt(self, req: P.ChatCompletionRequest, max_tokens: int | None) -> list[int]:
        text = self.render_chat(self.chat_messages(req.messages), req.add_generation_prompt,
                                req.chat_template_kwargs, req.tools)
        self.limits.check_chars(len(text), max_tokens, "messages")  # the rendered prompt, exactly bounded
        return self.tok.encode(text, add_special_tokens=False)

    async def chat(self, req: P.ChatCompletionRequest, rid: str, deadline: float | None = None, items: bool = False):
        """A ChatCompletionResponse, or when streaming the SSE lines (with items: the chunk objects
        of `chat_items`, for the endpoints that translate them)."""
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs requires logprobs=true", "top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise BadRequest(f"top_logprobs must be in [0, 20], got {req.top_logprobs}", "top_logprobs")
        if req.echo:
            raise BadRequest("echo is not supported on chat completions", "echo")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                 "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
        self.check_chat(req, max_tokens)
        params = await with_structured_outputs(self, req, params, deadline)
        ids = await self._until(deadline, self.off_loop(self.chat_prompt, req, max_tokens))
        if getattr(self.tool_parser_for(req), "needs_special_tokens", False):
            params = params.replace(skip_special_tokens=False)  # the call markers are special tokens
        stream = self._submit(rid, [ids], params, req.kv_transfer_params)
        if req.stream:
            if items:
                return self.chat_items(req, rid, params, stream, deadline)
            return self._stream_chat(req, rid, params, stream, deadline)
        n = params.n
        texts, lps, fins = await self._collect(stream, n, deadline)
        self._check_ended(fins)
        tools, reasoner = self.tool_parser_for(req), self.reasoning_parser_for(req)
        choices = []
        for i in range(n):
            message, finish = self._chat_message(texts[i], fins[i][0], tools, reasoner, req.parallel_tool_calls)
            choices.append(P.ChatChoice(i, message, self._chat_logprobs(lps[i]) if req.logprobs else None, finish,
                                        fins[i][1]))
        return P.ChatCompletionResponse(rid, int(time.time()), self.model_name, choices, _usage(stream),
                                        prompt_logprobs=self._prompt_logprobs_field(ids, stream.prompt_logprobs[0],
                                                                                    params.prompt_logprobs))

    async def count_chat_tokens(self, req: P.ChatCompletionRequest, deadline: float | None = None) -> int:
        """The prompt tokens the chat request's conversation (and tools) render to."""
        self.check_model(req.model)
        self.check_chat(req, None)
        ids = await self._until(deadline, self.off_loop(self.chat_prompt, req, None))
        return len(ids)

    @staticmethod
    def _chat_message(text: str, finish: str | None, tools: ToolParser | None, reasoner: ReasoningParser | None,
                      parallel: bool | None = None) -> tuple[P.ChatMessageOut, str | None]:
        """The assistant message of one whole output: reasoning split off first, then tool calls
        parsed from the rest; finish_reason becomes "tool_calls" when there are any."""
        reasoning = None
        if reasoner is not None:
            reasoning, text = reasoner.split(text)
        parsed = tools.parse(text) if tools is not None else ParsedOutput(text if text or not reasoning else None)
        if parallel is False:
            parsed.tool_calls = parsed.tool_calls[:1]
        if parsed.tool_calls:
            finish = _calls_finish(tools, finish)
        return P.ChatMessageOut("assistant", parsed.content, reasoning or None, parsed.tool_calls), finish

    def _chat_logprobs(self, lps) -> P.ChatLogprobs:
        def entry(tid: int, v: float) -> P.TopLogprob:
            t = self.tok.decode([tid], False)
            return P.TopLogprob(t, v, list(t.encode("utf-8")))

        content = []
        for lp in lps:
            e = entry(lp.token_id, lp.logprob)
            content.append(P.ChatTokenLogprob(e.token, e.logprob, e.bytes, [entry(i, v) for i, v in lp.top]))
        return P.ChatLogprobs(content)

    async def _stream_chat(self, req, rid, params, stream, deadline) -> AsyncIterator[bytes]:
        async for item in self.chat_items(req, rid, params, stream, deadline):
            yield _sse(item) if isinstance(item, P.ChatCompletionChunk) else _sse_error(*item)
        yield b"data: [DONE]\n\n"

    async def chat_items(self, req, rid, params, stream, deadline) -> AsyncIterator:
        """A streamed chat's chunks (P.ChatCompletionChunk), ending, for a stream cut short, with a
        StreamFailure: what the chat stream sends, before it is written as SSE (the Responses and
        Messages endpoints translate the same items into their own events)."""
        created = int(time.time())
        ended = None
        tools, reasoner = self.tool_parser_for(req), self.reasoning_parser_for(req)
        # One parser state per choice: text that may start a call marker or `</think>` waits in it.
        tool_streams = [tools.stream() if tools is not None else None for _ in range(params.n)]
        think_streams = [reasoner.stream() if reasoner is not None else None for _ in range(params.n)]
        called = [False] * params.n
        # A choice's role goes out with its first output, never before: clients (benchmarks
        # included) time the first chunk as the first token, so it must carry one (as vLLM's).
        # When the parsers hold that token's text back, the chunk has the role and empty content.
        greeted = [False] * params.n
        try:
            async for i, out in self._timed(stream, deadline):
                ended = ended or _error_of(out)
                first = not greeted[i]
                greeted[i] = True
                if not (first or out.new_text or out.finished or out.logprobs):
                    continue
                delta = _stream_delta(out.new_text, out.finished, think_streams[i], tool_streams[i])
                if delta.tool_calls and req.parallel_tool_calls is False:
                    delta.tool_calls = [c for c in delta.tool_calls if c.index == 0] or None
                called[i] = called[i] or bool(delta.tool_calls)
                if first:
                    delta.role = "assistant"
                    if delta.content is None and not delta.tool_calls:
                        delta.content = ""
                elif not (delta.content or delta.reasoning_content or delta.tool_calls or out.finished
                          or out.logprobs):
                    continue
                lp = self._chat_logprobs(out.logprobs or []) if req.logprobs else None
                finish = _calls_finish(tools, out.finish_reason) if out.finished and called[i] else out.finish_reason
                yield P.ChatCompletionChunk(rid, created, self.model_name, [P.ChatStreamChoice(
                    i, delta, lp, finish, out.stop_reason if out.finished else None)],
                    _usage(stream) if _continuous(req) else None)
            if self.engine.dead or ended:
                yield self._ended_failure(ended)
            elif req.stream_options and req.stream_options.include_usage:
                yield P.ChatCompletionChunk(rid, created, self.model_name, [], _usage(stream))
        except BadRequest as e:  # the request timed out
            yield StreamFailure(str(e), e.status, e.type, e.code)
        finally:
            await stream.aclose()

    # --- tokenizer endpoints (vLLM's /tokenize and /detokenize) ---------------------------------
    async def tokenize(self, req: P.TokenizeRequest, rid: str, deadline: float | None = None) -> P.TokenizeResponse:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise BadRequest("give either prompt (a string) or messages", "prompt" if req.messages is None
                             else "messages")
        if req.messages is not None:
            if not req.messages:
                raise BadRequest("messages must be a non-empty list", "messages")
            L.check_count("messages", len(req.messages), L.MAX_MESSAGES, "messages")
            L.check_count("tools", len(req.tools or ()), L.MAX_TOOLS, "tools")
        ids, strs = await self._until(deadline, self.off_loop(self._tokenize, req))
        return P.TokenizeResponse(len(ids), self.max_model_len, ids, strs)

    def _tokenize(self, req: P.TokenizeRequest) -> tuple[list[int], list[str] | None]:
        if req.prompt is not None:
            ids = self.tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        else:
            text = self.render_chat(self.chat_messages(req.messages), req.add_generation_prompt,
                                    req.chat_template_kwargs, req.tools)
            ids = self.tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
        return ids, [self.tok.id_to_token(i) or "" for i in ids] if req.return_token_strs else None

    async def detokenize(self, req: P.DetokenizeRequest, rid: str,
                         deadline: float | None = None) -> P.DetokenizeResponse:
        self.check_model(req.model)
        vocab = self.tok.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"tokens {bad[:8]}{' ...' if len(bad) > 8 else ''} are outside the vocabulary "
                             f"[0, {vocab})", "tokens")
        text = await self._until(deadline, self.off_loop(self.tok.decode, req.tokens, False))
        return P.DetokenizeResponse(text)

    # --- shared -----------------------------------------------------------------------------------
    def _timeout(self) -> BadRequest:
        return BadRequest(f"the request took longer than --request-timeout={self.request_timeout_s:g}s and was "
                          "aborted", None, 408, "request_timeout", "TimeoutError")

    async def _until(self, deadline: float | None, aw):
        """Await aw, or raise the request-timeout error once the deadline has passed."""
        if deadline is None:
            return await aw
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(aw, max(remaining, 0.0))
        except asyncio.TimeoutError:
            raise self._timeout() from None

    async def _timed(self, stream, deadline: float | None):
        """The stream's items until the deadline (then the request-timeout error)."""
        it = stream.__aiter__()
        while True:
            try:
                item = await self._until(deadline, it.__anext__())
            except StopAsyncIteration:
                return
            yield item

    async def _collect(self, stream, k: int, deadline: float | None) -> tuple[list[str], list[list], list[tuple]]:
        """Whole texts, log-probs and (finish_reason, stop_reason) of the k choices of a stream;
        closing the stream (also on timeout or cancellation) aborts whatever still runs."""
        texts, lps, fins = [""] * k, [[] for _ in range(k)], [(None, None)] * k
        try:
            async for c, out in self._timed(stream, deadline):
                texts[c] += out.new_text
                if out.logprobs:
                    lps[c].extend(out.logprobs)
                if out.finished:
                    fins[c] = (out.finish_reason, out.stop_reason)
        finally:
            await stream.aclose()
        return texts, lps, fins

    def _ended_event(self, reason: str | None) -> bytes:
        return _sse_error(*self._ended_failure(reason))

    def _ended_failure(self, reason: str | None) -> "StreamFailure":
        """The last event of a stream cut short: the engine died or the server is stopping (503),
        or the core refused the request (400)."""
        if self.engine.dead:
            return StreamFailure(f"the engine has stopped: {self.engine.dead}")
        if self.engine.stopping:
            return StreamFailure(reason or self.engine.stopping)
        return StreamFailure(reason or "the request was aborted", 400, "invalid_request_error")

    def _check_ended(self, fins) -> None:
        """A request cut short (the engine died, the server is stopping, the core refused it) is an
        error, not a short answer."""
        if self.engine.dead:
            raise BadRequest(f"the engine has stopped: {self.engine.dead}", None, 503, "engine_dead",
                             "ServiceUnavailableError")
        reason = next((r for f, r in fins if f == "abort" and isinstance(r, str)), None)
        if reason is None:
            return
        if self.engine.stopping:
            raise BadRequest(reason, None, 503, "server_shutting_down", "ServiceUnavailableError")
        raise BadRequest(reason, "prompt" if "prompt" in reason else _field_of(reason))

    def _prefill_route(self, kv_transfer_params: dict | None) -> tuple[str, dict] | None:
        """kv_transfer_params -> (prefill instance URL, headers), checked."""
        if kv_transfer_params is None:
            return None
        if self.engine.disaggregation_mode != "decode":
            raise BadRequest("kv_transfer_params: this instance was started with --disaggregation-mode "
                             f"{self.engine.disaggregation_mode}; only a decode instance takes a prefill_url",
                             "kv_transfer_params")
        extra = sorted(set(kv_transfer_params) - {"prefill_url"})
        if extra:
            raise BadRequest(f"kv_transfer_params: unknown key(s) {', '.join(extra)} (only prefill_url is taken)",
                             "kv_transfer_params")
        url = kv_transfer_params.get("prefill_url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise BadRequest(f"kv_transfer_params.prefill_url must be an http:// or https:// URL, got {url!r}",
                             "kv_transfer_params")
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return url.rstrip("/"), headers

    async def prefill(self, req, rid: str, deadline: float | None = None):
        """POST /v1/disagg/prefill (a prefill instance): compute a decode instance's prompt and
        write its KV into the blocks it reserved; answer once the write is done."""
        from moe_serve.disagg.messages import PrefillResponse
        from moe_serve.protocol import KVParams

        if self.engine.disaggregation_mode != "prefill":
            raise BadRequest(f"this instance was started with --disaggregation-mode {self.engine.disaggregation_mode}"
                             ": only a prefill instance computes prompts for others", None)
        ids, t = req.prompt_token_ids, req.target
        if len(ids) != t.end + 1 or not 0 <= t.start < t.end:
            raise BadRequest(f"prompt_token_ids has {len(ids)} tokens; the target asks for positions {t.start} .. "
                             f"{t.end - 1}", "prompt_token_ids")
        if not req.timeout_s > 0:
            raise BadRequest(f"timeout_s must be > 0, got {req.timeout_s}", "timeout_s")
        stream = self._submit(rid, [ids], SamplingParams(max_tokens=1, temperature=0.0),
                              kv=KVParams("prefill", t))

        async def drain():
            last = None
            async for _, out in stream:
                last = out
            return last

        late = False
        try:
            last = await asyncio.wait_for(drain(), min(req.timeout_s, (deadline - asyncio.get_running_loop().time())
                                                       if deadline is not None else req.timeout_s))
        except asyncio.TimeoutError:
            # Whatever answer this sends, the decode side reuses its blocks on it: so the request is
            # aborted but its stream kept, and the answer waits for the core's last word on it, which
            # comes only once no write of it is in flight (a posted write cannot be recalled).
            late = True
            self.engine.cancel(stream.child_ids)
            last = await drain()
        finally:
            await stream.aclose()
        if late and (last is None or last.finish_reason == "abort"):
            raise BadRequest(f"the prompt's KV was not written within {req.timeout_s:g}s (no write of it is in "
                             f"flight: {last.stop_reason if last else 'no output'})", None, 504,
                             "kv_transfer_timeout", "timeout_error")
        if last is None or last.finish_reason == "abort":
            raise BadRequest(f"the prompt's KV was not written: {last.stop_reason if last else 'no output'}", None,
                             502, "kv_transfer_failed", "ServiceUnavailableError")
        return PrefillResponse(req.request_id, len(ids), stream.num_cached_tokens, t.end - t.start)

    def _submit(self, rid: str, prompts: list[list[int]], params: SamplingParams,
                kv_transfer_params: dict | None = None, kv=None):
        for ids in prompts:  # the KV cache and max_model_len, with a message that says which
            self.limits.check_tokens(len(ids), params.max_tokens)
        prefill = self._prefill_route(kv_transfer_params)
        if prefill is not None and params.prompt_logprobs is not None:
            raise BadRequest("prompt_logprobs (also asked by echo with logprobs) cannot be served with "
                             "kv_transfer_params: the prompt is computed on a prefill instance, which returns "
                             "no logprobs", "prompt_logprobs")
        try:
            return self.engine.submit(rid, prompts, params, prefill, kv)
        except QueueFullError as e:
            raise BadRequest(str(e), None, 503, "server_overloaded", "ServiceUnavailableError") from None
        except RuntimeError as e:  # the engine has stopped
            raise BadRequest(str(e), None, 503, "engine_dead", "ServiceUnavailableError") from None
        except ValueError as e:
            msg = str(e)
            param = "max_tokens" if "max_tokens" in msg else ("prompt" if "prompt" in msg else _field_of(msg))
            raise BadRequest(msg, param) from None


class StreamFailure(NamedTuple):
    """Why a stream ends early (its last event): _sse_error's arguments."""
    message: str
    status: int = 503
    type: str = "ServiceUnavailableError"
    code: str | int | None = None


def _calls_finish(tools: ToolParser, finish: str | None) -> str | None:
    """finish_reason of an output with tool calls: "tool_calls"; a constrained tool_choice decides
    its own (vLLM's: "stop" for a named function; an output cut short stays "length")."""
    if isinstance(tools, ConstrainedToolParser):
        return tools.calls_finish_reason(finish)
    return "tool_calls"


def _continuous(req) -> bool:
    return bool(req.stream_options and req.stream_options.continuous_usage_stats)


def _stream_delta(text: str, final: bool, think, tools) -> P.Delta:
    """One engine output of a streamed choice as a chat delta: reasoning split off first, then
    tool calls parsed out of the content."""
    reasoning = ""
    if think is not None:
        reasoning, text = think.feed(text, final)
    if tools is None:
        return P.Delta(content=text or None, reasoning_content=reasoning or None)
    d: StreamDelta = tools.feed(text, final)
    return P.Delta(content=d.content or None, reasoning_content=reasoning or None, tool_calls=d.tool_calls or None)


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


def _sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def _sse_error(message: str, status: int = 503, type_: str = "ServiceUnavailableError",
               code: str | int | None = None) -> bytes:
    """A stream that cannot finish ends with an error event in OpenAI's error shape."""
    return _sse(P.ErrorResponse(P.ErrorInfo(message, type_, None, code if code is not None else status)))
