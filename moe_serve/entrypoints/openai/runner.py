"""The one path every OpenAI request runs on its way into the engine and back.

An endpoint (completions.py, chat.py, tokenize.py, prefill.py) checks its request's fields, turns
it into prompts and sampling parameters and hands them to this runner, which does the rest the
same way for each:

- tokenizer and chat-template work runs off the event loop, in a bounded pool (one huge prompt
  never stalls /health or other streams; beyond the bound, a 503);
- every await is bounded by the request's deadline (--request-timeout, a 408);
- `submit` validates the prompts once: their token counts against max_model_len and the smallest
  rank's KV cache (`PromptLimits`, with errors naming the field), then the engine's own check
  (token ids in the vocabulary, sampling parameters against it); the AsyncEngine is told they are
  checked and does not check again. (The engine core checks what it is sent as well: its limits are
  the truth, offline too.)
- outputs are collected, and a request cut short (the engine died, the server is stopping, the
  core refused it) becomes an error, not a short answer.

Checks that need no tokens (list sizes, a text's length in characters) run before anything is
spent, in each endpoint's check_* method; a prompt whose token ids came in the request is checked
there, in full, and not again here.
"""
from __future__ import annotations

import asyncio
import queue
import threading

from moe_serve.engine.async_engine import AsyncEngine, QueueFullError
from moe_serve.entrypoints.openai.outputs import StreamFailure, _sse_error
from moe_serve.entrypoints.openai.request_limits import BadRequest, PromptLimits, field_of
from moe_serve.routed_experts import refusal
from moe_serve.sampling_params import SamplingParams


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


class RequestRunner:
    def __init__(self, engine: AsyncEngine, served_model_name: str, max_model_len: int,
                 limits: PromptLimits | None = None, request_timeout_s: float | None = None,
                 tokenizer_threads: int = 2, max_pending_tokenizations: int = 256, api_key: str | None = None):
        self.engine = engine
        self.model_name = served_model_name
        self.max_model_len = max_model_len
        self.tok = engine.tokenizer
        # Without the cores' KV sizes (tests building the app by hand): no KV bound, no character bound.
        self.limits = limits or PromptLimits(max_model_len, None, 1, 1 << 62)
        self.request_timeout_s = request_timeout_s
        self.api_key = api_key  # a decode instance sends it to its prefill instances
        # The queue in front of the tokenizer pool is bounded (503).
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

    # --- deadlines --------------------------------------------------------------------------------
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

    # --- into the engine ----------------------------------------------------------------------------
    def submit(self, rid: str, prompts: list[list[int]], params: SamplingParams,
               kv_transfer_params: dict | None = None, kv=None, checked: bool = False):
        """Validate the prompts and queue them: the engine's stream of their outputs. checked: the
        prompts are token ids the request gave, already checked against the limits on arrival."""
        if not checked:
            for ids in prompts:  # the KV cache and max_model_len, with a message that says which
                self.limits.check_tokens(len(ids), params.max_tokens)
        prefill = self._prefill_route(kv_transfer_params)
        if prefill is not None and params.prompt_logprobs is not None:
            raise BadRequest("prompt_logprobs (also asked by echo with logprobs) cannot be served with "
                             "kv_transfer_params: the prompt is computed on a prefill instance, which returns "
                             "no logprobs", "prompt_logprobs")
        if params.return_routed_experts:
            ranks = getattr(self.engine, "rank_info", None) or {}  # (none: an engine stub in tests)
            why = refusal(not ranks or any(r.expert_slots for r in ranks.values()))
            if why is not None:
                raise BadRequest(why, "return_routed_experts")
        try:
            if self.engine.dead:
                raise RuntimeError(f"the engine has stopped: {self.engine.dead}")
            for ids in prompts:  # the engine's own check: token ids and sampling parameters
                self.engine.validate(ids, params)
            return self.engine.submit(rid, prompts, params, prefill, kv, validated=True)
        except QueueFullError as e:
            raise BadRequest(str(e), None, 503, "server_overloaded", "ServiceUnavailableError") from None
        except RuntimeError as e:  # the engine has stopped
            raise BadRequest(str(e), None, 503, "engine_dead", "ServiceUnavailableError") from None
        except ValueError as e:
            msg = str(e)
            param = "max_tokens" if "max_tokens" in msg else ("prompt" if "prompt" in msg else field_of(msg))
            raise BadRequest(msg, param) from None

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

    # --- out of the engine ----------------------------------------------------------------------------
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

    def _ended_failure(self, reason: str | None) -> StreamFailure:
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
        raise BadRequest(reason, "prompt" if "prompt" in reason else field_of(reason))
