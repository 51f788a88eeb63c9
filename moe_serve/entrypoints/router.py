"""`moe-serve router`: one OpenAI-compatible entry point in front of several moe-serve instances.

Each request (completions, chat completions, Responses, Anthropic Messages) goes whole to one
worker instance, chosen by `--policy`:

- `cache_aware` (default): the worker that already served the longest prefix of this request, so a
  conversation's turns land where its KV blocks are cached, when that prefix is at least
  `--cache-threshold` of the request and the worker has at most `--load-margin` requests in flight
  beyond the least busy one; otherwise the least busy (among equals, the one sent the least). The
  router sees JSON, not tokens: a request's key is its
  prompt-shaping fields (tools, system, then each message) serialized one after another, hashed
  in chained chunks of `CHUNK` characters as the engine hashes token blocks; each worker keeps the
  hashes of what it was sent, least recently used dropped beyond `--cache-entries` (the workers'
  own eviction is not visible here, so this is SGLang's approximate-tree idea, not an exact view);
- `least_load`: the worker with the fewest requests in flight;
- `round_robin`: each worker in turn.

Disaggregated (`--prefill URL... --decode URL...`): the decode instances are the workers above
(a request goes whole to one of them, chosen by the policy: its prefix cache saves KV moves); each
request also gets a prefill instance, chosen by the same policy among the prefill instances, named
in the body as `kv_transfer_params.prefill_url`. The decode instance reserves the prompt's blocks,
has that prefill instance compute the prompt and write its KV there (moe_serve/disagg), computes
the last prompt token itself and streams the output back through here. With no prefill instance
up, the decode instance computes the prompt itself.

Workers are health-checked every `--health-check-interval` seconds and skipped while down; a
request whose worker refuses the connection is sent to another, and the client only sees an error
(503, naming the workers tried) when none takes it. A worker that fails mid-stream ends the
client's stream with an error event naming it. A client that goes away closes the upstream
connection, and the worker aborts the request and frees its blocks. The server's hardening applies
here too: `--api-key`, body size and time limits, the header deadline and the connection cap.
"""

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import re
import time
from collections import OrderedDict

from moe_serve.engine.routing import cache_aware_choice

log = logging.getLogger("moe_serve.router")

POLICIES = ("cache_aware", "least_load", "round_robin")
CHUNK = 32  # characters per hashed chunk of a request's key
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]+)"')
_FORWARD_HEADERS = ("authorization", "x-api-key", "anthropic-version", "content-type", "accept")


