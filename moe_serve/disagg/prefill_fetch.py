"""The decode side of disaggregation in the front end, a part of `AsyncEngine`
(engine/async_engine.py, its one user): a rank reserved blocks for a request's prompt, so ask the
prefill instance to write them, and tell the rank how it went (KVDone); blocks a write may still
land in are given back only once the prefill side's write has ended."""
from __future__ import annotations

import asyncio
import logging
import time

from moe_serve.protocol import KVDone

log = logging.getLogger("moe_serve.async_engine")

# Decode side: how long blocks of a failed transfer wait (past the prefill side's own deadline) for
# word that its write has ended, before they are given back anyway (a hang guard, with a warning).
WRITE_END_GUARD_S = 600.0


class PrefillFetch:
    """AsyncEngine's requests to prefill instances (mixed into AsyncEngine: `_queues`,
    `_kv_prefill`, `_inbox`, `kv_timeout_s`, `metrics`, `_http`)."""

    # --- disaggregation: the decode side asks a prefill instance for a prompt's KV ----------------
    def _fetch_kv(self, rank: int, o) -> None:
        """A rank reserved blocks for a request's prompt: have the prefill instance fill them (in
        the request's event loop). Whatever happens, the rank hears back (KVDone), so blocks held
        for an aborted request are given back once no writer can be using them."""
        with self._lock:
            dest = self._queues.get(o.request_id)
            pre = self._kv_prefill.pop(o.request_id, None)
        if dest is None or pre is None:  # aborted before the reservation was known: nobody writes
            self._inbox.put((rank, KVDone(o.request_id, False, "the request was aborted")))
            return
        asyncio.run_coroutine_threadsafe(self._prefill(rank, o.request_id, o.kv_target, *pre), dest[0])

    async def _prefill(self, rank: int, cid: str, target, url: str, headers: dict, ids: list[int],
                       routed: bool = False) -> None:
        """routed: the request asked for return_routed_experts; the answer must then carry the rows
        of positions 0 .. target.end - 1, which go to the rank with the KVDone (an answer without
        them counts as a failed transfer: the rank computes the prompt, and its rows, itself)."""
        import httpx
        import msgspec

        from moe_serve.disagg.messages import PrefillRequest, PrefillResponse

        if self._http is None:  # no read timeout: the answer is awaited past this side's deadline (below)
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        # The prefill side gives up a little before this side does; it answers once no write of the
        # request is in flight (a posted write cannot be recalled), so any answer means "ended".
        budget = max(self.kv_timeout_s * 0.8, self.kv_timeout_s - 5.0)
        body = msgspec.json.encode(PrefillRequest(cid, ids, target, budget, routed))
        t0 = time.monotonic()
        post = asyncio.ensure_future(self._http.post(url + "/v1/disagg/prefill", content=body, headers={
            **headers, "content-type": "application/json"}))
        ok, ended, error, rows = False, True, "", None
        try:
            r = await asyncio.wait_for(asyncio.shield(post), self.kv_timeout_s)
            if r.status_code == 200:
                rows = msgspec.json.decode(r.content, type=PrefillResponse).routed_experts
                ok = not routed or _rows_cover(rows, target.end)
                if not ok:
                    error = f"the prefill instance {url} answered without the prompt's routed experts"
            else:
                error = f"the prefill instance {url} answered {r.status_code}: {r.text[:300]}"
        except asyncio.TimeoutError:  # its write may still be in flight
            ended = False
            error = f"the prefill instance {url} did not answer within {self.kv_timeout_s:g}s"
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as e:  # never sent: nothing written
            error = f"the prefill instance {url} could not be reached: {type(e).__name__}: {e}"
        except httpx.HTTPError as e:  # sent, and its answer lost: the instance may still be writing
            ended = False
            error = f"the prefill instance {url} failed: {type(e).__name__}: {e}"
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            error = f"the prefill instance {url} failed: {type(e).__name__}: {e}"
        seconds = time.monotonic() - t0
        self.metrics.kv_fetch.observe(seconds)
        if ok:
            log.info("request %s: %d prompt tokens' KV arrived from %s in %.3fs", cid,
                     target.end - target.start, url, seconds)
        else:
            log.warning("request %s: %s; computing its prompt here%s", cid, error,
                        "" if ended else " (its reserved blocks stay out of use until the prefill side's write ends)")
        self._inbox.put((rank, KVDone(cid, ok, error, ended, rows if ok and routed else None)))
        if not ended:
            why = await self._write_ended(url, post, budget)
            log.info("request %s: %s: the blocks reserved for its prompt are given back", cid, why)
            self._inbox.put((rank, KVDone(cid, False, why, True)))

    async def _write_ended(self, url: str, post, budget: float) -> str:
        """Wait until no write into a request's reserved blocks can land: the prefill instance's
        answer (it answers only then), or the instance gone (its engine core dies with its front
        end). A hang guard gives them back, with a warning, after WRITE_END_GUARD_S."""
        import httpx

        deadline = time.monotonic() + budget + WRITE_END_GUARD_S
        try:
            r = await asyncio.wait_for(post, deadline - time.monotonic())
            return f"the prefill instance {url} answered {r.status_code}"
        except asyncio.TimeoutError:
            pass
        except Exception:  # the answer was lost: is the instance still there?
            while time.monotonic() < deadline:
                try:
                    await self._http.get(url + "/health", timeout=5.0)
                except httpx.ConnectError:
                    return f"the prefill instance {url} is gone"
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        log.warning("the prefill instance %s neither answered nor went away within %.0fs", url,
                    budget + WRITE_END_GUARD_S)
        return "given up waiting for the prefill side"


def _rows_cover(rows, end: int) -> bool:
    """rows (protocol.RoutedExpertRows or None) hold exactly positions 0 .. end - 1."""
    return (rows is not None and rows.start == 0 and rows.num_layers > 0 and rows.top_k > 0
            and len(rows.data) == 2 * end * rows.num_layers * rows.top_k)
