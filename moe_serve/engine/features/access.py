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

    # --- the KV connector (moe_serve/disagg): what the loop does through the generic hooks, by name
    @property
    def kv_layout(self):
        """The CacheLayout peers write this instance's cache by (None: it moves no KV)."""
        return getattr(self.feature("kv_transfer"), "layout", None)

    def kv_done(self, done: list) -> None:
        """Decode side: prefill instances wrote (or failed to write) these requests' blocks (KVDone),
        handed to every feature that takes them, as the core's loop does (router replay takes the
        prompt's rows from them)."""
        from moe_serve.protocol import CoreInput

        self.features.deliver(CoreInput(kv_done=list(done)))

    def poll_kv(self) -> list:
        """Prefill side: the outputs of requests whose KV write ended (blocks given back)."""
        f = self.feature("kv_transfer")
        return f.poll() if f is not None and f.busy() else []

    def has_transfers(self) -> bool:
        """KV writes in flight (prefill side): the transfer engine's own thread moves them."""
        f = self.feature("kv_transfer")
        return f is not None and f.busy()
