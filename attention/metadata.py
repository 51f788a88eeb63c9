"""What an attention backend needs to know about one scheduled batch.

Tokens of all sequences in a step are packed along one axis (T). Sequence b owns query rows
query_start_loc[b] : query_start_loc[b+1]; those are the *last* q_len_b tokens of its context of
seq_lens[b] tokens (earlier tokens are already in the paged cache: prefix hits, earlier chunks,
earlier decode steps). Its cache blocks are block_tables[b, :ceil(seq_lens[b] / block_size)].
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # (B+1,) int32, on the model's device
    seq_lens: torch.Tensor  # (B,) int32: context length including this step's tokens
    block_tables: torch.Tensor  # (B, max_blocks) int32, unused entries are 0
    slot_mapping: torch.Tensor  # (T,) int64: block_id * block_size + offset for each new token
    block_size: int
    # Host copies so reference paths and kernel launchers need no device->host sync.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # The torch attention backend's plans for this step (which cache blocks its decodes gather, and
    # their masks: attention/backends/reference.py), made by the first layer and reused by the
    # others; and the step's DSA selection ("dsa_topk", attention/layer.py PagedDSAAttention), left by
    # a layer with an indexer for the layers that share it. Nothing else keeps per-step state here; a
    # graph capture starts from an empty one.
    backend_plans: dict = field(default_factory=dict, repr=False, compare=False)
    # Per-sequence state slots (B,) int64 of the step, for layers that keep a fixed-size state
    # (attention/state.py StateCache); None when the model has none.
    state_slots: torch.Tensor | None = None
    # Block tables and slot mappings of the other cache groups (sliding / chunked layers keep their
    # own tables): group -> (block_tables, slot_mapping). Group 0 is this object's own.
    group_tables: dict = field(default_factory=dict, repr=False, compare=False)

    def for_group(self, group: int) -> "AttentionMetadata":
        """The metadata a layer of cache group `group` attends with: the same batch, that group's
        block table and slot mapping (and its own backend plans, which depend on the table)."""
        if group == 0:
            return self
        plans = self.backend_plans.setdefault(("group", group), {})
        if "meta" not in plans:
            bt, slots = self.group_tables[group]
            plans["meta"] = AttentionMetadata(self.query_start_loc, self.seq_lens, bt, slots, self.block_size,
                                              self.query_lens_cpu, self.seq_lens_cpu, self.max_query_len,
                                              self.max_seq_len, state_slots=self.state_slots)
        return plans["meta"]

    @functools.cached_property
    def context_lens_cpu(self) -> list[int]:
        """Tokens each sequence had computed before this step (0: a fresh start, no prior state)."""
        return [s - q for s, q in zip(self.seq_lens_cpu, self.query_lens_cpu)]

    @functools.cached_property
    def leading_decodes(self) -> int:
        """How many sequences at the front of the batch have one query token each. The scheduler
        puts every decode before any prefill chunk, so in a mixed step they are all there."""
        n = 0
        for q in self.query_lens_cpu:
            if q != 1:
                break
            n += 1
        return n

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @staticmethod
    def from_tensors(
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
        query_lens_cpu: list[int],
        seq_lens_cpu: list[int],
    ) -> "AttentionMetadata":
        """Wrap tensors already on the device (the model runner's persistent input batch builds
        them); the host lists are the same lengths, kept so backends never read the device."""
        return AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            block_size=block_size,
            query_lens_cpu=query_lens_cpu,
            seq_lens_cpu=seq_lens_cpu,
            max_query_len=max(query_lens_cpu, default=0),
            max_seq_len=max(seq_lens_cpu, default=0),
        )

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Pack per-sequence host lists into tensors (one host->device copy per field)."""
        B = len(query_lens)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        max_blocks = max((len(t) for t in block_tables), default=0)
        bt = torch.zeros((B, max(max_blocks, 1)), dtype=torch.int32)
        slots: list[int] = []
        for b in range(B):
            table = block_tables[b]
            if table:
                bt[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
            for pos in range(seq_lens[b] - query_lens[b], seq_lens[b]):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        return AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=bt.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_size=block_size,
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )
