"""The MoE layer: router -> dispatcher.dispatch -> grouped experts -> dispatcher.combine.

One composition for every EP size: with EP=1 the dispatcher is the local one and moves nothing.
Shape legend: T tokens, D hidden, F expert intermediate size, E local expert slots, K top-k.

Experts live in physical slots (see expert_parallel/runtime/dispatch/base.py). Without a placement there
is one slot per logical expert; with one, hot experts have replicas and `replica_map` picks, for
every (token, k), which replica serves it. This rank holds slots
[rank * E, (rank + 1) * E) as w13 (E, 2F, D) and w2 (E, D, F).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from expert_parallel.placement.map import ReplicaMap
from expert_parallel.runtime.dispatch.base import Dispatcher
from expert_parallel.runtime.step import NO_STEP, MoEStep
from moe_serve.kernels.batch_invariant import sum_in_id_order
from moe_serve.kernels.grouped_gemm import TorchExperts
from moe_serve.quantization.fp8 import FP8, BlockFp8Experts, quantize_blocks, scale_shape


@dataclass
class MoEContext:
    """What every MoE layer of a model shares: how tokens move and where its experts sit. (Which
    kernel runs the experts is each layer's bound `ops`, chosen by moe_serve/platform.py.)"""

    dispatcher: Dispatcher
    # Per MoE layer (in layer order), the logical expert of each physical slot; None = identity.
    physical_to_logical: list[list[int]] | None = None
    # Optional (event, micro-batch, layer) callback, for tests that check the overlap schedule.
    trace: Callable[[str, int, int], None] | None = None
    # How a replicated expert's tokens are shared among its replicas (placement.ReplicaMap):
    # "balanced" (from each batch's counts, evening out the ranks) or "round_robin".
    replica_split: str = "balanced"
    # (MoE layers, local slots + 1) int32 on the device, or None: each layer marks the slots it
    # computes in a step (column 0 takes ids held elsewhere), for the decode speed-of-light meter
    # (moe_serve/speed_of_light.py), which zeroes it before every step.
    experts_hit_LS: torch.Tensor | None = None


def num_default_slots(num_experts: int, world_size: int) -> int:
    """Slots when no placement is given: the experts, rounded up to a multiple of the EP size."""
    return -(-num_experts // world_size) * world_size


def default_physical_to_logical(num_experts: int, num_slots: int) -> list[int]:
    """Slot e holds expert e; slots beyond the expert count (when the EP size does not divide it)
    hold replicas of experts 0, 1, ... so every rank holds the same number of slots."""
    return [s % num_experts for s in range(num_slots)]


class GroupedExperts(nn.Module):
    """This rank's expert slots as two stacked weight tensors, loaded by logical expert id."""

    def __init__(self, num_local: int, hidden_size: int, intermediate_size: int, local_logical: list[int], dtype,
                 bias: bool = False, activation="silu"):
        """bias: w13_bias (E, 2F) and w2_bias (E, D) (GPT-OSS); activation: see fused_experts."""
        super().__init__()
        self.F = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_local, 2 * intermediate_size, hidden_size, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(num_local, hidden_size, intermediate_size, dtype=dtype))
        self.w13_bias = nn.Parameter(torch.zeros(num_local, 2 * intermediate_size, dtype=dtype)) if bias else None
        self.w2_bias = nn.Parameter(torch.zeros(num_local, hidden_size, dtype=dtype)) if bias else None
        self.activation = activation
        self.set_local_logical(local_logical)

    def op_kwargs(self) -> dict:
        """The expert op's optional arguments for these experts: none for plain SwiGLU experts."""
        if self.w13_bias is None and self.activation == "silu":
            return {}
        return dict(w13_bias=self.w13_bias, w2_bias=self.w2_bias, activation=self.activation)

    def set_local_logical(self, local_logical: list[int]) -> None:
        self.local_logical = list(local_logical)
        self.slots_of: dict[int, list[int]] = {}
        for slot, e in enumerate(local_logical):
            self.slots_of.setdefault(e, []).append(slot)

    def holds(self, logical_id: int) -> bool:
        return logical_id in self.slots_of

    fp8_block: tuple[int, int] | None = None  # set by to_block_fp8 (moe_serve/quantization/fp8.py)
    fp8_act_quant: bool = False  # W8A8 in the Triton expert kernel (sm_89+; set by prepare.py)

    fp8_checkpoint_suffix = ""  # the checkpoint's expert weights are named <name> (see weights.py)

    def to_block_fp8(self, block: tuple[int, int]) -> None:
        """Keep the expert weights in block FP8: FP8 values and float32 block scales per expert, gate
        and up quantized separately (as checkpoints have them). Filled by the loader."""
        E, twoF, D = self.w13.shape
        dev = self.w13.device
        self.fp8_block = block
        self.w13 = nn.Parameter(torch.empty(E, twoF, D, dtype=FP8, device=dev), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, D, self.F, dtype=FP8, device=dev), requires_grad=False)
        r, c = scale_shape(self.F, D, block)
        self.register_buffer("w13_scale_inv", torch.ones(E, 2 * r, c, dtype=torch.float32, device=dev))
        self.register_buffer("w2_scale_inv", torch.ones(E, *scale_shape(D, self.F, block), dtype=torch.float32,
                                                        device=dev))

    def op_weights(self):
        """(w13, w2) as the expert op takes them: tensors, or FP8 weights it dequantizes per step."""
        if self.fp8_block is None:
            return self.w13, self.w2
        return (BlockFp8Experts(self.w13, self.w13_scale_inv, self.fp8_block, (self.F, self.F), self.fp8_act_quant),
                BlockFp8Experts(self.w2, self.w2_scale_inv, self.fp8_block, (self.w2.shape[1],), self.fp8_act_quant))

    def load(self, logical_id: int, kind: str, w: torch.Tensor, scale_inv: torch.Tensor | None = None) -> None:
        """kind: "gate" (F, D), "up" (F, D), "down" (D, F), "gate_up" (2F, D); copied to every replica.
        FP8 experts: `w` in FP8 with its `scale_inv`, or unquantized (quantized here)."""
        if self.fp8_block is not None:
            return self._load_fp8(logical_id, kind, w, scale_inv)
        for s in self.slots_of.get(logical_id, ()):
            if kind == "gate":
                self.w13.data[s, : self.F].copy_(w)
            elif kind == "up":
                self.w13.data[s, self.F:].copy_(w)
            elif kind == "gate_up":
                self.w13.data[s].copy_(w)
            elif kind == "down":
                self.w2.data[s].copy_(w)
            else:
                raise ValueError(f"unknown expert weight kind {kind!r}")

    def _load_fp8(self, logical_id: int, kind: str, w: torch.Tensor, scale_inv: torch.Tensor | None) -> None:
        if kind == "gate_up":
            if w.dtype == FP8:
                raise ValueError("fused gate_up FP8 expert tensors are not supported (the Hub's FP8 checkpoints "
                                 "have per-expert gate_proj / up_proj tensors)")
            self._load_fp8(logical_id, "gate", w[: self.F], None)  # --quantization fp8: halves quantized apart
            self._load_fp8(logical_id, "up", w[self.F:], None)
            return
        if kind not in ("gate", "up", "down"):
            raise ValueError(f"expert weight kind {kind!r} is not supported with FP8 experts (per-expert gate, up "
                             "and down tensors are)")
        if w.dtype != FP8:  # an unquantized checkpoint under --quantization fp8
            w, scale_inv = quantize_blocks(w, self.fp8_block)
        rows = {"gate": slice(0, self.F), "up": slice(self.F, 2 * self.F)}
        for s in self.slots_of.get(logical_id, ()):
            if kind == "down":
                self.w2.data[s].copy_(w)
            else:
                self.w13.data[s, rows[kind]].copy_(w)
        if scale_inv is not None:
            self.load_scale_inv(logical_id, kind, scale_inv)

    def load_scale_inv(self, logical_id: int, kind: str, scale_inv: torch.Tensor) -> None:
        """An FP8 expert weight's block scales, (ceil(rows / b0), ceil(cols / b1))."""
        nr = self.w13_scale_inv.shape[1] // 2
        target = {"gate": lambda s: self.w13_scale_inv[s, :nr], "up": lambda s: self.w13_scale_inv[s, nr:],
                  "down": lambda s: self.w2_scale_inv[s]}.get(kind)
        if target is None:
            raise ValueError(f"expert weight kind {kind!r} has no FP8 scales")
        for s in self.slots_of.get(logical_id, ()):
            dst = target(s)
            if tuple(dst.shape) != tuple(scale_inv.shape):
                raise ValueError(f"expert {logical_id} {kind} weight_scale_inv has shape {tuple(scale_inv.shape)}, "
                                 f"expected {tuple(dst.shape)} for weight_block_size {list(self.fp8_block)}")
            dst.copy_(scale_inv)


