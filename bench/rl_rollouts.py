"""What RL rollouts cost on a live server (docs/rl_rollouts.md): weight updates in seconds per GB,
the throughput cost of return_routed_experts, and the cluster model's figure for a 1T-parameter MoE.

(a) Weight updates, here: a synthetic MoE checkpoint (bench/synthetic_models.py) served by one
    `moe-serve serve`; a trainer in this process joins /init_weights_update_group (gloo over
    loopback) and pushes every tensor of the checkpoint through /update_weights_from_distributed
    (check_only first, as trainers do); then /update_weights_from_disk of the same checkpoint (its
    files in the page cache: the read is a memory copy, so this is the loader's own cost). Each is
    timed from the HTTP request to its answer, paused, and reported per GB of checkpoint.
(b) return_routed_experts: output tokens/s of the same requests with and without it, at 1 and 16
    concurrent requests, on the same server, alternated within the run.
(c) The cluster model: Kimi-K2's shape (bench/cluster_model.py's ModelConfig with its dimensions;
    1.04T parameters published, FP8 weights with block scales ~1.03 TB) updated on 8 GPUs over
    NCCL, with the link figures of bench/cluster_model.py's HARDWARE["h100"] (NVLink 450 GB/s and
    400 Gb/s InfiniBand per GPU, per direction; H200 has the same links, and its 141 GB are what 8
    GPUs need to hold 1 TB) at its link efficiency (0.8). The engine receives every tensor on every
    rank and keeps its slices (moe_serve/weight_sync.py), so one update moves the whole checkpoint
    into the node once (NCCL's broadcast is pipelined: the 8 ranks forward it over NVLink while the
    next chunk arrives). A trainer elsewhere: bound by the one inbound NIC the broadcast root's
    traffic takes; a trainer on the same node (colocated): by NVLink. Writing into the parameters
    is an HBM copy of each rank's share. For comparison, a scatter of only each rank's slices (8
    NICs in parallel) is printed too: it is not what the engine does.

    python bench/rl_rollouts.py [--model qwen3-moe-mid] [--requests 8] [--max-tokens 32]

Writes bench/results/rl_rollouts_<machine>.json (with bench/machine.py's description).
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import json
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

import httpx  # noqa: E402

RESULTS = HERE / "results"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tensors(path: str) -> dict:
    from safetensors.torch import load_file

    from moe_serve.weights import checkpoint_files

    out = {}
    for f in checkpoint_files(path):
        out.update(load_file(f))
    return out


def _post(url: str, path: str, body: dict | None = None, timeout: float = 600) -> dict:
    r = httpx.post(url + path, json=body or {}, timeout=timeout)
    if r.status_code != 200:
        raise SystemExit(f"{path}: {r.status_code} {r.text}")
    return r.json()


def weight_updates(url: str, path: str, repeats: int) -> dict:
    """Seconds of /update_weights_from_distributed (trainer here, gloo) and /update_weights_from_disk."""
    from moe_serve.weight_sync import broadcast_tensors, trainer_group

    state = _tensors(path)
    names = sorted(state)
    gb = sum(t.numel() * t.element_size() for t in state.values()) / 1e9
    spec = {"names": names, "dtypes": [str(state[n].dtype) for n in names],
            "shapes": [list(state[n].shape) for n in names]}
    port = _port()
    with cf.ThreadPoolExecutor(1) as pool:
        join = pool.submit(_post, url, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "bench", "backend": "gloo"})
        group = trainer_group("127.0.0.1", port, 2, "bench", "gloo", timeout_s=120)
        join.result(timeout=180)
        dist_s = []
        for i in range(repeats):
            _post(url, "/pause_generation")
            t0 = time.perf_counter()
            _post(url, "/update_weights_from_distributed", {**spec, "check_only": True})
            push = pool.submit(_post, url, "/update_weights_from_distributed", {**spec, "weight_version": f"d{i}"})
            broadcast_tensors(group, [state[n] for n in names])
            push.result(timeout=600)
            dist_s.append(time.perf_counter() - t0)
            _post(url, "/continue_generation")
    _post(url, "/destroy_weights_update_group")
    disk_s = []
    for i in range(repeats):
        t0 = time.perf_counter()
        _post(url, "/update_weights_from_disk", {"model_path": path, "weight_version": f"disk{i}"})
        disk_s.append(time.perf_counter() - t0)
    return {"checkpoint_gb": round(gb, 4), "tensors": len(names),
            "distributed_s": [round(s, 3) for s in dist_s], "disk_s": [round(s, 3) for s in disk_s],
            "distributed_s_per_gb": round(min(dist_s) / gb, 3), "disk_s_per_gb": round(min(disk_s) / gb, 3)}


async def _throughput(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int, routed: bool) -> dict:
    sem = asyncio.Semaphore(concurrency)
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if routed:
        body |= {"return_routed_experts": True, "routed_experts_format": "base64"}

    async with httpx.AsyncClient(timeout=600) as h:
        async def one(p):
            async with sem:
                r = await h.post(url + "/v1/completions", json={"prompt": p, **body})
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"]
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*[one(p) for p in prompts]))
        wall = time.perf_counter() - t0
    return {"output_tokens": tokens, "seconds": round(wall, 3), "tok_s": round(tokens / wall, 2)}


def routed_cost(url: str, pool: list[int], requests: int, max_tokens: int, levels=(1, 16)) -> list[dict]:
    """Output tok/s without and with return_routed_experts per concurrency, alternated: off, on, on, off."""
    import random

    rng = random.Random(0)
    rows = []
    for c in levels:
        prompts = [[rng.choice(pool) for _ in range(64)] for _ in range(max(requests, c))]
        asyncio.run(_throughput(url, prompts[:c], c, 4, False))  # warm: this level's batch shapes
        runs = {False: [], True: []}
        for routed in (False, True, True, False):
            runs[routed].append(asyncio.run(_throughput(url, prompts, c, max_tokens, routed)))
        off = sum(r["tok_s"] for r in runs[False]) / 2
        on = sum(r["tok_s"] for r in runs[True]) / 2
        rows.append({"concurrency": c, "requests": len(prompts), "max_tokens": max_tokens,
                     "tok_s_without": round(off, 2), "tok_s_with": round(on, 2),
                     "cost_pct": round(100 * (1 - on / off), 1), "runs": {"without": runs[False], "with": runs[True]}})
    return rows


def cluster_update(gpus: int = 8) -> dict:
    """The cluster model's figure for Kimi-K2 (module docstring, (c))."""
    from bench.cluster_model import HARDWARE, WEIGHT_BYTES, Efficiency, ModelConfig

    m = ModelConfig(layers=61, moe_layers=60, hidden=7168, vocab=163840, heads=64, experts=384, top_k=8)
    params = (m.replicated_params() + m.moe_layers * m.experts * m.expert_params() + 2 * m.vocab * m.hidden)
    hw, eff = HARDWARE["h100"], Efficiency()
    total = params * WEIGHT_BYTES["fp8"]
    experts = m.moe_layers * m.experts * m.expert_params() * WEIGHT_BYTES["fp8"]
    per_rank = total - experts + experts / gpus  # what each rank keeps: everything but the others' experts
    remote = total / (hw.nic_bw * eff.link)
    colocated = total / (hw.nvlink_bw * eff.link)
    write = 2 * per_rank / (hw.hbm_bw * eff.mem)  # read the received tensor, write the parameter
    scatter = per_rank / (hw.nic_bw * eff.link)
    return {"model": "Kimi-K2 shape (61 layers, 60 MoE of 384 experts of 7168x2048, MLA 64 heads, vocab 163840)",
            "params_model": params, "params_published": 1.04e12, "fp8_bytes": round(total), "gpus": gpus,
            "links": hw.name, "link_efficiency": eff.link, "nic_GBps": hw.nic_bw / 1e9,
            "nvlink_GBps": hw.nvlink_bw / 1e9, "kept_per_rank_bytes": round(per_rank),
            "trainer_remote_s": round(remote + write, 1), "trainer_colocated_s": round(colocated + write, 1),
            "write_in_s": round(write, 2), "scatter_slices_remote_s": round(scatter + write, 1),
            "assumptions": "one broadcast of every tensor to every rank (pipelined NCCL ring within the node); "
                           "the trainer's traffic enters the node through one 400 Gb/s NIC at 80% (remote) or "
                           "over NVLink at 80% (colocated); each rank copies its share into its parameters at "
                           "80% of 3.35 TB/s; no overlap of receive and write-in is assumed beyond that"}


