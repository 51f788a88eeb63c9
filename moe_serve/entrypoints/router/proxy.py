"""Forwarding: a request read under the server's limits and sent whole to the worker the policy
picks (a worker that refuses the connection is replaced by another), its answer relayed as it
streams (a worker that breaks off mid-stream ends the stream with an error event naming it), and,
disaggregated, the prefill instance named in the body as kv_transfer_params.prefill_url (the
decode instance hands the prompt over to it; moe_serve/disagg)."""

import json
import logging
import re

import httpx
from fastapi.responses import Response, StreamingResponse

from moe_serve.entrypoints.openai.api_server import anthropic_error_response, error_response
from moe_serve.entrypoints.openai.http_guard import ClientGone, Refusal, read_body
from moe_serve.entrypoints.router.policy import Worker, WorkerPool

log = logging.getLogger("moe_serve.router")

_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]+)"')
_FORWARD_HEADERS = ("authorization", "x-api-key", "anthropic-version", "content-type", "accept")


def errors_for(path: str):
    """The error writer of a path: Anthropic's shape on the Messages endpoints, OpenAI's elsewhere."""
    return anthropic_error_response if path.startswith("/v1/messages") else error_response


def forward_headers(request) -> dict:
    return {k: v for k, v in request.headers.items() if k in _FORWARD_HEADERS}


class _Answer(Exception):
    """The router answers the request itself (an error) instead of relaying a worker's answer."""

    def __init__(self, response: Response):
        super().__init__()
        self.response = response


