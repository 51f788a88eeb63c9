"""The OpenAI-compatible HTTP server: FastAPI routes, msgspec bodies, SSE streaming, API key,
Prometheus metrics, graceful shutdown on SIGTERM."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from moe_serve import __version__
from moe_serve.engine.async_engine import AsyncEngine
from moe_serve.entrypoints.openai import protocol as P
from moe_serve.entrypoints.openai.serving import BadRequest, OpenAIServing

log = logging.getLogger("moe_serve.api_server")


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | int | None = None) -> Response:
    body = P.ErrorResponse(P.ErrorInfo(message, type_, param, code if code is not None else status))
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def _msgspec_param(msg: str) -> str | None:
    # msgspec says e.g. "Expected `float`, got `str` - at `$.temperature`"
    if "at `$." in msg:
        return msg.split("at `$.", 1)[1].split("`", 1)[0].split("[", 1)[0].split(".", 1)[0]
    return None


def build_app(engine: AsyncEngine, served_model_name: str, max_model_len: int, api_key: str | None = None,
              extra_routes=None) -> FastAPI:
    serving = OpenAIServing(engine, served_model_name, max_model_len)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        log.info("shutting down: no new requests; finishing or aborting the ones in flight")

    app = FastAPI(title="moe-serve", version=__version__, lifespan=lifespan)

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error_response(401, "Invalid or missing API key (expected 'Authorization: Bearer <key>')",
                                      "authentication_error", None, "invalid_api_key")
        try:
            return await call_next(request)
        except Exception as e:  # never a traceback to the client
            log.exception("unhandled error on %s", request.url.path)
            return error_response(500, f"internal error: {type(e).__name__}", "internal_error")

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return error_response(404, f"no route {request.method} {request.url.path}", "NotFoundError")

    @app.exception_handler(405)
    async def bad_method(request: Request, exc):
        return error_response(405, f"method {request.method} not allowed on {request.url.path}")

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
        card = P.ModelCard(served_model_name, created, root=served_model_name, max_model_len=max_model_len)
        return Response(msgspec.json.encode(P.ModelList([card])), media_type="application/json")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(served_model_name, engine.stats()),
                                 media_type="text/plain; version=0.0.4")

    async def handle(request: Request, typ, fn, prefix: str):
        body = await request.body()
        try:
            req = msgspec.json.decode(body, type=typ)
        except msgspec.ValidationError as e:
            return error_response(400, f"invalid request: {e}", param=_msgspec_param(str(e)))
        except msgspec.DecodeError as e:
            return error_response(400, f"malformed JSON body: {e}")
        rid = f"{prefix}-{engine.new_request_id('r')}"
        try:
            result = await fn(req, rid)
        except BadRequest as e:
            return error_response(e.status, str(e), e.type, e.param, e.code)
        if req.stream:
            return StreamingResponse(result, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return Response(msgspec.json.encode(result), media_type="application/json")

    async def until_disconnect(request: Request, coro):
        """Run a non-streaming handler; if the client goes away first, cancel it (which aborts)."""
        task = asyncio.ensure_future(coro)
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return Response(status_code=499)
        return task.result()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await until_disconnect(request, handle(request, P.CompletionRequest, serving.completions, "cmpl"))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await until_disconnect(request, handle(request, P.ChatCompletionRequest, serving.chat, "chatcmpl"))

    for route in extra_routes or []:
        route(app)
    return app


def serve(app: FastAPI, engine: AsyncEngine, host: str, port: int, grace_s: float) -> int:
    """Run uvicorn until SIGINT/SIGTERM; then stop accepting, let requests finish for up to grace_s,
    abort the rest and return 0."""
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

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace_s,
                            access_log=False, lifespan="on")
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
