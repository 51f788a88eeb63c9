"""POST /v1/disagg/prefill, on a prefill instance (--disaggregation-mode prefill): a decode
instance's front end asks it to compute a prompt and write its KV into the blocks the decode
instance reserved; the answer comes once the write is done (or known never to land)."""
from __future__ import annotations

import asyncio

from moe_serve.entrypoints.openai.request_limits import BadRequest
from moe_serve.entrypoints.openai.runner import RequestRunner
from moe_serve.sampling_params import SamplingParams


class PrefillServing:
    def __init__(self, runner: RequestRunner):
        self.runner = runner

    async def prefill(self, req, rid: str, deadline: float | None = None):
        from moe_serve.disagg.messages import PrefillResponse
        from moe_serve.protocol import KVParams

        engine = self.runner.engine
        if engine.disaggregation_mode != "prefill":
            raise BadRequest(f"this instance was started with --disaggregation-mode {engine.disaggregation_mode}"
                             ": only a prefill instance computes prompts for others", None)
        ids, t = req.prompt_token_ids, req.target
        if len(ids) != t.end + 1 or not 0 <= t.start < t.end:
            raise BadRequest(f"prompt_token_ids has {len(ids)} tokens; the target asks for positions {t.start} .. "
                             f"{t.end - 1}", "prompt_token_ids")
        if not req.timeout_s > 0:
            raise BadRequest(f"timeout_s must be > 0, got {req.timeout_s}", "timeout_s")
        # With return_routed_experts this side records the prompt's routing too (refused here, 400
        # naming the field, for a model without MoE layers, as on any instance).
        params = SamplingParams(max_tokens=1, temperature=0.0, return_routed_experts=req.return_routed_experts)
        stream = self.runner.submit(rid, [ids], params, kv=KVParams("prefill", t))

        async def drain():
            last = None
            async for _, out in stream:
                last = out
            return last

        late = False
        try:
            last = await asyncio.wait_for(drain(), min(req.timeout_s, (deadline - asyncio.get_running_loop().time())
                                                       if deadline is not None else req.timeout_s))
        except asyncio.TimeoutError:
            # Whatever answer this sends, the decode side reuses its blocks on it: so the request is
            # aborted but its stream kept, and the answer waits for the core's last word on it, which
            # comes only once no write of it is in flight (a posted write cannot be recalled).
            late = True
            engine.cancel(stream.child_ids)
            last = await drain()
        finally:
            await stream.aclose()
        if late and (last is None or last.finish_reason == "abort"):
            raise BadRequest(f"the prompt's KV was not written within {req.timeout_s:g}s (no write of it is in "
                             f"flight: {last.stop_reason if last else 'no output'})", None, 504,
                             "kv_transfer_timeout", "timeout_error")
        if last is None or last.finish_reason == "abort":
            raise BadRequest(f"the prompt's KV was not written: {last.stop_reason if last else 'no output'}", None,
                             502, "kv_transfer_failed", "ServiceUnavailableError")
        return PrefillResponse(req.request_id, len(ids), stream.num_cached_tokens, t.end - t.start,
                               self._routing(stream, t.end) if req.return_routed_experts else None)

    @staticmethod
    def _routing(stream, end: int):
        """The rows of positions 0 .. end - 1 (the ones the decode side does not compute); the
        positions this side computed past them (the last prompt token) are the decode side's."""
        from moe_serve.protocol import RoutedExpertRows

        rows = stream.routed_experts[0]
        if rows is None or rows.num_positions < end:
            raise BadRequest(f"the prompt's routed experts were not recorded ({rows.num_positions if rows else 0} of "
                             f"{end} positions)", "return_routed_experts", 502, "kv_transfer_failed",
                             "ServiceUnavailableError")
        return RoutedExpertRows(0, rows.num_layers, rows.top_k, rows.data(end))
