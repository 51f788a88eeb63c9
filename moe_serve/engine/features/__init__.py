"""Step features: the capabilities that plug into the engine core's step (the contract:
`base.StepFeature`). `FEATURES` is the one place they are registered: one factory per line, called
in this order by `build_engine` once the core is made (so on every rank in the same order; a factory
may enter a collective). A factory takes the `FeatureContext` and returns a feature, or None when
the config leaves it off. Registration order is hook order: the expert-load recorder's hook runs
before EPLB's, and each turn's agreement is applied in this order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from moe_serve.engine.features.base import MIN, MinInt, StepFeature
from moe_serve.engine.features.feature_set import FeatureSet


@dataclass(frozen=True)
class FeatureContext:
    """What a factory may build a feature from: the resolved config and the parts build_engine made."""

    cfg: Any  # EngineConfig
    model: Any
    moe_ctx: Any  # MoEContext
    runner: Any  # ModelRunner
    num_slots: int  # physical expert slots per MoE layer, over the EP group
    ep_group: Any = None
    meter: Any = None  # the decode speed-of-light meter (made before the graphs, which mark its hits)
    scheduler: Any = None  # the core's Scheduler
    cache: Any = None  # the cache tensors bound: (per block group, the state pool's), in layer order


def _speed_of_light(ctx: FeatureContext):
    from moe_serve.engine.features.speed_of_light import SpeedOfLight

    return SpeedOfLight(ctx.meter) if ctx.meter is not None else None


def _expert_load(ctx: FeatureContext):
    from moe_serve.engine.features.expert_load import ExpertLoad

    return ExpertLoad.build(ctx)


def _eplb(ctx: FeatureContext):
    from moe_serve.engine.features.eplb import Eplb

    return Eplb.build(ctx) if ctx.cfg.parallel.eplb is not None else None


def _kv_connector(ctx: FeatureContext):
    from moe_serve.disagg.pd_connector import build_connector

    return build_connector(ctx)


def _kv_offload(ctx: FeatureContext):
    from moe_serve.engine.features.kv_offload import KVOffload

    return KVOffload.build(ctx)


def _routed_experts(ctx: FeatureContext):
    from moe_serve.engine.features.routed_experts import RoutedExperts

    return RoutedExperts.build(ctx)


def _weights_update(ctx: FeatureContext):
    from moe_serve.engine.features.weights_update import WeightsUpdate

    return WeightsUpdate.build(ctx)


Factory = Callable[[FeatureContext], "StepFeature | None"]

FEATURES: list[Factory] = [
    _speed_of_light,
    _expert_load,
    _eplb,
    _routed_experts,
    _weights_update,
    _kv_offload,  # before the connector: blocks restored from a tier are filled before its writes read them
    _kv_connector,  # last: its writes read the cache every other hook of the step has written
]


def register(factory: Factory) -> Factory:
    """Add a feature for every engine built from now on (usable as a decorator)."""
    FEATURES.append(factory)
    return factory


def build_features(ctx: FeatureContext) -> FeatureSet:
    return FeatureSet([f for f in (factory(ctx) for factory in FEATURES) if f is not None])


__all__ = ["FEATURES", "FeatureContext", "FeatureSet", "MIN", "MinInt", "StepFeature", "build_features", "register"]
