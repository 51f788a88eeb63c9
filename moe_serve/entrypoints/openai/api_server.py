"""The OpenAI-compatible HTTP server: FastAPI routes, msgspec bodies, SSE streaming, API key,
Prometheus metrics, graceful shutdown on SIGTERM (bounded: whatever is in flight ends within
--shutdown-grace plus a few seconds). Every error is OpenAI's `{"error": {...}}`; HTTP-level
protections (body size and read deadlines, connection cap) are in http_guard.py."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_serve import __version__
from moe_serve.engine.async_engine import AsyncEngine
from moe_serve.entrypoints.openai import anthropic as A
from moe_serve.entrypoints.openai import protocol as P
from moe_serve.entrypoints.openai import responses as R
from moe_serve.entrypoints.openai.http_guard import ClientGone, GuardedH11Protocol, Refusal, error_json, read_body
from moe_serve.entrypoints.openai.request_limits import PromptLimits
from moe_serve.entrypoints.openai.serving import BadRequest, OpenAIServing

log = logging.getLogger("moe_serve.api_server")


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | int | None = None, close: bool = False) -> Response:
    headers = {"connection": "close"} if close else None
    return Response(error_json(status, message, type_, param, code), status_code=status,
                    media_type="application/json", headers=headers)


def anthropic_error_response(status: int, message: str, type_: str = "invalid_request_error",
                             param: str | None = None, code: str | int | None = None, close: bool = False) -> Response:
    """An error of the Messages endpoints, in Anthropic's shape (the type follows the status)."""
    headers = {"connection": "close"} if close else None
    return Response(A.error_body(status, message), status_code=status, media_type="application/json",
                    headers=headers)


def _anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def _msgspec_param(msg: str) -> str | None:
    # msgspec says e.g. "Expected `float`, got `str` - at `$.temperature`"
    if "at `$." in msg:
        return msg.split("at `$.", 1)[1].split("`", 1)[0].split("[", 1)[0].split(".", 1)[0]
    return None


@dataclass(frozen=True)
class HTTPLimits:
    """The HTTP server's protections (the flags of `add_serve_args`)."""

    max_body_bytes: int = 1 << 20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int | None = 2048
    request_timeout_s: float | None = None


_BODIES = {"/v1/completions": P.CompletionRequest, "/v1/chat/completions": P.ChatCompletionRequest,
           "/v1/responses": R.ResponsesRequest, "/v1/messages": A.MessagesRequest,
           "/tokenize": P.TokenizeRequest, "/detokenize": P.DetokenizeRequest}


def unknown_fields(body: bytes, typ) -> list[str]:
    """The top-level fields of a (valid) JSON body that the request struct does not declare: they
    are ignored, and logged (vLLM's policy)."""
    try:
        keys = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, RecursionError):
        return []
    return sorted(set(keys) - set(typ.__struct_fields__))


