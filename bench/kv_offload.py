"""KV tiers below the device pool (--kv-offloading-size, --kv-offloading-disk): one server per
configuration (no tier, host tier, disk tier), each with a device pool forced to about a tenth of
the workload's working set, under the same multi-turn chat workload (`moe-serve bench serve
--dataset-name multi_turn`: each turn resends the conversation so far plus a new user message).

    python bench/kv_offload.py                           qwen3-moe-tiny, CPU, about two minutes
    python bench/kv_offload.py --json bench/results/kv_offload_cpu.json

Reported per configuration: the prefix hit rate (prompt tokens found on the device or in a tier /
prompt tokens looked up, from /metrics), prompt tokens computed, blocks restored per tier, TTFT
p50/p95 and output tok/s. On a CPU the host tier is the same memory as the pool; the disk tier is
the one a CPU server would use.
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
from types import SimpleNamespace

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from synthetic_models import resolve_model  # noqa: E402

sys.path.insert(0, str(HERE))  # synthetic_models takes bench/ off the path
from machine import machine  # noqa: E402

sys.path.insert(0, str(HERE))
from serve import Server  # noqa: E402  (it takes bench/ off the path too)


def scrape(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text

    def total(name: str, **labels) -> float:
        sel = "".join(f'[^}}]*{k}="{v}"' for k, v in labels.items())
        return sum(float(m.group(1)) for m in re.finditer(rf"^{name}{{{sel}[^}}]*}} (\S+)$", text, re.M))

    q, h = total("moe_serve:prefix_cache_queries_total"), total("moe_serve:prefix_cache_hits_total")
    return {"prefix_hit_rate": h / q if q else 0.0, "prompt_tokens_computed": int(total("moe_serve:prompt_tokens_total")),
            "host_hits": int(total("moe_serve:kv_offload_hits_total", tier="host")),
            "disk_hits": int(total("moe_serve:kv_offload_hits_total", tier="disk")),
            "disk_errors": int(total("moe_serve:kv_offload_disk_errors_total"))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-moe-tiny")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--input-len", type=int, default=48, help="words of each turn's new user message")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--ratio", type=float, default=10.0, help="working set / device pool")
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    path, _, description = resolve_model(ns.model)
    # Working set: every conversation's last context, roughly (a word is about 1.5 tokens, plus the
    # chat template's few tokens a turn); the pool a tenth of it, at least one conversation's.
    context = ns.turns * (int(1.5 * ns.input_len) + ns.output_len + 8)
    working_blocks = ns.conversations * -(-context // ns.block_size)
    pool = max(int(working_blocks / ns.ratio), ns.concurrency * -(-context // ns.block_size) // 2 + 2)
    disk_dir = tempfile.mkdtemp(prefix="kv-tier-")
    configs = {"none": [], "host": ["--kv-offloading-size", "1"],
               "disk": ["--kv-offloading-disk", disk_dir, "--kv-offloading-disk-size", "1"]}
    out = {"machine": machine(), "date": dt.date.today().isoformat(), "model": description,
           "workload": {k: getattr(ns, k) for k in ("conversations", "turns", "input_len", "output_len",
                                                    "concurrency", "block_size")},
           "device_pool_blocks": pool, "working_set_blocks_estimate": working_blocks, "configs": {}}
    for name, flags in configs.items():
        args = SimpleNamespace(served_model="m", kv_cache_memory=0, max_num_seqs=ns.concurrency, dtype="float32",
                               server_threads=None, server_args=" ".join(
                                   ["--num-kv-blocks", str(pool), "--block-size", str(ns.block_size), *flags]))
        server = Server(args, path)
        try:
            server.wait_ready(300)
            res = Path(tempfile.mkdtemp()) / "result.json"
            cmd = [sys.executable, "-m", "moe_serve.entrypoints.cli", "bench", "serve", "--base-url", server.base_url,
                   "--model", "m", "--dataset-name", "multi_turn", "--num-prompts",
                   str(ns.conversations), "--multi-turn-num-turns", str(ns.turns), "--random-input-len",
                   str(ns.input_len), "--random-output-len", str(ns.output_len), "--ignore-eos",
                   "--max-concurrency", str(ns.concurrency), "--seed", "0", "--disable-tqdm", "--save-result",
                   "--result-dir", str(res.parent), "--result-filename", res.name, "--percentile-metrics",
                   "ttft,tpot", "--metric-percentiles", "50,95"]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            r = json.loads(res.read_text())["levels"][0]
            m = scrape(server.base_url)
            out["configs"][name] = {**m, "ttft_p50_ms": r.get("p50_ttft_ms"), "ttft_p95_ms": r.get("p95_ttft_ms"),
                                    "output_tok_s": r.get("output_throughput"), "completed": r.get("completed")}
            print(f"{name:5s} prefix hit {100 * m['prefix_hit_rate']:.1f}%, prompt tokens computed "
                  f"{m['prompt_tokens_computed']}, restored blocks host {m['host_hits']} disk {m['disk_hits']}; "
                  f"TTFT p50 {r.get('p50_ttft_ms', float('nan')):.1f} ms, p95 {r.get('p95_ttft_ms', float('nan')):.1f}"
                  f" ms; {r.get('output_throughput', float('nan')):.1f} output tok/s; completed {r.get('completed')}",
                  flush=True)
        finally:
            server.stop()
    if ns.json:
        Path(ns.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