class Proxy:
    def __init__(self, state: dict, pool: WorkerPool, prefill_pool: WorkerPool | None, max_body_bytes: int,
                 body_timeout_s: float, request_timeout_s: float | None):
        self.state = state  # "client": the app's httpx client, set while it runs
        self.pool, self.prefill_pool = pool, prefill_pool
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s
        self.request_timeout_s = request_timeout_s

    async def forward(self, request) -> Response:
        """POST /v1/completions, /v1/chat/completions, /v1/responses and /v1/messages."""
        path = request.url.path
        errors = errors_for(path)
        try:
            body, parsed = await self._read(request, errors)
            hashes = self.pool.hashes(path, parsed)
            pre, body = self._with_prefill(parsed, body, hashes, errors)
            i, resp = await self._send(request, path, body, parsed, hashes, errors)
        except _Answer as a:
            return a.response
        w = self.pool.workers[i]
        w.requests += 1
        w.remember(hashes)
        if pre is not None:
            pre.requests += 1
            pre.in_flight += 1
            pre.remember(hashes)
        log.info("%s -> %s%s (%d)", path, f"{pre.url} + " if pre is not None else "", w.url, resp.status_code)
        media = resp.headers.get("content-type", "application/json")
        return StreamingResponse(self._relay(resp, path, i, pre, media), status_code=resp.status_code,
                                 media_type=media)

    async def _read(self, request, errors) -> tuple[bytes, dict]:
        """The body (within --max-request-body-bytes and --http-body-timeout) and its JSON object."""
        try:
            body = await read_body(request.receive, request.headers, self.max_body_bytes, self.body_timeout_s)
        except Refusal as e:
            raise _Answer(errors(e.status, str(e), e.type, None, e.code)) from None
        except ClientGone:
            raise _Answer(Response(status_code=499)) from None
        try:
            parsed = json.loads(body)
        except (UnicodeDecodeError, ValueError) as e:
            raise _Answer(errors(400, f"the request body is not valid JSON: {e}")) from None
        if not isinstance(parsed, dict):
            raise _Answer(errors(400, "the request body must be a JSON object"))
        return body, parsed

    def _with_prefill(self, parsed: dict, body: bytes, hashes: list[bytes], errors) -> tuple[Worker | None, bytes]:
        """Disaggregated: the prefill instance the policy picks among those up, named in the body
        (None, and the body as it is, when not disaggregated or none is up)."""
        prefill_pool = self.prefill_pool
        if prefill_pool is None:
            return None, body
        if "kv_transfer_params" in parsed:
            raise _Answer(errors(400, "kv_transfer_params is set by this router (disaggregated mode): leave it out",
                                 None, "kv_transfer_params"))
        j = prefill_pool.pick(hashes, {k for k, p in enumerate(prefill_pool.workers) if not p.healthy})
        if j is None:
            log.warning("no prefill instance is up: the decode instance computes the prompt itself")
            return None, body
        pre = prefill_pool.workers[j]
        parsed["kv_transfer_params"] = {"prefill_url": pre.url}
        return pre, json.dumps(parsed).encode()

    async def _send(self, request, path: str, body: bytes, parsed: dict, hashes: list[bytes], errors):
        """(worker index, its streaming answer's head): the first worker the policy picks that
        takes the connection (a stored response's follow-up goes only where it is stored)."""
        pool, client, tried, reasons = self.pool, self.state["client"], set(), []
        prev = parsed.get("previous_response_id") if path == "/v1/responses" else None
        if isinstance(prev, str) and prev in pool.response_owner:  # only that worker holds it
            tried = set(range(len(pool.workers))) - {pool.response_owner[prev]}
        while True:
            i = pool.pick(hashes, tried)
            if i is None:
                raise _Answer(errors(503, f"no worker took the request ({'; '.join(reasons)})",
                                     "ServiceUnavailableError", None, "no_worker"))
            tried.add(i)
            w = pool.workers[i]
            up = client.build_request("POST", w.url + path, content=body, headers=forward_headers(request))
            w.in_flight += 1
            try:
                return i, await client.send(up, stream=True)
            except (httpx.ConnectTimeout, httpx.NetworkError, httpx.RemoteProtocolError) as e:
                # Refused, reset or closed before any answer (a dead worker, or a pooled connection
                # it had closed): another worker can take the request; one that is alive aborts it
                # when it sees the connection gone.
                w.in_flight -= 1
                w.failures += 1
                w.healthy = False
                reasons.append(f"{w.url}: {type(e).__name__}")
                log.warning("worker %s refused a request (%s): trying another", w.url, e)
            except httpx.TimeoutException:
                w.in_flight -= 1
                raise _Answer(errors(504, f"the worker {w.url} sent nothing within {self.request_timeout_s:g}s "
                                          "(--request-timeout)", "timeout_error", None, "request_timeout")) from None
            except httpx.HTTPError as e:
                w.in_flight -= 1
                w.failures += 1
                raise _Answer(errors(502, f"the worker {w.url} failed before answering: {type(e).__name__}",
                                     "ServiceUnavailableError", None, "worker_failed")) from None
            except BaseException:
                w.in_flight -= 1
                raise

    async def _relay(self, resp, path: str, i: int, pre: Worker | None, media: str):
        """The worker's answer as it comes (a Responses answer's id noted: its follow-ups go there);
        a break-off mid-stream ends an event stream with an error event."""
        w, head = self.pool.workers[i], bytearray() if path == "/v1/responses" else None
        try:
            async for chunk in resp.aiter_bytes():
                if head is not None:  # the response's id, from the first bytes
                    head += chunk
                    m = _RESPONSE_ID.search(head)
                    if m or len(head) > 8192:
                        if m:
                            self.pool.own_response(m.group(1).decode(), i)
                        head = None
                yield chunk
        except httpx.HTTPError as e:
            w.failures += 1
            log.warning("worker %s broke off a response: %s", w.url, e)
            if media.startswith("text/event-stream"):
                text = f"the worker {w.url} failed mid-response: {type(e).__name__}"
                if path.startswith("/v1/messages"):  # Anthropic's stream error event
                    msg = {"type": "error", "error": {"type": "api_error", "message": text}}
                    yield f"event: error\ndata: {json.dumps(msg)}\n\n".encode()
                else:
                    msg = {"error": {"message": text, "type": "ServiceUnavailableError", "param": None,
                                     "code": "worker_failed"}}
                    yield f"data: {json.dumps(msg)}\n\ndata: [DONE]\n\n".encode()
        finally:
            w.in_flight -= 1
            if pre is not None:
                pre.in_flight -= 1
            await resp.aclose()

    async def models(self, request) -> Response:
        """GET /v1/models: the first worker's answer (those up first)."""
        for w in sorted(self.pool.workers, key=lambda w: not w.healthy):
            try:
                r = await self.state["client"].get(w.url + "/v1/models", headers=forward_headers(request), timeout=10)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        return error_response(503, "no worker answered /v1/models", "ServiceUnavailableError")

    async def stored_response(self, response_id: str, request) -> Response:
        """GET /v1/responses/{id}: from the worker that stored it."""
        owner = self.pool.response_owner.get(response_id)
        if owner is None:
            return error_response(404, f"no response {response_id!r} was made through this router", "NotFoundError")
        w = self.pool.workers[owner]
        try:
            r = await self.state["client"].get(f"{w.url}/v1/responses/{response_id}", headers=forward_headers(request))
        except httpx.HTTPError as e:
            return error_response(503, f"the worker {w.url} that holds {response_id} is unreachable: "
                                       f"{type(e).__name__}", "ServiceUnavailableError")
        return Response(r.content, status_code=r.status_code, media_type="application/json")
