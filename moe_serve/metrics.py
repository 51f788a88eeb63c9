"""Prometheus metrics in the text exposition format (vLLM-style names under the moe_serve: prefix)."""
from __future__ import annotations

import bisect
import threading


class Histogram:
    def __init__(self, name: str, help_: str, buckets: list[float]):
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, v: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, v)] += 1
            self.sum += v
            self.count += 1

    def render(self, model: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            lines.append(f'{self.name}_bucket{{model_name="{model}",le="{b}"}} {acc}')
        lines.append(f'{self.name}_bucket{{model_name="{model}",le="+Inf"}} {self.count}')
        lines.append(f'{self.name}_sum{{model_name="{model}"}} {self.sum}')
        lines.append(f'{self.name}_count{{model_name="{model}"}} {self.count}')
        return lines


_LAT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]


class EngineMetrics:
    def __init__(self):
        self.ttft = Histogram("moe_serve:time_to_first_token_seconds", "Time to first token.", _LAT)
        self.tpot = Histogram("moe_serve:time_per_output_token_seconds", "Time per output token after the first.", _LAT)
        self.e2e = Histogram("moe_serve:e2e_request_latency_seconds", "End-to-end request latency.", _LAT)
        self.eplb_transfer = Histogram("moe_serve:eplb_transfer_seconds",
                                       "Expert rebalancing: seconds from tuning to the last layer's switch.",
                                       _LAT + [160.0, 320.0])
        self.kv_fetch = Histogram("moe_serve:kv_transfer_wait_seconds",
                                  "Disaggregated decode: seconds from a prompt's blocks being reserved to the prefill "
                                  "instance's answer (its KV written, or a failure).", _LAT)
        # Elastic EP (launcher/elastic.py), set by the front end when the ranks regroup.
        self.elastic_recovery = Histogram("moe_serve:elastic_recovery_seconds",
                                          "Elastic EP: seconds from a rank's loss being seen (a collective failing) to the survivors serving again.",
                                          _LAT + [160.0])
        self.ep_world_size = 1
        self.elastic_recoveries = 0
        self.elastic_resubmitted = 0
        self.snapshot = None
        self._rebalances_seen = 0

    def update_from(self, stats) -> None:
        self.snapshot = stats
        # One observation per rebalance (stats arrive every step, so a new count is one new rebalance).
        eplb = stats.eplb
        new = eplb.rebalances - self._rebalances_seen
        if new > 0:
            for _ in range(new):
                self.eplb_transfer.observe(eplb.last_transfer_s)
            self._rebalances_seen = eplb.rebalances

    def render(self, model: str, s, ranks: list | None = None) -> str:
        """s: an EngineStats (summed over ranks); ranks: each rank's own (the per-rank gauges)."""
        sc, spec = s.scheduler, s.spec_decode
        gauges = [
            ("moe_serve:num_requests_running", "Requests running on the engine.", sc.num_running),
            ("moe_serve:num_requests_waiting", "Requests waiting to be scheduled.", sc.num_waiting),
            ("moe_serve:kv_cache_usage_perc", "Share of KV blocks in use (1 = full).", sc.kv_cache_usage),
            ("moe_serve:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache.",
             sc.prefix_cache_hit_rate),
            ("moe_serve:expert_balancedness", "Mean over max routed tokens per rank in the last expert-load "
             "window (1 = balanced; 0 = not measured yet).", s.eplb.balancedness),
            ("moe_serve:ep_world_size", "Ranks the experts are sharded over now (elastic EP: the members).",
             self.ep_world_size),
        ]
        counters = [
            ("moe_serve:prompt_tokens_total", "Prompt tokens computed.", sc.prompt_tokens),
            ("moe_serve:generation_tokens_total", "Tokens generated.", sc.generation_tokens),
            ("moe_serve:num_preemptions_total", "Requests preempted for lack of KV blocks.", sc.num_preemptions),
            ("moe_serve:eplb_rebalances_total", "Expert rebalances completed while serving.",
             s.eplb.rebalances),
            ("moe_serve:spec_decode_num_drafts_total", "Speculative decoding: pieces verified with draft tokens.",
             spec.num_drafts),
            ("moe_serve:spec_decode_num_draft_tokens_total", "Speculative decoding: draft tokens verified.",
             spec.num_draft_tokens),
            ("moe_serve:spec_decode_num_accepted_tokens_total", "Speculative decoding: draft tokens accepted.",
             spec.num_accepted_tokens),
            ("moe_serve:elastic_recoveries_total", "Elastic EP: regroups after a rank was lost.",
             self.elastic_recoveries),
            ("moe_serve:elastic_requests_resubmitted_total", "Elastic EP: requests in flight resubmitted to the "
             "members after a regroup (with the tokens already streamed).", self.elastic_resubmitted),
        ]
        lines: list[str] = []
        for name, h, v in gauges:
            lines += [f"# HELP {name} {h}", f"# TYPE {name} gauge", f'{name}{{model_name="{model}"}} {v}']
        for name, h, v in counters:
            lines += [f"# HELP {name} {h}", f"# TYPE {name} counter", f'{name}{{model_name="{model}"}} {v}']
        per_rank = [
            ("moe_serve:decode_speed_of_light_fraction", "Achieved share of the decode speed of light over the "
             "last window of decode-only steps: (bytes the steps must read / memory bandwidth) / their time "
             "(0 = no window closed yet).", ("speed_of_light", "fraction")),
            ("moe_serve:memory_bandwidth_bytes_per_second", "The memory bandwidth the speed of light assumes.",
             ("speed_of_light", "memory_bandwidth")),
            ("moe_serve:kv_blocks_in_use", "KV blocks and state slots held by requests, every cache group "
             "(0 when nothing runs: what a finished, aborted or failed request held has come back).",
             ("scheduler", "kv_blocks_in_use")),
        ]
        for name, h, (part, field) in per_rank:
            lines += [f"# HELP {name} {h}", f"# TYPE {name} gauge"]
            lines += [f'{name}{{model_name="{model}",rank="{r}"}} {getattr(getattr(rs, part), field)}'
                      for r, rs in enumerate(ranks or [s])]
        per_rank_counters = [
            ("moe_serve:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache (each prompt once).",
             ("scheduler", "prefix_cache_queries")),
            ("moe_serve:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", ("scheduler", "prefix_cache_hits")),
            ("moe_serve:kv_transfer_sent_requests_total", "Disaggregated prefill: requests whose KV was written to a "
             "decode instance.", ("kv_transfer", "sent_requests")),
            ("moe_serve:kv_transfer_sent_bytes_total", "Disaggregated prefill: KV bytes written to decode instances.",
             ("kv_transfer", "sent_bytes")),
            ("moe_serve:kv_transfer_send_failures_total", "Disaggregated prefill: KV writes that failed or timed out.",
             ("kv_transfer", "send_failures")),
            ("moe_serve:kv_transfer_send_seconds_total", "Disaggregated prefill: seconds from posting KV writes to "
             "their completion, summed.", ("kv_transfer", "send_seconds")),
            ("moe_serve:kv_transfer_received_requests_total", "Disaggregated decode: requests whose prompt KV arrived.",
             ("kv_transfer", "received_requests")),
            ("moe_serve:kv_transfer_fallbacks_total", "Disaggregated decode: requests whose prompt was computed here "
             "because the prefill instance failed.", ("kv_transfer", "fallbacks")),
        ]
        for name, h, (part, field) in per_rank_counters:
            lines += [f"# HELP {name} {h}", f"# TYPE {name} counter"]
            lines += [f'{name}{{model_name="{model}",rank="{r}"}} {getattr(getattr(rs, part), field)}'
                      for r, rs in enumerate(ranks or [s])]
        name = "moe_serve:spec_decode_num_accepted_tokens_per_pos_total"
        lines += [f"# HELP {name} Speculative decoding: draft tokens accepted at each draft position.",
                  f"# TYPE {name} counter"]
        lines += [f'{name}{{model_name="{model}",position="{j}"}} {v}' for j, v in enumerate(spec.accepted_per_pos)]
        lines += kv_offload_lines(model, ranks or [s])
        for hist in (self.ttft, self.tpot, self.e2e, self.eplb_transfer, self.kv_fetch, self.elastic_recovery):
            lines += hist.render(model)
        return "\n".join(lines) + "\n"


