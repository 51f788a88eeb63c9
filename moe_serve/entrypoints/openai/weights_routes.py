"""The routes an RL trainer drives (SGLang's and vLLM's names, which verl and slime call): weights
replaced in place, from disk or broadcast by the trainer; generation paused and continued; the
prefix cache flushed; the engine put to sleep and woken. The engine side is a step feature
(moe_serve/engine/features/weights_update.py) that does each call between steps, at a turn every
rank agrees on.

Every update is checked here, against the served checkpoint's tensor names, dtypes and shapes,
before the engine is asked anything: a refused update answers 400 naming the tensor at once, so a
trainer that waits for the check (`check_only`, or a 400 before it starts broadcasting) never
broadcasts to a group nobody receives on, and the old weights keep serving.

`weight_version` (a string) names the weights served: in GET /v1/models, every completion and
chat response and every streamed chunk (the version that made the chunk's tokens: it changes
mid-stream when an update lands there). An update sets it to its `weight_version`, or to the
number of updates so far, as its answer arrives from the engine (before any later output).
"""
from __future__ import annotations

import asyncio
import json
import logging

from fastapi import Request
from fastapi.responses import JSONResponse

log = logging.getLogger("moe_serve.weights_routes")

UPDATE_TIMEOUT_S = 1800.0  # a reload or a broadcast of a large model takes minutes
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")


