"""Decode steps as captured CUDA graphs: the batch-size ladder, padding, capture and replay.

Decode-only steps whose batch fits the ladder (1, 2, 4, 8, then multiples of 8 up to the largest
capture size) are padded to the next ladder size (`InputBatch.prepare(pad_to=...)`): each padded
row is a dummy one-token sequence at position 0 whose KV write goes to the runner's scratch block
(one block past those the allocator hands out, so never a real request's), which attends to that
key only, and which is never sampled (logits indices name real rows only). With expert
parallelism every rank pads to the ladder size of the most tokens any rank scheduled (the core
loop's per-step all-reduce), so all ranks run the same batch size, and the MoE layers exchange
tokens in the dispatcher's fixed-shape form (an all-gather of every rank's padded rows and a
reduce-scatter back: no host read, no data-dependent shape; `MoEStep.static_rows`, `decode_step`).

On CUDA one `torch.cuda.CUDAGraph` per ladder size holds the model forward over static input
buffers (ids, positions, slot mapping, query starts, sequence lengths, block tables); a decode step
copies its inputs into them and replays. What the attention launch reads on the host is fixed per
captured size: the grid (the padded batch), one query token per sequence, and the split-K count,
chosen from the longest context any step can have (max_model_len) instead of the step's.

Speculative decoding's verify steps, where every sequence runs its last token and K drafts, get the
same treatment with q = 1 + K tokens per sequence (`DecodeGraphs(query_len=q)`, a ladder in
sequences capped at the largest capture size in tokens): padded sequences are q tokens at
positions 0 .. q - 1 of the scratch block, and with expert parallelism the ranks agree on q as
they agree on decode (engine/core_proc.py `step_shape`). Prefill, mixed, split (overlap) steps
and verify steps where some sequence carries fewer drafts run eagerly.

On the CPU, where our C kernels run every layer of a model they can hold (runner/graphs.py
`cpu_graphs_apply`), each ladder size is a `CpuGraph` instead (moe_serve/cpu_graph.py): the same
static buffers, the forward recorded once as the C calls and torch ops it made (the smallest size
at start-up, each other one by the first step of its size), replayed without the Python of the
modules. Its ladder is every size up to 8, then multiples of 8 up to 32
(CPU_MAX_CAPTURE_SIZE, or --max-capture-size): on a CPU a padded row costs its share of the
arithmetic, and each size keeps its own buffers. Elsewhere on the CPU the padded path runs eagerly,
and only when asked (it is slower there: bench/results/architecture-figures.md).
"""
from __future__ import annotations

import logging
import time

import torch

from attention.metadata import AttentionMetadata
from expert_parallel.runtime.step import MoEStep
from moe_serve import platform
from moe_serve.cpu_graph import CaptureError, CpuGraph

log = logging.getLogger("moe_serve.cuda_graph")

MAX_CAPTURE_SIZE = 512


CPU_MAX_CAPTURE_SIZE = 32
# CPU recordings of up to this many sequences compute the LM head too, over all their rows (at most
# 16 x V float32 logits kept a size). Up to 16 rows the eager head runs the same C kernel family for
# the sampled rows alone (moe_serve/kernels/cpu_ops linear: bf16 dot tiles up to 16 rows; float32
# up to 4, then panels, and the CPU ladder pads only 9-15 to 16): a row's logits are the same.
CPU_LOGITS_MAX_ROWS = 16


def capture_sizes(max_num_seqs: int, max_capture_size: int | None = None, cpu: bool = False) -> list[int]:
    """The ladder: 1, 2, 4, 8 (on the CPU every size up to 8), then every multiple of 8, up to
    min(max_num_seqs, max_capture_size) (default cap 512, on the CPU 32); the cap itself is always
    included, so every batch up to it has a size."""
    cap = min(max_num_seqs, max_capture_size or (CPU_MAX_CAPTURE_SIZE if cpu else MAX_CAPTURE_SIZE))
    if cap < 1:
        raise ValueError(f"largest capture size {cap} must be >= 1")
    small = range(1, 8) if cpu else (1, 2, 4)
    sizes = [s for s in small if s < cap] + list(range(8, cap, 8))
    return sizes + [cap]


