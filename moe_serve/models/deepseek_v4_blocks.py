"""DeepSeek-V4's layers outside attention, written for the engine's packed (T tokens) batches.
The model (`deepseek_v4.py`) builds on them; they are checked against transformers' modules on
their own (tests/models/test_deepseek_v4_blocks.py).

- mHC, manifold-constrained hyper-connections: the residual is `hc_mult` streams per token,
  (T, N, D). Before attention and before the MoE, `HyperConnection` derives from the normed, flattened
  streams three mixes with a one-layer perceptron: `pre` (N) collapses the streams into the block's
  input, `post` (N) spreads the block's output back over them, and `comb` (N x N) carries the
  residual streams into the output ones, made doubly stochastic by Sinkhorn-Knopp iterations.
  `HyperHead` collapses the streams once more before the final norm. All in float32.
- Routing: `SqrtSoftplusRouter` scores sqrt(softplus(logits)), picks the top k of score + correction
  bias, weighs by the renormalised scores times routed_scaling_factor; `HashRouter` (the first
  `hash_moe` layers) takes the k experts from a fixed token-id table `tid2eid` and weighs them the
  same way.
- `GroupedOutputProjection`: the heads' outputs in `o_groups` groups, each projected to
  `o_lora_rank` by its own block of `o_a_proj` (block diagonal), then mixed to hidden by `o_b_proj`.
- `swiglu_limit`: SiLU(min(gate, limit)) * clamp(up, -limit, limit) in the shared and routed experts
  (`limited_swiglu`, from moe_serve/layers/experts.py with the expert blocks that use it).

Under --batch-invariant (a batch-invariant linear backend passed as `ops`, or bound to the routers
and the output projection) the products run on that backend, the sigmoids / softplus on its
padded-row `pointwise` form, and the sums over the N streams and the per-group products row by row
in a fixed order (torch's batched GEMMs over T rows pick kernels by T); with the default backends
(or none) everything computes exactly as before.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_serve.layers.experts import limited_swiglu  # noqa: F401 - one of V4's pieces, checked with them


def invariant(ops) -> bool:
    """Whether ops is a batch-invariant linear backend (`--batch-invariant`)."""
    return getattr(ops, "batch_invariant", False)


def streams_sum(w_TN: torch.Tensor, x_TN_: torch.Tensor) -> torch.Tensor:
    """sum_n w[:, n] * x[:, n] (x (T, N, ...), w broadcast over its trailing dims), added in n order:
    elementwise products and adds only, so a row's result does not depend on the batch."""
    def term(n):
        w = w_TN[:, n]
        return w.view(*w.shape, *([1] * (x_TN_.dim() - 1 - w.dim()))) * x_TN_[:, n]

    out = term(0)
    for n in range(1, x_TN_.shape[1]):
        out = out + term(n)
    return out


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Columns, then (rows, columns) iters - 1 more times, normalised to sum to 1 (+ eps floors)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """mHC mixes around one block: weights fn ((2 + N) N, N D), base ((2 + N) N), scale (3)."""

    def __init__(self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.N, self.iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        n = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.empty(n, hc_mult * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def forward(self, streams_TND: torch.Tensor, ops=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(post (T, N), comb (T, N, N), the block's input (T, D) in the streams' dtype); ops: the
        linear backend (its batch-invariant forms under the flag; module docstring)."""
        T, N, inv = streams_TND.shape[0], self.N, invariant(ops)
        flat = unweighted_rms_norm(streams_TND.reshape(T, N * streams_TND.shape[-1]).float(), self.norm_eps)
        mixes = ops(flat, self.fn) if inv else F.linear(flat, self.fn)
        sigmoid = ops.sigmoid if inv else torch.sigmoid
        pre_w, post_w, comb_w = mixes.split([N, N, N * N], dim=-1)
        pre_b, post_b, comb_b = self.base.split([N, N, N * N])
        s_pre, s_post, s_comb = self.scale.unbind(0)
        pre = sigmoid(pre_w * s_pre + pre_b) + self.hc_eps
        post = 2 * sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(T, N, N) * s_comb + comb_b.view(N, N), dim=-1) + self.hc_eps
        comb = sinkhorn(comb, self.iters, self.hc_eps)
        collapsed = streams_sum(pre, streams_TND) if inv else (pre.unsqueeze(-1) * streams_TND).sum(dim=1)
        return post, comb, collapsed.to(streams_TND.dtype)

    @staticmethod
    def merge(streams_TND: torch.Tensor, out_TD: torch.Tensor, post_TN: torch.Tensor,
              comb_TNN: torch.Tensor, ops=None) -> torch.Tensor:
        """The streams after a block: post spreads its output, comb (transposed) carries the residual."""
        dtype = streams_TND.dtype
        spread = post_TN.to(dtype).unsqueeze(-1) * out_TD.unsqueeze(-2)
        if invariant(ops):  # out[t, j] = sum_n comb[t, n, j] * streams[t, n], not a batched GEMM over T
            return spread + streams_sum(comb_TNN.to(dtype), streams_TND[:, :, None, :])
        return spread + torch.matmul(comb_TNN.to(dtype).transpose(-1, -2), streams_TND)


class HyperHead(nn.Module):
    """The last collapse of the N streams into one, before the model's final norm."""

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.N, self.hc_eps, self.norm_eps = hc_mult, hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams_TND: torch.Tensor, ops=None) -> torch.Tensor:
        """(T, N, D) -> (T, D); ops: as HyperConnection's."""
        T = streams_TND.shape[0]
        flat = unweighted_rms_norm(streams_TND.reshape(T, self.N * streams_TND.shape[-1]).float(), self.norm_eps)
        if invariant(ops):
            pre = ops.sigmoid(ops(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.hc_eps
            return streams_sum(pre, streams_TND).to(streams_TND.dtype)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams_TND).sum(dim=1).to(streams_TND.dtype)


def sqrt_softplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x).sqrt()


def router_scores(router: nn.Module, x_TD: torch.Tensor) -> torch.Tensor:
    """sqrt(softplus(x @ weight^T)) in float32: on the bound linear backend under --batch-invariant,
    else F.linear as before (the routers' `ops` is bound, op kind "linear", for that case only)."""
    ops = router.ops
    if invariant(ops):
        return ops.pointwise(sqrt_softplus, ops(x_TD.float(), router.weight))
    return sqrt_softplus(F.linear(x_TD.float(), router.weight))


class SqrtSoftplusRouter(nn.Module):
    """V4's learned routing: top k of sqrt(softplus(logits)) + e_score_correction_bias."""

    op_kind = "linear"  # bound only for the batch-invariant scores (`router_scores`)
    ops = None

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, routed_scaling_factor: float):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, n_routed_experts={num_experts}]")
        self.num_experts, self.top_k, self.scale = num_experts, top_k, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = router_scores(self, x_TD)
        ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, ids)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scale, ids