class MoE(nn.Module):
    """Sparse MoE block; `shared_experts` (DeepSeek) run while routed tokens are away.

    weights_on_inputs (Llama-4): the routing weight scales each (token, expert) pair's input, not
    its output: y = sum_k expert_k(w_k * x), the outputs added with weight 1 (`pairs_as_rows`)."""

    op_kind = "experts"  # platform.bind_ops gives the layer its experts backend
    ops = TorchExperts()

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, router: nn.Module,
                 ctx: MoEContext, dtype, shared_experts: nn.Module | None = None,
                 experts_cls: type | None = None, experts_kwargs: dict | None = None, *, layer_index: int,
                 weights_on_inputs: bool = False):
        """layer_index: this layer's place among the model's MoE layers (0 for the first), which
        indexes placements and recorded load; the model derives it from its layer ids.
        experts_cls / experts_kwargs: another GroupedExperts (GPT-OSS's MXFP4 experts) and extra
        arguments (bias, activation)."""
        super().__init__()
        self.ctx = ctx
        self.layer_index = layer_index
        self.num_experts = num_experts
        d = ctx.dispatcher
        if ctx.physical_to_logical is not None:
            if self.layer_index >= len(ctx.physical_to_logical):
                raise ValueError(f"expert placement has {len(ctx.physical_to_logical)} layers; the model has more "
                                 f"MoE layers")
            p2l = ctx.physical_to_logical[self.layer_index]
        else:
            p2l = default_physical_to_logical(num_experts, d.num_slots)
        if len(p2l) != d.num_slots:
            raise ValueError(f"MoE layer {self.layer_index}: {len(p2l)} physical slots but the dispatcher has {d.num_slots}")
        lo = d.rank * d.slots_per_rank
        self.gate = router
        self.experts = (experts_cls or GroupedExperts)(d.slots_per_rank, hidden_size, intermediate_size,
                                                       p2l[lo: lo + d.slots_per_rank], dtype, **(experts_kwargs or {}))
        self.shared_experts = shared_experts
        self.weights_on_inputs = weights_on_inputs
        self.replica_map: Any = None  # logical ids -> physical slot ids when any expert has replicas
        self._set_map(p2l)

    def _set_map(self, p2l: list[int]) -> None:
        self.replica_map = None
        if list(p2l) != list(range(self.num_experts)):
            # Each data-parallel rank starts its round over replicas at its own offset.
            d = self.ctx.dispatcher
            self.replica_map = ReplicaMap(p2l, self.num_experts, offset=d.rank, split=self.ctx.replica_split,
                                          slots_per_gpu=d.slots_per_rank)

    def slot_tensors(self) -> dict[str, torch.Tensor]:
        """Every per-slot tensor of this rank's experts (first dimension = local slots): the weights,
        and biases or quantization scales where the experts have them. A rebalance moves them all."""
        ex, n = self.experts, len(self.experts.local_logical)
        found = list(ex.named_parameters(recurse=False)) + list(ex.named_buffers(recurse=False))
        return {name: t.data for name, t in found if t is not None and t.dim() >= 1 and t.shape[0] == n}

    def switch_experts(self, tensors: dict[str, torch.Tensor], physical_to_logical_S: list[int],
                       local_logical: list[int]) -> dict[str, torch.Tensor]:
        """Serve a new placement from the next step on (expert rebalancing, between steps): this
        rank's slot tensors (slot_tensors' names, the same shapes), its slot list and the router's
        map change together. Returns the replaced tensors."""
        ex, old = self.experts, {}
        for name, new in tensors.items():
            cur = getattr(ex, name)
            if new.shape != cur.shape or new.dtype != cur.dtype:
                raise ValueError(f"MoE layer {self.layer_index}: new {name} {tuple(new.shape)} {new.dtype} does not "
                                 f"match {tuple(cur.shape)} {cur.dtype}")
            old[name] = cur.data
            if isinstance(cur, nn.Parameter):
                cur.data = new
            else:
                ex._buffers[name] = new  # a registered buffer (e.g. quantization scales)
        ex.set_local_logical(local_logical)
        self._set_map(physical_to_logical_S)
        if self.ctx.physical_to_logical is not None:
            self.ctx.physical_to_logical[self.layer_index] = list(physical_to_logical_S)
        return old

    def forward(self, x_TD: torch.Tensor, step: MoEStep = NO_STEP, token_ids_T: torch.Tensor | None = None) -> torch.Tensor:
        return run_to_end(self.stages(x_TD, step, token_ids_T))

    def stages(self, x_TD: torch.Tensor, step: MoEStep = NO_STEP, token_ids_T: torch.Tensor | None = None):
        """The layer as a generator that yields while its communication is in flight: once after
        starting dispatch, once after starting combine. Run alone (`forward`) the yields cost
        nothing; with two micro-batches (expert_parallel/runtime/overlap.py) the other micro-batch computes
        during them. Returns y_TD. token_ids_T: the tokens' ids, for a router that routes by them
        (DeepSeek-V4's hash layers)."""
        trace, mb = self.ctx.trace, step.microbatch
        w_TK, ids_TK = self.gate(x_TD) if token_ids_T is None else self.gate(x_TD, token_ids_T)
        if step.load_recorder is not None:
            step.load_recorder(self.layer_index, ids_TK)
        slots_TK = self.replica_map(ids_TK) if self.replica_map is not None else ids_TK
        x_in, routed_step = x_TD, step
        if self.weights_on_inputs:
            x_in, slots_TK, w_TK, routed_step = pairs_as_rows(x_TD, slots_TK, w_TK, step)
        d = self.ctx.dispatcher
        trace and trace("dispatch_start", mb, self.layer_index)
        pending = d.dispatch_async(x_in, slots_TK, w_TK, routed_step)
        # The shared experts need no communication: they fill the wait.
        shared = self.shared_experts(x_TD) if self.shared_experts is not None else None
        yield
        sent = pending.wait()
        trace and trace("dispatch_end", mb, self.layer_index)
        if self.ctx.experts_hit_LS is not None:
            mark_slots_hit(self.ctx.experts_hit_LS[self.layer_index], sent, self.ops)
        trace and trace("experts", mb, self.layer_index)
        # --batch-invariant over several ranks: each (token, k) pair's output travels home apart and
        # is added there in expert id order, as one process adds them (a per-rank partial sum would
        # make a token's sum depend on how its experts fall over the ranks; kernels/batch_invariant.py)
        pairs = d.world_size > 1 and getattr(self.ops, "batch_invariant", False)
        y_RD = expert_outputs(sent, self.experts, self.ops, x_in.shape[0], all_local=d.world_size == 1, pairs=pairs)
        trace and trace("combine_start", mb, self.layer_index)
        pending = d.combine_async(y_RD, sent.handle)
        yield
        y_TD = pending.wait()
        trace and trace("combine_end", mb, self.layer_index)
        if pairs:
            order_TK = ids_TK if x_in is x_TD else slots_TK  # logical ids, as one process orders them
            y_TKD = y_TD.view(x_in.shape[0], slots_TK.shape[1], x_TD.shape[-1])
            y_TD = sum_in_id_order(y_TKD, order_TK).to(x_TD.dtype)
        if x_in.shape[0] != x_TD.shape[0]:  # rows were (token, expert) pairs: sum each token's
            y_TD = y_TD.view(x_TD.shape[0], -1, y_TD.shape[-1]).sum(1)
        return y_TD if shared is None else y_TD + shared