def _serve(path: str, dtype: str, kv: int):
    from bench.serve import Server

    args = SimpleNamespace(served_model="rl", kv_cache_memory=kv, max_num_seqs=32, server_args="", dtype=dtype,
                           server_threads=None)
    s = Server(args, path)
    s.wait_ready(600)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-moe-mid")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    ap.add_argument("--machine", default=None, help="the results file's machine name (default: from the CPU)")
    a = ap.parse_args()
    from bench.machine import describe, machine
    from bench.synthetic_models import ensure_synthetic, token_pool

    path = ensure_synthetic(a.model)
    server = _serve(path, a.dtype, a.kv_cache_memory)
    try:
        routed = routed_cost(server.base_url, token_pool(path), a.requests, a.max_tokens)
        updates = weight_updates(server.base_url, path, a.repeats)
    finally:
        server.stop()
    res = {"machine": machine(), "machine_description": describe(), "model": a.model, "dtype": a.dtype,
           "weight_updates": updates, "routed_experts": routed, "cluster_kimi_k2": cluster_update()}
    _print(res)
    cpu = res["machine"]["cpu"].lower()
    name = a.machine or (f"xeon-{res['machine']['isa']}" if "xeon" in cpu else res["machine"]["isa"])
    out = Path(a.out) if a.out else RESULTS / f"rl_rollouts_{name}.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")


