"""The persistent input batch: every running request owns a row of preallocated host buffers
(tokens, block table, counts, sampling parameters) that is updated only where something changed,
and each step's model inputs are gathered from those rows with tensor ops.

Shape legend: R rows (max_num_seqs), L max_model_len, M max blocks per request, B sequences in a
(micro-)batch, T tokens in it, W widest block table among them, S sampled rows.

Row invariants (between steps, for a request in `row_of`):
  - token_ids_RL[row, :num_tokens_R[row]] are its prompt then output tokens as last synced;
  - block_table_RM[row, :num_blocks_R[row]] are its block ids (cache group 0); the rest of the row
    is 0; the other groups' tables (`group_tables`) are filled the same way from
    `Request.group_block_ids` (entries a sliding or chunked group has freed since they were written
    are stale and never read: the kernels start at the window); state_slot_R[row] is its live
    state slot (models with per-sequence state);
  - a free row holds zeros and neutral sampling parameters.
Rows change when a request is added (all its tokens and blocks written once), when it leaves
(finished, aborted or preempted: the row is cleared and freed; a preempted request is re-added when
readmitted), and when it is scheduled again (new output tokens, usually one, and new block ids are
appended). So per step the Python work is proportional to the scheduled requests, never to their
context lengths, and the persistent buffers are never copied to the device whole: the step's
gathered tensors travel in one host->device copy (`staging.HostToDevice`, a pinned buffer on CUDA).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from attention.metadata import AttentionMetadata
from expert_parallel.runtime.overlap import ATTENTION_TOKENS_PER_UNIT, split_pieces
from moe_serve.request import Request, RequestStatus
from moe_serve.sampling_metadata import SamplingMetadata, SamplingRows
from moe_serve.scheduler import SchedulerOutput
from moe_serve.staging import HostToDevice

# (row, first position computed, tokens computed, whether the step samples for it)
Piece = tuple[int, int, int, bool]


@dataclass
class StepInputs:
    """One step's device inputs: one (ids_T, positions_T, meta) per micro-batch (two when split),
    the rows of the packed hidden states to sample from, and the sampling metadata."""

    batches: list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]]
    logits_indices_S: torch.Tensor | None  # int64 indices into the step's packed tokens
    sampling: SamplingMetadata | None
    # Prompt logprobs (rows of requests that asked, `InputBatch.prompt_logprob_plan`): the packed
    # index of each prompt position computed this step and the prompt token that follows it.
    prompt_lp_indices_P: torch.Tensor | None = None
    prompt_lp_targets_P: torch.Tensor | None = None


@dataclass
class PromptLogprobPiece:
    """One request's prompt positions in a step whose next token's logprob it asked for: `count`
    consecutive packed rows from `first_index` of the step's prompt-logprob rows, giving prompt
    tokens `first_token` .. first_token + count - 1, with `num_top` top logprobs each."""

    request_id: str
    first_index: int
    count: int
    first_token: int
    num_top: int


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, vocab_size: int,
                 device: torch.device | str = "cpu", group_scratch: list[int] | None = None,
                 state_scratch: int | None = None):
        """group_scratch: the scratch block of each cache group after group 0 (the model runner's
        groups; none for a model with one kind of attention); state_scratch: the state slot padded
        rows use (None: the model keeps no per-sequence state)."""
        R, L, bs = max_num_seqs, max_model_len, block_size
        self.max_model_len, self.block_size = L, bs
        self.max_blocks = -(-L // bs)
        self.token_ids_RL = torch.zeros((R, L), dtype=torch.int32)
        self.num_tokens_R = torch.zeros(R, dtype=torch.int64)
        self.num_prompt_R = torch.zeros(R, dtype=torch.int64)
        self.num_blocks_R = torch.zeros(R, dtype=torch.int64)
        self.block_table_RM = torch.zeros((R, self.max_blocks), dtype=torch.int32)
        self.group_scratch = list(group_scratch or [])
        self.group_tables = [torch.zeros((R, self.max_blocks), dtype=torch.int32) for _ in self.group_scratch]
        self._gbt = [t.numpy() for t in self.group_tables]
        self.state_scratch = state_scratch
        self.state_slot_R = torch.zeros(R, dtype=torch.int64)
        self._slot = self.state_slot_R.numpy()
        # numpy views of the same memory: single-element writes from Python cost ~100 ns this way.
        self._tok, self._ntok = self.token_ids_RL.numpy(), self.num_tokens_R.numpy()
        self._nprompt, self._nblk, self._bt = self.num_prompt_R.numpy(), self.num_blocks_R.numpy(), \
            self.block_table_RM.numpy()
        self.sampling = SamplingRows(R, vocab_size, self.num_tokens_R, self.num_prompt_R, self.token_ids_RL)
        self.row_of: dict[str, int] = {}
        self.req_at_row: list[Request | None] = [None] * R
        self._preemptions_at_add = [0] * R
        self._free = list(range(R - 1, -1, -1))  # pop() hands out the lowest row first
        self.h2d = HostToDevice(device)

    # --- rows -----------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput) -> list[Piece]:
        """Apply what changed since the last step; the scheduled requests as pieces, in order."""
        for rid in out.finished_req_ids:
            self.remove(rid)
        for rid in out.preempted_req_ids:
            self.remove(rid)
        pieces = []
        self.step_drafts = []  # draft tokens at the end of each piece (speculative decoding)
        self.prompt_logprob_plan: list[PromptLogprobPiece] = []
        self._prompt_lp_rows: tuple[list[int], list[int]] = ([], [])  # packed indices, next prompt tokens
        packed = 0
        for s in out.scheduled:
            row = self._sync(s.request)
            if s.draft_ids:  # after the known tokens, not counted in them: the next sync overwrites
                have = int(self._ntok[row])
                self._check_len(s.request, have + len(s.draft_ids))
                self._tok[row, have:have + len(s.draft_ids)] = s.draft_ids
            start = s.request.num_computed_tokens
            pieces.append((row, start, s.num_tokens, s.samples))
            self.step_drafts.append(len(s.draft_ids))
            if s.request.needs_prompt_logprobs:
                self._plan_prompt_logprobs(s.request, packed, start, s.num_tokens)
            packed += s.num_tokens
        return pieces

    def _plan_prompt_logprobs(self, req: Request, packed: int, start: int, n: int) -> None:
        """The positions p of this piece (start .. start + n - 1) whose hidden state gives the
        logprob of prompt token p + 1 that req has not got yet (a recomputed piece, after a
        preemption, skips those it has)."""
        lo, hi = max(start, req.num_prompt_logprobs), min(start + n, req.num_prompt_tokens - 1)
        if hi <= lo:
            return
        idx, targets = self._prompt_lp_rows
        self.prompt_logprob_plan.append(PromptLogprobPiece(req.request_id, len(idx), hi - lo, lo + 1,
                                                           req.params.prompt_logprobs))
        idx.extend(range(packed + lo - start, packed + hi - start))
        targets.extend(req.prompt_token_ids[lo + 1:hi + 1])

    def _sync(self, req: Request) -> int:
        """req's row, added if it has none; new tokens and block ids appended."""
        row = self.row_of.get(req.request_id)
        if row is not None and (self.req_at_row[row] is not req
                                or self._preemptions_at_add[row] != req.num_preemptions):
            # A reused id, or a preemption the runner was not told of (a skipped empty step).
            self.remove(req.request_id)
            row = None
        if row is None:
            return self.add(req)
        have, total = int(self._ntok[row]), req.num_tokens
        if total > have:
            self._check_len(req, total)
            self._tok[row, have:total] = req.output_token_ids[have - req.num_prompt_tokens:]
            self._ntok[row] = total
        nb, blocks = int(self._nblk[row]), req.block_ids
        if len(blocks) > nb:
            self._bt[row, nb:len(blocks)] = blocks[nb:]
            for bt, table in zip(self._gbt, req.group_block_ids):
                bt[row, nb:len(blocks)] = table[nb:]
            self._nblk[row] = len(blocks)
        return row

    def add(self, req: Request) -> int:
        """Give req a row and write all it has: tokens, block ids, sampling parameters."""
        if not self._free:
            self._reclaim()
        row = self._free.pop()
        tokens = req.all_token_ids
        self._check_len(req, len(tokens))
        self._tok[row, :len(tokens)] = tokens
        self._ntok[row], self._nprompt[row] = len(tokens), req.num_prompt_tokens
        self._bt[row, :len(req.block_ids)] = req.block_ids
        for bt, table in zip(self._gbt, req.group_block_ids):
            bt[row, :len(table)] = table
        self._nblk[row] = len(req.block_ids)
        if self.state_scratch is not None:
            self._slot[row] = req.state_slot
        self.sampling.add(row, req)
        self.row_of[req.request_id] = row
        self.req_at_row[row] = req
        self._preemptions_at_add[row] = req.num_preemptions
        return row

    def remove(self, request_id: str) -> None:
        """Free request_id's row, if it has one, restoring the free-row invariant."""
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        self._bt[row, :self._nblk[row]] = 0
        for bt in self._gbt:
            bt[row, :self._nblk[row]] = 0
        self._slot[row] = 0
        self._ntok[row] = self._nprompt[row] = self._nblk[row] = 0
        self.sampling.remove(row)
        self.req_at_row[row] = None
        self._free.append(row)

    def _reclaim(self) -> None:
        """Free rows whose request is no longer running but whose end the runner was not told of;
        with every SchedulerOutput executed this never finds any."""
        for req in [r for r in self.req_at_row if r is not None and r.status != RequestStatus.RUNNING]:
            self.remove(req.request_id)
        if not self._free:
            raise RuntimeError(f"input batch full: all {len(self.req_at_row)} rows (max_num_seqs) hold running requests")

    def _check_len(self, req: Request, n: int) -> None:
        if n > self.max_model_len:
            raise ValueError(f"request {req.request_id!r} has {n} tokens, more than the input batch's "
                             f"max_model_len={self.max_model_len}")

    # --- one step -------------------------------------------------------------------------------
    def prepare(self, pieces: list[Piece], split: bool = False, pad_to: int | None = None,
                scratch_block: int = 0, pad_q: int = 1) -> StepInputs:
        """Device inputs of one step; with split, two micro-batches cut at a cost-balanced token
        (expert_parallel/runtime/overlap.py) and built from the same rows. One host->device copy.
        pad_to (steps whose sequences all have pad_q tokens, unsplit): dummy sequences of pad_q
        tokens appended up to pad_to sequences, at positions 0.. writing their KV to the first
        slots of scratch_block and never sampled."""
        groups = [pieces]
        if split:
            groups = list(split_pieces(pieces, split_point_T(self._positions(pieces))))
        host: list[torch.Tensor | None] = []
        lens = []
        scratch = [scratch_block, *self.group_scratch]
        for g in groups:
            tensors, q_lens, seq_lens = self._forward_host(g)
            if pad_to is not None and pad_to > len(g):
                tensors = _pad_decode(tensors, pad_to - len(g), scratch, self.block_size, self.state_scratch, pad_q)
                q_lens, seq_lens = q_lens + [pad_q] * (pad_to - len(g)), seq_lens + [pad_q] * (pad_to - len(g))
            host += tensors
            lens.append((q_lens, seq_lens))
        sample_rows, logits_idx, offsets, end = [], [], [], 0
        drafts = getattr(self, "step_drafts", None) or [0] * len(pieces)
        for (row, _, n, samples), k in zip(pieces, drafts):  # the packed order is the same split or not
            end += n
            if samples:  # the last token, and each draft token (position j sees j more outputs)
                for j in range(k + 1):
                    sample_rows.append(row)
                    logits_idx.append(end - 1 - k + j)
                    offsets.append(j)
        md = self.sampling.build(sample_rows, offsets if any(offsets) else None) if sample_rows else None
        names = md.tensor_fields() if md is not None else []
        host.append(torch.tensor(logits_idx, dtype=torch.int64) if sample_rows else None)
        host += [getattr(md, k) for k in names]
        # Taken once: a step prepared without an update (an empty lockstep step) has none.
        (lp_idx, lp_targets), self._prompt_lp_rows = getattr(self, "_prompt_lp_rows", ([], [])), ([], [])
        if lp_idx:  # prompt logprobs: their rows travel in the same copy
            host += [torch.tensor(lp_idx, dtype=torch.int64), torch.tensor(lp_targets, dtype=torch.int64)]
        self.last_logits_idx = logits_idx  # host copy: what speculative drafters read back
        dev = self.h2d(host)
        per = self._tensors_per_batch
        batches = [self._device_batch(dev[per * i:per * (i + 1)], q_lens, seq_lens)
                   for i, (q_lens, seq_lens) in enumerate(lens)]
        k = per * len(groups)
        if names:
            md = replace(md, **dict(zip(names, dev[k + 1:k + 1 + len(names)])))
        lp = dev[k + 1 + len(names):] if lp_idx else (None, None)
        return StepInputs(batches, dev[k], md, *lp)

    def _device_batch(self, dev: list[torch.Tensor], q_lens: list[int], seq_lens: list[int]):
        """(ids_T, positions_T, meta) from one batch's device tensors (_forward_host's order)."""
        ids, pos, slots, qsl, sl, bt, *more = dev
        meta = AttentionMetadata.from_tensors(qsl, sl, bt, slots, self.block_size, q_lens, seq_lens)
        for g in range(len(self.group_scratch)):
            meta.group_tables[g + 1] = (more[2 * g + 1], more[2 * g])
        if self.state_scratch is not None:
            meta.state_slots = more[-1]
        return ids, pos, meta

    # --- draft passes (MTP) ----------------------------------------------------------------------
    def can_write(self, row: int, pos: int) -> bool:
        """Whether row's request holds a cache slot for position pos (blocks reserved ahead)."""
        return pos < self.max_model_len and pos // self.block_size < int(self._nblk[row])

    def one_token_batch(self, row_pos: list[tuple[int, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        """(positions_T, meta) of one token per (row, position): a decode-shaped batch whose K/V
        go to those positions' slots of the rows' blocks (speculative drafters' chained passes)."""
        tensors, q_lens, seq_lens = self._forward_host([(row, pos, 1, False) for row, pos in row_pos])
        _, pos, meta = self._device_batch(self.h2d(tensors), q_lens, seq_lens)
        return pos, meta

    def next_token_ids(self, pieces: list[Piece], sampled: list[int]) -> torch.Tensor:
        """For each token of the last prepared step, in packed order, the token after it: the
        row's next token, or at a sampled position the token sampled there (`sampled`, in the
        order of `last_logits_idx`). Positions past what a row holds read stale ids; every one of
        them is a sampled position."""
        if not pieces:
            return torch.zeros(0, dtype=torch.int64)
        rows_B, start_B, q_B = torch.tensor([p[:3] for p in pieces], dtype=torch.int64).T
        T = int(q_B.sum())
        qsl = torch.cumsum(q_B, 0) - q_B
        pos_T = torch.arange(T) + torch.repeat_interleave(start_B - qsl, q_B, output_size=T)
        row_T = torch.repeat_interleave(rows_B, q_B, output_size=T)
        nxt = self.token_ids_RL[row_T, (pos_T + 1).clamp(max=self.max_model_len - 1)].to(torch.int64)
        if sampled:
            nxt[torch.tensor(self.last_logits_idx[:len(sampled)], dtype=torch.int64)] = \
                torch.tensor(sampled, dtype=torch.int64)
        return nxt

    def _positions(self, pieces: list[Piece]) -> torch.Tensor:
        if not pieces:
            return torch.zeros(0, dtype=torch.int64)
        starts, nums = torch.tensor([[p[1], p[2]] for p in pieces], dtype=torch.int64).T
        qsl = torch.cumsum(nums, 0) - nums
        return torch.arange(int(nums.sum())) + torch.repeat_interleave(starts - qsl, nums)

    @property
    def _tensors_per_batch(self) -> int:
        return 6 + 2 * len(self.group_scratch) + (self.state_scratch is not None)

    def _forward_host(self, pieces: list[Piece]) -> tuple[list[torch.Tensor], list[int], list[int]]:
        """[ids_T, positions_T, slot_mapping_T, query_start_loc, seq_lens, block_tables] on the host,
        gathered from the rows, then (slot_mapping_T, block_tables) of each further cache group and
        the state slots (B,) where the model has them, plus host lists of query and sequence lengths."""
        B, bs = len(pieces), self.block_size
        q_lens = [p[2] for p in pieces]
        seq_lens = [p[1] + p[2] for p in pieces]
        if B == 0:
            empty = torch.zeros(0, dtype=torch.int64)
            no_table = torch.zeros((0, 1), dtype=torch.int32)
            return [empty, empty, empty, torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                    no_table] + [empty, no_table] * len(self.group_scratch) + \
                [empty] * (self.state_scratch is not None), q_lens, seq_lens
        # In numpy: a step's host work is a dozen tiny gathers, each several times cheaper there
        # than as a torch op (the tensors share memory with the arrays).
        rows_B, start_B, q_B = np.array([p[:3] for p in pieces], dtype=np.int64).T
        T = sum(q_lens)
        qsl = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(q_B, out=qsl[1:])
        # Token t of sequence b sits at position start_b + (t - qsl_b), in row rows_b.
        pos_T = np.arange(T, dtype=np.int64) + np.repeat(start_B - qsl[:-1], q_B)
        row_T = np.repeat(rows_B, q_B)
        blk_T, off_T = pos_T // bs, pos_T % bs
        ids_T = self.token_ids_RL.numpy()[row_T, pos_T].astype(np.int64)
        W = max(1, -(-max(seq_lens) // bs))  # the blocks the longest context spans (a host int: no tensor read)

        def slots_and_table(table: torch.Tensor) -> list[np.ndarray]:
            t = table.numpy()
            return [t[row_T, blk_T].astype(np.int64) * bs + off_T, t[rows_B, :W]]

        slot_T, bt_BW = slots_and_table(self.block_table_RM)
        out = [ids_T, pos_T, slot_T, qsl.astype(np.int32), (start_B + q_B).astype(np.int32), bt_BW]
        for table in self.group_tables:
            out += slots_and_table(table)
        if self.state_scratch is not None:
            out.append(self.state_slot_R.numpy()[rows_B])
        out = [torch.from_numpy(a) for a in out]
        return out, q_lens, seq_lens


def _pad_decode(tensors: list[torch.Tensor], n: int, scratch: list[int], block_size: int,
                state_scratch: int | None = None, q: int = 1) -> list[torch.Tensor]:
    """_forward_host's tensors with n dummy sequences appended, each of q tokens (q > 1: a verify
    step's shape): tokens 0 at positions 0 .. q - 1, their slots the first q of their group's
    scratch block (scratch: one per cache group), the context those tokens, the block table
    [scratch block, 0, ...], the state slot `state_scratch`."""
    ids_T, pos_T, slot_T, qsl, sl, bt_BW, *more = tensors
    pos_pad = torch.arange(q, dtype=torch.int64).repeat(n)

    def pad_group(slot_T, bt_BW, scratch_block):
        bt_pad = torch.zeros((n, bt_BW.shape[1]), dtype=torch.int32)
        bt_pad[:, 0] = scratch_block
        return [torch.cat([slot_T, scratch_block * block_size + pos_pad]), torch.cat([bt_BW, bt_pad])]

    slot_T, bt_BW = pad_group(slot_T, bt_BW, scratch[0])
    out = [torch.cat([ids_T, torch.zeros(n * q, dtype=torch.int64)]), torch.cat([pos_T, pos_pad]), slot_T,
           torch.cat([qsl, qsl[-1] + q * torch.arange(1, n + 1, dtype=torch.int32)]),
           torch.cat([sl, torch.full((n,), q, dtype=torch.int32)]), bt_BW]
    for g in range(1, len(scratch)):
        out += pad_group(more[2 * g - 2], more[2 * g - 1], scratch[g])
    if state_scratch is not None:
        out.append(torch.cat([more[-1], torch.full((n,), state_scratch, dtype=torch.int64)]))
    return out


def split_point_T(positions_T: torch.Tensor) -> int:
    """overlap.split_point over a tensor of positions: the first token whose cost midpoint reaches
    half the total, where a token at position p costs 1 + p / ATTENTION_TOKENS_PER_UNIT."""
    costs_T = 1.0 + positions_T.to(torch.float64) / ATTENTION_TOKENS_PER_UNIT
    mid_T = torch.cumsum(costs_T, 0) - costs_T / 2  # cost before token t plus half its own
    # mid_T increases with t, so the tokens before the cut are exactly those below half.
    return int((mid_T < costs_T.sum() / 2).sum())
