"""Routers: hidden states -> (top-k weights, top-k logical expert ids). Scores in float32.

Shape legend: T tokens, D hidden, E logical experts, K top-k.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.to(torch.float32)  # a no-op .to still costs an op


def topk_softmax(logits_TE: torch.Tensor, k: int, over_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest logits, largest first, weighted by the softmax over those k (over_topk)
    or over the whole row (the same ids: the softmax keeps the order)."""
    if over_topk:
        top_TK, ids_TK = torch.topk(logits_TE, k, dim=-1)
        return torch.softmax(top_TK, dim=-1), ids_TK
    return torch.topk(torch.softmax(logits_TE, dim=-1), k, dim=-1)


class _GemmRouter(nn.Module):
    """A router whose scores are one GEMM of the hidden states with a float32 weight. That GEMM runs
    on the platform's linear backend, as every Linear's does (`op_kind`; moe_serve/platform.py
    bind_ops gives it `ops`: on the CPU our C kernels, where torch's GEMM spends more in its own
    overhead than in a 1-row router product); F.linear while unbound (a router used on its own)."""

    op_kind = "linear"
    ops = None

    def scores(self, x_TD: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = _f32(x_TD)
        return F.linear(x, self.weight, bias) if self.ops is None else self.ops(x, self.weight, bias)

    def choose(self, logits_TE: torch.Tensor, over_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """topk_softmax of the logits, on the backend the GEMM ran on (one C call on the CPU)."""
        if self.ops is None:
            return topk_softmax(logits_TE, self.top_k, over_topk)
        return self.ops.topk_softmax(logits_TE, self.top_k, over_topk)


class SoftmaxTopKRouter(_GemmRouter):
    """Mixtral / Qwen3-MoE: softmax over all experts, keep the top k, optionally renormalise."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool, dtype=torch.float32):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        # Kept in float32 whatever the model's dtype (a half-precision checkpoint's values convert
        # exactly, once, at load): the scores are computed in float32 and no step converts it.
        del dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # softmax over all, top k, renormalised = softmax over the top-k logits
        return self.choose(self.scores(x_TD), over_topk=self.renormalize)


class GroupLimitedSigmoidRouter(_GemmRouter):
    """DeepSeek-V3: sigmoid scores; experts chosen by score + e_score_correction_bias within the
    topk_group best of n_group groups (a group scores the sum of its 2 best); weights are the raw
    scores of the chosen experts, renormalised if norm_topk_prob, times routed_scaling_factor."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 renormalize: bool, routed_scaling_factor: float, dtype=torch.float32):
        super().__init__()
        if num_experts % n_group:
            raise ValueError(f"n_routed_experts={num_experts} is not divisible by n_group={n_group}")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
        self.num_experts, self.top_k = num_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.renormalize, self.scale = renormalize, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = x_TD.shape[0]
        logits_TE = self.scores(x_TD)
        scores_TE = torch.sigmoid(logits_TE) if self.ops is None else self.ops.sigmoid(logits_TE)
        choice_TE = scores_TE + self.e_score_correction_bias
        if self.n_group == 1:  # the one group is always kept: nothing to mask (Kimi-K2, MiniMax-M2)
            ids_TK = torch.topk(choice_TE, self.top_k, dim=-1, sorted=False)[1]
        else:
            per_group = self.num_experts // self.n_group
            group_scores = choice_TE.view(T, self.n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(-1)
            group_idx = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            expert_mask = group_mask.unsqueeze(-1).expand(T, self.n_group, per_group).reshape(T, self.num_experts)
            masked = choice_TE.masked_fill(expert_mask == 0, float("-inf"))
            ids_TK = torch.topk(masked, self.top_k, dim=-1, sorted=False)[1]
        w_TK = scores_TE.gather(1, ids_TK)
        if self.renormalize:
            w_TK = w_TK / (w_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return w_TK * self.scale, ids_TK


class TopKThenSoftmaxRouter(_GemmRouter):
    """GPT-OSS: logits with a bias, the top k kept, softmax over those k only."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k = num_experts, top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.choose(self.scores(x_TD, self.bias), over_topk=True)


class TopKSigmoidRouter(_GemmRouter):
    """Llama-4: the top k logits (no bias), each passed through a sigmoid; no normalisation. (Its
    MoE layer applies the weights to the experts' inputs: MoE's weights_on_inputs.)"""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k = num_experts, top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top_TK, ids_TK = torch.topk(self.scores(x_TD), self.top_k, dim=-1)
        return torch.sigmoid(top_TK), ids_TK
