"""Two-batch overlap of one MoE layer, measured on real ranks (gloo here; NCCL under torchrun).

For T tokens per rank split into two micro-batches it times, per MoE layer (median of --iters):
  comm      dispatch + combine of both micro-batches alone (no expert compute),
  compute   router + expert GEMMs of both micro-batches alone (no communication),
  plain     the whole layer, micro-batches one after the other,
  overlap   the whole layer, micro-batches interleaved (expert_parallel/runtime/overlap.py),
and the overlap efficiency (comm + compute - overlap) / min(comm, compute): 1 means the shorter of
the two is hidden completely. Results go to bench/results/overlap_<device>.json in the form the
cluster cost model (bench/cluster_model.py) reads.

    python bench/overlap.py --ep 2 4                  # CPU: spawns gloo processes
    torchrun --nproc-per-node 8 bench/overlap.py      # GPUs: NCCL
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from expert_parallel.runtime.dispatch.all_to_all import AllToAllDispatcher  # noqa: E402
from expert_parallel.runtime.layer import MoE, MoEContext, run_to_end  # noqa: E402
from expert_parallel.runtime.overlap import run_interleaved  # noqa: E402
from expert_parallel.runtime.router import SoftmaxTopKRouter  # noqa: E402
from expert_parallel.runtime.step import MoEStep  # noqa: E402
from moe_serve.kernels.grouped_gemm import fused_experts  # noqa: E402
from moe_serve import platform  # noqa: E402


def build(args, rank: int, world: int, device) -> MoE:
    torch.manual_seed(0)
    E = args.experts_per_rank * world
    d = AllToAllDispatcher(E, rank, world, None)
    ctx = MoEContext(d)
    with torch.device(device):
        router = SoftmaxTopKRouter(args.hidden, E, args.top_k, True)
        moe = MoE(args.hidden, args.inter, E, router, ctx, torch.float32 if device.type == "cpu" else torch.bfloat16,
                  layer_index=0)
    moe.ops = platform.resolve_ops(device, "triton" if device.type == "cuda" else "torch", "torch").experts
    for p in moe.parameters():
        p.data.normal_(0, p.shape[-1] ** -0.5)
    return moe


def timed(fn, iters: int, device) -> float:
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(args, rank: int, world: int, device) -> dict:
    moe = build(args, rank, world, device)
    d = moe.ctx.dispatcher
    g = torch.Generator(device="cpu").manual_seed(rank)
    dtype = moe.experts.w13.dtype
    half = args.tokens // 2
    xs = [torch.randn(n, args.hidden, generator=g).to(device, dtype) for n in (half, args.tokens - half)]
    routed = [moe.gate(x) for x in xs]
    sent = [d.dispatch(x, ids, w) for x, (w, ids) in zip(xs, routed)]

    def comm():
        for x, (w, ids) in zip(xs, routed):
            s = d.dispatch(x, ids, w)
            d.combine(s.x_RD, s.handle)

    def compute():
        for x, s in zip(xs, sent):
            moe.gate(x)
            fused_experts(s.x_RD, moe.experts.w13, moe.experts.w2, s.topk_weights_RK, s.topk_ids_RK,
                          backend=moe.ops)

    def plain():
        for i, x in enumerate(xs):
            run_to_end(moe.stages(x, MoEStep(microbatch=i)))

    def overlapped():
        run_interleaved([moe.stages(x, MoEStep(split=True, microbatch=i)) for i, x in enumerate(xs)])

    with torch.inference_mode():
        for f in (comm, compute, plain, overlapped):  # warm up
            f()
        r = {name: timed(f, args.iters, device) for name, f in
             (("comm_ms", comm), ("compute_ms", compute), ("plain_ms", plain), ("overlap_ms", overlapped))}
    gathered = [None] * world
    dist.all_gather_object(gathered, r)  # bench-only; the engine never pickles
    out = {k: max(g[k] for g in gathered) for k in r}  # a step waits for the slowest rank
    eff = (out["comm_ms"] + out["compute_ms"] - out["overlap_ms"]) / max(1e-9, min(out["comm_ms"], out["compute_ms"]))
    out.update(ep_size=world, tokens_per_rank=args.tokens, overlap_efficiency=max(0.0, min(1.0, eff)),
               raw_efficiency=eff, speedup=out["plain_ms"] / out["overlap_ms"])
    return out


def worker(rank: int, world: int, port: int, args, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        r = measure(args, rank, world, torch.device("cpu"))
        if rank == 0:
            q.put(r)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4], help="EP sizes to spawn (CPU)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank per step")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--experts-per-rank", type=int, default=4)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    rows = []
    if "RANK" in os.environ:  # under torchrun: one world, NCCL on GPUs
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        r = measure(args, dist.get_rank(), dist.get_world_size(), device)
        if dist.get_rank() == 0:
            rows.append(r)
        dist.destroy_process_group()
        if not rows:
            return
        dev_type = device.type
    else:
        ctx = mp.get_context("spawn")
        for w in args.ep:
            print(f"EP={w}: spawning {w} gloo ranks ...", flush=True)
            q = ctx.Queue()
            port = free_port()
            procs = [ctx.Process(target=worker, args=(r, w, port, args, q)) for r in range(w)]
            for pr in procs:
                pr.start()
            rows.append(q.get(timeout=600))
            for pr in procs:
                pr.join(60)
        dev_type = "cpu"
    print(f"{'EP':>3} {'tokens':>7} {'comm ms':>9} {'compute ms':>11} {'plain ms':>9} {'overlap ms':>11} "
          f"{'speedup':>8} {'efficiency':>11}")
    for r in rows:
        print(f"{r['ep_size']:>3} {r['tokens_per_rank']:>7} {r['comm_ms']:>9.2f} {r['compute_ms']:>11.2f} "
              f"{r['plain_ms']:>9.2f} {r['overlap_ms']:>11.2f} {r['speedup']:>8.2f} {r['overlap_efficiency']:>11.2f}")
    out = Path(__file__).parent / "results" / f"overlap_{dev_type}.json"
    out.parent.mkdir(exist_ok=True)
    meta = {"device_type": dev_type, "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if dev_type == "cuda" else "cpu", "args": vars(args)}
    out.write_text(json.dumps({**meta, "overlap": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
