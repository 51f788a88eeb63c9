"""Sort (token, k) pairs by expert and pad each expert's run to the GEMM row block.

Shape legend: T tokens, K top-k, P = T*K (token, k) pairs, E experts on this rank, S = padded
length of the sorted pair list (an upper bound known on the host, see below), B = S // BLOCK_M row
blocks.

The grouped GEMM runs one program per (row block, column block). Each row block must hold pairs of a
single expert, so every expert's run of pairs is padded up to a multiple of BLOCK_M with a sentinel
pair index P, which the kernels mask out. Pairs routed to expert -1 (held by another rank) appear in
no block at all.

Everything here is vectorised torch and sync-free: the padded length S is a host-side upper bound,
so the kernel launch grid is known without reading the device. Blocks past the real padded length
carry expert id -1 and exit at once in the kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AlignedRouting:
    """Pairs grouped by expert and padded to BLOCK_M; everything the grouped GEMM kernels need.

    Attributes:
        sorted_pair_ids_S: (S,) int32 pair indices t*K + k grouped by expert, each expert's run padded
            to a multiple of block_m with the sentinel P (= T*K). Entries past the real padded length
            are also P.
        expert_ids_B: (S // block_m,) int32 expert of each row block; -1 for blocks that hold no expert
            (past the real padded length), which the kernels skip.
        num_padded: (1,) int32 the real padded length (sum over experts of their padded run).
        block_m: the row block size the runs are padded to.
        num_pairs: P = T*K, also the sentinel value.
    """

    sorted_pair_ids_S: torch.Tensor
    expert_ids_B: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    num_pairs: int


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Host-side bound on the padded length S, a multiple of block_m.

    At most min(E, P) experts receive pairs, and each wastes at most block_m - 1 slots of padding.
    Using min(E, P) rather than E keeps decode launches small (one token, E=256: 8 blocks, not 256).
    """
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return (bound + block_m - 1) // block_m * block_m


def align_block_size(topk_ids_TK: torch.Tensor, num_experts: int, block_m: int) -> AlignedRouting:
    """Group (token, k) pairs by expert and pad each expert's run to a multiple of block_m.

    Args:
        topk_ids_TK: (T, K) int expert ids in [0, num_experts), or -1 for a pair to skip.
        num_experts: E, the number of experts on this rank.
        block_m: the row block size (power of two >= 16 for the Triton kernels).
    Returns:
        AlignedRouting; within an expert's run pairs keep their original (t, k) order.
    """
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts} must be at least 1")
    device = topk_ids_TK.device
    P = topk_ids_TK.numel()
    S = max_padded_pairs(P, num_experts, block_m)
    ids_P = topk_ids_TK.reshape(-1).to(torch.int64)
    valid_P = ids_P >= 0
    # Invalid pairs sort to a virtual expert E after every real one and are then dropped.
    keys_P = torch.where(valid_P, ids_P, num_experts)
    # scatter_add rather than bincount: CUDA bincount reads max() back to the host (a sync).
    counts_E = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts_E = counts_E.scatter_add_(0, keys_P, torch.ones_like(keys_P))[:num_experts]
    padded_E = (counts_E + block_m - 1) // block_m * block_m
    padded_end_E = torch.cumsum(padded_E, 0)
    padded_start_E = padded_end_E - padded_E
    raw_start_E = torch.cumsum(counts_E, 0) - counts_E

    order_P = torch.argsort(keys_P, stable=True)
    sorted_keys_P = keys_P[order_P]
    keep_P = sorted_keys_P < num_experts
    expert_of_sorted = sorted_keys_P.clamp(max=num_experts - 1)
    # Position of a pair in the padded list: its expert's padded start + its rank within the expert.
    rank_P = torch.arange(P, device=device) - raw_start_E[expert_of_sorted]
    dest_P = padded_start_E[expert_of_sorted] + rank_P
    # Dropped pairs are sent to a scratch slot S, cut off below, so the scatter needs no mask (no sync).
    dest_P = torch.where(keep_P, dest_P, S)
    sorted_ids = torch.full((S + 1,), P, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest_P, order_P.to(torch.int32))

    # Block b belongs to the expert whose padded range [start, end) contains b * block_m.
    block_start_B = torch.arange(0, S, block_m, device=device)
    expert_B = torch.searchsorted(padded_end_E, block_start_B, right=True)
    expert_B = torch.where(expert_B < num_experts, expert_B, -1).to(torch.int32)
    return AlignedRouting(
        sorted_pair_ids_S=sorted_ids[:S],
        expert_ids_B=expert_B,
        num_padded=padded_end_E[-1:].to(torch.int32),
        block_m=block_m,
        num_pairs=P,
    )
