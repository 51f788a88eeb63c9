"""Disaggregated prefill and decode as the engine's KV connector (the contract: disagg/base.py).

A decode instance reserves a request's prompt blocks at admission (the scheduler's kv_transfer
phase, moe_serve/scheduling/kv_transfer.py), reports them once (`EngineCoreOutput.kv_target`), and
resumes the request when its front end says the prefill instance's write ended (`KVDone`). A
prefill instance computes the prompt, then writes its cache straight into the decode side's blocks
(`KVWriter`, moe_serve/disagg/connector.py) and holds the request's blocks and its one output until
the write has ended. `build_connector` is the registered factory (moe_serve/engine/features/).
"""
from __future__ import annotations

import logging
import time

from moe_serve.disagg.base import KVConnectorBase, NoKVTransfer
from moe_serve.protocol import EngineCoreOutput, KVTarget, KVTransferStats

log = logging.getLogger("moe_serve.engine")


def build_connector(ctx):
    """A disaggregated instance's connector, its cache (bound already) registered with the transfer
    engine; NoKVTransfer under --disaggregation-mode none (it refuses transfer parts)."""
    cfg = ctx.cfg
    if cfg.disaggregation_mode == "none":
        return NoKVTransfer()
    from moe_serve.disagg.connector import KVWriter, layout_signature

    groups, state = ctx.cache
    mc = cfg.model
    sig = layout_signature(f"{mc.architecture}:{mc.hf.get('num_hidden_layers')}", cfg.activation_dtype,
                           cfg.cache.block_size, groups, state)
    writer = KVWriter(cfg.disaggregation_transfer_backend, groups, state, sig, str(cfg.device),
                      cfg.disaggregation_timeout_s)
    log.info("disaggregation: %s instance, KV over %s", cfg.disaggregation_mode, cfg.disaggregation_transfer_backend)
    return PrefillDecodeConnector(cfg.disaggregation_mode, writer, ctx.scheduler, cfg.device)


