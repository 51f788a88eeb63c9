"""Router replay as a step feature: for requests with `SamplingParams.return_routed_experts`, the
logical top-k experts every MoE layer's router chose at each of their positions, sent with their
outputs (`EngineCoreOutput.routed_experts`; assembled and formatted by moe_serve/routed_experts.py).

How each case keeps the rows right:
- capture: while a request that asked is live (agreed over the EP ranks, since it changes whether
  decode steps are padded into graphs), the MoE layers' load hook hands this feature each layer's
  router ids (logical: taken before replicas or an EPLB placement map them to slots), the step's
  tokens in packed order (two overlapped micro-batches call it A then B per layer). One device->host
  copy per step, and only in steps that hold such a request; with none live the hook is detached
  and nothing is paid. Under EP every rank routes its own tokens before dispatch: rows are local.
- chunked prefill: a request's rows fill in over several steps and go out with its next output.
- speculative decoding: rows of every verified position are written, then cut back to the
  request's computed tokens after the step (rejected drafts are not computed).
- preemption by recompute: recomputed positions overwrite their rows and are sent again (chunks
  carry their start; the front end replaces).
- prefix-cache hits: rows of every full block of a request that asked are kept under the block's
  chained hash (`BlockRows`, as many blocks as the KV cache has, least recently used dropped first);
  such a request takes hits only for blocks whose rows are kept (`Request.prefix_hit_limit`), and
  the hit positions' rows are copied from there.
- disaggregated prefill/decode: the prefill instance records the prompt as any request, and its
  front end answers the decode side with the rows of positions 0 .. end - 1 (end: the last prompt
  token, which the decode side computes; moe_serve/disagg/messages.py). The decode front end hands
  them in with the KVDone that says the KV landed (`on_input`), and they fill those positions as
  prefix hits' rows do, before the decode side's own are recorded. A failed transfer (KVDone not
  ok) carries none: the decode side computes the prompt, and records its rows, itself.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import msgspec
import numpy as np

from attention.blocks import hash_block
from moe_serve.engine.features.base import StepFeature
from moe_serve.protocol import RoutedExpertRows

log = logging.getLogger("moe_serve.routed_experts")
UNKNOWN = -1  # the id written where a position's routing could not be known (logged when it happens)


class CaptureAgreement(msgspec.Struct):
    """capture: 1 while any rank has a live request that asked (every rank then leaves decode
    steps unpadded, as with load recording)."""

    capture: int = 0


class BlockRows:
    """Rows of full blocks by chained block hash (attention/blocks.py hash_block), for prefix hits.
    At most `capacity` blocks (the KV cache's count), least recently used dropped first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._rows: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def put(self, h: bytes, rows: np.ndarray) -> None:
        self._rows[h] = rows.copy()
        self._rows.move_to_end(h)
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)

    def get(self, h: bytes) -> np.ndarray | None:
        rows = self._rows.get(h)
        if rows is not None:
            self._rows.move_to_end(h)
        return rows

    def clear(self) -> None:
        self._rows.clear()

    def known_prefix(self, hashes: list[bytes]) -> int:
        """How many leading blocks have their rows here (Request.prefix_hit_limit)."""
        n = 0
        while n < len(hashes) and hashes[n] in self._rows:
            self._rows.move_to_end(hashes[n])
            n += 1
        return n


class _Seq:
    """One request's rows: rows[p] = (layers, k) ids of position p; the first `valid` are right,
    the first `sent` went out; `hashes` its chained full-block hashes, `stored` how many of its
    blocks are in BlockRows."""

    def __init__(self, req, L: int, K: int, resets: int = 0):
        self.req = req
        self.resets = resets  # the prefix cache's resets when it began (its rows are stored only if none since)
        self.rows = np.full((max(16, req.num_tokens), L, K), UNKNOWN, dtype=np.int16)
        self.valid = self.sent = self.stored = 0
        self.hashes: list[bytes] = []
        self.remote: np.ndarray | None = None  # rows of 0 .. n - 1 a prefill instance computed (disaggregated)

    def reserve(self, n: int) -> None:
        if n > len(self.rows):
            grown = np.full((max(n, 2 * len(self.rows)), *self.rows.shape[1:]), UNKNOWN, dtype=np.int16)
            grown[:len(self.rows)] = self.rows
            self.rows = grown

    def write(self, start: int, rows: np.ndarray) -> None:
        self.reserve(start + len(rows))
        self.rows[start:start + len(rows)] = rows
        self.valid = start + len(rows)  # cut back to the computed tokens after the step
        self.sent = min(self.sent, start)  # recomputed rows go out again

    def block_hashes(self, nfull: int, block_size: int) -> list[bytes]:
        tokens = self.req.all_token_ids
        for b in range(len(self.hashes), nfull):
            self.hashes.append(hash_block(self.hashes[-1] if self.hashes else None,
                                          tokens[b * block_size:(b + 1) * block_size]))
        return self.hashes


