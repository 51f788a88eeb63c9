"""Which instance takes a request: the workers' state as the router sees it, and the policies
(cache_aware, least_load, round_robin) over it. No HTTP here beyond the health check."""

import asyncio
import hashlib
import itertools
import json
import logging
from collections import OrderedDict

from moe_serve.engine.routing import cache_aware_choice

log = logging.getLogger("moe_serve.router")

POLICIES = ("cache_aware", "least_load", "round_robin")
CHUNK = 32  # characters per hashed chunk of a request's key


def request_key(path: str, body: dict) -> str:
    """The request's prompt-shaping fields as one string whose prefix is stable across the turns of
    a conversation (each message serialized on its own, in order)."""
    def enc(x) -> str:
        return json.dumps(x, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    parts = []
    if path == "/v1/completions":
        prompt = body.get("prompt")
        parts.append(prompt if isinstance(prompt, str) else enc(prompt))
    else:
        for field in ("tools", "instructions", "system"):
            if body.get(field) is not None:
                parts.append(enc(body[field]))
        msgs = body.get("messages", body.get("input"))
        if isinstance(msgs, list):
            parts += [enc(m) for m in msgs]
        elif msgs is not None:
            parts.append(enc(msgs))
    return "\x1e".join(parts)


def chunk_hashes(text: str) -> list[bytes]:
    out, parent = [], b"moe-serve-router"
    data = text.encode("utf-8", "surrogatepass")
    for i in range(0, len(data) - len(data) % CHUNK, CHUNK):
        parent = hashlib.blake2b(parent + data[i:i + CHUNK], digest_size=16).digest()
        out.append(parent)
    return out


class Worker:
    def __init__(self, url: str, cache_entries: int, role: str = "worker"):
        self.url = url.rstrip("/")
        self.role = role  # worker | prefill | decode
        self.in_flight = 0
        self.healthy = True
        self.requests = 0
        self.failures = 0
        self.seen: OrderedDict[bytes, None] = OrderedDict()  # chunk hashes sent here, least recent first
        self.cache_entries = cache_entries

    def matched(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.seen:
                break
            n += 1
        return n

    def remember(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.seen[h] = None
            self.seen.move_to_end(h)
        while len(self.seen) > self.cache_entries:
            self.seen.popitem(last=False)


class WorkerPool:
    def __init__(self, urls: list[str], policy: str = "cache_aware", load_margin: int = 8,
                 cache_entries: int = 1 << 18, threshold: float = 0.5, role: str = "worker"):
        if not urls:
            raise ValueError(f"--{role}: give at least one URL")
        if policy not in POLICIES:
            raise ValueError(f"--policy={policy} is not one of {', '.join(POLICIES)}")
        if load_margin < 0:
            raise ValueError(f"--load-margin={load_margin} must be >= 0")
        if not 0 <= threshold <= 1:
            raise ValueError(f"--cache-threshold={threshold} must be within [0, 1]")
        if cache_entries < 1:
            raise ValueError(f"--cache-entries={cache_entries} must be >= 1")
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"--{role} {u!r} is not an http:// or https:// URL")
        self.workers = [Worker(u, cache_entries, role) for u in urls]
        self.policy, self.load_margin, self.threshold = policy, load_margin, threshold
        self._turn = itertools.count()
        self.routed_by_prefix = 0
        # Responses API: which worker stored each response (previous_response_id must go back there).
        self.response_owner: OrderedDict[str, int] = OrderedDict()

    def own_response(self, response_id: str, worker: int) -> None:
        self.response_owner[response_id] = worker
        while len(self.response_owner) > 1 << 16:
            self.response_owner.popitem(last=False)

    def hashes(self, path: str, body: dict) -> list[bytes]:
        """The request's prefix chunks, as the policy matches them (none unless cache_aware)."""
        return chunk_hashes(request_key(path, body)) if self.policy == "cache_aware" else []

    def pick(self, hashes: list[bytes], exclude: set[int]) -> int | None:
        """The worker index for a request (None: every worker was tried)."""
        cand = [i for i in range(len(self.workers)) if i not in exclude]
        if not cand:
            return None
        up = [i for i in cand if self.workers[i].healthy] or cand  # all down: try anyway
        if self.policy == "round_robin":
            return up[next(self._turn) % len(up)]
        loads = {i: self.workers[i].in_flight for i in up}
        sizes = {i: len(self.workers[i].seen) for i in up}
        if self.policy == "least_load":
            return min(up, key=lambda i: (loads[i], sizes[i], i))
        matched = {i: self.workers[i].matched(hashes) for i in up}
        i, by_prefix = cache_aware_choice(up, matched, len(hashes), loads, sizes, self.threshold, self.load_margin)
        self.routed_by_prefix += by_prefix
        return i

    async def check_health(self, client, interval_s: float) -> None:
        import httpx

        while True:
            for w in self.workers:
                try:
                    ok = (await client.get(w.url + "/health", timeout=min(interval_s, 5.0))).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok != w.healthy:
                    log.info("worker %s is %s", w.url, "up" if ok else "down")
                w.healthy = ok
            await asyncio.sleep(interval_s)
