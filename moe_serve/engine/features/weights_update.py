"""Weights replaced while serving, generation paused and resumed, the prefix cache flushed, and the
engine put to sleep (its KV cache, and at level 2 its weights, given back to the OS) and woken: a
step feature answering the front end's utility calls (moe_serve/entrypoints/openai/weights_routes.py).

Calls come to rank 0's core. Each is queued there and done between steps at a turn every rank
agrees on: the agreement carries how many calls rank 0 holds; at that turn rank 0 broadcasts them
(method and JSON payload) over the ranks' CPU group, and every rank does them, in order, so the
ranks enter a weights broadcast or a reload together. Only rank 0 answers.

While paused or asleep the feature holds the steps (`holds_steps`): requests stay queued, with
their KV, and go on once generation continues (a request that arrives while asleep waits too; the
front end refuses new ones then). The checks of a weight update are the front end's and repeated
here before anything is written (moe_serve/weight_sync.py).
"""
from __future__ import annotations

import json
import logging
import time

import msgspec
import torch

from moe_serve.engine.features.base import StepFeature
from moe_serve.protocol import UtilityResult

log = logging.getLogger("moe_serve.weights_update")

METHODS = ("weights_from_disk", "weights_init_group", "weights_from_distributed", "weights_destroy_group",
           "pause_generation", "continue_generation", "flush_cache", "sleep", "wake_up")


class WeightsAgreement(msgspec.Struct):
    calls: int = 0  # calls queued on this rank (rank 0): every rank does them at this turn


class _Queued(msgspec.Struct, array_like=True):
    call_id: int
    method: str
    arg: int
    data: bytes


