"""OpenAI completions and chat completions over the AsyncEngine: request -> prompts and sampling
parameters (with errors that name the field), then whole responses or SSE streams."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

import msgspec

from moe_serve.engine.async_engine import AsyncEngine, QueueFullError
from moe_serve.entrypoints.openai import protocol as P
from moe_serve.sampling_params import SamplingParams


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.code, self.type = param, status, code, type_


def _field_of(msg: str) -> str | None:
    """The parameter a validation message names (the first word before '=' / ' must')."""
    for token in msg.replace("=", " ").split():
        token = token.split("[", 1)[0]
        if token.isidentifier() and token not in ("the", "a", "an", "max"):
            return token
    return None


def sampling_params(req: P._Common, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    if req.n is None or req.n < 1:
        raise BadRequest(f"n must be >= 1, got {req.n}", "n")
    if req.n > 16:
        raise BadRequest(f"n must be <= 16, got {req.n}", "n")
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
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
            prompt_logprobs=req.prompt_logprobs)
    except ValueError as e:
        raise BadRequest(str(e), _field_of(str(e))) from None


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, served_model_name: str, max_model_len: int, tokenizer_threads: int = 2,
                 max_pending_tokenizations: int = 256):
        self.engine = engine
        self.model_name = served_model_name
        self.max_model_len = max_model_len
        self.tok = engine.tokenizer
        # Tokenization and chat templating run here, never on the event loop: one huge prompt must
        # not stall /health or other streams. The queue in front of the pool is bounded (503).
        self._pool = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="tokenize")
        self._pending = 0
        self._max_pending = max_pending_tokenizations

    async def off_loop(self, fn, *args):
        """Run a tokenizer/template call in the bounded pool."""
        if self._pending >= self._max_pending:
            raise BadRequest(f"more than {self._max_pending} requests are waiting to be tokenized", None, 503,
                             "server_overloaded", "ServiceUnavailableError")
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self._pending -= 1

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise BadRequest(f"The model `{model}` does not exist.", "model", 404, "model_not_found",
                             "NotFoundError")

    # --- completions ----------------------------------------------------------------------------
    def completion_prompts(self, req: P.CompletionRequest) -> list[tuple[str | None, list[int]]]:
        p = req.prompt
        if p is None or p == "" or p == []:
            raise BadRequest("prompt must not be empty", "prompt")
        if isinstance(p, str):
            return [(p, self.tok.encode(p))]
        if all(isinstance(x, int) for x in p):
            return [(None, list(p))]
        if all(isinstance(x, str) for x in p):
            return [(s, self.tok.encode(s)) for s in p]
        if all(isinstance(x, list) for x in p):
            return [(None, list(x)) for x in p]
        raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a list of lists", "prompt")

    async def completions(self, req: P.CompletionRequest, rid: str):
        """Returns a CompletionResponse, or an async iterator of SSE lines when streaming."""
        self.check_model(req.model)
        if req.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        params = sampling_params(req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs)
        prompts = await self.off_loop(self.completion_prompts, req)
        stream = self._submit(rid, [ids for _, ids in prompts], params)
        if req.stream:
            return self._stream_completions(req, rid, prompts, params, stream)
        k = len(prompts) * params.n
        texts, lps, fins = await _collect(stream, k)
        self._check_alive()
        choices = []
        for c in range(k):
            ptext, ids = prompts[c // params.n]
            prefix = (ptext if ptext is not None else self.tok.decode(ids)) if req.echo else ""
            lp = self._completion_logprobs(lps[c], len(prefix)) if req.logprobs is not None else None
            choices.append(P.CompletionChoice(c, prefix + texts[c], lp, fins[c][0], fins[c][1]))
        return P.CompletionResponse(rid, int(time.time()), self.model_name, choices, _usage(stream))

    def _completion_logprobs(self, lps, offset: int) -> P.CompletionLogprobs:
        tokens, tlp, top, offs = [], [], [], []
        for lp in lps:
            t = self.tok.decode([lp.token_id], False)
            offs.append(offset)
            offset += len(t)
            tokens.append(t)
            tlp.append(lp.logprob)
            top.append({self.tok.decode([i], False): v for i, v in lp.top} or None)
        return P.CompletionLogprobs(tokens, tlp, top, offs)

    async def _stream_completions(self, req, rid, prompts, params, stream) -> AsyncIterator[bytes]:
        created = int(time.time())
        try:
            if req.echo:
                for c in range(len(prompts) * params.n):
                    ptext, ids = prompts[c // params.n]
                    yield _sse(P.CompletionResponse(rid, created, self.model_name, [P.CompletionChoice(
                        c, ptext if ptext is not None else self.tok.decode(ids))]))
            async for c, out in stream:
                if not (out.new_text or out.finished or out.logprobs):
                    continue
                lp = self._completion_logprobs(out.logprobs or [], 0) if req.logprobs is not None else None
                yield _sse(P.CompletionResponse(rid, created, self.model_name, [P.CompletionChoice(
                    c, out.new_text, lp, out.finish_reason, out.stop_reason)]))
            if self.engine.dead:
                yield _sse_error(f"the engine has stopped: {self.engine.dead}")
            elif req.stream_options and req.stream_options.include_usage:
                yield _sse(P.CompletionResponse(rid, created, self.model_name, [], _usage(stream)))
            yield b"data: [DONE]\n\n"
        finally:
            await stream.aclose()

    # --- chat -----------------------------------------------------------------------------------
    def chat_prompt(self, req: P.ChatCompletionRequest) -> list[int]:
        if not req.messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        msgs = []
        for m in req.messages:
            if m.role not in ("system", "user", "assistant", "tool", "developer"):
                raise BadRequest(f"unknown message role {m.role!r}", "messages")
            content = m.content
            if isinstance(content, list):  # content parts: keep the text ones
                texts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise BadRequest("only text content parts are supported", "messages")
                    texts.append(part["text"])
                content = "".join(texts)
            msgs.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
        try:
            text = self.tok.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt,
                                                **(req.chat_template_kwargs or {}))
        except Exception as e:  # template errors (e.g. raise_exception on a role order) are the client's
            raise BadRequest(f"the chat template rejected the messages: {e}", "messages") from None
        return self.tok.encode(text, add_special_tokens=False)

    async def chat(self, req: P.ChatCompletionRequest, rid: str):
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs requires logprobs=true", "top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise BadRequest(f"top_logprobs must be in [0, 20], got {req.top_logprobs}", "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        ids = await self.off_loop(self.chat_prompt, req)
        stream = self._submit(rid, [ids], params)
        if req.stream:
            return self._stream_chat(req, rid, params, stream)
        n = params.n
        texts, lps, fins = await _collect(stream, n)
        self._check_alive()
        choices = [P.ChatChoice(i, P.ChatMessageOut("assistant", texts[i]),
                                self._chat_logprobs(lps[i]) if req.logprobs else None, fins[i][0], fins[i][1])
                   for i in range(n)]
        return P.ChatCompletionResponse(rid, int(time.time()), self.model_name, choices, _usage(stream))

    def _chat_logprobs(self, lps) -> P.ChatLogprobs:
        def entry(tid: int, v: float) -> P.TopLogprob:
            t = self.tok.decode([tid], False)
            return P.TopLogprob(t, v, list(t.encode("utf-8")))

        content = []
        for lp in lps:
            e = entry(lp.token_id, lp.logprob)
            content.append(P.ChatTokenLogprob(e.token, e.logprob, e.bytes, [entry(i, v) for i, v in lp.top]))
        return P.ChatLogprobs(content)

    async def _stream_chat(self, req, rid, params, stream) -> AsyncIterator[bytes]:
        created = int(time.time())
        try:
            for i in range(params.n):
                yield _sse(P.ChatCompletionChunk(rid, created, self.model_name,
                                                 [P.ChatStreamChoice(i, P.Delta(role="assistant", content=""))]))
            async for i, out in stream:
                if not (out.new_text or out.finished or out.logprobs):
                    continue
                lp = self._chat_logprobs(out.logprobs or []) if req.logprobs else None
                yield _sse(P.ChatCompletionChunk(rid, created, self.model_name, [P.ChatStreamChoice(
                    i, P.Delta(content=out.new_text), lp, out.finish_reason)]))
            if self.engine.dead:
                yield _sse_error(f"the engine has stopped: {self.engine.dead}")
            elif req.stream_options and req.stream_options.include_usage:
                yield _sse(P.ChatCompletionChunk(rid, created, self.model_name, [], _usage(stream)))
            yield b"data: [DONE]\n\n"
        finally:
            await stream.aclose()

    def _check_alive(self) -> None:
        """A request cut short because the engine died is an error, not a short answer."""
        if self.engine.dead:
            raise BadRequest(f"the engine has stopped: {self.engine.dead}", None, 503, "engine_dead",
                             "ServiceUnavailableError")

    def _submit(self, rid: str, prompts: list[list[int]], params: SamplingParams):
        try:
            return self.engine.submit(rid, prompts, params)
        except QueueFullError as e:
            raise BadRequest(str(e), None, 503, "server_overloaded", "ServiceUnavailableError") from None
        except RuntimeError as e:  # the engine has stopped
            raise BadRequest(str(e), None, 503, "engine_dead", "ServiceUnavailableError") from None
        except ValueError as e:
            msg = str(e)
            param = "max_tokens" if "max_tokens" in msg else ("prompt" if "prompt" in msg else _field_of(msg))
            raise BadRequest(msg, param) from None


async def _collect(stream, k: int) -> tuple[list[str], list[list], list[tuple]]:
    """Whole texts, log-probs and (finish_reason, stop_reason) of the k choices of a stream."""
    texts, lps, fins = [""] * k, [[] for _ in range(k)], [(None, None)] * k
    try:
        async for c, out in stream:
            texts[c] += out.new_text
            if out.logprobs:
                lps[c].extend(out.logprobs)
            if out.finished:
                fins[c] = (out.finish_reason, out.stop_reason)
    finally:
        await stream.aclose()
    return texts, lps, fins


def _usage(stream) -> P.UsageInfo:
    return P.UsageInfo(stream.num_prompt_tokens, stream.num_output_tokens,
                       stream.num_prompt_tokens + stream.num_output_tokens)


def _sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def _sse_error(message: str, status: int = 503) -> bytes:
    """A stream that cannot finish ends with an error event in OpenAI's error shape."""
    return _sse(P.ErrorResponse(P.ErrorInfo(message, "ServiceUnavailableError", None, status)))