class HashRouter(nn.Module):
    """V4's first MoE layers: the experts of a token are tid2eid[token id]; the learned gate only weighs them."""

    op_kind = "linear"  # as SqrtSoftplusRouter's
    ops = None

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, vocab_size: int, routed_scaling_factor: float):
        super().__init__()
        self.num_experts, self.top_k, self.scale = num_experts, top_k, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        # A parameter (loaded by name like the rest), integer and frozen; until loaded, token t
        # goes to experts t*k .. t*k + k - 1 (mod n): distinct, and spread over all of them.
        spread = (torch.arange(vocab_size)[:, None] * top_k + torch.arange(top_k)[None, :]) % num_experts
        self.tid2eid = nn.Parameter(spread, requires_grad=False)

    def check(self) -> None:
        """The table as loaded: every entry an expert of this layer."""
        t = self.tid2eid
        if t.numel() and not (0 <= int(t.min()) and int(t.max()) < self.num_experts):
            raise ValueError(f"tid2eid names expert {int(t.min()) if int(t.min()) < 0 else int(t.max())}, outside "
                             f"[0, n_routed_experts={self.num_experts})")

    def forward(self, x_TD: torch.Tensor, ids_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = router_scores(self, x_TD)
        experts = self.tid2eid[ids_T.long()]  # checked once, after loading (`check`): no host read here
        w = scores.gather(1, experts)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scale, experts


class GroupedOutputProjection(nn.Module):
    """o_a_proj (o_groups blocks of (o_lora_rank, heads * head_dim / o_groups), one weight as the Hub
    stores it), then o_b_proj."""

    def __init__(self, num_heads: int, head_dim: int, o_groups: int, o_lora_rank: int, hidden_size: int, dtype):
        super().__init__()
        if num_heads % o_groups:
            raise ValueError(f"num_attention_heads={num_heads} is not divisible by o_groups={o_groups}")
        from moe_serve.layers.linear import Linear

        self.G, self.per_group = o_groups, num_heads * head_dim // o_groups
        self.o_a_proj = Linear(self.per_group, o_groups * o_lora_rank, dtype=dtype)
        # Read as G blocks by a batched GEMM: an FP8 checkpoint's is dequantized once at load.
        self.o_a_proj.weight_used_directly = True
        self.o_b_proj = Linear(o_groups * o_lora_rank, hidden_size, dtype=dtype)

    def forward(self, attn_THH: torch.Tensor) -> torch.Tensor:
        """attn: (T, heads, head_dim) -> (T, hidden)."""
        T = attn_THH.shape[0]
        ops = self.o_a_proj.ops
        if invariant(ops):  # group by group through the backend's row-invariant per_head, not bmm over T
            y = ops.per_head(attn_THH.reshape(T, self.G, self.per_group),
                             self.o_a_proj.weight.view(self.G, -1, self.per_group))
            return self.o_b_proj(y.reshape(T, self.o_a_proj.weight.shape[0]))
        x_GTI = attn_THH.reshape(T, self.G, self.per_group).transpose(0, 1)
        w_GIR = self.o_a_proj.weight.view(self.G, -1, self.per_group).transpose(1, 2)
        y = torch.bmm(x_GTI, w_GIR).transpose(0, 1).reshape(T, self.o_a_proj.weight.shape[0])
        return self.o_b_proj(y)
