"""Expert-load recording as a step feature: routed tokens per (MoE layer, logical expert) in windows
of steps (expert_parallel/placement/load_stats.py), started, stopped and dumped over HTTP at a turn
every rank agrees on (each window's reduction over the ranks is collective)."""
from __future__ import annotations

import json

import msgspec

from moe_serve.engine.features.base import StepFeature
from moe_serve.protocol import UtilityResult


class LoadAgreement(msgspec.Struct):
    """Asked on any rank this turn: start recording, stop it, dump what was recorded."""

    start: int = 0
    stop: int = 0
    dump: int = 0


class ExpertLoad(StepFeature):
    """Always registered, so that the HTTP routes answer the same with recording off (an empty
    dump); `recorder` is None until recording is enabled (--expert-load-record/-window or
    `EngineCore.enable_load_recording`)."""

    name = "expert_load"
    calls = ("load_start", "load_stop", "load_dump")

    def __init__(self, model_path: str, recorder=None):
        self.model_path = model_path
        self.recorder = recorder  # ExpertLoadRecorder
        self._pending: str | None = None  # "load_start" | "load_stop" asked on this rank
        self._dumps: list[int] = []  # load_dump call ids asked on this rank, answered at the agreed turn
        self._results: list[UtilityResult] = []

    @classmethod
    def build(cls, ctx) -> "ExpertLoad":
        par = ctx.cfg.parallel
        feature = cls(ctx.cfg.model.path)
        if par.expert_load_record or par.expert_load_window:
            feature.enable(ctx.cfg, ctx.runner, par.expert_load_window or 100, ctx.ep_group,
                           start=bool(par.expert_load_record))
        return feature

    def enable(self, cfg, runner, window_steps: int, ep_group=None, start: bool = False):
        """Count routed tokens per (MoE layer, logical expert) in windows of `window_steps` steps.
        With expert parallelism every window is summed over the ranks (one all_reduce per window,
        at the same step on every rank). Returns the recorder."""
        import torch.distributed as dist

        from expert_parallel.placement.load_stats import ExpertLoadRecorder
        from moe_serve.models.registry import num_logical_experts

        reduce_fn = None
        if cfg.parallel.world_size > 1:
            reduce_fn = lambda t: dist.all_reduce(t, group=ep_group)  # noqa: E731
        rec = ExpertLoadRecorder(runner.model.num_moe_layers, num_logical_experts(cfg.model.architecture,
                                 cfg.model.hf), window_steps, reduce_fn=reduce_fn, device=cfg.device)
        self.recorder = rec
        runner.load_hooks.append(rec.record)
        if start:
            rec.start()
        return rec

    def on_call(self, call) -> UtilityResult | None:
        if call.method == "load_dump":
            self._dumps.append(call.call_id)
            return None
        self._pending = call.method  # applied at the turn every rank agrees on
        return UtilityResult(call.call_id, b"true")

    def agreement(self) -> LoadAgreement:
        action, self._pending = self._pending, None
        return LoadAgreement(action == "load_start", action == "load_stop", bool(self._dumps))

    def apply_agreement(self, agreed: LoadAgreement, group=None) -> None:
        rec = self.recorder
        if rec is not None and (agreed.start or agreed.stop):
            rec.start() if agreed.start else rec.stop()
        if agreed.dump:  # every rank (the open window's reduction is collective); the asking rank answers
            text = json.dumps(self.dump()).encode()
            self._results += [UtilityResult(cid, text) for cid in self._dumps]
            self._dumps = []

    def after_forward(self, sched, result, seconds: float) -> None:
        if self.recorder is not None:
            self.recorder.end_step()

    def take_results(self) -> list[UtilityResult]:
        out, self._results = self._results, []
        return out

    def cancel_calls(self, reason: str) -> list[UtilityResult]:
        out = [UtilityResult(cid, error=reason) for cid in self._dumps]
        self._dumps, self._pending = [], None
        return out

    def dump(self, path: str | None = None) -> dict:
        if self.recorder is None:
            return {}
        return self.recorder.dump(path, metadata={"model": self.model_path})

    def shutdown(self) -> None:
        """Every rank at the same turn: a partial window is kept."""
        if self.recorder is not None:
            self.recorder.stop()
