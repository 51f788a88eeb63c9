"""The engine core's side of disaggregated prefill and decode (moe_serve/disagg: the transfer and
the connector): taking a request's part, reporting the blocks a decode side reserved, posting the
prefill side's writes and collecting the ones that ended. Functions of the core (`EngineCore`):
its scheduler, connector, early outputs and `kv_sent` counts."""
from __future__ import annotations

import logging
import time

from moe_serve.protocol import EngineCoreOutput

log = logging.getLogger("moe_serve.engine")
SEND_WAIT_S = 0.05  # prefill side: how long a step waits for the KV writes it posted before going on


def disaggregated(core, req, kv) -> None:
    """Mark a request whose prompt cache moves between instances (moe_serve/disagg); ValueError
    when this instance cannot take that part."""
    mode = core.cfg.disaggregation_mode
    if kv.role not in ("prefill", "decode"):
        raise ValueError(f"kv role {kv.role!r} is not prefill or decode")
    if req.params.prompt_logprobs is not None:
        # The prompt's hidden states exist only on the prefill instance, which returns no tokens.
        raise ValueError("prompt_logprobs cannot be computed for a disaggregated request: its prompt is "
                         "computed on a prefill instance")
    if mode != kv.role:
        raise ValueError(f"this instance was started with --disaggregation-mode {mode}: it does not take "
                         f"the {kv.role} side of a disaggregated request")
    req.kv_role = kv.role
    if kv.role == "decode":
        req.kv_end = req.num_prompt_tokens - 1  # the last prompt token is computed here, where it samples
        return
    from moe_serve.disagg.connector import LayoutMismatch

    t = kv.target
    if t is None or not 0 <= t.start < t.end == req.num_prompt_tokens - 1:
        raise ValueError("a prefill request needs the whole prompt and a target that ends before its last token")
    if t.layout.signature != core.connector.layout.signature:
        raise LayoutMismatch(f"the decode instance's cache layout ({t.layout.signature}) differs from this "
                             f"instance's ({core.connector.layout.signature}): both must serve the same model, "
                             "dtype, block size and speculative layers")
    req.kv_target = t
    req.max_new_tokens = 1
    # The whole prompt is computed (the MTP layer's entry of a position reads the next token), but
    # per-sequence state must stop before the last token, which the decode side computes.
    if core.scheduler.kv.has_state:
        req.prompt_token_ids = req.prompt_token_ids[:t.end]


def report_reserved(core) -> list[EngineCoreOutput]:
    """Decode side: tell the front end which blocks each newly reserved request holds."""
    from moe_serve.protocol import KVTarget

    sched = core.scheduler
    bs = sched.block_size
    outs = []
    for req in sched.take_kv_reserved():
        start, end = req.num_computed_tokens, req.kv_end
        tables = [[-1 if b == sched.kv.null_block(g) else b for b in t[start // bs:-(-end // bs)]]
                  for g, t in enumerate(sched.kv.tables(req))]
        slot = -1 if req.state_slot is None else req.state_slot
        outs.append(EngineCoreOutput(req.request_id, [], kv_target=KVTarget(core.connector.layout, start, end,
                                                                             tables, slot)))
    return outs


def send_kv(core, held: list, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    """Prefill side: post the writes of the requests that finished computing; their outputs
    wait for the writes (poll_kv). Returns the outputs of the other requests."""
    from moe_serve.disagg.transfer import TransferError

    ids = {r.request_id: r for r in held}
    sched, rest = core.scheduler, []
    if core.cfg.device.type == "cuda":  # the step's kernels have written the cache before it is read
        import torch

        torch.cuda.current_stream(core.cfg.device).synchronize()
    nulls = [sched.kv.null_block(g) for g in range(len(sched.kv.allocs))]
    for o in outputs:
        req = ids.pop(o.request_id, None)
        if req is None:
            rest.append(o)
            continue
        try:
            core.connector.post(req, req.kv_target, sched.kv.tables(req), nulls, req.state_slot, sched.block_size, o)
        except (TransferError, ValueError) as e:
            sched.free_held(req)
            core.kv_sent.send_failures += 1
            log.warning("request %s: its KV could not be sent: %s", req.request_id, e)
            rest.append(EngineCoreOutput(req.request_id, [], True, "abort", f"KV transfer failed: {e}"))
    for req in ids.values():  # finished without an output of this step (not expected): give back
        sched.free_held(req)
    # A write of a few MB takes milliseconds: wait for it (briefly) rather than leave its request's
    # answer until after the next step, which may be a long prefill.
    deadline = time.monotonic() + SEND_WAIT_S
    while core.connector.sending and time.monotonic() < deadline:
        rest += core.poll_kv()
        if core.connector.sending:
            time.sleep(0.0002)
    return rest


def poll_kv(core) -> list[EngineCoreOutput]:
    """Prefill side: the outputs of requests whose KV write ended (blocks given back)."""
    outs, counts = [], core.kv_sent
    for send, state in core.connector.poll():
        core.scheduler.free_held(send.req)
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
