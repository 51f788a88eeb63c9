"""KV tiers through `moe-serve serve`: a disk tier below a device pool that holds a fraction of the
prompts; asking every prompt again gives the same greedy completions, with their prefixes read back
from the disk tier (as /metrics counts them), and the tier's directory goes with the server."""
from __future__ import annotations

import os
import random

import httpx

from tests.e2e.server import ServerProcess


def test_repeated_prompts_come_back_from_the_disk_tier(checkpoints, tmp_path):
    server = ServerProcess(["--model", checkpoints["mixtral"], "--dtype", "float32", "--served-model-name", "tiny",
                            "--block-size", "4", "--num-kv-blocks", "24", "--max-num-seqs", "2",
                            "--kv-offloading-disk", str(tmp_path), "--kv-offloading-disk-size", "0.01"])
    try:
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 500) for _ in range(22)] for _ in range(10)]  # 50 blocks; the pool has 24

        def complete(p):
            r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 4,
                                                                 "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        first = [complete(p) for p in prompts]
        again = [complete(p) for p in prompts]
        assert again == first
        text = httpx.get(server.url + "/metrics", timeout=10).text
        hits = [line for line in text.splitlines() if line.startswith("moe_serve:kv_offload_hits_total")
                and 'tier="disk"' in line]
        assert hits and float(hits[0].split()[-1]) > 0, hits
        assert os.listdir(tmp_path)  # the engine's own directory, while it runs
    finally:
        server.stop()
    assert not os.listdir(tmp_path)  # removed at shutdown
