"""Cache-aware routing across data-parallel ranks against fewest-outstanding-tokens routing, on a
multi-turn chat workload (each turn's prompt is the previous turn's prompt, the answer received and
a new user message), through HTTP on CPU ranks (torchrun, gloo), one job per policy, same run:

    python bench/cache_aware_routing.py                    qwen3-moe-tiny, 4 ranks
    python bench/cache_aware_routing.py --json bench/results/cache_aware_routing_cpu.json

Reported per policy: the prefix-hit rate over every rank (prompt tokens found in a rank's prefix
cache / prompt tokens looked up, from /metrics), each rank's, TTFT p50/p95 and output tok/s from
`moe-serve bench serve --dataset-name multi_turn`. The workload is the one the serving benchmark
ships: `--conversations` conversations of `--turns` turns, `--concurrency` at a time.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eplb import Job  # noqa: E402
from synthetic_models import resolve_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # synthetic_models takes bench/ off the path
from machine import machine  # noqa: E402


def hit_rates(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text

    def per_rank(name):
        return {int(m.group(1)): float(m.group(2)) for m in
                re.finditer(rf'^moe_serve:{name}_total{{[^}}]*rank="(\d+)"}} (\S+)$', text, re.M)}
    q, h = per_rank("prefix_cache_queries"), per_rank("prefix_cache_hits")
    return {"overall": sum(h.values()) / max(sum(q.values()), 1.0),
            "per_rank": [h[r] / q[r] if q[r] else 0.0 for r in sorted(q)],
            "prompt_tokens_per_rank": [int(q[r]) for r in sorted(q)]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-moe-tiny")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--input-len", type=int, default=96, help="tokens of each turn's new user message")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    path, _, description = resolve_model(ns.model)
    out = {"machine": machine(), "date": dt.date.today().isoformat(), "model": description, "nproc": ns.nproc,
           "workload": {k: getattr(ns, k) for k in ("conversations", "turns", "input_len", "output_len",
                                                    "concurrency")},
           "policies": {}}
    for policy in ("cache_aware", "least_load"):
        log = tempfile.NamedTemporaryFile(prefix=f"routing-{policy}-", suffix=".log", delete=False).name
        job = Job(ns.nproc, ["--model", path, "--dtype", "float32", "--load-balance-method", policy,
                             "--log-interval", "1000"], log)
        try:
            res = Path(tempfile.mkdtemp()) / "result.json"
            cmd = [sys.executable, "-m", "moe_serve.entrypoints.cli", "bench", "serve", "--base-url", job.url,
                   "--model", path, "--dataset-name", "multi_turn", "--num-prompts", str(ns.conversations),
                   "--multi-turn-num-turns", str(ns.turns), "--random-input-len", str(ns.input_len),
                   "--random-output-len", str(ns.output_len), "--ignore-eos", "--max-concurrency",
                   str(ns.concurrency), "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir",
                   str(res.parent), "--result-filename", res.name, "--percentile-metrics", "ttft,tpot",
                   "--metric-percentiles", "50,95"]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            r = json.loads(res.read_text())["levels"][0]
            rates = hit_rates(job.url)
            out["policies"][policy] = {"prefix_hit_rate": rates, "ttft_p50_ms": r.get("p50_ttft_ms"),
                                       "ttft_p95_ms": r.get("p95_ttft_ms"), "tpot_p50_ms": r.get("p50_tpot_ms"),
                                       "output_tok_s": r.get("output_throughput"),
                                       "completed": r.get("completed")}
            print(f"{policy:12s} prefix hit {100 * rates['overall']:.1f}% (per rank "
                  f"{', '.join(f'{100 * x:.0f}%' for x in rates['per_rank'])}); TTFT p50 "
                  f"{r.get('p50_ttft_ms', float('nan')):.1f} ms, p95 {r.get('p95_ttft_ms', float('nan')):.1f} ms; "
                  f"{r.get('output_throughput', float('nan')):.1f} output tok/s", flush=True)
        finally:
            job.stop()
    ca, ll = out["policies"]["cache_aware"], out["policies"]["least_load"]
    out["ratios"] = {"hit_rate": ca["prefix_hit_rate"]["overall"] / max(ll["prefix_hit_rate"]["overall"], 1e-9),
                     "ttft_p50": (ca["ttft_p50_ms"] or 0) / max(ll["ttft_p50_ms"] or 1e-9, 1e-9)}
    print(f"cache_aware / least_load: hit rate x{out['ratios']['hit_rate']:.2f}, TTFT p50 x{out['ratios']['ttft_p50']:.2f}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