class Refused(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def refusal(status: int, message: str, param: str | None = None) -> JSONResponse:
    """SGLang's {"success": false, "message"} (what verl and slime read) with OpenAI's error."""
    return JSONResponse({"success": False, "message": message,
                         "error": {"message": message, "type": "invalid_request_error" if status < 500
                                   else "ServiceUnavailableError", "param": param, "code": None}}, status)


async def _body(request: Request, fields: dict[str, tuple[type, ...]], required: tuple[str, ...] = ()) -> dict:
    """The JSON object body; Refused naming a field that is unknown, missing or of another type."""
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError as e:
        raise Refused(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise Refused("the body must be a JSON object")
    for k, v in body.items():
        if k not in fields:
            raise Refused(f"unknown field {k!r} (this route takes: {', '.join(fields)})", k)
        if v is not None and (not isinstance(v, fields[k]) or (isinstance(v, bool) and bool not in fields[k])):
            raise Refused(f"field {k!r} must be {' or '.join(t.__name__ for t in fields[k])}", k)
    for k in required:
        if body.get(k) is None:
            raise Refused(f"field {k!r} is required", k)
    return body


class _Job:
    """What the routes share: the engine, the served checkpoint's manifest, the sleep level, the
    count of updates (the default weight_version)."""

    def __init__(self, engine, model_path: str):
        self.engine, self.model_path = engine, model_path
        self._manifest = None
        self.updates, self.sleep_level, self.group = 0, 0, False

    async def manifest(self) -> dict:
        from moe_serve.weight_sync import checkpoint_manifest

        if self._manifest is None:
            self._manifest = await asyncio.to_thread(checkpoint_manifest, self.model_path)
        return self._manifest

    async def call(self, method: str, body: dict | None = None, arg: int = 0) -> dict:
        try:
            out = await self.engine.call(method, arg, json.dumps(body or {}).encode(), UPDATE_TIMEOUT_S)
        except RuntimeError as e:  # the engine refused it (a check it repeats) or failed doing it
            raise Refused(str(e)) from None
        return json.loads(out or b"{}")

    async def update(self, method: str, body: dict, version: str | None) -> tuple[dict, str]:
        """A weight update; its answer's dict and the weight_version now served."""
        version = version or str(self.updates + 1)

        def served():  # in the engine's receiver thread: outputs after this one carry it
            self.engine.weight_version = version
        try:
            out = await self.engine.call(method, 0, json.dumps(body).encode(), UPDATE_TIMEOUT_S, served)
        except RuntimeError as e:
            raise Refused(str(e)) from None
        self.updates += 1
        return json.loads(out or b"{}"), version


def _router(app):
    """route(path, fields, required): a POST handler taking the checked JSON body and the request,
    answering {"success": true, ...its dict} or a refusal."""
    def route(path: str, fields: dict, required: tuple = ()):
        def wrap(fn):
            async def handler(request: Request):
                try:
                    return JSONResponse({"success": True, **(await fn(await _body(request, fields, required),
                                                                     request))})
                except Refused as e:
                    return refusal(e.status, str(e), e.param)
            handler.__name__ = fn.__name__
            app.post(path)(handler)
            return fn
        return wrap
    return route


def weights_routes(engine, model_path: str):
    """The route group for build_app's extra_routes; `model_path`: the checkpoint the job serves."""
    job = _Job(engine, model_path)

    def add(app):
        @app.middleware("http")
        async def asleep(request: Request, call_next):
            if job.sleep_level and request.url.path in GENERATION_PATHS:
                return refusal(503, f"the engine is asleep (level {job.sleep_level}): POST /wake_up first")
            return await call_next(request)

        _update_routes(app, _router(app), job)
        _control_routes(app, _router(app), job)

    return add


def _update_routes(app, route, job: _Job) -> None:
    """Weights from disk or from the trainer's broadcast group."""
    from moe_serve import weight_sync as ws

    version = {"weight_version": (str,), "flush_cache": (bool,)}

    @route("/update_weights_from_disk", {"model_path": (str,), "load_format": (str,), **version}, ("model_path",))
    async def update_weights_from_disk(body, request):
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise Refused(f"load_format={body['load_format']!r}: only safetensors checkpoints load", "load_format")
        problem = ws.check_checkpoint(await job.manifest(), body["model_path"])
        if problem is not None:
            raise Refused(problem[1], problem[0])
        out, version = await job.update("weights_from_disk", {"model_path": body["model_path"],
                                        "flush_cache": body.get("flush_cache", True)}, body.get("weight_version"))
        return {"message": f"weights loaded from {body['model_path']}", **out, "weight_version": version}

    @route("/init_weights_update_group", {"master_address": (str,), "master_port": (int,), "rank_offset": (int,),
                                          "world_size": (int,), "group_name": (str,), "backend": (str,)},
           ("master_address", "master_port", "rank_offset", "world_size"))
    async def init_weights_update_group(body, request):
        ranks = len(job.engine.live) if getattr(job.engine, "live", None) else 1
        if body["rank_offset"] < 1:
            raise Refused("rank_offset must be >= 1 (the trainer is rank 0)", "rank_offset")
        if body["world_size"] < body["rank_offset"] + ranks:
            raise Refused(f"world_size={body['world_size']} leaves no room for this job's {ranks} rank(s) "
                          f"from rank_offset={body['rank_offset']}", "world_size")
        backend = body.get("backend") or "gloo"
        if backend not in ("gloo", "nccl"):
            raise Refused(f"backend={backend!r} is not one of: gloo, nccl", "backend")
        if job.group:
            raise Refused("a weights update group is joined already: POST /destroy_weights_update_group first")
        await job.call("weights_init_group", {**body, "backend": backend, "group_name": body.get("group_name") or ""})
        job.group = True
        return {"message": "joined the weights update group"}

    @route("/destroy_weights_update_group", {"group_name": (str,)})
    async def destroy_weights_update_group(body, request):
        await job.call("weights_destroy_group")
        job.group = False
        return {"message": "left the weights update group"}

    @route("/update_weights_from_distributed", {"names": (list,), "dtypes": (list,), "shapes": (list,),
                                                "group_name": (str,), "check_only": (bool,), **version},
           ("names", "dtypes", "shapes"))
    async def update_weights_from_distributed(body, request):
        problem = ws.check_tensors(await job.manifest(), body["names"], body["dtypes"], body["shapes"])
        if problem is not None:
            raise Refused(problem[1], problem[0])
        if body.get("check_only"):
            return {"message": f"{len(body['names'])} tensors may be sent"}
        if not job.group:
            raise Refused("no weights update group: POST /init_weights_update_group first")
        out, version = await job.update("weights_from_distributed", {k: body[k] for k in ("names", "dtypes", "shapes")}
                                        | {"flush_cache": body.get("flush_cache", True)}, body.get("weight_version"))
        return {"message": f"{len(body['names'])} tensors received", **out, "weight_version": version}


def _control_routes(app, route, job: _Job) -> None:
    """Pause and continue, the prefix cache, sleep and wake, the version served."""
    @route("/pause_generation", {"mode": (str,)})
    async def pause_generation(body, request):
        if body.get("mode") not in (None, "keep"):
            raise Refused(f"mode={body['mode']!r}: only 'keep' (requests wait, with their KV)", "mode")
        await job.call("pause_generation")
        return {"message": "paused"}

    @route("/continue_generation", {})
    async def continue_generation(body, request):
        await job.call("continue_generation")
        return {"message": "continued"}

    @route("/flush_cache", {})
    async def flush_cache(body, request):
        return {"message": "prefix cache flushed", **(await job.call("flush_cache"))}

    @route("/sleep", {"level": (int,)})
    async def sleep(body, request):
        level = body.get("level") or request.query_params.get("level", "1")
        if str(level) not in ("1", "2"):
            raise Refused(f"level={level!r} is not one of: 1, 2", "level")
        if job.engine.has_work():
            raise Refused("requests are in flight: let them finish (or abort them) before sleeping", None, 409)
        out = await job.call("sleep", arg=int(level))
        job.sleep_level = int(level)
        return {"message": f"asleep (level {level})", **out}

    @route("/wake_up", {"tags": (list,)})
    async def wake_up(body, request):
        if body.get("tags") not in (None, ["weights", "kv_cache"], ["kv_cache", "weights"]):
            raise Refused("tags: only both parts wake together (omit it)", "tags")
        out = await job.call("wake_up")
        job.sleep_level = 0
        return {"message": "awake", **out}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return JSONResponse({"is_sleeping": bool(job.sleep_level)})

    @app.get("/get_weight_version")
    async def get_weight_version():
        return JSONResponse({"weight_version": job.engine.weight_version})