_KV_OFFLOAD = [  # name, type, help, the stats field per tier ({t}: host, disk) or None
    ("moe_serve:kv_offload_hits_total", "counter", "KV tiers: prefix-cache blocks (and state snapshots) restored "
     "from a tier instead of recomputed.", "{t}_hits"),
    ("moe_serve:kv_offload_saved_bytes_total", "counter", "KV tiers: bytes of evicted blocks written to a tier.",
     "{t}_saved_bytes"),
    ("moe_serve:kv_offload_restored_bytes_total", "counter", "KV tiers: bytes copied back from a tier to the "
     "device cache.", "{t}_restored_bytes"),
    ("moe_serve:kv_offload_used_bytes", "gauge", "KV tiers: bytes each tier holds now.", "{t}_used_bytes"),
    ("moe_serve:kv_offload_restore_seconds_total", "counter", "KV tiers: seconds spent restoring blocks (copies "
     "back to the device, disk reads), summed.", "restore_seconds"),
    ("moe_serve:kv_offload_disk_errors_total", "counter", "KV tiers: disk writes and reads that failed (a full "
     "disk, an I/O error); the block is recomputed, never an error to the client.", "disk_errors"),
]


def kv_offload_lines(model: str, ranks: list) -> list[str]:
    """The KV tiers' figures per rank (the `kv_offload` feature's stats; 0 where it is off)."""
    lines = []
    for name, kind, h, field in _KV_OFFLOAD:
        lines += [f"# HELP {name} {h}", f"# TYPE {name} {kind}"]
        for r, rs in enumerate(ranks):
            st = (getattr(rs, "features", None) or {}).get("kv_offload") or {}
            get = st.get if isinstance(st, dict) else lambda f, d, st=st: getattr(st, f, d)
            if "{t}" in field:
                lines += [f'{name}{{model_name="{model}",rank="{r}",tier="{t}"}} {get(field.format(t=t), 0)}'
                          for t in ("host", "disk")]
            else:
                lines.append(f'{name}{{model_name="{model}",rank="{r}"}} {get(field, 0)}')
    return lines
