"""Settings of expert rebalancing while serving (EPLB online), shaped like vLLM's flags.

    --enable-eplb                   rebalance while serving
    --num-redundant-experts N       spare physical slots beyond one per logical expert
    --eplb-window-size S            steps of recorded expert load the tuner sees
    --eplb-step-interval K          steps between rebalances
    --eplb-config '{"window_size": S, "step_interval": K, "num_redundant_experts": N}'
                                    the same as one JSON object (its keys win over the flags)

Imports no torch: the front end and the CLI validate these.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

# Windows the last S steps are cut into for the tuner's forecast (it backtests its decay on them).
FORECAST_WINDOWS = 8
# Layers whose weights may travel at once, each into its own spare buffer (double buffering).
LAYERS_IN_FLIGHT = 2


@dataclass(frozen=True)
class EplbConfig:
    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0

    def __post_init__(self):
        for name in ("window_size", "step_interval"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"eplb {name}={v!r} must be a positive integer")
        v = self.num_redundant_experts
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"num_redundant_experts={v!r} must be a non-negative integer")

    @property
    def steps_per_window(self) -> int:
        return max(1, self.window_size // FORECAST_WINDOWS)

    @property
    def max_windows(self) -> int:
        return -(-self.window_size // self.steps_per_window)


def resolve_eplb(enable: bool, num_redundant_experts: int | None, window_size: int | None,
                 step_interval: int | None, config_json: str | None) -> EplbConfig | None:
    """The flags and --eplb-config merged (JSON keys win); None when rebalancing is off. A flag
    given without --enable-eplb is refused, naming it, rather than ignored."""
    given = {"num_redundant_experts": num_redundant_experts, "window_size": window_size,
             "step_interval": step_interval}
    given = {k: v for k, v in given.items() if v is not None}
    if config_json:
        try:
            obj = json.loads(config_json)
        except json.JSONDecodeError as e:
            raise ValueError(f"eplb_config is not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError("eplb_config must be a JSON object")
        unknown = sorted(set(obj) - {"window_size", "step_interval", "num_redundant_experts"})
        if unknown:
            raise ValueError(f"eplb_config has an unknown key {unknown[0]!r} (known: window_size, step_interval, "
                             "num_redundant_experts)")
        given.update(obj)
    if not enable:
        if given:
            name = "eplb_config" if config_json else next(iter(given))
            raise ValueError(f"{name} is set but enable_eplb is not (add --enable-eplb)")
        return None
    return EplbConfig(**given)
