"""Data-parallel attention, expert-parallel MoE: one EngineCore per rank, stepped in lockstep.

Rank 0 runs the HTTP front end and the `DistributedStepper`: each engine-loop turn it sends one
`StepPlan` to every rank over the CPU (gloo) group, every rank applies its share and, when any
rank has work, every rank steps its EngineCore (a rank without tokens runs an empty forward so the
MoE collectives line up), then every rank answers with a `StepReport` gathered back to rank 0.
Messages are msgspec-encoded bytes in uint8 tensors: nothing is pickled.

New requests go to the rank with the fewest outstanding tokens (prompt + tokens still to generate).
"""
from __future__ import annotations

import logging
import signal
import time

import msgspec
import torch
import torch.distributed as dist

from moe_serve.engine.async_engine import apply_control
from moe_serve.protocol import (AbortRequest, ControlMessage, EngineOutput, LoadRecordControl, NewRequest, StepPlan,
                                StepReport)

log = logging.getLogger("moe_serve.dp")

_plan_dec = msgspec.msgpack.Decoder(StepPlan)
_report_dec = msgspec.msgpack.Decoder(StepReport)
_enc = msgspec.msgpack.Encoder()


def broadcast_bytes(data: bytes | None, group, src: int = 0) -> bytes:
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None else \
        torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return buf.numpy().tobytes()


def all_gather_bytes(data: bytes, group, world_size: int) -> list[bytes]:
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.empty(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=group)
    n = max(int(s) for s in sizes)
    buf = torch.zeros(n, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    bufs = [torch.empty(n, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(bufs, buf, group=group)
    return [b[: int(s)].numpy().tobytes() for b, s in zip(bufs, sizes)]


class RankEngine:
    """What every rank does with a plan: apply its messages, step (or not), report."""

    def __init__(self, core, rank: int, world_size: int, cpu_group):
        self.core, self.rank, self.world_size, self.group = core, rank, world_size, cpu_group
        self.wants_shutdown = False
        self.turns = 0
        self.on_turn = lambda n: None  # the watchdog's heartbeat: called as each turn starts

    def turn(self, plan: StepPlan) -> list[StepReport]:
        self.turns += 1
        outs: list[EngineOutput] = apply_control(self.core, plan.per_rank[self.rank])
        if plan.run_step:
            outs += self.core.step(lockstep=True)
        report = StepReport(self.rank, outs, {k: float(v) for k, v in self.core.stats().items()},
                            self.core.has_unfinished(), self.wants_shutdown)
        return [_report_dec.decode(b) for b in all_gather_bytes(_enc.encode(report), self.group, self.world_size)]


def agree_max_model_len(core, group) -> int:
    """Every rank serves the same context limit: the smallest any rank's KV cache allows."""
    t = torch.tensor([core.max_model_len], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    core.max_model_len = core.scheduler.max_model_len = int(t)
    return int(t)


class DistributedStepper:
    """Rank 0's side of the loop (the AsyncEngine's Stepper across all ranks)."""

    def __init__(self, rank_engine: RankEngine):
        self.re = rank_engine
        self.world_size = rank_engine.world_size
        self.owner: dict[str, int] = {}  # request id -> rank
        self.outstanding: dict[str, int] = {}  # request id -> tokens it may still add
        self.rank_has_work = [False] * self.world_size
        self.rank_stats: list[dict] = [{} for _ in range(self.world_size)]
        self.shutdown_requested = False

    def _load(self, r: int) -> int:
        return sum(n for rid, n in self.outstanding.items() if self.owner[rid] == r)

    def _plan(self, msgs: list[ControlMessage], run_step: bool, shutdown: bool = False) -> StepPlan:
        per_rank: list[list] = [[] for _ in range(self.world_size)]
        for m in msgs:
            if isinstance(m, NewRequest):
                r = min(range(self.world_size), key=lambda k: (self._load(k), k))
                self.owner[m.request_id] = r
                self.outstanding[m.request_id] = len(m.prompt_token_ids) + (m.params.max_tokens or 0)
                per_rank[r].append(m)
                log.info("request %s -> rank %d", m.request_id, r)
            elif isinstance(m, AbortRequest) and m.request_id in self.owner:
                per_rank[self.owner[m.request_id]].append(m)
            elif isinstance(m, LoadRecordControl):
                for lst in per_rank:
                    lst.append(m)
        return StepPlan(per_rank, run_step, shutdown)

    def _turn(self, plan: StepPlan) -> list[EngineOutput]:
        self.re.on_turn(self.re.turns + 1)
        broadcast_bytes(_enc.encode(plan), self.re.group)
        reports = self.re.turn(plan)
        outs: list[EngineOutput] = []
        for rep in reports:
            self.rank_has_work[rep.rank] = rep.has_work
            self.rank_stats[rep.rank] = rep.stats
            if rep.wants_shutdown and not self.shutdown_requested:
                log.info("rank %d asked to shut down (SIGTERM); stopping the job", rep.rank)
                self.shutdown_requested = True
                signal.raise_signal(signal.SIGTERM)  # the front end drains, then close() stops all
            for o in rep.outputs:
                if o.request_id in self.outstanding:
                    self.outstanding[o.request_id] -= len(o.new_token_ids)
                if o.finished:
                    self.owner.pop(o.request_id, None)
                    self.outstanding.pop(o.request_id, None)
                outs.append(o)
        return outs

    # --- Stepper --------------------------------------------------------------------------------
    def step(self, msgs: list[ControlMessage]) -> list[EngineOutput]:
        plan = self._plan(msgs, run_step=True)
        return self._turn(plan)

    def has_work(self) -> bool:
        return any(self.rank_has_work) or bool(self.owner)

    def idle(self) -> list[EngineOutput]:
        """A heartbeat turn: no model step, but every rank answers (a dead rank shows up here)."""
        return self._turn(self._plan([], run_step=False))

    def stats(self) -> dict:
        agg: dict[str, float] = {}
        for s in self.rank_stats:
            for k in ("num_running", "num_waiting", "num_preemptions", "prompt_tokens", "generation_tokens"):
                agg[k] = agg.get(k, 0) + s.get(k, 0)
        n = max(1, len(self.rank_stats))
        agg["kv_cache_usage"] = sum(s.get("kv_cache_usage", 0.0) for s in self.rank_stats) / n
        agg["prefix_cache_hit_rate"] = sum(s.get("prefix_cache_hit_rate", 0.0) for s in self.rank_stats) / n
        for r, s in enumerate(self.rank_stats):
            agg[f"rank{r}_num_running"] = s.get("num_running", 0)
        return agg

    def validate(self, prompt_token_ids, params) -> int:
        return self.re.core.validate(prompt_token_ids, params)

    def close(self) -> None:
        """Abort everything still running and tell every rank to exit."""
        aborts = [AbortRequest(rid) for rid in list(self.owner)]
        self._turn(self._plan(aborts, run_step=False, shutdown=True))


def worker_loop(rank_engine: RankEngine) -> int:
    """Ranks other than 0: follow rank 0's plans until it says shut down. SIGTERM here is passed
    on to rank 0 in the next report, so the whole job stops together."""
    def on_term(signum, frame):
        rank_engine.wants_shutdown = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    t0 = time.monotonic()
    while True:
        rank_engine.on_turn(rank_engine.turns + 1)
        plan = _plan_dec.decode(broadcast_bytes(None, rank_engine.group))
        rank_engine.turn(plan)
        if plan.shutdown:
            log.info("rank %d: shutdown after %.0fs", rank_engine.rank, time.monotonic() - t0)
            return 0
