"""Named ways in to the built-in features, for callers outside the step (the launcher, tests, the
offline `LLM`). The engine core's step never uses them: it only iterates its features."""
from __future__ import annotations


class FeatureAccess:
    """Mixed into EngineCore (which holds `features`, `cfg` and `runner`)."""

    features: "FeatureSet"

    def feature(self, name: str):
        """The registered feature called `name`, or None."""
        return self.features.get(name)

    @property
    def meter(self):
        """The decode speed-of-light meter (moe_serve/speed_of_light.py DecodeMeter), or None."""
        f = self.feature("speed_of_light")
        return f.meter if f is not None else None

    @property
    def load_recorder(self):
        """The expert-load recorder (expert_parallel/placement/load_stats.py), None while recording is off."""
        f = self.feature("expert_load")
        return f.recorder if f is not None else None

    @property
    def eplb(self):
        """The online rebalancer (expert_parallel/rebalance/eplb.py EplbManager), or None."""
        f = self.feature("eplb")
        return f.manager if f is not None else None

    def enable_load_recording(self, window_steps: int, ep_group=None, start: bool = False):
        """Count routed tokens per (MoE layer, logical expert) in windows of `window_steps` steps
        (features/expert_load.py ExpertLoad.enable); returns the recorder."""
        return self.feature("expert_load").enable(self.cfg, self.runner, window_steps, ep_group, start)

    def dump_load(self, path: str | None = None) -> dict:
        f = self.feature("expert_load")
        return f.dump(path) if f is not None else {}
