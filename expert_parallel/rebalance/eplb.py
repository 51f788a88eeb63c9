"""Expert rebalancing while serving (EPLB online): record load, tune, move weights, switch maps.

Shape legend: L MoE layers, E logical experts, S physical slots, P ranks, s = S / P local slots,
W forecast windows, T tokens, K top-k.

Every rank runs the same state machine, driven from the core loop at step boundaries:

  record   every step adds the router's logical ids to a local ExpertLoadRecorder (windows of
           window_size / 8 steps, the last window_size steps kept).
  tune     every step_interval model steps (every rank counts the same steps: lockstep), the ranks
           sum their windows in one all_reduce over the CPU group, so every rank holds the same
           numbers (int64 token counts: the sum is exact). Each rank then runs the
           same deterministic tuner (expert_parallel/placement/tuner.py: a fixed-seed RNG, stable sorts, the
           same float operations in the same order) on every layer in a background thread while serving goes
           on, and so computes the same placement with no further collective. It is used once every
           rank is done (the per-turn flag below); the per-turn all-reduce also carries a digest of
           each rank's placement (as d and -d under MAX), so ranks that disagreed (a different numpy
           build, say) stop with an error instead of serving different maps. So a rebalance costs
           one small collective over the CPU group, none per step.
  move     changed layers, in order, at most LAYERS_IN_FLIGHT at once: the experts a rank gains
           are received (torch.distributed irecv/isend on a group of their own) into a spare
           buffer, together with local copies of the experts it keeps; a thread waits for them.
           The live weights are only read meanwhile, and steps keep running on them.
  switch   a layer switches when every rank has all of its pieces: each turn, the core loop's one
           MAX all-reduce carries "my oldest pending item is not ready" (local_flag); when the
           agreed value is 0, every rank at the same boundary swaps the spare buffer in for the
           layer's weights and replaces its slot list and ReplicaMap together. The old weights
           become the spare buffer. So a step sees each layer wholly before or wholly after.

Memory: LAYERS_IN_FLIGHT spare buffers, each one layer's local experts (s x 3 x F x D elements of
the expert weights' dtype, plus biases or quantization scales where the experts have them: every
per-slot tensor moves), allocated at start and logged. Bytes travel as uint8 views, so any dtype
(FP8 included) goes through any backend.
A rank that dies mid-transfer leaves the others' receives pending (they keep serving on the old
weights) until the per-turn all-reduce cannot complete: the watchdog then names the rank and ends
the job within --dist-timeout.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from expert_parallel.rebalance.config import LAYERS_IN_FLIGHT, EplbConfig
from expert_parallel.placement.load_stats import ExpertLoadRecorder
from expert_parallel.runtime.groups import group_timeout
from expert_parallel.rebalance.plan import LayerPlan, plan_layer

log = logging.getLogger("moe_serve.eplb")

# Test hook: "RANK:LAYER" makes that rank SIGKILL itself right after posting that layer's transfer.
_FAULT_ENV = "MOE_SERVE_EPLB_KILL_DURING_TRANSFER"


def tuner_fn(nodes: int = 1, groups: int | None = None, split: str = "balanced"):
    """The project's tuner as a tune_fn(history_WLE, gpus, slots) -> physical_to_logical_LS. With
    several nodes (and the router's expert groups) it also keeps tokens near their node; split:
    how the MoE layers share replicas' tokens (MoEContext.replica_split), which it judges by."""
    def tune(history_WLE: np.ndarray, gpus: int, slots: int) -> np.ndarray:
        from expert_parallel.placement import tuner

        return tuner.tune(history_WLE, gpus, nodes, slots, groups, tuner.TuneConfig(split=split))[0]
    return tune


def placement_digest(rows_LS) -> int:
    """A positive 62-bit hash of a placement (int64 rows), equal on every rank for equal rows."""
    import hashlib

    data = np.ascontiguousarray(rows_LS, dtype="<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2 or 1


class _Transfer:
    """One layer in flight: its plan, its spare buffer, and a thread that waits for its pieces."""

    def __init__(self, plan: LayerPlan, buf):
        self.plan, self.buf = plan, buf
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.received_bytes = 0

    def run(self, copies, works, on_cuda: bool) -> None:
        """In the transfer thread. On the CPU the local copies are plain memcpys, done here so the
        step boundary does not pay for them (the live weights are only read). On CUDA they were
        queued on the serving stream already (copies is then an event to wait for), and a thread
        must not block a stream: completion is polled."""
        try:
            if on_cuda:
                while not (copies.query() and all(w.is_completed() for w in works)):
                    time.sleep(0.0005)
            else:
                for dst, src in copies:
                    dst.copy_(src)
                for w in works:
                    w.wait()
        except BaseException as e:  # a peer died: reported at the switch (if the job lives that long)
            self.error = e
        self.done.set()


class EplbManager:
    def __init__(self, moe_layers, physical_to_logical_LS: list[list[int]], num_experts: int, cfg: EplbConfig,
                 rank: int, world_size: int, device, tune_fn=None):
        self.layers = sorted(moe_layers, key=lambda m: m.layer_index)
        self.rows = [list(r) for r in physical_to_logical_LS]
        self.E, self.cfg, self.rank, self.world = num_experts, cfg, rank, world_size
        self.S = len(self.rows[0])
        self.s = self.S // world_size
        self.tune_fn = tune_fn or tuner_fn()
        self.recorder = ExpertLoadRecorder(len(self.layers), num_experts, cfg.steps_per_window, device=device,
                                           max_windows=cfg.max_windows)
        self.recorder.start()
        # A group of its own for the weight traffic: its sends never interleave with MoE collectives.
        # Within the world's timeout: a rank lost while it is being made (an elastic job's next
        # generation, formed while a second rank dies) fails the build, which then regroups.
        self.p2p_group = (dist.new_group(backend=dist.get_backend(), timeout=group_timeout())
                          if world_size > 1 else None)
        first = self.layers[0].slot_tensors()
        for m in self.layers:
            if {k: (t.shape, t.dtype) for k, t in m.slot_tensors().items()} != \
                    {k: (t.shape, t.dtype) for k, t in first.items()}:
                raise ValueError("expert rebalancing needs every MoE layer's experts to have one shape")
        self.names = sorted(first)  # the per-slot tensors, in the order their pieces are tagged
        self._free = [{k: torch.empty_like(t) for k, t in first.items()} for _ in range(LAYERS_IN_FLIGHT)]
        self.buffer_bytes = LAYERS_IN_FLIGHT * sum(t.numel() * t.element_size() for t in first.values())
        log.info("expert rebalancing: %d slots (%d redundant), every %d steps from the last %d; %d transfer "
                 "buffers, %.1f MiB in all", self.S, self.S - num_experts, cfg.step_interval, cfg.window_size,
                 LAYERS_IN_FLIGHT, self.buffer_bytes / 2**20)
        self.steps = 0
        self._due = False
        self._queue: deque = deque()  # Future (tuning) or LayerPlan (not posted) or _Transfer (posted)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="eplb-tune")
        self._fault = os.environ.get(_FAULT_ENV)
        # Metrics (identical on every rank).
        self.rebalances = 0
        self.balancedness = 0.0  # not measured before the first rebalance
        self.last_transfer_s = 0.0
        self._started = 0.0
        self._moved_layers = 0
        self._bytes = 0
        self._step_ms: list[float] = []  # this rebalance period's step times
        self._switch_ms: list[float] = []  # steps right after a switch (their boundary work included)
        self._switch_boundary_ms: list[float] = []  # the boundary work alone at a switch
        self._boundary_s = 0.0
        self._switched = False
        self._report = False  # a rebalance finished: log it after the step that follows its last switch

    # --- per step -------------------------------------------------------------------------------
    def record(self, layer: int, topk_ids_TK: torch.Tensor) -> None:
        self.recorder.record(layer, topk_ids_TK)

    def end_step(self, seconds: float) -> None:
        """After every model step (empty ones included), on every rank."""
        self.recorder.end_step()
        self.steps += 1
        ms = 1e3 * (seconds + self._boundary_s)
        (self._switch_ms if self._switched else self._step_ms).append(ms)
        self._switched, self._boundary_s = False, 0.0
        if self._report:
            self._log_rebalance()
        if self.steps % self.cfg.step_interval == 0 and self.recorder.num_windows:
            self._due = True

    def local_flag(self) -> int:
        """1 while this rank's oldest pending item (the tuning or a layer's transfer) is not done."""
        return self.local_state()[0]

    def local_state(self) -> tuple[int, int]:
        """(local_flag, digest), read together: the digest (a positive 62-bit hash) of the tuned
        placement once the oldest pending item is a finished tuning, else 0. The per-turn
        agreement carries both (see boundary)."""
        if not self._queue:
            return 0, 0
        head = self._queue[0]
        if isinstance(head, Future):
            if not head.done():
                return 1, 0
            if not hasattr(head, "digest"):
                head.digest = placement_digest(head.result())
            return 0, head.digest
        return (0 if isinstance(head, _Transfer) and head.done.is_set() else 1), 0

    def boundary(self, agreed_flag: int, sync_group=None, digests: tuple[int, int] | None = None) -> None:
        """At the turn's boundary, after the ranks agreed (MAX over local_flag): the same call on
        every rank. Starts a due rebalance, completes the oldest item when every rank is ready,
        and keeps LAYERS_IN_FLIGHT transfers posted. digests: (MAX of the ranks' digests, MAX of
        their negations) from the same agreement; when a tuned placement is taken up they must
        be each other's negation (every rank tuned the same placement)."""
        t0, was_switched = time.perf_counter(), self._switched
        if self._due and not self._queue:
            self._due = False
            self._start(sync_group)
        elif self._queue and agreed_flag == 0:
            head = self._queue.popleft()
            if isinstance(head, Future):
                rows = head.result()
                if digests is not None and digests[0] != -digests[1]:
                    raise RuntimeError(
                        "expert rebalancing: the ranks tuned different placements from the same summed load "
                        f"(placement digests range over [{-digests[1]}, {digests[0]}]); the tuner must be "
                        "deterministic across ranks (same numpy build and CPU features)")
                self._plan(rows)
            else:
                self._switch(head)
        self._post_ready()
        self._boundary_s += time.perf_counter() - t0
        if self._switched and not was_switched:
            self._switch_boundary_ms.append(1e3 * (time.perf_counter() - t0))

    # --- the phases -----------------------------------------------------------------------------
    def _start(self, sync_group) -> None:
        history = self.recorder.windows()  # (W, L, E) this rank's tokens
        if self.world > 1:
            dist.all_reduce(history, group=sync_group)  # every rank: the same numbers
        h = history.numpy()
        from expert_parallel.placement.evaluation import evaluate

        # The last window as the layers' split would have served it (evaluation.slot_loads replays it
        # as batches through ReplicaMap): an estimate, the steps' own batches are not kept.
        split = getattr(self.layers[0].ctx, "replica_split", "round_robin")
        self.balancedness = evaluate(h.sum(0), np.asarray(self.rows), self.world, 1,
                                     split=split)["overall_balancedness"]
        if h.sum() == 0:
            return
        self._started = time.perf_counter()
        # Every rank tunes every layer from the same summed load: the same placement everywhere,
        # with no collective to share it (the tuner's CPU time is repeated on each rank instead).
        self._queue.append(self._pool.submit(self._tune_all, h))

    def _tune_all(self, h: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self.tune_fn(h, self.world, self.S), dtype=np.int64)

    def _plan(self, new_LS) -> None:
        new = [list(map(int, r)) for r in new_LS]
        for l, (old, row) in enumerate(zip(self.rows, new)):
            if old != row:
                self._queue.append(plan_layer(l, old, row, self.world, self.rank))
        self._moved_layers, self._bytes = len(self._queue), 0
        if not self._queue:
            log.info("expert rebalancing: the placement stays (balancedness of the last window %.3f)",
                     self.balancedness)

    def _post_ready(self) -> None:
        posted = sum(isinstance(x, _Transfer) for x in self._queue)
        for i, item in enumerate(self._queue):
            if posted >= LAYERS_IN_FLIGHT or not self._free:
                break
            if isinstance(item, LayerPlan):
                self._queue[i] = self._post(item)
                posted += 1

    def _post(self, plan: LayerPlan) -> _Transfer:
        live = self.layers[plan.layer].slot_tensors()
        t = _Transfer(plan, self._free.pop())
        buf = t.buf
        copies = [(buf[k][j], live[k][i]) for j, i in plan.copies for k in self.names]
        on_cuda = next(iter(buf.values())).device.type == "cuda"
        if on_cuda:  # queued behind the steps that still read the recycled buffer as live weights
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
            copies = torch.cuda.Event()
            copies.record()
        works = dist.batch_isend_irecv(self._p2p_ops(plan, buf, live, t)) if plan.recvs or plan.sends else []
        if self._fault == f"{self.rank}:{plan.layer}":
            log.warning("rank %d: killing itself during the transfer of MoE layer %d (%s)", self.rank, plan.layer,
                        _FAULT_ENV)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=t.run, args=(copies, works, on_cuda), name="eplb-transfer", daemon=True).start()
        return t

    def _p2p_ops(self, plan: LayerPlan, buf: dict, live: dict, t: _Transfer) -> list:
        """The layer's receives and sends as one batch: NCCL runs point-to-point work between two
        ranks in the order it is posted, so receives and sends posted one by one deadlock when two
        ranks swap experts (each waits in its first receive for a send queued behind the other's);
        a batch is posted as one group, matched whatever its order. (P2POp takes c10d's own
        isend / irecv: it checks the op by identity.)"""
        n, ops = len(self.names), []
        for j, src, e in plan.recvs:
            for k, name in enumerate(self.names):
                piece = buf[name][j]
                ops.append(dist.P2POp(c10d.irecv, piece.reshape(-1).view(torch.uint8), src, group=self.p2p_group,
                                      tag=(plan.layer * self.E + e) * n + k))
                t.received_bytes += piece.numel() * piece.element_size()
        for i, dst, e in plan.sends:
            for k, name in enumerate(self.names):
                ops.append(dist.P2POp(c10d.isend, live[name][i].reshape(-1).view(torch.uint8), dst,
                                      group=self.p2p_group, tag=(plan.layer * self.E + e) * n + k))
        return ops

    def _switch(self, t: _Transfer) -> None:
        if t.error is not None:
            raise RuntimeError(f"expert rebalancing: the transfer of MoE layer {t.plan.layer} failed: {t.error}")
        plan, moe = t.plan, self.layers[t.plan.layer]
        for j, j0 in plan.dups:
            for piece in t.buf.values():
                piece[j].copy_(piece[j0])
        lo = self.rank * self.s
        # The replaced weights are the next spare buffer: every send from them has completed.
        self._free.append(moe.switch_experts(t.buf, plan.new_row, plan.new_row[lo:lo + self.s]))
        self.rows[plan.layer] = plan.new_row
        self._bytes += t.received_bytes
        self._switched = True
        if not self._queue:
            self._finish()

    def _finish(self) -> None:
        self.rebalances += 1
        self.last_transfer_s = time.perf_counter() - self._started
        self._report = True

    def _log_rebalance(self) -> None:
        mean = lambda xs: float(np.mean(xs)) if xs else 0.0  # noqa: E731
        log.info("expert rebalancing %d done: %d MoE layers moved, %.2f MiB received here, %.3fs from tuning to the "
                 "last switch; balancedness of the last window %.3f; mean step %.2f ms, switch steps %.2f ms "
                 "(switch boundaries %.2f ms)", self.rebalances, self._moved_layers, self._bytes / 2**20,
                 self.last_transfer_s, self.balancedness, mean(self._step_ms), mean(self._switch_ms),
                 mean(self._switch_boundary_ms))
        self._step_ms, self._switch_ms, self._switch_boundary_ms = [], [], []
        self._report = False

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
