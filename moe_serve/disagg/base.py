"""The KV connector contract: a capability that moves requests' KV cache between engine instances
plugs into the core's step as one step feature (moe_serve/engine/features/base.py), named
"kv_transfer". The shape follows vLLM V1's `KVConnectorBase_V1`, a scheduler side and a worker side,
in this engine's terms (the scheduler and the model run in one process, so both sides are one object):

Scheduler side (pure bookkeeping, between steps):
    take_request(req, part)   a new request carries a transfer part (NewRequest.kv): mark it, or raise
                              ValueError to refuse it. (vLLM: get_num_new_matched_tokens; here the
                              matched tokens are the part's: a decode side loads all but the prompt's
                              last token, a prefill side computes and saves them.)
    reserved() -> outputs     after scheduling: the blocks newly reserved for tokens a peer is to
                              write, reported once (vLLM: update_state_after_alloc + the step's
                              connector metadata)
    loaded(done)              the front end says a peer's write into reserved blocks ended, landed or
                              not (CoreInput.kv_done; vLLM: get_finished, receiving side)
Worker side (the cache, after the step's kernels):
    finished_requests()       the requests that finished computing in the step and hold their blocks
                              for a save (vLLM: request_finished)
    save(reqs, outputs)       post those requests' writes; returns the outputs not held back (a held
                              output goes out from poll once its write has ended; vLLM: save_kv_layer)
    wait_for_save(seconds)    the step waits briefly for the writes it posted; returns the outputs of
                              the ones that ended (vLLM: wait_for_save)
    poll() -> outputs         the writes that ended since the last call, their held outputs released
                              and their blocks given back (vLLM: get_finished, sending side)
    abort(request_id) -> bool an abort of a request whose write is posted: answered by poll once the
                              write has ended (a posted write cannot be recalled)
    in_flight() -> bool       writes posted and not ended
    layout                    the CacheLayout peers write into (None: this side is written to by none)

Loads need no worker-side step here: the peer's writes are one-sided, so a decode side's blocks are
filled without it, and `loaded` is all it hears. `KVConnectorBase` maps these onto the step-feature
hooks; `moe_serve/disagg/pd_connector.py` is the one implementation (prefill and decode instances
over a transfer engine, moe_serve/disagg/transfer.py). Nothing outside moe_serve/disagg knows the
roles or the transfer engine.
"""
from __future__ import annotations

from moe_serve.engine.features.base import StepFeature

SEND_WAIT_S = 0.05  # how long a step waits for the KV writes it posted before going on


def check_part(mode: str, req, new) -> None:
    """The checks every instance makes of a request's transfer part, whatever its own mode; ValueError
    when this instance (--disaggregation-mode `mode`) cannot take it."""
    kv = new.kv
    if new.output_token_ids:  # moved here from a lost rank: it is recomputed here, not transferred
        raise ValueError("a resumed request must have tokens left to generate and no KV transfer")
    if kv.role not in ("prefill", "decode"):
        raise ValueError(f"kv role {kv.role!r} is not prefill or decode")
    if req.params.prompt_logprobs is not None:
        # The prompt's hidden states exist only on the prefill instance, which returns no tokens.
        raise ValueError("prompt_logprobs cannot be computed for a disaggregated request: its prompt is "
                         "computed on a prefill instance")
    if mode != kv.role:
        raise ValueError(f"this instance was started with --disaggregation-mode {mode}: it does not take "
                         f"the {kv.role} side of a disaggregated request")


class NoKVTransfer(StepFeature):
    """An instance that moves no KV (--disaggregation-mode none): it refuses a request that asks for
    a transfer, and has no other hook (a plain step pays nothing for it)."""

    name = "kv_transfer"
    layout = None

    def admit(self, req, new) -> None:
        if new.kv is not None:
            check_part("none", req, new)


class KVConnectorBase(StepFeature):
    """The step-feature side of a KV connector: the hooks the core calls, in terms of the connector's
    own methods (the module's docstring). A subclass implements those methods; `role` is its mode."""

    name = "kv_transfer"
    inputs = ("kv_done",)
    layout = None
    role = "none"

    def __init__(self):
        self._reports: list = []  # scheduler-side outputs not taken yet (reserved blocks)

    # --- the connector's own methods (a subclass implements them) -------------------------------
    def take_request(self, req, part) -> None:
        raise NotImplementedError

    def reserved(self) -> list:
        return []

    def loaded(self, done: list) -> None:
        pass

    def finished_requests(self) -> list:
        """Requests that finished computing in the step and hold their blocks for a save."""
        return []

    def save(self, reqs: list, outputs: list) -> list:
        return outputs

    def wait_for_save(self, seconds: float) -> list:
        return []

    def poll(self) -> list:
        return []

    def abort(self, request_id: str) -> bool:
        return False

    def in_flight(self) -> bool:
        return False

    # --- the step-feature hooks ------------------------------------------------------------------
    def admit(self, req, new) -> None:
        if new.kv is not None:
            check_part(self.role, req, new)
            self.take_request(req, new.kv)

    def on_input(self, field: str, items: list) -> None:
        self.loaded(items)

    def after_schedule(self, sched) -> None:
        self._reports += self.reserved()

    def on_outputs(self, outputs: list) -> list:
        held = self.finished_requests()
        if not held:
            return outputs
        # A write of a few MB takes milliseconds: wait for it (briefly) rather than leave its
        # request's answer until after the next step, which may be a long prefill.
        return self.save(held, outputs) + self.wait_for_save(SEND_WAIT_S)

    def take_outputs(self) -> list:
        outs, self._reports = self._reports, []
        return outs + self.poll()

    def claims_abort(self, request_id: str) -> bool:
        return self.abort(request_id)

    def busy(self) -> bool:
        return self.in_flight()