def verify_capture_sizes(max_num_seqs: int, max_capture_size: int | None, query_len: int) -> list[int]:
    """The ladder of verify steps (query_len tokens per sequence), in sequences: the decode ladder
    capped so that no graph runs more tokens than the largest capture size."""
    return capture_sizes(max_num_seqs, max(1, (max_capture_size or MAX_CAPTURE_SIZE) // query_len))


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest ladder size >= n (sizes ascending); None when n is 0 or above the ladder."""
    if n < 1:
        return None
    for s in sizes:
        if s >= n:
            return s
    return None


def capture_agreement(dispatcher):
    """With expert parallelism, agree(ok) -> whether every rank captured a size (one small MAX
    all-reduce over the dispatcher's group), so that the ranks keep graphs or run eagerly together;
    None with one rank."""
    if dispatcher is None or dispatcher.world_size == 1:
        return None
    return lambda ok: dispatcher.agree_max(0 if ok else 1) == 0


def decode_step(B: int) -> MoEStep:
    """What the MoE layers are told of a padded decode step of B rows: every rank runs B rows (the
    dispatcher's fixed-shape exchange, which a graph can hold), and B is the most any rank runs."""
    return MoEStep(max_tokens_any_rank=B, static_rows=B)


def capture_ladder(sizes: list[int], capture_one, agree=None) -> dict:
    """{size: capture_one(size)} for every ladder size, largest first (the smaller graphs reuse its
    pool). agree(ok) -> bool, a collective over the EP group,
    says after each size whether every rank captured it; if any did not, every rank raises
    RuntimeError at that same size (so all of them run eagerly, and none waits in a collective the
    others never enter). A capture's failure of any kind counts; without agree it is raised as is."""
    graphs = {}
    for B in sorted(sizes, reverse=True):
        err = None
        try:
            graphs[B] = capture_one(B)
        except Exception as e:  # noqa: BLE001 - every rank must reach agree() whatever failed here
            if agree is None:
                raise
            err = e
        if agree is not None and not agree(err is None):
            raise RuntimeError(f"decode graph capture of batch {B} failed on "
                               f"{'this rank' if err else 'another rank'}: {err or ''}") from err
    return graphs


class DecodeGraphs:
    """One captured decode forward per ladder size, over static buffers sized for the largest.

    model(ids_T, positions_T, meta) -> hidden (T, D) is captured; sampling stays outside the graph.
    Capture needs the KV cache bound (the graphs write and read it at fixed addresses)."""

    def __init__(self, model, sizes: list[int], max_blocks: int, block_size: int, max_seq_len: int,
                 scratch_block: int, device: torch.device, group_scratch: list[int] | None = None,
                 state_scratch: int | None = None, query_len: int = 1):
        """group_scratch: the scratch block of every cache group after group 0; state_scratch: the
        scratch state slot (models with per-sequence state): idle rows point there too.
        query_len: tokens per sequence (1: decode; 1 + K: speculative decoding's verify steps, each
        sequence its last token and K drafts); sizes count sequences, a graph runs sizes * query_len
        tokens. An idle sequence is query_len tokens at positions 0.. in the scratch block."""
        if query_len > block_size:
            raise ValueError(f"graphs of {query_len} tokens per sequence need block_size >= {query_len}")
        self.model, self.sizes, self.block_size, self.q = model, sorted(sizes), block_size, query_len
        self.max_seq_len = max_seq_len
        n, q = self.sizes[-1], query_len
        kw = dict(device=device)
        # Idle rows point at the scratch block: what a capture or warm-up writes lands there only.
        self.ids = torch.zeros(n * q, dtype=torch.int64, **kw)
        self.pos = torch.arange(q, dtype=torch.int64, **kw).repeat(n)
        self.slots = scratch_block * block_size + self.pos.clone()
        self.qsl = torch.arange(0, (n + 1) * q, q, dtype=torch.int32, **kw)
        self.seq_lens = torch.full((n,), q, dtype=torch.int32, **kw)
        self.block_tables = torch.full((n, max_blocks), scratch_block, dtype=torch.int32, **kw)
        self.group_tables = {g + 1: (torch.full((n, max_blocks), s, dtype=torch.int32, **kw),
                                     s * block_size + self.pos.clone())
                             for g, s in enumerate(group_scratch or [])}
        self.state_slots = None if state_scratch is None else torch.full((n,), state_scratch, dtype=torch.int64, **kw)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.memory_bytes = 0
        self.capture_s = 0.0
        self.record_lazily = False  # the CPU: sizes not recorded yet are recorded by their first step
        # The CPU: logits of every row (B, V) that a size's recording computes after its forward, and
        # those of the last replay (None: that step ran eagerly or its recording has none).
        self.logits: dict[int, torch.Tensor] = {}
        self.last_logits: torch.Tensor | None = None

    def _meta(self, B: int) -> AttentionMetadata:
        # Host lengths at their largest: the split count is fixed by max_model_len, not the step.
        T = B * self.q
        meta = AttentionMetadata.from_tensors(self.qsl[:B + 1], self.seq_lens[:B], self.block_tables[:B],
                                              self.slots[:T], self.block_size, [self.q] * B, [self.max_seq_len] * B)
        meta.group_tables = {g: (bt[:B], slots[:T]) for g, (bt, slots) in self.group_tables.items()}
        meta.state_slots = None if self.state_slots is None else self.state_slots[:B]
        return meta

    @torch.inference_mode()
    def capture(self, agree=None) -> None:
        """Capture every size, largest first. With expert parallelism every rank captures the same
        sizes in the same order (the MoE layers' collectives are captured too, in the dispatcher's
        fixed-shape form), and agree(ok) -> bool, a collective, says after each size whether every
        rank captured it: if one did not, all of them raise (and so all run eagerly)."""
        cpu = self.ids.device.type == "cpu"
        if not cpu:
            torch.cuda.synchronize()
            free0, _ = torch.cuda.mem_get_info()
        t0 = time.perf_counter()
        self.graphs = {}  # none kept unless every size is captured (on every rank)
        if cpu:
            # One size now (a recording that fails fails here, before serving: the steps then run
            # eagerly and unpadded); the others when a step first needs them (a recording costs one
            # forward, and a start-up, a test's above all, uses few sizes).
            self.graphs = {self.sizes[0]: self._capture_one(self.sizes[0], None)}
            self.record_lazily = True
            self.capture_s = time.perf_counter() - t0
            log.info("decode steps replayed from CPU recordings (batch %s; each recorded on first use, %d now in "
                     "%.2fs)", ",".join(map(str, self.sizes)), len(self.graphs), self.capture_s)
            return
        pool = torch.cuda.graph_pool_handle()
        self.graphs = capture_ladder(self.sizes, lambda B: self._capture_one(B, pool), agree)
        torch.cuda.synchronize()
        self.memory_bytes = free0 - torch.cuda.mem_get_info()[0]
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d %s graphs (batch %s) in %.1fs, %.1f MiB of graph memory", len(self.graphs),
                 "decode" if self.q == 1 else f"verify ({self.q} tokens per sequence)",
                 ",".join(map(str, self.sizes)), self.capture_s, self.memory_bytes / 2**20)

    def _record(self, B: int):
        """A CPU recording of size B made by the step that first needs it (its inputs already in the
        static buffers: the recorded forward is that step's); None, and no more recordings, if it
        fails (that step and the later ones run eagerly on the static buffers)."""
        try:
            g, out = self._capture_one(B, None, warm=False)
        except CaptureError as e:
            self.record_lazily = False
            log.warning("CPU recording of decode batch %d failed, running such steps eagerly: %s", B, e)
            return None
        self.graphs[B] = (g, out)
        self.memory_bytes += g.memory_bytes
        log.debug("decode batch %d recorded: %d calls, %.2f MiB", B, len(g.calls), g.memory_bytes / 2**20)
        return out

    def _capture_one(self, B: int, pool, warm: bool = True) -> tuple:
        T = B * self.q
        ids, pos, meta, step = self.ids[:T], self.pos[:T], self._meta(B), decode_step(T)
        if pool is None:  # the CPU: the forward as it runs there (our C kernels), recorded
            if warm:  # lazily made tables and buffers, before the first recording
                meta.backend_plans.clear()
                self.model(ids, pos, meta, step)
            if self.q == 1 and B <= CPU_LOGITS_MAX_ROWS:
                head = []  # set once the forward is recorded and the LM head begins

                def forward_and_logits():
                    h = self.model(ids, pos, meta, step)
                    head.append(True)
                    return h, self.model.compute_logits(h)

                try:  # the LM head over every row too: its host work (checks, allocations) leaves the step
                    meta.backend_plans.clear()
                    g = CpuGraph()
                    h, self.logits[B] = g.capture(forward_and_logits)
                    return g, h
                except CaptureError as e:
                    if not head:  # the forward failed: so would a recording of it alone
                        raise
                    log.debug("decode batch %d recorded without its LM head: %s", B, e)
            meta.backend_plans.clear()
            g = CpuGraph()
            return g, g.capture(lambda: self.model(ids, pos, meta, step))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), platform.capturable(self.model):
            for _ in range(2):  # compiles, autotuning and allocator warm-up outside the capture
                meta.backend_plans.clear()
                self.model(ids, pos, meta, step)
        torch.cuda.current_stream().wait_stream(side)
        meta.backend_plans.clear()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool), platform.capturable(self.model):
            out = self.model(ids, pos, meta, step)
        return g, out

    def replay(self, ids_T: torch.Tensor, pos_T: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a padded decode step (its size a ladder size): inputs copied into the
        static buffers, the graph replayed. Block-table columns past the step's width keep stale
        ids: the kernels read a row's blocks only up to its sequence length. A size not captured
        (none is, before `capture` or on the CPU) runs the model eagerly on the same static buffers
        and metadata a graph reads, which is how the CPU tests check what the graphs are given."""
        T = ids_T.shape[0]
        B = T // self.q
        self.ids[:T].copy_(ids_T, non_blocking=True)
        self.pos[:T].copy_(pos_T, non_blocking=True)
        self.slots[:T].copy_(meta.slot_mapping, non_blocking=True)
        self.qsl[:B + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.seq_lens[:B].copy_(meta.seq_lens, non_blocking=True)
        bt = meta.block_tables
        self.block_tables[:B, :bt.shape[1]].copy_(bt, non_blocking=True)
        for g, (bt_g, slots_g) in self.group_tables.items():
            src_bt, src_slots = meta.group_tables[g]
            bt_g[:B, :src_bt.shape[1]].copy_(src_bt, non_blocking=True)
            slots_g[:T].copy_(src_slots, non_blocking=True)
        if self.state_slots is not None:
            self.state_slots[:B].copy_(meta.state_slots, non_blocking=True)
        self.last_logits = None
        if B not in self.graphs:
            if self.record_lazily and B in self.sizes and (out := self._record(B)) is not None:
                self.last_logits = self.logits.get(B)
                return out
            return self.model(self.ids[:T], self.pos[:T], self._meta(B), decode_step(T))
        g, out = self.graphs[B]
        g.replay()
        self.last_logits = self.logits.get(B)
        return out
