"""KV block moves between two processes through each transfer engine (moe_serve/disagg/transfer.py),
same run, this host's memory (DRAM to DRAM):

    python bench/kv_transfer.py
    python bench/kv_transfer.py --json bench/results/kv_transfer_cpu.json

A "decode" process registers a paged cache (--cache-mib, blocks of --block-kib) and publishes its
engine metadata; a "prefill" process registers its own, connects, and writes a request's blocks
(--tokens-per-request tokens of a model with --bytes-per-token KV bytes per token, its blocks
scattered over the cache, as a paged cache holds them) into scattered blocks of the other, one
write per request. Reported per engine: setup (register + connect) time, latency of one request's
move p50/p95, bandwidth over --requests requests posted back to back, and whether every byte
arrived (each block's contents checked on the decode side).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine  # noqa: E402


def _decode_side(engine, cache_bytes, conn):
    import torch

    from moe_serve.disagg.transfer import make_transfer

    cache = torch.zeros(cache_bytes, dtype=torch.uint8)
    t = make_transfer(engine)
    t.register([(cache.data_ptr(), cache.numel())])
    conn.send((t.metadata(), cache.data_ptr()))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        blocks, block_bytes, seeds = msg  # check what arrived: each block filled with its seed
        bad = sum(int(not bool((cache[b * block_bytes:(b + 1) * block_bytes] == s).all())) for b, s in zip(blocks, seeds))
        conn.send(bad)
    t.close()


def run_engine(engine: str, ns) -> dict:
    import torch

    from moe_serve.disagg.transfer import make_transfer

    block_bytes = ns.block_kib * 1024
    nblocks = ns.cache_mib * (1 << 20) // block_bytes
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_decode_side, args=(engine, nblocks * block_bytes, there), daemon=True)
    proc.start()
    try:
        cache = torch.zeros(nblocks * block_bytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        t = make_transfer(engine)
        t.register([(cache.data_ptr(), cache.numel())])
        meta, remote_base = here.recv()
        peer = t.connect(meta)
        setup_s = time.perf_counter() - t0
        base = cache.data_ptr()
        per_req = max(1, ns.tokens_per_request * ns.bytes_per_token // block_bytes)
        g = torch.Generator().manual_seed(0)

        def request(r, dst=None, src=None):
            src = src if src is not None else torch.randperm(nblocks, generator=g)[:per_req].tolist()
            dst = dst if dst is not None else torch.randperm(nblocks, generator=g)[:per_req].tolist()
            seeds = [(r * 7 + i) % 251 + 1 for i in range(per_req)]
            for b, s in zip(src, seeds):
                cache[b * block_bytes:(b + 1) * block_bytes] = s
            return ([(base + b * block_bytes, block_bytes) for b in src],
                    [(remote_base + b * block_bytes, block_bytes) for b in dst], dst, seeds)

        def wait(h):
            while True:
                st = t.poll(h)
                if st != "PROC":
                    t.release(h)
                    return st

        lat, bad = [], 0
        for r in range(ns.warmup + ns.latency_requests):
            local, remote, dst, seeds = request(r)
            s = time.perf_counter()
            st = wait(t.write(peer, local, remote))
            if r >= ns.warmup:
                lat.append(time.perf_counter() - s)
            assert st == "DONE", st
            here.send((dst, block_bytes, seeds))
            bad += here.recv()
        # Bandwidth: requests posted back to back (distinct destination blocks), then all awaited.
        n = min(ns.requests, nblocks // per_req)
        order, srcs = torch.randperm(nblocks, generator=g).tolist(), torch.randperm(nblocks, generator=g).tolist()
        reqs = [request(1000 + r, order[r * per_req:(r + 1) * per_req], srcs[r * per_req:(r + 1) * per_req])
                for r in range(n)]
        out = {"setup_s": setup_s, "blocks_per_request": per_req, "bytes_per_request": per_req * block_bytes,
               "latency_ms_p50": 1e3 * statistics.median(lat),
               "latency_ms_p95": 1e3 * sorted(lat)[int(0.95 * (len(lat) - 1))],
               "latency_GBps_p50": per_req * block_bytes / statistics.median(lat) / 1e9}
        s = time.perf_counter()
        handles = [t.write(peer, local, remote) for local, remote, _, _ in reqs]
        states = [wait(h) for h in handles]
        elapsed = time.perf_counter() - s
        if all(x == "DONE" for x in states):
            out["bandwidth_GBps"] = n * per_req * block_bytes / elapsed / 1e9
            for _, _, dst, seeds in reqs:  # destinations are distinct: every block must hold its seed
                here.send((dst, block_bytes, seeds))
                bad += here.recv()
        else:
            out["bandwidth_error"] = f"{states.count('ERR')} of {n} writes posted back to back failed"
        out["blocks_wrong"] = bad
        here.send(None)
        t.close()
        return out
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", nargs="+", default=["nixl", "mooncake"])
    p.add_argument("--cache-mib", type=int, default=512)
    p.add_argument("--block-kib", type=int, default=64, help="bytes of one KV block (all layers), KiB")
    p.add_argument("--bytes-per-token", type=int, default=4096,
                   help="KV bytes per token over all layers (4096: a small GQA model in bf16)")
    p.add_argument("--tokens-per-request", type=int, default=2048)
    p.add_argument("--latency-requests", type=int, default=50)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    out = {"machine": machine(), "date": dt.date.today().isoformat(), "settings": vars(ns), "engines": {}}
    for e in ns.engines:
        try:
            r = run_engine(e, ns)
        except Exception as ex:  # an engine that is not installed or failed here: say so, go on
            r = {"error": f"{type(ex).__name__}: {ex}"}
        out["engines"][e] = r
        print(e, json.dumps(r), flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