class RoutedExperts(StepFeature):
    """`active` (read by the model runner's padding choice through its load hook) is the agreed
    capture flag; the hook `record` sits on the runner only while there is something to capture."""

    name = "routed_experts"
    inputs = ("kv_done",)  # a disaggregated request's prompt rows come with its KVDone

    def __init__(self, runner, num_layers: int, top_k: int, block_size: int, prefix_caching: bool,
                 world_size: int = 1, scheduler=None):
        self.runner, self.L, self.K = runner, num_layers, top_k
        self.block_size, self.world_size = block_size, world_size
        self.store = BlockRows(runner.num_blocks) if prefix_caching else None
        # The kept rows follow the prefix cache's resets (Scheduler.prefix_resets): once the cache
        # forgot every prefix (the weights changed), rows routed by the old weights are dropped, and
        # requests that began before are not kept, so no later hit returns old routing.
        self.scheduler, self._resets = scheduler, 0
        self.active = False
        self._live: dict[str, _Seq] = {}
        self._plan: list[tuple[_Seq, int, int, int]] = []  # (seq, packed offset, start, tokens) this step
        self._ids: list[list] = [[] for _ in range(num_layers)]

    @classmethod
    def build(cls, ctx) -> "RoutedExperts | None":
        """None for a model without MoE layers (the front end refuses the field there)."""
        from expert_parallel.runtime.layer import MoE

        # The model's own MoE layers (a multi-token-prediction layer's is a drafter's, not routing
        # of the sequence's positions).
        moes = [m for name, m in ctx.model.named_modules() if isinstance(m, MoE) and not name.startswith("mtp")]
        if not moes:
            return None
        if sorted(m.layer_index for m in moes) != list(range(len(moes))):
            raise ValueError("routed experts: the MoE layers' indices are not 0 .. n - 1")
        top_k = {m.gate.top_k for m in moes}
        if len(top_k) != 1:
            raise ValueError(f"routed experts: the MoE layers route to different top-k {sorted(top_k)}")
        cache = ctx.cfg.cache
        return cls(ctx.runner, len(moes), top_k.pop(), cache.block_size, cache.enable_prefix_caching,
                   ctx.cfg.parallel.world_size, ctx.scheduler)

    # --- requests -------------------------------------------------------------------------------
    def on_request_added(self, req) -> None:
        if not req.params.return_routed_experts:
            return
        self._live[req.request_id] = _Seq(req, self.L, self.K, self._current_resets())
        if self.store is not None:
            req.prefix_hit_limit = self._known_prefix

    def _current_resets(self) -> int:
        """The prefix cache's resets so far; the kept rows are dropped when there were more."""
        n = self.scheduler.prefix_resets if self.scheduler is not None else 0
        if n != self._resets:
            self._resets = n
            if self.store is not None:
                self.store.clear()
        return n

    def on_input(self, field: str, items: list) -> None:
        """KVDones (decode side): keep the prefill instance's rows of a request whose KV landed, for
        its first step (after_schedule). Rows of another shape (not this model's) are dropped with
        a warning: those positions are then unknown, as the log says."""
        for d in items:
            seq, rows = self._live.get(d.request_id), d.routed_experts
            if seq is None or not d.ok or rows is None:
                continue
            shape = (rows.start, rows.num_layers, rows.top_k)
            if shape != (0, self.L, self.K) or len(rows.data) % (2 * self.L * self.K):
                log.warning("request %s: the prefill instance's routed experts (from %d, %d layers, k %d, %d bytes) "
                            "are not this model's", d.request_id, rows.start, rows.num_layers, rows.top_k,
                            len(rows.data))
                continue
            seq.remote = np.frombuffer(rows.data, dtype="<i2").astype(np.int16).reshape(-1, self.L, self.K)

    def _known_prefix(self, hashes: list[bytes]) -> int:
        self._current_resets()
        return self.store.known_prefix(hashes)

    def agreement(self) -> CaptureAgreement:
        return CaptureAgreement(int(bool(self._live)))

    def apply_agreement(self, agreed: CaptureAgreement, group=None) -> None:
        self.active = bool(agreed.capture)
        self._hook(self.active)

    def _hook(self, on: bool) -> None:
        hooks = self.runner.load_hooks
        if on and self.record not in hooks:
            hooks.append(self.record)
        elif not on and self.record in hooks:
            hooks.remove(self.record)

    # --- one step -------------------------------------------------------------------------------
    def after_schedule(self, sched) -> None:
        for rid in sched.finished_req_ids:  # aborted ones too (they send no output)
            seq = self._live.get(rid)
            if seq is not None and seq.req.is_finished:
                del self._live[rid]
        self._plan, off = [], 0
        for s in sched.scheduled:
            seq = self._live.get(s.request.request_id)
            if seq is not None and seq.req is s.request:
                start = s.request.num_computed_tokens
                if start > seq.valid:
                    self._fill(seq, start)
                self._plan.append((seq, off, start, s.num_tokens))
            off += s.num_tokens
        if self._plan and not self.active:
            # Queued during scheduling (a compiled grammar): capture it now. Alone the runner's
            # padding follows at once; under EP it stays as agreed until the next turn.
            self._hook(True)
            self.active = self.active or self.world_size == 1

    def _fill(self, seq: _Seq, start: int) -> None:
        """Rows of positions seq.valid .. start - 1, which this step does not compute: a prefill
        instance's rows where it sent them (used once: a recompute after a preemption records its
        own), then the rows kept with the prefix cache's blocks."""
        if seq.remote is not None:
            n = min(start, len(seq.remote))
            if n > seq.valid:
                seq.reserve(n)
                seq.rows[seq.valid:n] = seq.remote[seq.valid:n]
                seq.valid = n
            seq.remote = None
        if start > seq.valid:
            self._fill_from_store(seq, start)

    def _fill_from_store(self, seq: _Seq, start: int) -> None:
        """Rows of positions seq.valid .. start - 1, which prefix-cache hits served."""
        bs = self.block_size
        self._current_resets()
        hashes = seq.block_hashes(start // bs, bs)
        seq.reserve(start)
        for b in range(seq.valid // bs, start // bs):
            rows = self.store.get(hashes[b]) if self.store is not None else None
            if rows is None:
                log.warning("request %s: no routed experts kept for cached block %d", seq.req.request_id, b)
                seq.rows[b * bs:(b + 1) * bs] = UNKNOWN
            else:
                seq.rows[b * bs:(b + 1) * bs] = rows
        if start % bs:
            log.warning("request %s: routed experts of positions %d..%d are unknown (not computed here)",
                        seq.req.request_id, start // bs * bs, start - 1)
            seq.rows[start // bs * bs:start] = UNKNOWN
        seq.valid = start

    def record(self, layer: int, ids_TK) -> None:
        """The MoE layers' load hook: one layer's logical top-k ids of the step's tokens."""
        if self._plan and layer < self.L:
            self._ids[layer].append(ids_TK)

    def after_forward(self, sched, result, seconds: float) -> None:
        plan, self._plan = self._plan, []
        ids, self._ids = self._ids, [[] for _ in range(self.L)]
        if not plan:
            return
        rows = self._rows_of_step(ids, plan)
        for seq, off, start, n in plan:
            seq.write(start, rows[off:off + n])

    def _rows_of_step(self, ids: list[list], plan) -> np.ndarray:
        """(tokens, layers, k) int16 of the step, each row's ids ascending: one device->host copy."""
        import torch

        T = max(off + n for _, off, _, n in plan)
        if any(not per_layer for per_layer in ids):  # a captured graph ran (EP, not yet agreed)
            log.warning("routed experts: a step ran without the router hook; %d positions are unknown", T)
            return np.full((T, self.L, self.K), UNKNOWN, dtype=np.int16)
        layers = [torch.cat(x) if len(x) > 1 else x[0] for x in ids]
        L_TK = torch.stack([x[:T] for x in layers]).to(torch.int16)
        return torch.sort(L_TK, dim=-1)[0].permute(1, 0, 2).cpu().numpy()

    def on_outputs(self, outputs: list) -> list:
        """After the scheduler's update: rows cut back to the computed tokens, full blocks kept for
        prefix hits, and each output of a request that asked carries its rows not yet sent."""
        if not self._live:
            return outputs
        for seq in self._live.values():
            seq.valid = min(seq.valid, seq.req.num_computed_tokens)
            seq.sent = min(seq.sent, seq.valid)  # preempted: what it recomputes goes out again
            self._store_blocks(seq)
        for o in outputs:
            seq = self._live.get(o.request_id)
            if seq is None:
                continue
            if seq.valid > seq.sent:
                rows = seq.rows[seq.sent:seq.valid].astype("<i2").tobytes()
                o.routed_experts = RoutedExpertRows(seq.sent, self.L, self.K, rows)
                seq.sent = seq.valid
            if o.finished:
                del self._live[o.request_id]
        return outputs

    def _store_blocks(self, seq: _Seq) -> None:
        if self.store is None:
            return
        bs = self.block_size
        nfull = seq.valid // bs
        if nfull <= seq.stored or seq.resets != self._current_resets():  # began under other weights
            return
        hashes = seq.block_hashes(nfull, bs)
        for b in range(seq.stored, nfull):
            self.store.put(hashes[b], seq.rows[b * bs:(b + 1) * bs])
        seq.stored = nfull

    def shutdown(self) -> None:
        self._hook(False)
        self._live.clear()
