"""Decode step of a DeepSeek-V4-shaped model (sliding, CSA and HCA layers, mHC, hash and learned
routing), this tree against another revision, alternating in one run.

    .venv/bin/python bench/v4_decode.py --before <rev> [--after <rev>] [--shape mid] [--batch 8 32] [--rounds 3]
    .venv/bin/python bench/v4_decode.py --measure [--tree PATH] ...   (one tree's figures, JSON on stdout)

A random-init model of the shape (`tiny`: tests/checkpoints.py's V4_FIELDS; `mid`: wider, eight
layers, window 128, CSA groups of 4 with an indexer keeping 64 entries, HCA groups of 32), float32,
on this machine's default backends, is stepped by hand: B sequences whose caches hold random rows
for contexts of about `context` tokens (staggered by 3 per sequence, so each step completes some
groups and not others), then one decode step (model forward and the LM head) timed, median of
--repeats. `--before` (and `--after`, else this working tree) are checked out as git worktrees in a
temporary directory (removed at the end); --measure runs in each in turn for --rounds rounds, so
drift of the machine hits both alike; per batch the fastest round of each tree counts. Writes
bench/results/v4_decode_<shape>_cpu.json (or --out) with the machine (bench/machine.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
TINY = dict(hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
            q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=8, compress_rates={CSA: 2, HCA: 8},
            layer_types=[HCA, CSA, SLIDING, CSA], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=4,
            hc_mult=2, partial_rotary_factor=0.25, vocab_size=512)
MID = dict(hidden_size=512, moe_intermediate_size=256, num_hidden_layers=8, num_attention_heads=8, head_dim=128,
           q_lora_rank=256, num_experts_per_tok=2, n_routed_experts=16, n_shared_experts=1,
           compress_rates={CSA: 4, HCA: 32}, layer_types=[HCA, CSA, SLIDING, CSA] * 2,
           mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 6, sliding_window=128, o_groups=4, o_lora_rank=128,
           index_n_heads=8, index_head_dim=64, index_topk=64, hc_mult=4, partial_rotary_factor=0.25, vocab_size=4096)
SHAPES = {"tiny": TINY, "mid": MID}
BLOCK = 16


def build(shape: dict):
    import torch

    from expert_parallel.runtime.dispatch.local import LocalDispatcher
    from expert_parallel.runtime.layer import MoEContext
    from moe_serve import platform
    from moe_serve.models.registry import model_class

    hf = dict(shape, architectures=["DeepseekV4ForCausalLM"], max_position_embeddings=65536, rms_norm_eps=1e-6)
    model = model_class("DeepseekV4ForCausalLM")(hf, MoEContext(LocalDispatcher(hf["n_routed_experts"])),
                                                 torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.dtype.is_floating_point:
                continue
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    choice = platform.choose("cpu")
    platform.bind_ops(model, platform.resolve_ops(torch.device("cpu"), choice.moe_backend, choice.attention_backend,
                                                  choice.linear_backend, choice.norm_backend))
    return model, choice


def bind_caches(model, blocks: int) -> None:
    """Every paged row cache of the model as `blocks` blocks of random rows; sliding ones read the
    step's group 1 table, full ones group 0 (the same tables)."""
    import torch

    from attention.cache_kinds import FULL
    from attention.layer import PagedRows

    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, PagedRows):
            m.cache_group = 0 if m.cache_kind == FULL else 1
            m.bind([torch.randn(s, generator=g) for s in m.cache_shape(blocks, BLOCK)])