def mark_slots_hit(hits_S1: torch.Tensor, sent, backend) -> None:
    """Mark (non-zero) the local slots a dispatch output sends rows to (device ops only, no host
    sync; whether a slot was hit is all the meter reads, so a fill, not a count); a routed layout's
    marks by the layer's experts backend (`mark_slots`: one C call on the CPU)."""
    if sent.expert_major is not None:
        count_S = sent.expert_major[1]
        hits_S1[1:1 + count_S.shape[0]] += (count_S > 0).to(hits_S1.dtype)
    else:
        backend.mark_slots(hits_S1, sent.topk_ids_RK)


def pairs_as_rows(x_TD: torch.Tensor, slots_TK: torch.Tensor, w_TK: torch.Tensor, step: MoEStep):
    """Routing weights on the experts' inputs (Llama-4): every (token, expert) pair becomes a row
    of its own, the token scaled by the pair's weight (in the activations' dtype, as transformers
    does), routed top-1 with weight 1: (T * K, D) rows, (T * K, 1) slots and weights, and the step
    with its agreed row counts times K (every rank has the same K). Every dispatcher and expert
    kernel runs them unchanged; the caller adds the K output rows of each token. With K = 1 the
    rows are the tokens, scaled; with K > 1 a token travels once per chosen expert, not once per
    rank holding one (the price of a different input per pair)."""
    T, K = slots_TK.shape
    x_RD = (x_TD[:, None, :] * w_TK.to(x_TD.dtype)[:, :, None]).reshape(T * K, x_TD.shape[-1])
    ones = torch.ones(T * K, 1, dtype=w_TK.dtype, device=w_TK.device)
    if K > 1:
        def times_k(n):
            return None if n is None else n * K

        step = replace(step, max_tokens_any_rank=times_k(step.max_tokens_any_rank),
                       static_rows=times_k(step.static_rows))
    return x_RD, slots_TK.reshape(T * K, 1), ones, step


