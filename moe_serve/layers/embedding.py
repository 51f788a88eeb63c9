"""Token embedding and the LM head (optionally tied to it)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_serve.kernels.linear import TorchLinear


class Embedding(nn.Module):
    # The activations' dtype where the table is kept narrower (a bfloat16 table under float32
    # activations: moe_serve/prepare.py); None: the table's own.
    out_dtype: torch.dtype | None = None

    def __init__(self, vocab_size: int, hidden_size: int, dtype=torch.float32):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype))

    def forward(self, ids_T: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids_T, self.weight)
        return rows if self.out_dtype is None else rows.to(self.out_dtype)


class LMHead(nn.Module):
    """Logits in float32 for the rows that are sampled (the last token of each sequence)."""

    op_kind = "linear"
    ops = TorchLinear()

    def __init__(self, vocab_size: int, hidden_size: int, dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype))

    def tie_to(self, embedding: Embedding) -> None:
        self.weight = embedding.weight

    def forward(self, h_BD: torch.Tensor) -> torch.Tensor:
        return self.ops(h_BD, self.weight).to(torch.float32)