def _openapi_bodies(app: FastAPI) -> None:
    """The routes read their bodies themselves (msgspec, not pydantic), so FastAPI cannot see
    them: put the request structs' JSON schemas into /openapi.json by hand."""
    _, components = msgspec.json.schema_components(list(_BODIES.values()),
                                                         ref_template="#/components/schemas/{name}")
    base = app.openapi

    def openapi():
        if app.openapi_schema is None:
            schema = base()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
            for path, typ in _BODIES.items():
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{typ.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def build_app(engine: AsyncEngine, served_model_name: str, max_model_len: int, api_key: str | None = None,
              extra_routes=None, limits: PromptLimits | None = None, http: HTTPLimits = HTTPLimits(),
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None) -> FastAPI:
    """The server's app: its guards (API key, errors in OpenAI's shape), then each group of routes
    in turn (the order of /openapi.json), then extra_routes (each a function that adds routes)."""
    serving = OpenAIServing(engine, served_model_name, max_model_len, limits, http.request_timeout_s,
                            enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                            reasoning_parser=reasoning_parser, api_key=api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        log.info("shutting down: no new requests; finishing or aborting the ones in flight")

    app = FastAPI(title="moe-serve", version=__version__, lifespan=lifespan)
    # Set once the shutdown has waited --shutdown-grace: bodies still arriving are refused (503).
    app.state.stopping = asyncio.Event()
    _add_guards(app, api_key)
    _add_server_routes(app, engine, served_model_name, max_model_len)
    _add_elastic_routes(app, engine)
    handle = _request_handler(app, serving, engine, http)
    _add_openai_routes(app, serving, handle)
    for route in extra_routes or []:
        route(app)
    _openapi_bodies(app)
    return app


def _add_guards(app: FastAPI, api_key: str | None) -> None:
    """The API key on /v1 and the tokenizer routes; every error in OpenAI's shape (Anthropic's on
    the Messages endpoints), never a traceback."""

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if api_key and (request.url.path.startswith("/v1") or request.url.path in ("/tokenize", "/detokenize")):
            # OpenAI's clients send the key as a bearer token, Anthropic's as x-api-key.
            if (request.headers.get("authorization", "") != f"Bearer {api_key}"
                    and request.headers.get("x-api-key") != api_key):
                errors = anthropic_error_response if _anthropic_path(request.url.path) else error_response
                return errors(401, "Invalid or missing API key (expected 'Authorization: Bearer <key>' or "
                                   "'x-api-key: <key>')", "authentication_error", None, "invalid_api_key")
        try:
            return await call_next(request)
        except Exception as e:  # never a traceback to the client
            log.exception("unhandled error on %s", request.url.path)
            return error_response(500, f"internal error: {type(e).__name__}", "internal_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            errors = anthropic_error_response if _anthropic_path(request.url.path) else error_response
            return errors(404, f"no route {request.method} {request.url.path}", "NotFoundError")
        if exc.status_code == 405:
            return error_response(405, f"method {request.method} not allowed on {request.url.path}")
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        loc = [str(x) for x in (errs[0].get("loc") or ()) if x not in ("body", "query", "path")] if errs else []
        return error_response(400, f"invalid request: {errs[0].get('msg') if errs else exc}",
                              param=loc[0] if loc else None)


def _add_server_routes(app: FastAPI, engine: AsyncEngine, served_model_name: str, max_model_len: int) -> None:
    """/health, /version, /v1/models, /metrics and /ranks."""
    created = int(time.time())

    @app.get("/health")
    async def health():
        if engine.dead:
            return error_response(503, f"engine stopped: {engine.dead}", "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return JSONResponse({"version": __version__})

    @app.get("/v1/models")
    async def models():
        card = P.ModelCard(served_model_name, created, root=served_model_name, max_model_len=max_model_len,
                           weight_version=engine.weight_version)
        return Response(msgspec.json.encode(P.ModelList([card])), media_type="application/json")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(served_model_name, engine.stats(), engine.rank_stats),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/ranks")
    async def ranks():
        return JSONResponse(engine.ranks_view())


def _add_elastic_routes(app: FastAPI, engine: AsyncEngine) -> None:
    @app.post("/scale_elastic_ep")
    async def scale_elastic_ep(request: Request):
        """vLLM's shape: {"new_data_parallel_size": N}. Down: the highest rank ids leave at a step
        boundary, their requests resubmitted; answered once the job serves at N."""
        if not engine.elastic:
            return error_response(400, "scale_elastic_ep needs a job started with --enable-elastic-ep",
                                  param="new_data_parallel_size")
        try:
            body = msgspec.json.decode(await request.body())
            n = body["new_data_parallel_size"]
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError
        except Exception:
            return error_response(400, "the body must be {\"new_data_parallel_size\": N} with N an integer >= 1",
                                  param="new_data_parallel_size")
        extra = sorted(set(body) - {"new_data_parallel_size", "drain_timeout"})
        if extra:
            return error_response(400, f"unknown field {extra[0]!r}", param=extra[0])
        now = len(engine.live)
        if n > now:
            return error_response(400, f"new_data_parallel_size={n} is more than the {now} ranks serving: a rank joins "
                                  "by starting it with --enable-elastic-ep --elastic-join NODE0:PORT (it takes a free "
                                  "rank id, up to the job's starting size)", param="new_data_parallel_size")
        if n < now:
            timeout = body.get("drain_timeout", 120)
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
                return error_response(400, "drain_timeout must be a positive number of seconds", param="drain_timeout")
            await engine.call("scale", n)
            deadline = time.monotonic() + timeout
            while len(engine.live) != n:
                if time.monotonic() > deadline:
                    return error_response(503, f"the ranks did not regroup to {n} within {timeout}s",
                                          "ServiceUnavailableError")
                await asyncio.sleep(0.05)
        return JSONResponse({"new_data_parallel_size": len(engine.live), **engine.ranks_view()})


def _request_handler(app: FastAPI, serving: OpenAIServing, engine: AsyncEngine, http: HTTPLimits):
    """handle(request, body type, handler, request-id prefix[, error writer]): read, decode and run
    one request; the error writer writes its errors (OpenAI's shape, or Anthropic's on the
    Messages endpoints)."""

    async def handle(request: Request, typ, fn, prefix: str, error_response=error_response):
        deadline = serving.deadline()
        try:
            body = await read_body(request.receive, request.headers, http.max_body_bytes, http.body_timeout_s,
                                   app.state.stopping)
        except Refusal as e:
            # The rest of the body is drained (up to --http-header-timeout) so the client reads the answer.
            return error_response(e.status, str(e), e.type, None, e.code)
        except ClientGone:
            return Response(status_code=499)
        try:
            req = msgspec.json.decode(body, type=typ)
        except msgspec.ValidationError as e:
            return error_response(400, f"invalid request: {e}", param=_msgspec_param(str(e)))
        except msgspec.DecodeError as e:
            return error_response(400, f"malformed JSON body: {e}", code="invalid_json")
        except RecursionError:  # free-form fields (dicts) nested thousands deep
            return error_response(400, "the JSON body is nested too deeply", code="invalid_json")
        rid = f"{prefix}-{engine.new_request_id('r')}"
        extra = unknown_fields(body, typ)
        if extra:
            log.warning("request %s: ignored unknown field(s) %s", rid, ", ".join(extra))

        async def run():
            try:
                result = await fn(req, rid, deadline)
            except BadRequest as e:
                return error_response(e.status, str(e), e.type, e.param, e.code)
            if getattr(req, "stream", False):
                return StreamingResponse(result, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return Response(msgspec.json.encode(result), media_type="application/json")

        return await _until_disconnect(request, run())

    return handle


async def _until_disconnect(request: Request, coro):
    """Run a non-streaming handler; if the client goes away first, cancel it (which aborts).
    (Only once the body is read: a disconnect check reads from the same channel as the body.)"""
    task = asyncio.ensure_future(coro)
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return Response(status_code=499)
        return task.result()
    except asyncio.CancelledError:
        task.cancel()
        raise


def _add_openai_routes(app: FastAPI, serving: OpenAIServing, handle) -> None:
    """The request endpoints: completions, chat, the agents' (Responses, Anthropic Messages), the
    disaggregated prefill and the tokenizer's, each read and run by handle."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, P.CompletionRequest, serving.completions, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, P.ChatCompletionRequest, serving.chat, "chatcmpl")

    _add_agent_routes(app, serving, handle)

    # Disaggregation: a decode instance's front end asks this (prefill) instance for a prompt's KV.
    @app.post("/v1/disagg/prefill")
    async def disagg_prefill(request: Request):
        from moe_serve.disagg.messages import PrefillRequest

        return await handle(request, PrefillRequest, serving.prefill, "prefill")

    # vLLM's tokenizer endpoints (outside /v1 as in vLLM; the API key is required here too).
    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await handle(request, P.TokenizeRequest, serving.tokenize, "tok")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await handle(request, P.DetokenizeRequest, serving.detokenize, "detok")


def _add_agent_routes(app: FastAPI, serving: OpenAIServing, handle) -> None:
    """The agents' endpoints: translations onto the chat path (responses.py, anthropic.py)."""
    responses, messages = R.ResponsesServing(serving), A.MessagesServing(serving)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        return await handle(request, R.ResponsesRequest, responses.create, "resp")

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        try:
            return Response(msgspec.json.encode(responses.get(response_id)), media_type="application/json")
        except BadRequest as e:
            return error_response(e.status, str(e), e.type, e.param, e.code)

    @app.post("/v1/messages")
    async def create_message(request: Request):
        return await handle(request, A.MessagesRequest, messages.create, "msg", anthropic_error_response)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return await handle(request, A.MessagesRequest, messages.count_tokens, "count", anthropic_error_response)


def serve(app: FastAPI, engine: AsyncEngine, host: str, port: int, grace_s: float,
          http: HTTPLimits = HTTPLimits()) -> int:
    """Run uvicorn until SIGINT/SIGTERM; then stop accepting, let requests finish for up to
    grace_s, end the rest (streams get a final error event), tell the cores to exit and return 0."""
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        # uvicorn re-raises the signal after a graceful shutdown, so the process would die by
        # SIGTERM; we handle it ourselves and exit 0 once everything is closed.
        @contextlib.contextmanager
        def capture_signals(self):
            prev = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in prev.items():
                    signal.signal(s, h)

        async def shutdown(self, sockets=None):
            """uvicorn's graceful shutdown waits for every connection to close, however slow its
            client; ours waits grace_s for the requests in flight, then ends them."""
            for server in self.servers:
                server.close()
            for sock in sockets or []:
                sock.close()
            state = self.server_state
            for conn in list(state.connections):
                try:
                    conn.shutdown()  # idle connections close now; busy ones after their response
                except Exception:  # a connection in an odd protocol state: just close it
                    conn.transport.close()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace_s
            while state.tasks and loop.time() < deadline and not self.force_exit:
                await asyncio.sleep(0.05)
            if state.tasks:
                n = engine.end_all("the server is shutting down")
                log.info("shutdown: %d request(s) still running after %.0fs were ended (%d HTTP task(s))", n,
                         grace_s, len(state.tasks))
                app.state.stopping.set()
                end = loop.time() + 2.0  # streams write their error event and [DONE]
                while state.tasks and loop.time() < end:
                    await asyncio.sleep(0.05)
                for t in list(state.tasks):
                    t.cancel()
                if state.tasks:
                    await asyncio.wait(list(state.tasks), timeout=2.0)
            for conn in list(state.connections):
                conn.transport.close()
            await self.lifespan.shutdown()

    protocol = GuardedH11Protocol.configure(http.header_timeout_s, http.max_connections)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace_s,
                            access_log=False, lifespan="on", http=protocol)
    server = Server(config)
    # An engine that died cannot serve: stop the server and exit non-zero (under torchrun this
    # stops the whole job).
    # Requests in flight have already been ended with the reason; /health says 503 for a moment
    # so that clients and load balancers see why, then the process exits.
    engine.on_fatal = lambda: threading.Timer(1.0, lambda: setattr(server, "should_exit", True)).start()
    log.info("serving %s on http://%s:%d/v1", engine.model_name, host, port)
    server.run()
    engine.shutdown(grace_s=0.0)  # aborts what is left and waits for every core to exit
    if engine.dead:
        log.error("server stopped: the engine failed (%s)", engine.dead)
        return 1
    log.info("server stopped")
    return 0