class WeightsUpdate(StepFeature):
    name = "weights_update"
    calls = METHODS

    def __init__(self, cfg, model, runner, scheduler=None, cache=None):
        self.cfg, self.model, self.runner, self.scheduler = cfg, model, runner, scheduler
        self.cache = cache  # the KV tensors bound: (per block group, the state pool's)
        self.model_path = cfg.model.path  # where a level-2 wake reloads from (the last checkpoint loaded)
        self.paused = False
        self.sleep_level = 0
        self._queued: list[_Queued] = []
        self._results: list[UtilityResult] = []
        self._group = None  # weight_sync.UpdateGroup once a trainer's group is joined
        self._manifest = None
        self._released: list = []  # (tensors, sizes) given back while asleep

    @classmethod
    def build(cls, ctx) -> "WeightsUpdate":
        return cls(ctx.cfg, ctx.model, ctx.runner, ctx.scheduler, ctx.cache)

    def holds_steps(self) -> bool:
        return self.paused or self.sleep_level > 0

    def on_call(self, call):
        self._queued.append(_Queued(call.call_id, call.method, call.arg, getattr(call, "data", b"")))
        return None  # answered at the agreed turn

    def agreement(self) -> WeightsAgreement:
        return WeightsAgreement(len(self._queued))

    def apply_agreement(self, agreed: WeightsAgreement, group=None) -> None:
        if not agreed.calls:
            return
        mine = {q.call_id for q in self._queued}
        queued, self._queued = self._queued, []
        if group is not None:  # every rank does rank 0's calls (only rank 0 holds any)
            queued = _broadcast_calls(queued, group)
        for q in queued:
            try:
                result = json.dumps(self._do(q.method, json.loads(q.data or b"{}"), q.arg)).encode()
                answer = UtilityResult(q.call_id, result)
            except Exception as e:  # noqa: BLE001 - the caller hears why; the engine serves on
                log.exception("%s failed", q.method)
                answer = UtilityResult(q.call_id, error=f"{type(e).__name__}: {e}")
            if q.call_id in mine:
                self._results.append(answer)

    def take_results(self) -> list[UtilityResult]:
        out, self._results = self._results, []
        return out

    def cancel_calls(self, reason: str) -> list[UtilityResult]:
        out = [UtilityResult(q.call_id, error=reason) for q in self._queued]
        self._queued = []
        return out

    # --- the calls ---------------------------------------------------------------------------------
    def _do(self, method: str, body: dict, arg: int) -> dict:
        from moe_serve import weight_sync as ws

        if method == "pause_generation":
            self.paused = True
        elif method == "continue_generation":
            self.paused = False
        elif method == "flush_cache":
            return {"flushed_blocks": self.flush_prefix_cache()}
        elif method == "sleep":
            return self.sleep(arg)
        elif method == "wake_up":
            return self.wake_up()
        elif method == "weights_init_group":
            if self._group is not None:
                raise ValueError("a weights update group is joined already: destroy it first")
            self._group = ws.UpdateGroup(body["master_address"], body["master_port"],
                                         body["rank_offset"] + self.cfg.parallel.rank, body["world_size"],
                                         body["group_name"], body["backend"], self.cfg.device)
        elif method == "weights_destroy_group":
            self._group = None
        elif method == "weights_from_disk":
            return self.load_from_disk(body["model_path"], body.get("flush_cache", True))
        elif method == "weights_from_distributed":
            return self.receive(body["names"], body["dtypes"], body["shapes"], body.get("flush_cache", True))
        return {}

    def _check(self, problem) -> None:
        if problem is not None:
            raise ValueError(problem[1])

    def manifest(self) -> dict:
        from moe_serve.weight_sync import checkpoint_manifest

        if self._manifest is None:
            self._manifest = checkpoint_manifest(self.cfg.model.path)
        return self._manifest

    def load_from_disk(self, path: str, flush: bool) -> dict:
        from moe_serve.weight_sync import LiveWriter, check_checkpoint

        if self.sleep_level >= 2:
            raise ValueError("the weights are asleep (level 2): wake_up first")
        self._check(check_checkpoint(self.manifest(), path))  # before anything is written
        t0 = time.perf_counter()
        writer = LiveWriter(self.model, self.cfg, path)
        writer.load_checkpoint(path)
        writer.finish()
        self.model_path = path
        flushed = self.flush_prefix_cache(live=True) if flush else 0
        log.info("weights loaded from %s in %.2fs", path, time.perf_counter() - t0)
        return {"model_path": path, "flushed_blocks": flushed}

    def receive(self, names: list, dtypes: list, shapes: list, flush: bool) -> dict:
        from moe_serve.weight_sync import LiveWriter, check_tensors, dtype_name

        if self._group is None:
            raise ValueError("no weights update group: POST /init_weights_update_group first")
        if self.sleep_level >= 2:
            raise ValueError("the weights are asleep (level 2): wake_up first")
        self._check(check_tensors(self.manifest(), names, dtypes, shapes))  # before anything is received
        t0 = time.perf_counter()
        writer = LiveWriter(self.model, self.cfg, self.model_path)
        for name, dt, shape in zip(names, dtypes, shapes):  # one tensor in memory at a time
            t = self._group.receive(dtype_name(dt), list(shape))
            writer.write(name, t.to(self.cfg.device))
            del t
        writer.finish()
        flushed = self.flush_prefix_cache(live=True) if flush else 0
        log.info("%d tensors received and loaded in %.2fs", len(names), time.perf_counter() - t0)
        return {"tensors": len(names), "flushed_blocks": flushed}

    def flush_prefix_cache(self, live: bool = False) -> int:
        """Forget every cached prefix no running request holds (KV made by other weights, or lost);
        live (after an update): those running requests hold too, which they stop registering: a
        request paused across an update holds KV of the old weights, and its later blocks attend
        over it, so no other request may take them as a prefix hit."""
        return self.scheduler.forget_prefixes(live) if self.scheduler is not None else 0

    # --- sleep -------------------------------------------------------------------------------------
    def _kv_tensors(self) -> list[torch.Tensor]:
        if self.cache is not None:
            blocks, state = self.cache
            return [t for group in blocks for t in group] + list(state)
        out = []  # no cache handed over: the tensors the attention layers hold
        for layer in self.runner.attn_layers:
            for v in vars(layer).values():
                vs = v if isinstance(v, (list, tuple)) else [v]
                out += [t for t in vs if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)]
        return out

    def _weight_tensors(self) -> list[torch.Tensor]:
        return list(self.model.parameters()) + [b for n, b in self.model.named_buffers() if n.endswith("scale_inv")]

    def sleep(self, level: int) -> dict:
        from moe_serve.weight_sync import release

        if level not in (1, 2):
            raise ValueError(f"level={level} is not one of: 1, 2")
        if self.sleep_level:
            raise ValueError(f"the engine is asleep already (level {self.sleep_level})")
        self.flush_prefix_cache()  # the cache's contents are gone
        kv = self._kv_tensors()
        freed, sizes = release(kv)
        self._released = [(kv, sizes)]
        weights = 0
        if level == 2:
            w = self._weight_tensors()
            weights, wsizes = release(w)
            self._released.append((w, wsizes))
        self.sleep_level = level
        log.info("asleep (level %d): %.1f MiB of KV cache and %.1f MiB of weights given back", level, freed / 2**20,
                 weights / 2**20)
        return {"level": level, "kv_cache_bytes": freed, "weight_bytes": weights}

    def wake_up(self) -> dict:
        from moe_serve.weight_sync import LiveWriter, restore

        if not self.sleep_level:
            return {"level": 0}
        moved = False
        for tensors, sizes in self._released:
            restore(tensors, sizes)
            moved |= any(sizes)
        level, self._released = self.sleep_level, []
        if moved:  # CUDA storages came back at other addresses: captured graphs read the old ones
            self.runner.graphs = None
            self.runner.verify_graphs = None
            log.warning("woken up: the decode graphs held the old addresses and were dropped (eager steps)")
        if level == 2:  # the weights are reloaded (a trainer then pushes its own, as after any wake)
            writer = LiveWriter(self.model, self.cfg, self.model_path)
            writer.load_checkpoint(self.model_path)
            writer.finish()
        self.sleep_level = 0
        return {"level": level}


def _broadcast_calls(queued: list[_Queued], group) -> list[_Queued]:
    """Rank 0's queued calls, on every rank (msgspec bytes in a uint8 tensor, its length first)."""
    import torch.distributed as dist

    data = msgspec.msgpack.encode(queued)
    n = torch.tensor([len(data)], dtype=torch.int64)
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    dist.broadcast(n, src=src, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    if buf.numel() != int(n):
        buf = torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return msgspec.msgpack.decode(buf.numpy().tobytes(), type=list[_Queued])
