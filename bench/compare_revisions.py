"""Host overhead of two revisions side by side, in one run: bench/overhead.py's offline part (ms
per decode step at each batch) and ops part (aten ops per layer per step, host reads per step),
run from a checkout of --before and from this working tree, alternating (before, after, before,
after, ...) so that drift of the machine hits both alike. For refactors that must not slow a step.

    .venv/bin/python bench/compare_revisions.py --before 4dea0cd --models tiny,mid --rounds 2

Each round runs both trees once per model; per batch the fastest of the rounds counts, and the
ratio after / before is reported (above 1: the working tree is slower). The checkout is a git
worktree in a temporary directory, removed at the end. Writes bench/results/compare_<before>.json
(or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_overhead(tree: Path, model: str, parts: str, extra: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, str(tree / "bench" / "overhead.py"), "--model", model, "--parts", parts, "--out", out,
           *extra]
    print(f"$ ({tree}) {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, cwd=tree, check=True, env=dict(os.environ, PYTHONPATH=str(tree)))
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="a git revision of this repository")
    p.add_argument("--models", default="tiny,mid")
    p.add_argument("--parts", default="offline,ops")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--overhead-args", default="", help="more bench/overhead.py flags, one string")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rev = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    after_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True, capture_output=True,
                               text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout)
    extra = args.overhead_args.split()
    results: dict = {"before": rev, "after": after_rev + ("+uncommitted" if dirty else ""), "machine":
                     platform.processor() or platform.machine(), "cpus": os.cpu_count(), "rounds": args.rounds,
                     "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        before_tree = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(before_tree), rev], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for model in args.models.split(","):
                runs: dict[str, list[dict]] = {"before": [], "after": []}
                for r in range(args.rounds):
                    for side, tree in (("before", before_tree), ("after", ROOT)):
                        t0 = time.perf_counter()
                        runs[side].append(run_overhead(tree, model, args.parts, extra))
                        print(f"  {model} round {r + 1} {side}: {time.perf_counter() - t0:.0f} s", flush=True)
                results["models"][model] = summarize(runs)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before_tree)], cwd=ROOT, capture_output=True)
    out = args.out or str(ROOT / "bench" / "results" / f"compare_{rev}.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print_table(results)
    print(f"wrote {out}")
    return 0


def summarize(runs: dict[str, list[dict]]) -> dict:
    s: dict = {"runs": runs}
    if all("offline" in r for r in runs["before"] + runs["after"]):
        rows = []
        batches = [row["batch"] for row in runs["before"][0]["offline"]["rows"]]
        for i, b in enumerate(batches):
            best = {side: min(r["offline"]["rows"][i]["ms_per_decode_step"] for r in runs[side]) for side in runs}
            rows.append({"batch": b, "before_ms": best["before"], "after_ms": best["after"],
                         "after_over_before": best["after"] / best["before"]})
        s["offline"] = rows
    if all("ops" in r for r in runs["before"] + runs["after"]):
        s["ops"] = {side: {"aten_ops_per_layer_per_step": runs[side][0]["ops"]["aten_ops_per_layer_per_step"],
                           "host_reads_per_step": runs[side][0]["ops"]["host_reads_per_step"]} for side in runs}
    return s


def print_table(results: dict) -> None:
    print(f"\nbefore = {results['before']}, after = {results['after']} ({results['machine']}, {results['cpus']} CPUs; "
          f"fastest of {results['rounds']} rounds)")
    for model, s in results["models"].items():
        for row in s.get("offline", []):
            print(f"  {model:6} batch {row['batch']:4d}: {row['before_ms']:8.2f} -> {row['after_ms']:8.2f} ms/step "
                  f"(x{row['after_over_before']:.3f})")
        if "ops" in s:
            b, a = s["ops"]["before"], s["ops"]["after"]
            print(f"  {model:6} aten ops/layer/step {b['aten_ops_per_layer_per_step']:.1f} -> "
                  f"{a['aten_ops_per_layer_per_step']:.1f}; host reads/step {b['host_reads_per_step']:.1f} -> "
                  f"{a['host_reads_per_step']:.1f}")


if __name__ == "__main__":
    raise SystemExit(main())
