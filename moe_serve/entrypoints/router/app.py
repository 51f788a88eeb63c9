"""The router's app (routes, guards, worker health checks) and `moe-serve router`, which serves it."""

import argparse
import asyncio
import contextlib
import logging
import time

from moe_serve.entrypoints.router.policy import CHUNK, POLICIES, WorkerPool

log = logging.getLogger("moe_serve.router")

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")  # forwarded


def build_router_app(pool: WorkerPool, api_key: str | None = None, max_body_bytes: int = 64 << 20,
                     body_timeout_s: float = 60.0, request_timeout_s: float | None = None,
                     prefill_pool: WorkerPool | None = None):
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from moe_serve.entrypoints.openai.api_server import error_response
    from moe_serve.entrypoints.router.proxy import Proxy, errors_for

    state = {"interval": 5.0}  # seconds between health checks (run_router sets the flag's)
    pools = [pool] + ([prefill_pool] if prefill_pool is not None else [])
    everyone = [w for p in pools for w in p.workers]
    proxy = Proxy(state, pool, prefill_pool, max_body_bytes, body_timeout_s, request_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=5.0),
                                   limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        state["client"] = client
        state["health"] = [asyncio.create_task(p.check_health(client, state["interval"])) for p in pools]
        yield
        for t in state["health"]:
            t.cancel()
        await client.aclose()

    app = FastAPI(title="moe-serve router", lifespan=lifespan)
    app.state.router_state = state

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1") and (
                request.headers.get("authorization", "") != f"Bearer {api_key}"
                and request.headers.get("x-api-key") != api_key):
            return errors_for(request.url.path)(401, "Invalid or missing API key (expected 'Authorization: Bearer "
                                                     "<key>' or 'x-api-key: <key>')", "authentication_error", None,
                                                "invalid_api_key")
        try:
            return await call_next(request)
        except Exception as e:  # never a traceback to the client
            log.exception("unhandled error on %s", request.url.path)
            return error_response(500, f"internal error: {type(e).__name__}", "internal_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return errors_for(request.url.path)(404, f"no route {request.method} {request.url.path}", "NotFoundError")
        return error_response(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health():
        if any(w.healthy for w in pool.workers):
            return Response(status_code=200)
        return error_response(503, "no worker is up: " + ", ".join(w.url for w in pool.workers),
                              "ServiceUnavailableError")

    @app.get("/workers")
    async def workers():
        return JSONResponse([{"url": w.url, "role": w.role, "healthy": w.healthy, "in_flight": w.in_flight,
                              "requests": w.requests, "failures": w.failures} for w in everyone])

    @app.get("/metrics")
    async def metrics():
        return Response(_metrics_text(pool, everyone), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        return await proxy.models(request)

    async def forward(request: Request):
        return await proxy.forward(request)

    for route in ROUTES:
        app.add_api_route(route, forward, methods=["POST"])

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        return await proxy.stored_response(response_id, request)

    return app


def _metrics_text(pool: WorkerPool, everyone: list) -> str:
    """/metrics in Prometheus' text format: per worker (every pool's), and the policy's count."""
    lines = []
    for name, h, attr in (("moe_serve_router:requests_total", "Requests sent to each worker.", "requests"),
                          ("moe_serve_router:worker_failures_total", "Requests a worker failed (connection "
                           "refused, or it broke off mid-response).", "failures")):
        lines += [f"# HELP {name} {h}", f"# TYPE {name} counter"]
        lines += [f'{name}{{worker="{w.url}",role="{w.role}"}} {getattr(w, attr)}' for w in everyone]
    for name, h, fn in (("moe_serve_router:requests_in_flight", "Requests in flight at each worker.",
                         lambda w: w.in_flight),
                        ("moe_serve_router:worker_up", "1 while the worker answers its health check.",
                         lambda w: int(w.healthy))):
        lines += [f"# HELP {name} {h}", f"# TYPE {name} gauge"]
        lines += [f'{name}{{worker="{w.url}",role="{w.role}"}} {fn(w)}' for w in everyone]
    name = "moe_serve_router:requests_routed_by_prefix_total"
    lines += [f"# HELP {name} Requests sent to a worker for the prefix it has seen rather than the least busy.",
              f"# TYPE {name} counter", f"{name} {pool.routed_by_prefix}"]
    return "\n".join(lines) + "\n"


def add_router_parser(sub) -> None:
    p = sub.add_parser("router", help="one OpenAI-compatible endpoint in front of several moe-serve instances")
    p.add_argument("--worker", nargs="+", default=None, metavar="URL", help="the instances' base URLs")
    p.add_argument("--prefill", nargs="+", default=None, metavar="URL",
                   help="disaggregated serving: the prefill instances (--disaggregation-mode prefill); with --decode")
    p.add_argument("--decode", nargs="+", default=None, metavar="URL",
                   help="disaggregated serving: the decode instances (--disaggregation-mode decode); with --prefill")
    p.add_argument("--policy", default="cache_aware", choices=POLICIES,
                   help="cache_aware (where the request's prefix was sent before, within --load-margin of the "
                        "least busy), least_load (fewest requests in flight) or round_robin")
    p.add_argument("--load-margin", type=int, default=8,
                   help="requests in flight a worker may carry beyond the least busy one and still take a "
                        "request for its prefix")
    p.add_argument("--cache-threshold", type=float, default=0.5,
                   help="cache_aware follows a worker's prefix only when it covers at least this share of the request")
    p.add_argument("--cache-entries", type=int, default=1 << 18,
                   help=f"per worker, the {CHUNK}-character prefix chunks remembered (least recent dropped)")
    p.add_argument("--health-check-interval", type=float, default=5.0, help="seconds between worker health checks")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes "
                                                   "(forwarded to the workers)")
    p.add_argument("--max-request-body-bytes", type=int, default=64 << 20)
    p.add_argument("--http-header-timeout", type=float, default=10.0)
    p.add_argument("--http-body-timeout", type=float, default=60.0)
    p.add_argument("--max-connections", type=int, default=2048, help="0: no cap")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a worker may go without sending anything before the request is ended")
    p.set_defaults(fn=run_router)


def run_router(ns: argparse.Namespace) -> int:
    import uvicorn

    from moe_serve.entrypoints.openai.http_guard import GuardedH11Protocol

    for flag in ("health_check_interval", "http_header_timeout", "http_body_timeout"):
        if not getattr(ns, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')}={getattr(ns, flag)} must be > 0")
    if ns.request_timeout is not None and not ns.request_timeout > 0:
        raise ValueError(f"--request-timeout={ns.request_timeout} must be > 0")
    if ns.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes={ns.max_request_body_bytes} must be >= 1")
    if ns.max_connections < 0:
        raise ValueError(f"--max-connections={ns.max_connections} must be >= 0")
    if ns.worker and (ns.prefill or ns.decode):
        raise ValueError("--worker serves colocated instances; --prefill/--decode disaggregated ones: not both")
    if not ns.worker and not (ns.prefill and ns.decode):
        raise ValueError("give --worker URL..., or --prefill URL... and --decode URL...")
    prefill_pool = None
    if ns.worker:
        pool = WorkerPool(ns.worker, ns.policy, ns.load_margin, ns.cache_entries, ns.cache_threshold)
    else:
        pool = WorkerPool(ns.decode, ns.policy, ns.load_margin, ns.cache_entries, ns.cache_threshold, "decode")
        prefill_pool = WorkerPool(ns.prefill, ns.policy, ns.load_margin, ns.cache_entries, ns.cache_threshold,
                                  "prefill")
    app = build_router_app(pool, ns.api_key, ns.max_request_body_bytes, ns.http_body_timeout, ns.request_timeout,
                           prefill_pool)
    app.state.router_state["interval"] = ns.health_check_interval
    protocol = GuardedH11Protocol.configure(ns.http_header_timeout, ns.max_connections or None)
    log.info("router on http://%s:%d/v1 over %d worker(s) (%s): %s", ns.host, ns.port, len(pool.workers), ns.policy,
             ", ".join(w.url for w in pool.workers))
    if prefill_pool is not None:
        log.info("disaggregated: prefill on %s, decode on %s", ", ".join(w.url for w in prefill_pool.workers),
                 ", ".join(w.url for w in pool.workers))
    t0 = time.monotonic()
    uvicorn.run(app, host=ns.host, port=ns.port, log_level="warning", access_log=False, http=protocol)
    log.info("router stopped after %.0fs", time.monotonic() - t0)
    return 0
