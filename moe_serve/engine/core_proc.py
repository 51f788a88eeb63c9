"""The engine-core process: a busy loop (receive -> schedule -> run -> sample -> send) that never
waits on HTTP. One per data-parallel rank.

Each turn it takes every `CoreInput` that has arrived from the front end (ZMQ PULL), schedules, and
runs the step; the new tokens of the step go back in one `CoreOutputs` message (ZMQ PUSH). With
expert parallelism the ranks agree once per turn, in one small all-reduce (MAX) over the CPU group,
on named fields (`TurnAgreement`, and each step feature's own struct: moe_serve/engine/features/):
the most tokens any rank scheduled (0: nobody has work, so nobody runs the model; otherwise every
rank runs the step, an empty forward where it has nothing, so the MoE collectives line up), the
step's shape, whether any rank got SIGTERM, whether the front end said shut down, and the
features' fields: a regroup (elastic EP: a feature of the loop itself, features/regroup.py),
expert-load recording starting or stopping (so every rank's windows cover the same steps), whether
any rank's part of a pending expert-rebalancing step is unfinished (0 means every rank switches the
layer at this turn).

`python -m moe_serve.engine.core_proc` is the single-process server's core (one rank, spawned by
the front end); torchrun ranks run `CoreLoop` from launcher/worker.py.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
import sys
import time
from typing import Callable

import msgspec
import zmq

from moe_serve.engine.features.agreement import Layout
from moe_serve.engine.features.base import MinInt
from moe_serve.engine.features.feature_set import FeatureSet
from moe_serve.engine.features.regroup import Regroup  # noqa: F401 - where the launcher catches it
from moe_serve.protocol import (CoreFatal, CoreInput, CoreOutputs, CoreReady, UtilityResult, input_decoder,
                                input_encoder)

log = logging.getLogger("moe_serve.core_proc")

_IDLE_POLL_MS = 10  # how long an idle core waits for input before it checks in again


_MIXED = 1 << 40  # the agreement's query length of a step whose sequences differ


def step_shape(sched) -> tuple[int, int]:
    """What a rank adds to the per-turn MAX agreement about its step's shape: the tokens every
    sequence has when they all have the same number (1: decode, 1 + K: speculative verify), as q
    and -q, so that MAX gives the largest and (negated) the smallest over the ranks that run any;
    an idle rank adds 0 and -MIXED, a rank with prefill or mixed pieces MIXED."""
    lens = {s.num_tokens for s in sched.scheduled} if sched is not None else set()
    if not lens:
        return 0, -_MIXED
    q = lens.pop() if len(lens) == 1 else _MIXED
    return q, -q


def agreed_shape(q_max: int, neg_q_min: int) -> int:
    """The tokens per sequence of every rank's step, from step_shape's values MAX-reduced; 0 when
    the ranks' steps differ or any is mixed (then no rank pads)."""
    return q_max if q_max == -neg_q_min and q_max < _MIXED else 0


class TurnAgreement(msgspec.Struct):
    """The loop's own fields of the per-turn agreement (the features add theirs)."""

    max_tokens: int = 0  # the most tokens any rank scheduled (0: nobody runs the model)
    sigterm_rank: int = 0  # 1 + a rank that got SIGTERM (0: none)
    shutdown: int = 0  # the front end said shut down
    q_max: int = 0  # the step's shape (step_shape): the most tokens per sequence ...
    q_min: MinInt = _MIXED  # ... and the fewest, over the ranks that run any