def step_times(model, B: int, S: int, repeats: int) -> list[float]:
    import torch

    from attention.metadata import AttentionMetadata

    lens = [S + 1 - 3 * b for b in range(B)]
    nb = -(-(S + 1) // BLOCK)
    tables = [list(range(b * nb, (b + 1) * nb)) for b in range(B)]
    ids = torch.randint(3, model.hf["vocab_size"], (B,))
    pos = torch.tensor([n - 1 for n in lens], dtype=torch.int64)

    def run():
        meta = AttentionMetadata.build([1] * B, lens, tables, BLOCK)
        meta.group_tables[1] = (meta.block_tables, meta.slot_mapping)
        with torch.no_grad():
            model.compute_logits(model(ids, pos, meta))

    run()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return times


def measure(a) -> dict:
    import torch

    torch.manual_seed(0)
    model, choice = build(SHAPES[a.shape])
    rows = []
    for B in a.batch:
        for S in a.context:
            bind_caches(model, B * -(-(S + 1) // BLOCK))
            t = step_times(model, B, S, a.repeats)
            rows.append(dict(batch=B, context=S, step_ms=sorted(t)[len(t) // 2] * 1e3, runs_ms=[x * 1e3 for x in t]))
    import moe_serve

    source = str(Path(moe_serve.__file__).resolve().parents[1])
    if source != str(Path(a.tree).resolve()):
        raise SystemExit(f"moe_serve imported from {source}, not from --tree {a.tree}")
    return dict(source=source, load_avg_1m=os.getloadavg()[0], threads=torch.get_num_threads(), torch=torch.__version__,
                backends=dict(experts=choice.moe_backend, attention=choice.attention_backend,
                              linear=choice.linear_backend, norm=choice.norm_backend), rows=rows)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def compare(a) -> dict:
    from bench.machine import machine

    before = _git("rev-parse", "--short", a.before)
    after = _git("rev-parse", "--short", a.after or "HEAD")
    flags = ["--shape", a.shape, "--repeats", str(a.repeats), "--batch", *map(str, a.batch),
             "--context", *map(str, a.context)]
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": Path(tmp) / "before", "after": Path(tmp) / "after" if a.after else ROOT}
        for name, rev in (("before", a.before), ("after", a.after)):
            if rev:
                _git("worktree", "add", "--detach", str(trees[name]), rev)
        try:
            for r in range(a.rounds):
                for name, root in trees.items():
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", "--tree", str(root), *flags]
                    out = subprocess.run(cmd, cwd=root, check=True, capture_output=True, text=True,
                                         env=dict(os.environ, PYTHONPATH=str(root))).stdout
                    runs[name].append(json.loads(out.strip().splitlines()[-1]))
                    print(f"round {r + 1} {name}: " + ", ".join(f"B={x['batch']} S={x['context']} {x['step_ms']:.1f} ms"
                                                                for x in runs[name][-1]["rows"]), flush=True)
        finally:
            for name, rev in (("before", a.before), ("after", a.after)):
                if rev:
                    _git("worktree", "remove", "--force", str(trees[name]))
    table = []
    for i, row in enumerate(runs["after"][0]["rows"]):
        best = {name: min(run["rows"][i]["step_ms"] for run in runs[name]) for name in runs}
        table.append(dict(batch=row["batch"], context=row["context"], before_ms=best["before"],
                          after_ms=best["after"], after_over_before=best["after"] / best["before"]))
        print(f"B={row['batch']:3d} S={row['context']:5d}  before {best['before']:8.2f} ms  after "
              f"{best['after']:8.2f} ms  after/before {best['after'] / best['before']:.2f}")
    dirty = not a.after and bool(_git("status", "--porcelain", "--", "attention", "moe_serve", "expert_parallel"))
    return dict(before=before, after=after + ("+uncommitted" if dirty else ""), shape=a.shape,
                config=SHAPES[a.shape], rounds=a.rounds, repeats=a.repeats, machine=machine(), table=table,
                runs=runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", help="a git revision to compare against")
    p.add_argument("--after", help="a git revision to compare (default: this working tree)")
    p.add_argument("--measure", action="store_true", help="time one tree and print its JSON")
    p.add_argument("--tree", default=str(ROOT), help="with --measure: the checkout to import from")
    p.add_argument("--shape", choices=sorted(SHAPES), default="mid")
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    p.add_argument("--context", type=int, nargs="+", default=[512])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.measure:
        here = str(Path(__file__).resolve().parent)
        sys.path[:] = [a.tree] + [x for x in sys.path if x not in (here, a.tree)]
        print(json.dumps(measure(a)))
        return 0
    if not a.before:
        p.error("--before REV or --measure")
    sys.path.insert(0, str(ROOT))
    result = compare(a)
    out = a.out or str(ROOT / "bench" / "results" / f"v4_decode_{a.shape}_cpu.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