class PrefillDecodeConnector(KVConnectorBase):
    """One side of a prefill/decode pair: `role` "prefill" writes, "decode" is written to. The
    scheduler keeps the per-request bookkeeping; this keeps the writes and the prefill side's counts."""

    def __init__(self, role: str, writer, scheduler, device):
        super().__init__()
        self.role = role
        self.writer = writer  # disagg.connector.KVWriter
        self.layout = writer.layout
        self.scheduler = scheduler
        self.device = device
        self.sent = KVTransferStats()  # the prefill side's counts (the decode side's: the scheduler's)

    # --- scheduler side --------------------------------------------------------------------------
    def take_request(self, req, part) -> None:
        """Mark a request whose prompt cache moves (check_part has checked the role)."""
        req.kv_role = part.role
        if part.role == "decode":
            req.kv_end = req.num_prompt_tokens - 1  # the last prompt token is computed here, where it samples
            return
        from moe_serve.disagg.connector import LayoutMismatch

        t = part.target
        if t is None or not 0 <= t.start < t.end == req.num_prompt_tokens - 1:
            raise ValueError("a prefill request needs the whole prompt and a target that ends before its last token")
        if t.layout.signature != self.layout.signature:
            raise LayoutMismatch(f"the decode instance's cache layout ({t.layout.signature}) differs from this "
                                 f"instance's ({self.layout.signature}): both must serve the same model, "
                                 "dtype, block size and speculative layers")
        req.kv_target = t
        req.max_new_tokens = 1
        # The whole prompt is computed (the MTP layer's entry of a position reads the next token), but
        # per-sequence state must stop before the last token, which the decode side computes.
        if self.scheduler.kv.has_state:
            req.prompt_token_ids = req.prompt_token_ids[:t.end]

    def reserved(self) -> list[EngineCoreOutput]:
        """Decode side: tell the front end which blocks each newly reserved request holds."""
        sched = self.scheduler
        bs = sched.block_size
        outs = []
        for req in sched.take_kv_reserved():
            start, end = req.num_computed_tokens, req.kv_end
            tables = [[-1 if b == sched.kv.null_block(g) else b for b in t[start // bs:-(-end // bs)]]
                      for g, t in enumerate(sched.kv.tables(req))]
            slot = -1 if req.state_slot is None else req.state_slot
            outs.append(EngineCoreOutput(req.request_id, [], kv_target=KVTarget(self.layout, start, end, tables,
                                                                                slot)))
        return outs

    def loaded(self, done: list) -> None:
        """Decode side: prefill instances wrote (or failed to write) these requests' blocks."""
        for d in done:
            req = self.scheduler.kv_done(d.request_id, d.ok, d.ended)
            if req is not None and not d.ok:
                log.warning("request %s: its prompt's KV did not arrive (%s): computing it here", d.request_id,
                            d.error or "no reason given")

    def finished_requests(self) -> list:
        return self.scheduler.take_kv_outbox()

    # --- worker side -----------------------------------------------------------------------------
    def save(self, held: list, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Prefill side: post the writes of the requests that finished computing; their outputs
        wait for the writes (poll). Returns the outputs of the other requests."""
        from moe_serve.disagg.transfer import TransferError

        ids = {r.request_id: r for r in held}
        sched, rest = self.scheduler, []
        if self.device.type == "cuda":  # the step's kernels have written the cache before it is read
            import torch

            torch.cuda.current_stream(self.device).synchronize()
        nulls = [sched.kv.null_block(g) for g in range(len(sched.kv.allocs))]
        for o in outputs:
            req = ids.pop(o.request_id, None)
            if req is None:
                rest.append(o)
                continue
            try:
                self.writer.post(req, req.kv_target, sched.kv.tables(req), nulls, req.state_slot, sched.block_size, o)
            except (TransferError, ValueError) as e:
                sched.free_held(req)
                self.sent.send_failures += 1
                log.warning("request %s: its KV could not be sent: %s", req.request_id, e)
                rest.append(EngineCoreOutput(req.request_id, [], True, "abort", f"KV transfer failed: {e}"))
        for req in ids.values():  # finished without an output of this step (not expected): give back
            sched.free_held(req)
        return rest

    def wait_for_save(self, seconds: float) -> list[EngineCoreOutput]:
        outs = []
        deadline = time.monotonic() + seconds
        while self.writer.sending and time.monotonic() < deadline:
            outs += self.poll()
            if self.writer.sending:
                time.sleep(0.0002)
        return outs

    def poll(self) -> list[EngineCoreOutput]:
        """Prefill side: the outputs of requests whose KV write ended (blocks given back)."""
        if not self.writer.sending:
            return []
        outs, counts = [], self.sent
        for send, state in self.writer.poll():
            self.scheduler.free_held(send.req)
            if send.aborted:  # aborted while its write was posted: answered now that the write has ended
                if state == "DONE":
                    counts.sent_requests += 1
                    counts.sent_bytes += send.nbytes
                else:
                    counts.send_failures += 1
                outs.append(EngineCoreOutput(send.req.request_id, [], True, "abort",
                                             f"aborted; its KV write has ended ({state})"))
            elif state == "DONE":
                counts.sent_requests += 1
                counts.sent_bytes += send.nbytes
                counts.send_seconds += time.monotonic() - send.t0
                outs.append(send.output)
            else:
                counts.send_failures += 1
                log.warning("request %s: %s", send.req.request_id, state)
                outs.append(EngineCoreOutput(send.req.request_id, [], True, "abort", f"KV transfer failed: {state}"))
        return outs

    def abort(self, request_id: str) -> bool:
        return self.writer.abort(request_id)

    def in_flight(self) -> bool:
        return bool(self.writer.sending)

    def stats(self) -> KVTransferStats:
        received, fallbacks = self.scheduler.kv_transfer_counts()
        s = self.sent
        return KVTransferStats(s.sent_requests, s.sent_bytes, s.send_failures, s.send_seconds, received, fallbacks)