def request_key(path: str, body: dict) -> str:
    """The request's prompt-shaping fields as one string whose prefix is stable across the turns of
    a conversation (each message serialized on its own, in order)."""
    def enc(x) -> str:
        return json.dumps(x, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    parts = []
    if path == "/v1/completions":
        prompt = body.get("prompt")
        parts.append(prompt if isinstance(prompt, str) else enc(prompt))
    else:
        for field in ("tools", "instructions", "system"):
            if body.get(field) is not None:
                parts.append(enc(body[field]))
        msgs = body.get("messages", body.get("input"))
        if isinstance(msgs, list):
            parts += [enc(m) for m in msgs]
        elif msgs is not None:
            parts.append(enc(msgs))
    return "\x1e".join(parts)


def chunk_hashes(text: str) -> list[bytes]:
    out, parent = [], b"moe-serve-router"
    data = text.encode("utf-8", "surrogatepass")
    for i in range(0, len(data) - len(data) % CHUNK, CHUNK):
        parent = hashlib.blake2b(parent + data[i:i + CHUNK], digest_size=16).digest()
        out.append(parent)
    return out


class Worker:
    def __init__(self, url: str, cache_entries: int, role: str = "worker"):
        self.url = url.rstrip("/")
        self.role = role  # worker | prefill | decode
        self.in_flight = 0
        self.healthy = True
        self.requests = 0
        self.failures = 0
        self.seen: OrderedDict[bytes, None] = OrderedDict()  # chunk hashes sent here, least recent first
        self.cache_entries = cache_entries

    def matched(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.seen:
                break
            n += 1
        return n

    def remember(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.seen[h] = None
            self.seen.move_to_end(h)
        while len(self.seen) > self.cache_entries:
            self.seen.popitem(last=False)


class WorkerPool:
    def __init__(self, urls: list[str], policy: str = "cache_aware", load_margin: int = 8,
                 cache_entries: int = 1 << 18, threshold: float = 0.5, role: str = "worker"):
        if not urls:
            raise ValueError(f"--{role}: give at least one URL")
        if policy not in POLICIES:
            raise ValueError(f"--policy={policy} is not one of {', '.join(POLICIES)}")
        if load_margin < 0:
            raise ValueError(f"--load-margin={load_margin} must be >= 0")
        if not 0 <= threshold <= 1:
            raise ValueError(f"--cache-threshold={threshold} must be within [0, 1]")
        if cache_entries < 1:
            raise ValueError(f"--cache-entries={cache_entries} must be >= 1")
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"--{role} {u!r} is not an http:// or https:// URL")
        self.workers = [Worker(u, cache_entries, role) for u in urls]
        self.policy, self.load_margin, self.threshold = policy, load_margin, threshold
        self._turn = itertools.count()
        self.routed_by_prefix = 0
        # Responses API: which worker stored each response (previous_response_id must go back there).
        self.response_owner: OrderedDict[str, int] = OrderedDict()

    def own_response(self, response_id: str, worker: int) -> None:
        self.response_owner[response_id] = worker
        while len(self.response_owner) > 1 << 16:
            self.response_owner.popitem(last=False)

    def pick(self, hashes: list[bytes], exclude: set[int]) -> int | None:
        """The worker index for a request (None: every worker was tried)."""
        cand = [i for i in range(len(self.workers)) if i not in exclude]
        if not cand:
            return None
        up = [i for i in cand if self.workers[i].healthy] or cand  # all down: try anyway
        if self.policy == "round_robin":
            return up[next(self._turn) % len(up)]
        loads = {i: self.workers[i].in_flight for i in up}
        sizes = {i: len(self.workers[i].seen) for i in up}
        if self.policy == "least_load":
            return min(up, key=lambda i: (loads[i], sizes[i], i))
        matched = {i: self.workers[i].matched(hashes) for i in up}
        i, by_prefix = cache_aware_choice(up, matched, len(hashes), loads, sizes, self.threshold, self.load_margin)
        self.routed_by_prefix += by_prefix
        return i

    async def check_health(self, client, interval_s: float) -> None:
        import httpx

        while True:
            for w in self.workers:
                try:
                    ok = (await client.get(w.url + "/health", timeout=min(interval_s, 5.0))).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok != w.healthy:
                    log.info("worker %s is %s", w.url, "up" if ok else "down")
                w.healthy = ok
            await asyncio.sleep(interval_s)


def build_router_app(pool: WorkerPool, api_key: str | None = None, max_body_bytes: int = 64 << 20,
                     body_timeout_s: float = 60.0, request_timeout_s: float | None = None,
                     prefill_pool: WorkerPool | None = None):
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from moe_serve.entrypoints.openai.api_server import anthropic_error_response, error_response
    from moe_serve.entrypoints.openai.http_guard import ClientGone, Refusal, read_body

    state = {}

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

    state["interval"] = 5.0
    pools = [pool] + ([prefill_pool] if prefill_pool is not None else [])
    everyone = [w for p in pools for w in p.workers]
    app = FastAPI(title="moe-serve router", lifespan=lifespan)
    app.state.router_state = state

    def errors_for(path: str):
        return anthropic_error_response if path.startswith("/v1/messages") else error_response

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
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        for w in sorted(pool.workers, key=lambda w: not w.healthy):
            try:
                r = await state["client"].get(w.url + "/v1/models", headers=_headers(request), timeout=10)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        return error_response(503, "no worker answered /v1/models", "ServiceUnavailableError")

    async def forward(request: Request):
        path = request.url.path
        errors = errors_for(path)
        try:
            body = await read_body(request.receive, request.headers, max_body_bytes, body_timeout_s)
        except Refusal as e:
            return errors(e.status, str(e), e.type, None, e.code)
        except ClientGone:
            return Response(status_code=499)
        try:
            parsed = json.loads(body)
        except (UnicodeDecodeError, ValueError) as e:
            return errors(400, f"the request body is not valid JSON: {e}")
        if not isinstance(parsed, dict):
            return errors(400, "the request body must be a JSON object")
        hashes = chunk_hashes(request_key(path, parsed)) if pool.policy == "cache_aware" else []
        pre = None
        if prefill_pool is not None:
            if "kv_transfer_params" in parsed:
                return errors(400, "kv_transfer_params is set by this router (disaggregated mode): leave it out",
                              None, "kv_transfer_params")
            j = prefill_pool.pick(hashes, {k for k, p in enumerate(prefill_pool.workers) if not p.healthy})
            if j is None:
                log.warning("no prefill instance is up: the decode instance computes the prompt itself")
            else:
                pre = prefill_pool.workers[j]
                parsed["kv_transfer_params"] = {"prefill_url": pre.url}
                body = json.dumps(parsed).encode()
        client, tried, reasons = state["client"], set(), []
        prev = parsed.get("previous_response_id") if path == "/v1/responses" else None
        if isinstance(prev, str) and prev in pool.response_owner:  # only that worker holds it
            tried = set(range(len(pool.workers))) - {pool.response_owner[prev]}
        while True:
            i = pool.pick(hashes, tried)
            if i is None:
                return errors(503, f"no worker took the request ({'; '.join(reasons)})", "ServiceUnavailableError",
                              None, "no_worker")
            tried.add(i)
            w = pool.workers[i]
            up = client.build_request("POST", w.url + path, content=body, headers=_headers(request))
            w.in_flight += 1
            try:
                resp = await client.send(up, stream=True)
            except (httpx.ConnectTimeout, httpx.NetworkError, httpx.RemoteProtocolError) as e:
                # Refused, reset or closed before any answer (a dead worker, or a pooled connection
                # it had closed): another worker can take the request; one that is alive aborts it
                # when it sees the connection gone.
                w.in_flight -= 1
                w.failures += 1
                w.healthy = False
                reasons.append(f"{w.url}: {type(e).__name__}")
                log.warning("worker %s refused a request (%s): trying another", w.url, e)
                continue
            except httpx.TimeoutException:
                w.in_flight -= 1
                return errors(504, f"the worker {w.url} sent nothing within {request_timeout_s:g}s (--request-timeout)",
                              "timeout_error", None, "request_timeout")
            except httpx.HTTPError as e:
                w.in_flight -= 1
                w.failures += 1
                return errors(502, f"the worker {w.url} failed before answering: {type(e).__name__}",
                              "ServiceUnavailableError", None, "worker_failed")
            except BaseException:
                w.in_flight -= 1
                raise
            break
        w.requests += 1
        w.remember(hashes)
        if pre is not None:
            pre.requests += 1
            pre.in_flight += 1
            pre.remember(hashes)
        log.info("%s -> %s%s (%d)", path, f"{pre.url} + " if pre is not None else "", w.url, resp.status_code)
        media = resp.headers.get("content-type", "application/json")

        head = bytearray() if path == "/v1/responses" else None

        async def relay():
            nonlocal head
            try:
                async for chunk in resp.aiter_bytes():
                    if head is not None:  # the response's id, from the first bytes
                        head += chunk
                        m = _RESPONSE_ID.search(head)
                        if m or len(head) > 8192:
                            if m:
                                pool.own_response(m.group(1).decode(), i)
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

        return StreamingResponse(relay(), status_code=resp.status_code, media_type=media)

    for route in ROUTES:
        app.add_api_route(route, forward, methods=["POST"])

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        owner = pool.response_owner.get(response_id)
        if owner is None:
            return error_response(404, f"no response {response_id!r} was made through this router", "NotFoundError")
        w = pool.workers[owner]
        try:
            r = await state["client"].get(f"{w.url}/v1/responses/{response_id}", headers=_headers(request))
        except httpx.HTTPError as e:
            return error_response(503, f"the worker {w.url} that holds {response_id} is unreachable: "
                                       f"{type(e).__name__}", "ServiceUnavailableError")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    return app


def _headers(request) -> dict:
    return {k: v for k, v in request.headers.items() if k in _FORWARD_HEADERS}


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