def masked_applies(sent, experts, backend) -> bool:
    """Whether the masked grouped GEMM serves this dispatch output: an expert-major layout (DeepEP
    low-latency) and an experts backend with the masked kernel that takes these experts."""
    return sent.expert_major is not None and backend.has_masked and backend.masked_applies(experts)


def expert_outputs(sent, experts, backend, num_tokens: int = 0, all_local: bool = False,
                   pairs: bool = False) -> torch.Tensor:
    """y_RD for a dispatch output: with an expert-major layout the masked kernel writes only each
    expert's valid rows (y in the same (E*C, D) layout, unweighted, which the backend's combine
    expects); else the generic grouped GEMM over the routed rows. num_tokens: this rank's T, which
    picks the masked kernel's tile. backend: the layer's experts backend (moe_serve/kernels/grouped_gemm).
    pairs: a batch-invariant backend's (R, K * D) float32 rows, each (row, k) pair's weighted output
    apart (zero for slots held elsewhere), for the caller to add in id order after combine."""
    if pairs:
        if sent.expert_major is not None:
            raise ValueError("--batch-invariant: an expert-major dispatch (DeepEP low-latency) has no batch-invariant "
                             "combine; use --all2all-backend all_to_all")
        w13, w2 = experts.op_weights()
        y = backend.pairs(sent.x_RD, w13, w2, sent.topk_weights_RK, sent.topk_ids_RK, **experts.op_kwargs())
        return y.flatten(1)  # (R, K * D), R may be 0
    if masked_applies(sent, experts, backend):
        K = getattr(sent.handle, "topk_ids_TK", None)
        return backend.masked_experts(*sent.expert_major, experts, num_tokens, K.shape[1] if K is not None and K.dim() == 2 else 1)
    w13, w2 = experts.op_weights()
    return backend(sent.x_RD, w13, w2, sent.topk_weights_RK, sent.topk_ids_RK, all_local=all_local,
                   **experts.op_kwargs())


def run_to_end(stages):
    """Drive a stage generator to its end without interleaving; returns its value."""
    while True:
        try:
            next(stages)
        except StopIteration as stop:
            return stop.value
