"""The decode speed-of-light meter as a step feature (the meter itself: moe_serve/speed_of_light.py)."""
from __future__ import annotations

from moe_serve.engine.features.base import StepFeature
from moe_serve.protocol import SpeedOfLightStats


class SpeedOfLight(StepFeature):
    """Times every step this rank runs; decode-only ones count toward the window. An idle turn
    closes the window with the burst that filled it."""

    name = "speed_of_light"

    def __init__(self, meter):
        self.meter = meter  # speed_of_light.DecodeMeter
        self._decode_lens: list[int] | None = None

    def before_forward(self, sched) -> None:
        self.meter.begin_step()
        # A decode-only step: each sequence's cache length with its new token (read before the
        # step moves the requests on).
        scheduled = sched.scheduled
        if scheduled and all(s.num_tokens == 1 and s.request.num_computed_tokens == s.request.num_tokens - 1
                             for s in scheduled):
            self._decode_lens = [s.request.num_tokens for s in scheduled]
        else:
            self._decode_lens = None

    def after_forward(self, sched, result, seconds: float) -> None:
        self.meter.end_step(self._decode_lens)  # the step's turn of the loop, since the step before ended

    def on_idle(self) -> bool:
        return self.meter.pause() is not None

    def stats(self) -> SpeedOfLightStats:
        m = self.meter
        return SpeedOfLightStats(fraction=m.fraction, tokens_per_s=m.last["tokens_per_s"], memory_bandwidth=m.bandwidth)
