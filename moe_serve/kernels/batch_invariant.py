"""Batch-invariant forms of the linear and expert backends (`--batch-invariant`).

Contract: a token's output of each op is bitwise the same whatever else shares the call: how many
rows there are, where the token's row sits, what the other rows hold. Then a request's tokens and
logprobs do not depend on batch size, on where chunked prefill cuts its prompt, or on whether a
token is computed in a decode step or recomputed inside a prefill after preemption.

What breaks that by default, measured op by op (float32 and bf16 activations, 2 threads):
- torch's GEMM (oneDNN/MKL): another kernel (GEMV, small-M, blocked GEMM) per row count, each
  summing over k in its own order; torch's grouped GEMM likewise per expert row count;
- our C linear: dot-product tiles up to 4 rows, the panel micro-kernel above (another order); bf16
  weights: a lone row keeps a second accumulator for odd halves (moe.c `tile`);
- our C experts: the panel path for an expert with 17 rows or more, which a batch decides;
- torch's elementwise silu / sigmoid / softplus / gelu: a vectorised body and a scalar tail that
  differ in the last bit, and which elements fall in the tail depends on the tensor's size.
Norms (per-row reductions in torch and in C), the routers' top-k softmax, log_softmax and the
sampler's other ops are per row already (checked by tests/models/test_batch_invariance.py).

The forms here fix one reduction order per output element, independent of M:
- `linear`: torch ops, one GEMV per row on a fresh row (same shape, same alignment every time);
- `elementwise`: a row-wise op run on rows padded to whole vectors, in serial pieces, so every
  element takes the vectorised path whatever the tensor's size;
- C: `cpu_ops.linear_invariant` and `cpu_ops.moe_experts(pairs=True)` (dot-product tiles for
  every M). They are slower than the default paths at prefill sizes; the default is untouched.
- Triton: `triton_invariant.linear_invariant` and `experts_pairs_triton` (one fixed config, tile
  and K step, for every row count; `InvariantTritonLinear`, `InvariantTritonExperts`);
- experts: each (token, k) pair's weighted output apart (`pairs`), then a token's pairs added into a
  float32 zero in ascending expert id (`sum_in_id_order`). Under expert parallelism the pairs come
  home apart and are added there the same way, so a token's output is also the same whichever rank
  holds which of its experts, and the same as one process's (a per-rank partial sum, or a product
  fused into a running sum as a C loop compiles it, would add in an order the other cannot repeat).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_serve.kernels import cpu_ops
from moe_serve.kernels.grouped_gemm import CpuCExperts, TorchExperts, TritonExperts
from moe_serve.kernels.linear import CpuCLinear, TorchLinear, TritonLinear

# Whole vectors of torch's widest CPU loop (2 x 16 float32 lanes, AVX-512) and, below, elements per
# serial piece: under torch's parallel grain (32768) a piece runs on one thread in one loop, whose
# scalar tail a padded row never reaches.
_LANES = 64
_PIECE = 16384


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (+ b) accumulated in float32, each row by its own GEMV, returned in x's dtype."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    wf = w if w.dtype == torch.float32 else w.float()
    bf = None if b is None else b.float()
    y = torch.empty(x2.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    for i in range(x2.shape[0]):
        # a fresh contiguous row: the GEMV sees the same shape and alignment whatever the batch
        y[i] = F.linear(x2[i:i + 1].to(torch.float32, copy=True), wf, bf)[0]
    return y.to(x.dtype).view(*x.shape[:-1], w.shape[0])


def elementwise(fn, *xs: torch.Tensor) -> torch.Tensor:
    """fn(*xs) for an elementwise fn over tensors of one shape, every element on torch's vectorised
    path: rows (last dim) padded to whole vectors, run a few rows at a time."""
    shape = xs[0].shape
    D = shape[-1] if len(shape) else 1
    Dp = -(-D // _LANES) * _LANES
    rows = [x.reshape(-1, D) for x in xs]
    n = rows[0].shape[0]
    out = torch.empty(n, D, dtype=torch.promote_types(*[x.dtype for x in xs]) if len(xs) > 1 else xs[0].dtype,
                      device=xs[0].device)
    step = max(1, _PIECE // Dp)
    for r0 in range(0, n, step):
        parts = [F.pad(r[r0:r0 + step], (0, Dp - D)) for r in rows]
        out[r0:r0 + step] = fn(*parts)[:, :D]
    return out.view(shape)


def _silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


def pair_activation(variant: dict):
    """act(gate, up) of the invariant experts' pair form for an experts variant (`op_kwargs`), or
    None where it has none: plain SwiGLU, or DeepSeek-V4's LimitedSwiGLU (known by its class name
    and `limit`, as grouped_gemm's kernel_activation knows it) without biases. Clamps are exact, so
    the limited form stays row-invariant on padded rows."""
    if variant.get("w13_bias") is not None or variant.get("w2_bias") is not None:
        return None
    act = variant.get("activation", "silu")
    if act == "silu":
        return _silu_mul
    if type(act).__name__ == "LimitedSwiGLU" and hasattr(act, "limit"):
        limit = act.limit
        if limit is None:
            return _silu_mul
        return lambda g, u: F.silu(g.clamp(max=limit)) * u.clamp(min=-limit, max=limit)
    return None


class InvariantTorchLinear(TorchLinear):
    """TorchLinear's contract, batch-invariant (see the module docstring)."""

    name = "torch+bi"
    batch_invariant = True

    def capturable(self) -> "InvariantTorchLinear":
        return InvariantTorchLinear(self.device)

    def __call__(self, x, w, b=None):
        return linear(x, w, b)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return elementwise(_silu_mul, gate, up)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return elementwise(torch.sigmoid, x)

    def pointwise(self, fn, *xs: torch.Tensor) -> torch.Tensor:
        return elementwise(fn, *xs)

    def per_head(self, x_TNK: torch.Tensor, w_NOK: torch.Tensor) -> torch.Tensor:
        # head by head through this backend's row-invariant linear (torch's batched GEMM is not)
        return torch.stack([self(x_TNK[:, n], w_NOK[n]) for n in range(w_NOK.shape[0])], dim=1)