def _print(res: dict) -> None:
    u, c = res["weight_updates"], res["cluster_kimi_k2"]
    print(f"machine: {res['machine_description']}; model {res['model']} ({res['dtype']}, {u['checkpoint_gb']} GB, "
          f"{u['tensors']} tensors)")
    print(f"{'weight update':<44}{'best s':>10}{'s per GB':>10}")
    print(f"{'distributed (trainer here, gloo loopback)':<44}{min(u['distributed_s']):>10.3f}"
          f"{u['distributed_s_per_gb']:>10.3f}")
    print(f"{'from disk (page cache warm)':<44}{min(u['disk_s']):>10.3f}{u['disk_s_per_gb']:>10.3f}")
    print(f"{'concurrency':<14}{'tok/s without':>14}{'tok/s with':>12}{'cost':>8}   (return_routed_experts)")
    for r in res["routed_experts"]:
        print(f"{r['concurrency']:<14}{r['tok_s_without']:>14.1f}{r['tok_s_with']:>12.1f}{r['cost_pct']:>7.1f}%")
    print(f"cluster model, {c['model']}: {c['params_model'] / 1e12:.3f}T params, {c['fp8_bytes'] / 1e12:.2f} TB FP8, "
          f"{c['gpus']} GPUs ({c['links']}):")
    print(f"  trainer remote (1 NIC, {c['nic_GBps']:.0f} GB/s x {c['link_efficiency']}): {c['trainer_remote_s']} s; "
          f"colocated (NVLink): {c['trainer_colocated_s']} s; write-in {c['write_in_s']} s; "
          f"a scatter of each rank's slices over 8 NICs would take {c['scatter_slices_remote_s']} s")


if __name__ == "__main__":
    main()