class CoreLoop:
    def __init__(self, core, rank: int, world_size: int, in_addr: str, out_addr: str, sync_group=None,
                 on_turn: Callable[[int], None] = lambda n: None, peer_alive: Callable[[], bool] = lambda: True,
                 features=()):
        self.core, self.rank, self.world_size, self.group = core, rank, world_size, sync_group
        # The loop's own step features, which outlive a generation's core (elastic EP's regroup:
        # features/regroup.py): agreed and called with the core's, and applied before them.
        self.features = FeatureSet(features)
        self.on_turn, self.peer_alive = on_turn, peer_alive
        self.ctx = zmq.Context()
        if "[" in in_addr:  # the front end is on an IPv6 address
            self.ctx.setsockopt(zmq.IPV6, 1)
        self.inp = self.ctx.socket(zmq.PULL)
        self.inp.connect(in_addr)
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.LINGER, 5000)
        self.out.setsockopt(zmq.SNDTIMEO, 1000)  # send() checks the front end is alive between tries
        self.out.connect(out_addr)
        self.wants_shutdown = False  # SIGTERM here
        self.shutdown_asked_by = -1  # the rank whose SIGTERM is known here (own, or agreed over ranks)
        self._reported_shutdown_wish = False
        self.turns = 0
        self._owed: set[int] = set()  # utility calls a feature answers at an agreed turn
        self._layouts: dict[tuple, Layout] = {}
        self._peer_checked = time.monotonic()
        self._changed = False  # state changed without an output (the next turn reports stats)
        self.generation = 0  # elastic EP (launcher/elastic.py): the membership generation served

    def rebind(self, core, world_size: int, sync_group, generation: int) -> None:
        """Serve a rebuilt engine core (elastic EP) through the same sockets."""
        self.core, self.world_size, self.group, self.generation = core, world_size, sync_group, generation
        for cid in sorted(self._owed):  # a new generation records afresh: nothing of the old one to dump
            self.send(UtilityResult(cid, error="the job regrouped before the dump; ask again"))
        self._owed.clear()
        gc.collect()
        gc.freeze()

    def send(self, msg) -> None:
        """Blocks while the front end is behind (its queue full), but not past its death: a core
        streaming to a front end that was killed would otherwise wait in send forever."""
        data = input_encoder.encode(msg)
        while True:
            try:
                self.out.send(data, copy=False)
                return
            except zmq.Again:
                if not self.peer_alive():
                    raise RuntimeError("the front-end process is gone") from None

    def ready(self, announce: bool = True) -> None:
        """announce: say CoreReady to the front end (at start; not for a replacement joining later)."""
        c = self.core
        # What start-up made (modules, weights, tokenizer, buffers) lives as long as this process:
        # moved out of the collector's generations, so the collections the step loop's small
        # allocations trigger never scan it again (a full one scanned all of it). Only here, in a
        # process that runs one engine: an in-process LLM may be dropped, and frozen cycles would leak.
        gc.collect()
        gc.freeze()
        if self.world_size > 1 or self.generation > 0:  # the front end routes by every rank's prefix cache
            c.track_cache_events()
        if announce:
            self.send(CoreReady(self.rank, c.max_model_len, c.vocab_size, c.runner.num_blocks,
                                sorted(c.eos_token_ids), c.allocator.block_size, c.allocator.enable_prefix_caching,
                                c.cfg.disaggregation_mode, c.kv_layout,
                                socket.gethostname(), os.getpid(), c.moe_ctx.dispatcher.slots_per_rank))

    def _receive(self, timeout_ms: int) -> tuple[list, bool]:
        """Apply every input waiting (waiting up to timeout_ms for the first); returns outputs of
        aborts and refused requests, and whether the front end said shut down."""
        outs, shutdown = [], False
        if not self.inp.poll(timeout_ms):
            return outs, shutdown
        while True:
            try:
                frame = self.inp.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return outs, shutdown
            try:
                msg: CoreInput = input_decoder.decode(frame.buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.error("rank %d: dropped a malformed message from the front end (%d bytes): %s", self.rank,
                          len(frame.buffer), e)
                continue
            for call in msg.calls:
                self._call(call)
            shutdown = shutdown or msg.shutdown
            if msg.generation < self.generation:  # queued for a core of an earlier generation
                continue  # (the front end resubmits its requests for this one)
            for new in msg.new:
                rejected = self.core.add_request(new)
                if rejected is not None:
                    outs.append(rejected)
            outs += self.core.abort_requests(msg.aborts)
            # Queued or aborted without a step (generation paused, or asleep): the figures change.
            self._changed |= bool(msg.new or msg.aborts)
            if self.core.features.deliver(msg):  # a feature's input (KVDone: blocks given back)
                self._changed = True  # state changed without an output: the front end's figures should say so

    def _call(self, call) -> None:
        taken, answer = self.features.call(call)  # the loop's own (scale), else the core's (load_dump, ...)
        if not taken:
            taken, answer = self.core.features.call(call)
        if taken:
            if answer is None:  # answered at a turn every rank agrees on
                self._owed.add(call.call_id)
            else:
                self.send(answer)
        else:
            self.send(UtilityResult(call.call_id, error=f"unknown utility call {call.method!r}"))

    def _agree(self, sched, shutdown: bool) -> tuple[int, int | None, bool]:
        """The turn's agreement: with EP, the loop's fields and every feature's in ONE MAX all-reduce
        (features/agreement.py lays them out by name); one process agrees with itself. Raises
        Regroup when one is agreed; applies the features' part. Returns the most tokens any rank
        scheduled, the tokens every sequence has (agreed_shape; None: this rank decides), shutdown."""
        ntok = sched.num_batched_tokens if sched is not None else 0
        parts = self.features.agreement() + self.core.features.agreement()
        if self.world_size > 1:
            q, neg_q = step_shape(sched)
            mine = TurnAgreement(ntok, self.rank + 1 if self.wants_shutdown else 0, int(shutdown),
                                 q, -neg_q)
            agreed = self._all_reduce([("turn", mine), *parts])
            turn = agreed.pop("turn")
            shutdown = bool(turn.shutdown)
            self.shutdown_asked_by = turn.sigterm_rank - 1
            max_tok, uniform = turn.max_tokens, agreed_shape(turn.q_max, -turn.q_min)
        else:
            agreed, max_tok, uniform = dict(parts), ntok, None  # one process: its own step decides
            self.shutdown_asked_by = 0 if self.wants_shutdown else -1
        # Between steps, at the same turn on every rank: first the loop's own features (a regroup
        # raises here, never on the turn the job stops), then the core's: load recording, rebalancing.
        if not shutdown:
            self.features.apply_agreement(agreed, self.group)
        self.core.features.apply_agreement(agreed, self.group)
        for result in self.core.features.take_results():
            self._owed.discard(result.call_id)
            self.send(result)
        return max_tok, uniform, shutdown

    def _all_reduce(self, parts: list) -> dict:
        import torch
        import torch.distributed as dist

        key = tuple((name, type(p)) for name, p in parts)
        layout = self._layouts.get(key) or self._layouts.setdefault(key, Layout(parts))
        flags = torch.tensor(layout.pack(parts), dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return layout.unpack(flags.tolist())

    def run(self) -> int:
        """Loop until the front end says shut down (every rank at the same turn); returns 0."""
        core, any_work = self.core, False
        while True:
            self.turns += 1
            self.on_turn(self.turns)
            held = core.features.holds_steps()  # generation paused, or asleep: requests wait
            busy = (core.has_unfinished() and not held) or any_work
            outs, shutdown = self._receive(0 if busy else (1 if core.features.busy() else _IDLE_POLL_MS))
            outs += core.take_early_outputs()  # before scheduling: work that ended gives its blocks back first
            sched = core.schedule() if core.has_unfinished() and not held else None
            outs += core.take_early_outputs()
            max_tok, uniform, shutdown = self._agree(sched, shutdown)
            any_work = max_tok > 0
            if any_work:
                outs += core.execute(sched if sched is not None else _empty(), lockstep=self.world_size > 1,
                                     max_tokens_any_rank=max_tok if self.world_size > 1 else None,
                                     uniform_len=uniform)
            # Idle: the features close what the burst filled (the speed-of-light window).
            closed = not any_work and core.features.idle()
            self._report(core, outs, any_work, shutdown, closed)
            if shutdown:
                core.features.shutdown()  # every rank at this turn (a partial load window is kept)
                return 0
            if time.monotonic() - self._peer_checked > 1.0:  # busy or idle: a step is far shorter
                self._peer_checked = time.monotonic()
                if not self.peer_alive():
                    raise RuntimeError("the front-end process is gone")

    def _report(self, core, outs: list, any_work: bool, shutdown: bool, closed: bool) -> None:
        """One CoreOutputs when there is news (the first turn reports the stats known at start-up,
        the assumed bandwidth among them)."""
        wish = self.shutdown_asked_by >= 0 and not self._reported_shutdown_wish
        events = core.take_cache_events()
        if outs or any_work or wish or shutdown or closed or events or self.turns == 1 or self._changed:
            self._changed = False
            self._reported_shutdown_wish |= wish
            self.send(CoreOutputs(self.rank, outs, core.stats(), self.shutdown_asked_by, bool(shutdown), events,
                                  self.generation))

    def fatal(self, e: BaseException) -> None:
        """Tell the front end why this core stops, if it is there to hear it: never blocks (a PUSH
        socket whose peer is gone would wait forever, and the orphaned core never exit)."""
        try:
            self.out.send(input_encoder.encode(CoreFatal(self.rank, f"{type(e).__name__}: {e}")), zmq.NOBLOCK)
        except Exception:
            pass
        self.out.setsockopt(zmq.LINGER, 1000)

    def close(self) -> None:
        self.inp.close(0)
        self.out.close()
        self.ctx.term()


def _empty():
    from moe_serve.scheduler import SchedulerOutput

    return SchedulerOutput()


def install_signal_handlers(loop: CoreLoop) -> None:
    """SIGTERM asks the front end to drain and stop the job (via the next output); Ctrl-C in a
    terminal reaches the front end too, which stops the cores itself."""
    def on_term(signum, frame):
        loop.wants_shutdown = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _die_with_parent(parent: int) -> None:
    """A prefill instance's core ends with its front end, at once (Linux): a decode instance that
    finds the front end gone takes its KV writes as ended (moe_serve/disagg), so none may go on."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the loop's own check ends it within a second
        return
    if os.getppid() != parent:  # the front end was gone before this was set
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    """The single-process server's engine core: EngineArgs as JSON, the front end's addresses."""
    p = argparse.ArgumentParser(prog="python -m moe_serve.engine.core_proc")
    p.add_argument("--engine-args", required=True, help="EngineArgs as JSON")
    p.add_argument("--in-addr", required=True)
    p.add_argument("--out-addr", required=True)
    ns = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("MOE_SERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s [core] %(name)s: %(message)s")
    from moe_serve.engine.args import EngineArgs
    from moe_serve.engine.core import build_engine

    parent = os.getppid()
    args = msgspec.json.decode(ns.engine_args.encode(), type=EngineArgs)
    if args.disaggregation_mode == "prefill":
        _die_with_parent(parent)
    loop = None
    try:
        core = build_engine(args.create_engine_config(), show_progress=args.show_progress)
        loop = CoreLoop(core, 0, 1, ns.in_addr, ns.out_addr, peer_alive=lambda: os.getppid() == parent)
        install_signal_handlers(loop)
        loop.ready()
        log.info("engine core ready (pid %d)", os.getpid())
        rc = loop.run()
        if args.expert_load_record:
            core.dump_load(args.expert_load_record)
            log.info("expert load written to %s", args.expert_load_record)
        loop.close()
        return rc
    except Exception as e:
        log.exception("engine core failed")
        if loop is None:  # failed while building: tell the front end through a socket of our own
            loop = _bare_sender(ns.out_addr)
        loop.fatal(e)
        time.sleep(0.2)
        return 1


def _bare_sender(out_addr: str):
    class _Sender:
        def __init__(self):
            self.ctx = zmq.Context()
            self.out = self.ctx.socket(zmq.PUSH)
            self.out.setsockopt(zmq.LINGER, 2000)
            self.out.connect(out_addr)

        def fatal(self, e):
            self.out.send(input_encoder.encode(CoreFatal(0, f"{type(e).__name__}: {e}")))

    return _Sender()


if __name__ == "__main__":
    sys.exit(main())