class InvariantCpuCLinear(CpuCLinear):
    """CpuCLinear's contract, batch-invariant: our C dot-product tiles for every row count where
    they take the operands, else the torch form above (which a given layer always takes)."""

    name = "cpu_c+bi"
    batch_invariant = True

    def capturable(self) -> InvariantTorchLinear:
        return InvariantTorchLinear(self.device)

    def __call__(self, x, w, b=None):
        if cpu_ops.linear_invariant_fits(x, w):
            y = cpu_ops.linear_invariant(x, w, b)
            return y if y.dtype == x.dtype else y.to(x.dtype)
        return linear(x, w, b)

    def packed(self, layer, x: torch.Tensor) -> torch.Tensor:
        """A packed int4 / int8 weight: dequantized for this call, then the invariant form above (the
        C quant kernels pick their path by row count)."""
        return TorchLinear.packed(self, layer, x)

    silu_mul = InvariantTorchLinear.silu_mul
    sigmoid = InvariantTorchLinear.sigmoid
    pointwise = InvariantTorchLinear.pointwise
    per_head = InvariantTorchLinear.per_head


def experts_torch_pairs(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, act=_silu_mul) -> torch.Tensor:
    """(T, K, D) float32: each (token, k) pair's weighted expert output, zero for ids outside [0, E),
    batch-invariant: each (token, expert) row through rowwise GEMVs. act(gate, up): the gated
    activation, on rows padded to whole vectors."""
    T, D = x_TD.shape
    E, F2 = w13_EFD.shape[0], w13_EFD.shape[1]
    out = torch.zeros(T, topk_ids_TK.shape[1], D, dtype=torch.float32, device=x_TD.device)
    ids = topk_ids_TK.to(torch.int64)
    for e in torch.unique(ids[(ids >= 0) & (ids < E)]).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = linear(x_TD.index_select(0, tok).float(), w13_EFD[e])
        a = elementwise(act, h[:, :F2 // 2].contiguous(), h[:, F2 // 2:].contiguous())
        out[tok, slot] = linear(a, w2_EDF[e]) * topk_weights_TK[tok, slot].float()[:, None]
    return out


def sum_in_id_order(pairs_TKD: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """(T, D) float32: each token's K pair outputs added one by one into a float32 zero, in ascending
    expert id. One order per token whatever the batch, and one an expert-parallel combine repeats
    exactly: there each pair's output comes home apart (not summed per rank) and is added here, so
    a token's sum does not depend on which rank holds which of its experts."""
    T, K, D = pairs_TKD.shape
    order_TK = torch.argsort(ids_TK.to(torch.int64), dim=1, stable=True)
    rows_T = torch.arange(T, device=pairs_TKD.device)
    out = torch.zeros(T, D, dtype=torch.float32, device=pairs_TKD.device)
    for j in range(K):
        out += pairs_TKD[rows_T, order_TK[:, j]]
    return out


def experts_torch(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, act=_silu_mul) -> torch.Tensor:
    """fused_experts_reference's contract (ids outside [0, E) contribute nothing), batch-invariant:
    `experts_torch_pairs` added in id order (`sum_in_id_order`)."""
    pairs = experts_torch_pairs(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, act)
    return sum_in_id_order(pairs, topk_ids_TK).to(x_TD.dtype)


class InvariantTorchExperts(TorchExperts):
    """TorchExperts' contract for SwiGLU experts (plain or limited: `pair_activation`), batch-
    invariant (`experts_torch`): dense, or quantized (packed int4 / int8, block FP8, MXFP4: anything
    with `dequantize(dtype, experts)`), whose routed experts are dequantized to float32 per step, an
    elementwise function of the weights alone. Biases and other activations are refused: they have
    no invariant form yet."""

    name = "torch+bi"
    batch_invariant = True
    linear_backend = InvariantTorchLinear

    def capturable(self) -> "InvariantTorchExperts":
        return InvariantTorchExperts(self.device, host_reads=False)

    def plain(self, x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, all_local: bool) -> torch.Tensor:
        pairs = self.pairs(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK)
        return sum_in_id_order(pairs, topk_ids_TK).to(x_TD.dtype)

    def pairs(self, x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, **variant) -> torch.Tensor:
        """(T, K, D) float32 each (token, k) pair's weighted output, zero for ids outside [0, E): what an
        expert-parallel MoE layer sends home for `sum_in_id_order` (expert_parallel/runtime/layer.py).
        variant: the experts' op_kwargs; what `pair_activation` has no form for is refused."""
        act = pair_activation(variant)
        if act is None:
            self.refuse(variant.get("activation", "silu"))
        if not isinstance(w13_EFD, torch.Tensor) or not isinstance(w2_EDF, torch.Tensor):
            w13_EFD, w2_EDF, topk_ids_TK = routed_dense(w13_EFD, w2_EDF, topk_ids_TK)
        return experts_torch_pairs(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, act)

    def variant(self, x_TD, w13, w2, topk_weights_TK, topk_ids_TK, w13_bias, w2_bias, activation):
        """The pair form of a variant `pair_activation` takes (DeepSeek-V4's limited SwiGLU), added
        in id order; others refused."""
        pairs = InvariantTorchExperts.pairs(self, x_TD, w13, w2, topk_weights_TK, topk_ids_TK, w13_bias=w13_bias,
                                            w2_bias=w2_bias, activation=activation)
        return sum_in_id_order(pairs, topk_ids_TK).to(x_TD.dtype)

    def refuse(self, activation):
        raise ValueError(f"--batch-invariant: the {self.name.split('+')[0]} experts backend has no batch-invariant "
                         f"form for experts with biases or activation {activation!r}")


def routed_dense(w13, w2, topk_ids_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantized experts' routed experts dequantized to float32, and the ids renumbered over them
    (in the same order: ids outside [0, E) stay outside)."""
    E = w13.shape[0]
    ids = topk_ids_TK.to(torch.int64)
    valid = (ids >= 0) & (ids < E)
    used = torch.unique(ids[valid])
    renumber = torch.full((E,), -1, dtype=torch.int64, device=ids.device)
    renumber[used] = torch.arange(used.numel(), device=ids.device)
    ids = torch.where(valid, renumber[ids.clamp(0, E - 1)], torch.full_like(ids, -1))
    return w13.dequantize(torch.float32, used), w2.dequantize(torch.float32, used), ids


class InvariantCpuCExperts(CpuCExperts):
    """CpuCExperts' contract, batch-invariant: our C kernel's dot-product tiles for every expert
    whatever its row count (`cpu_ops.moe_experts(pairs=True)`), else `experts_torch_pairs` (which
    also runs DeepSeek-V4's limited SwiGLU: the C kernel has plain SwiGLU only)."""

    name = "cpu_c+bi"
    batch_invariant = True
    linear_backend = InvariantCpuCLinear

    def capturable(self) -> InvariantTorchExperts:
        return InvariantTorchExperts(self.device, host_reads=False)

    plain = InvariantTorchExperts.plain

    def pairs(self, x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, **variant) -> torch.Tensor:
        """InvariantTorchExperts.pairs' contract, by our C kernel where it takes the operands."""
        if (not variant and x_TD.is_cpu and x_TD.dtype in (torch.float32, torch.bfloat16) and isinstance(w13_EFD, torch.Tensor)
                and isinstance(w2_EDF, torch.Tensor) and w13_EFD.is_contiguous() and w2_EDF.is_contiguous()
                and w13_EFD.dtype in (torch.float32, torch.bfloat16) and w2_EDF.dtype == w13_EFD.dtype
                and cpu_ops.available()):
            return cpu_ops.moe_experts(x_TD.float(), w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, pairs=True)
        return InvariantTorchExperts.pairs(self, x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, **variant)

    variant = InvariantTorchExperts.variant
    refuse = InvariantTorchExperts.refuse


class InvariantTritonLinear(TritonLinear):
    """TritonLinear's contract, batch-invariant: dense weights through our Triton GEMM at one config
    (`triton_invariant.linear_invariant`, not cuBLAS), block-FP8 weights through the FP8 kernel at
    one row tile whatever M is."""

    name = "triton+bi"
    batch_invariant = True
    FP8_TILE_ROWS = 32  # the row tile every block-FP8 call takes (one of ROW_TILES: compiled already)
    ROW_TILES = (FP8_TILE_ROWS,)
    packed_tile_rows = FP8_TILE_ROWS  # packed int4 / int8 weights: one row tile whatever M is, likewise

    def capturable(self) -> "InvariantTritonLinear":
        return self

    def __call__(self, x, w, b=None):
        from moe_serve.kernels.triton_invariant import linear_invariant  # lazy: triton is heavy

        return linear_invariant(x, w, b)

    def fp8(self, layer, x: torch.Tensor) -> torch.Tensor:
        from moe_serve.kernels.fp8_linear import fp8_linear_triton  # lazy: triton is heavy

        return fp8_linear_triton(x, layer.weight, layer.weight_scale_inv, layer.fp8_block, layer.bias,
                                 layer.fp8_act_quant, tile_rows=self.FP8_TILE_ROWS)

    # CUDA's elementwise kernels apply one scalar formula to every element, vectorised or not; torch's
    # CPU loops (the interpreter's device) do not (module docstring): the padded form there.
    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return elementwise(_silu_mul, gate, up) if gate.device.type == "cpu" else F.silu(gate) * up

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return elementwise(torch.sigmoid, x) if x.device.type == "cpu" else torch.sigmoid(x)

    def pointwise(self, fn, *xs: torch.Tensor) -> torch.Tensor:
        return elementwise(fn, *xs) if xs[0].device.type == "cpu" else fn(*xs)

    per_head = InvariantTorchLinear.per_head

    def launch(self, layer, dtype: torch.dtype, M: int) -> None:
        """The layer (dense, block FP8 or packed) over M "meta" rows: compiled, not run."""
        x = torch.empty(M, layer.in_features, dtype=dtype, device="meta")
        if getattr(layer, "weight_scale_inv", None) is not None:
            self.fp8(layer, x)
        elif getattr(layer, "qweight", None) is not None:
            self.packed(layer, x)
        else:
            self(x, layer.weight, layer.bias)

    def warm_up(self, layer, dtype: torch.dtype) -> None:
        """The one variant a layer launches (one tile whatever M; M is not specialised)."""
        self.launch(layer, dtype, 1)


class InvariantTritonExperts(TritonExperts):
    """TritonExperts' contract, batch-invariant: every weight format and activation the grouped GEMM
    takes (`kernel_args`), at grouped_gemm.config.INVARIANT_CONFIG for every T
    (`triton_invariant.experts_pairs_triton`), each pair's output apart, added in expert id order
    (`sum_in_id_order`). No masked GEMM (its tile is chosen by rows per expert): an expert-parallel
    layer sends the pairs home instead. What the kernel does not take is refused."""

    name = "triton+bi"
    batch_invariant = True
    has_masked = False
    takes_packed = False  # the packed grouped GEMM has no one-config pairs form yet: refused, named
    linear_backend = InvariantTritonLinear

    def capturable(self) -> "InvariantTritonExperts":
        return InvariantTritonExperts(self.device, host_reads=False)

    plain = InvariantTorchExperts.plain

    def variant(self, x_TD, w13, w2, topk_weights_TK, topk_ids_TK, w13_bias, w2_bias, activation):
        pairs = self.pairs(x_TD, w13, w2, topk_weights_TK, topk_ids_TK, w13_bias=w13_bias, w2_bias=w2_bias,
                           activation=activation)
        return sum_in_id_order(pairs, topk_ids_TK).to(x_TD.dtype)

    def pairs(self, x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, **variant) -> torch.Tensor:
        """InvariantTorchExperts.pairs' contract, by the Triton grouped GEMM at its one config."""
        from moe_serve.kernels.triton_invariant import experts_pairs_triton  # lazy: triton is heavy

        args = self.kernel_args(w13_EFD, w2_EDF, x_TD.dtype, **variant)
        if args is None:
            raise ValueError(f"--batch-invariant: the triton experts backend has no batch-invariant form for "
                             f"activation {variant.get('activation', 'silu')!r} or weights of another dtype")
        k13, k2, kw = args
        return experts_pairs_triton(x_TD, k13, k2, topk_weights_TK, topk_ids_TK, **kw)

    def configs(self, moe, dtype: torch.dtype) -> list[dict]:
        """The one config this backend launches (warm-up and moe_serve/kernels/aot_check.py)."""
        from moe_serve.kernels.grouped_gemm.config import INVARIANT_CONFIG

        return [dict(INVARIANT_CONFIG)]
