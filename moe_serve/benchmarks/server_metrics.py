"""What the benchmark reads from the server's Prometheus /metrics while a load level runs: peak KV
cache usage (moe-serve, vLLM or SGLang names), peak running requests, and on moe-serve the decode
speed of light per rank, the memory bandwidth it assumes, and its token counters."""
from __future__ import annotations

import asyncio
import math
import re
from dataclasses import dataclass, field

import httpx

# Share of the KV cache in use, 0..1, by server.
KV_USAGE = {"moe-serve": ("moe_serve:kv_cache_usage_perc",),
            "vllm": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            "sglang": ("sglang:token_usage",)}
RUNNING = {"moe-serve": ("moe_serve:num_requests_running",), "vllm": ("vllm:num_requests_running",),
           "sglang": ("sglang:num_running_reqs",)}
SOL = "moe_serve:decode_speed_of_light_fraction"
BANDWIDTH = "moe_serve:memory_bandwidth_bytes_per_second"
PROMPT_TOKENS = "moe_serve:prompt_tokens_total"
GENERATION_TOKENS = "moe_serve:generation_tokens_total"
PREFIX_HIT_RATE = "moe_serve:prefix_cache_hit_rate"

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse_prometheus(text: str) -> Samples:
    """{metric name: [(labels, value), ...]} of a text exposition (comments skipped)."""
    out: Samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.setdefault(m.group(1), []).append((dict(_LABEL.findall(m.group(2) or "")), value))
    return out


def server_kind(samples: Samples) -> str | None:
    """'moe-serve', 'vllm' or 'sglang' from the metric names; None for anything else."""
    prefixes = {name.split(":", 1)[0] for name in samples if ":" in name}
    for kind, prefix in (("moe-serve", "moe_serve"), ("vllm", "vllm"), ("sglang", "sglang")):
        if prefix in prefixes:
            return kind
    return None


def first_of(samples: Samples, names: tuple[str, ...]) -> float | None:
    """The largest value of the first of `names` that the server exposes."""
    for name in names:
        if samples.get(name):
            return max(v for _, v in samples[name])
    return None


def per_rank(samples: Samples, name: str) -> dict[str, float]:
    return {labels.get("rank", "0"): v for labels, v in samples.get(name, [])}


def total(samples: Samples, name: str) -> float | None:
    return sum(v for _, v in samples[name]) if samples.get(name) else None


@dataclass
class MetricsWatch:
    """Polls /metrics every `interval` seconds in the background while a level runs."""

    client: httpx.AsyncClient
    interval: float
    kind: str | None = None
    polls: int = 0
    kv_peak: float | None = None
    running_peak: float | None = None
    sol_polls: list[float] = field(default_factory=list)  # mean over ranks, polls > 0 during the run
    sol_rank_polls: dict[str, list[float]] = field(default_factory=dict)
    bandwidth: dict[str, float] = field(default_factory=dict)
    before: Samples = field(default_factory=dict)
    after: Samples = field(default_factory=dict)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task | None = None

    async def fetch(self) -> Samples | None:
        try:
            r = await self.client.get("/metrics", timeout=5.0)
        except httpx.HTTPError:
            return None
        return parse_prometheus(r.text) if r.status_code == 200 else None

    async def start(self) -> None:
        """The baseline poll (counters before the level), then polling in the background."""
        self.before = await self.fetch() or {}
        self.kind = server_kind(self.before)
        if self.kind is not None:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Stop polling, then one last poll (the gauges as the level's last steps left them)."""
        self._stop.set()
        if self._task is not None:
            await self._task
            s = await self.fetch()
            if s is not None:
                self._observe(s)
                self.after = s

    async def _loop(self) -> None:
        while not self._stop.is_set():
            s = await self.fetch()
            if s is not None:
                self._observe(s)
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass

    def _observe(self, s: Samples) -> None:
        self.polls += 1
        kv = first_of(s, KV_USAGE.get(self.kind, ()))
        if kv is not None:
            self.kv_peak = kv if self.kv_peak is None else max(self.kv_peak, kv)
        run = first_of(s, RUNNING.get(self.kind, ()))
        if run is not None:
            self.running_peak = run if self.running_peak is None else max(self.running_peak, run)
        if self.kind != "moe-serve":
            return
        bw = per_rank(s, BANDWIDTH)
        if bw:
            self.bandwidth = bw
        # The gauge holds the last closed window's fraction: it counts once this level has decoded
        # (the generation counter moved), so a previous run's last value is not taken for this one's.
        gen0, gen = total(self.before, GENERATION_TOKENS), total(s, GENERATION_TOKENS)
        if gen0 is not None and gen is not None and gen <= gen0:
            return
        ranks = per_rank(s, SOL)
        if ranks:
            mean = sum(ranks.values()) / len(ranks)
            if mean > 0 and math.isfinite(mean):
                self.sol_polls.append(mean)
                for r, v in ranks.items():
                    self.sol_rank_polls.setdefault(r, []).append(v)

    def delta(self, name: str) -> int | None:
        a, b = total(self.before, name), total(self.after, name)
        return None if a is None or b is None else int(round(b - a))

    def facts(self) -> dict:
        """The level's server-side figures (None where the server does not expose them)."""
        ours = self.kind == "moe-serve"
        sol = sum(self.sol_polls) / len(self.sol_polls) if self.sol_polls else None
        ranks = ({r: sum(v) / len(v) for r, v in sorted(self.sol_rank_polls.items(), key=lambda kv: int(kv[0])
                                                           if kv[0].isdigit() else 0)}
                 if self.sol_rank_polls else None)
        bw = sum(self.bandwidth.values()) / len(self.bandwidth) if self.bandwidth else None
        return {
            "server_kind": self.kind,
            "metrics_polls": self.polls,
            "peak_kv_cache_usage": self.kv_peak,
            "peak_num_requests_running": self.running_peak,
            "decode_speed_of_light_fraction": sol,
            "decode_speed_of_light_fraction_per_rank": ranks,
            "decode_speed_of_light_polls": len(self.sol_polls),
            "memory_bandwidth_bytes_per_second": bw if ours and bw else None,
            "server_prompt_tokens_computed": self.delta(PROMPT_TOKENS) if ours else None,
            "server_generation_tokens": self.delta(GENERATION_TOKENS) if ours else None,
            "prefix_cache_hit_rate": first_of(self.after, (PREFIX_HIT_RATE,)) if ours else None,
        }
