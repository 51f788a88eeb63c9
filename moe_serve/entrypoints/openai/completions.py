"""POST /v1/completions: a prompt (a text, token ids, or a batch of either) run with the request's
sampling parameters; whole responses or SSE chunks, with OpenAI's legacy logprobs and echo."""
from __future__ import annotations

import time
from typing import AsyncIterator

import msgspec

from moe_serve.entrypoints.openai import protocol as P
from moe_serve.entrypoints.openai.outputs import (_continuous, _error_of, _sse, _sse_error, _usage, prompt_logprobs_field,
                                                  routed_experts_field)
from moe_serve.entrypoints.openai.request_limits import BadRequest, sampling_params
from moe_serve.entrypoints.openai.runner import RequestRunner
from moe_serve.entrypoints.openai.structured import with_structured_outputs
from moe_serve.sampling_params import SamplingParams


class CompletionServing:
    def __init__(self, runner: RequestRunner):
        self.runner, self.tok = runner, runner.tok

    def check_completion_prompt(self, req: P.CompletionRequest, n: int, max_tokens: int | None) -> None:
        """Cheap checks of the prompt's shape and size, before anything is tokenized. Token ids
        given in the request are checked here in full (the runner does not check them again)."""
        p, limits = req.prompt, self.runner.limits
        if p is None or p == "" or p == []:
            raise BadRequest("prompt must not be empty", "prompt")
        if isinstance(p, str):
            limits.check_chars(len(p), max_tokens)
            return
        batch = not all(isinstance(x, int) for x in p)
        if batch:
            most = self.runner.engine.max_waiting_requests
            if len(p) * n > most:
                raise BadRequest(f"{len(p)} prompts x n={n} is more than the {most} requests the server queues "
                                 "(--max-waiting-requests)", "n" if n > 1 else "prompt")
        for x in (p if batch else [p]):
            if isinstance(x, str):
                limits.check_chars(len(x), max_tokens)
            elif isinstance(x, list):
                limits.check_tokens(len(x), max_tokens)

    def completion_prompts(self, req: P.CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) of each prompt; text None for prompts given as token ids."""
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

    async def create(self, req: P.CompletionRequest, rid: str, deadline: float | None = None):
        """Returns a CompletionResponse, or an async iterator of SSE lines when streaming."""
        run = self.runner
        run.check_model(req.model)
        if req.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        params = self.completion_params(req)
        self.check_completion_prompt(req, params.n, params.max_tokens)
        params = await with_structured_outputs(run, req, params, deadline)
        prompts = await run._until(deadline, run.off_loop(self.completion_prompts, req))
        # Prompts given as token ids (text None) were checked on arrival.
        stream = run.submit(rid, [ids for _, ids in prompts], params, req.kv_transfer_params,
                            checked=prompts[0][0] is None)
        if req.stream:
            return self._stream_completions(req, rid, prompts, params, stream, deadline)
        k = len(prompts) * params.n
        texts, lps, fins = await run._collect(stream, k, deadline)
        run._check_ended(fins)
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
            choices.append(P.CompletionChoice(c, text, lp, *fin, prompt_logprobs_field(
                self.tok, ids, plps,
                req.prompt_logprobs if req.prompt_logprobs is not None else params.prompt_logprobs),
                routed_experts_field(req, stream, c)))
        return P.CompletionResponse(rid, int(time.time()), run.model_name, choices,
                                    _usage(stream, 0 if echo_only else None), weight_version=stream.weight_version)

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

    async def _stream_completions(self, req, rid, prompts, params, stream, deadline) -> AsyncIterator[bytes]:
        run, created, ended = self.runner, int(time.time()), None
        echo_only = req.max_tokens == 0
        # The echoed prompt goes first; with its logprobs (which come with a choice's first token)
        # or alone (max_tokens 0) it goes with the choice's first output.
        deferred = req.echo and (req.logprobs is not None or echo_only)

        def echo_chunk(c: int, entries=None, finish: str | None = None) -> bytes:
            ptext, ids = prompts[c // params.n]
            lp = self._completion_logprobs([], 0, req.logprobs, (ids, entries)) if req.logprobs is not None else None
            return _sse(P.CompletionResponse(rid, created, run.model_name, [P.CompletionChoice(
                c, ptext if ptext is not None else self.tok.decode(ids), lp, finish)],
                _usage(stream, 0 if echo_only else None) if _continuous(req) else None,
                weight_version=stream.weight_version))

        try:
            if req.echo and not deferred:
                for c in range(len(prompts) * params.n):
                    yield echo_chunk(c)
            echoed = [False] * (len(prompts) * params.n)
            async for c, out in run._timed(stream, deadline):
                error = _error_of(out)
                ended = ended or error
                if deferred and not echoed[c] and error is None:
                    echoed[c] = True
                    yield echo_chunk(c, out.prompt_logprobs, "length" if echo_only else None)
                if echo_only or not (out.new_text or out.finished or out.logprobs):
                    continue
                lp = self._completion_logprobs(out.logprobs or [], 0, req.logprobs) if req.logprobs is not None \
                    else None
                routed = routed_experts_field(req, stream, c) if out.finished else msgspec.UNSET
                yield _sse(P.CompletionResponse(rid, created, run.model_name, [P.CompletionChoice(
                    c, out.new_text, lp, out.finish_reason, out.stop_reason, routed_experts=routed)],
                    _usage(stream) if _continuous(req) else None, weight_version=stream.weight_version))
            if run.engine.dead or ended:
                yield run._ended_event(ended)
            elif req.stream_options and req.stream_options.include_usage:
                yield _sse(P.CompletionResponse(rid, created, run.model_name, [],
                                                _usage(stream, 0 if echo_only else None),
                                                weight_version=stream.weight_version))
        except BadRequest as e:  # the request timed out
            yield _sse_error(str(e), e.status, e.type, e.code)
        finally:
            await stream.aclose()
        yield b"data: [DONE]\n\n"
