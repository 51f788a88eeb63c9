"""Linear-attention (Gated DeltaNet) backends: one object per way of running the short causal
convolution and the gated delta rule of Qwen3-Next / Qwen3.5 linear-attention layers, chosen once
at start-up by moe_serve/platform.py (kind "linear_attention") and bound to every such layer.

- `TorchLinearAttention` ("torch"): torch ops. A decode step (every sequence one row) is one
  batched recurrent step over the gathered states, with no host read and no loop over sequences,
  so a CUDA graph can hold it; prefill runs the chunked form of the rule per sequence.
- `CpuCLinearAttention` ("cpu_c"): the torch backend with the decode step of float32 layers in
  our C kernel (moe_serve/kernels/cpu_ops/gated_delta.c), each state read and written once in place.
- `TritonLinearAttention` ("triton"): the kernels of moe_serve/kernels/gated_delta/triton_kernels.py (a
  chunked prefill kernel pair and a one-token recurrent kernel), imported on first use so CPU
  users never load Triton.

Both take the batch as moe_serve/kernels/gated_delta/reference.py documents it (packed rows, a state slot
per sequence, host query and context lengths; context 0 starts from zeros) and have its
signatures; the reference is what they are tested against.

A fresh sequence (context 0) among one-row sequences needs a host-made mask; a captured decode
step is given every context > 0 (its host lengths are those of a long context), so the graph
holds the unmasked step: a one-token prompt must not be replayed in a graph unless its slot
holds zeros.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_serve.kernels import cpu_ops
from moe_serve.kernels.gated_delta.reference import L2NORM_EPS, l2norm

# The torch prefill's chunk length (the chunked form's block of rows solved at once).
TORCH_CHUNK = 64


@dataclass(frozen=True)
class LinearAttentionShape:
    """What the kernels' variants depend on in a layer: value heads H (q/k heads repeated to H),
    key and value head dims, the convolution's channels and width (and whether it has a bias),
    and the dtypes of the two state caches. A layer gives it as `linear_attention_shape` for the
    warm-up (moe_serve/kernel_warmup.py) and moe_serve/kernels/aot_check.py builds one per model."""
    heads: int
    k_dim: int
    v_dim: int
    conv_dim: int
    conv_width: int
    conv_bias: bool = False
    state_dtype: torch.dtype = torch.float32
    conv_state_dtype: torch.dtype | None = None  # None: the model dtype


def leading_decodes(query_lens_cpu) -> int:
    """How many sequences at the front of the batch have one row each (the scheduler puts every
    decode before any prefill chunk)."""
    n = 0
    for q in query_lens_cpu:
        if q != 1:
            break
        n += 1
    return n


def continuing_mask(context_lens_cpu, device: torch.device) -> torch.Tensor | None:
    """(B,) bool, True where the sequence continues from its cached state; None when every one
    does (then nothing is copied to the device)."""
    if all(c > 0 for c in context_lens_cpu):
        return None
    return torch.tensor([c > 0 for c in context_lens_cpu], dtype=torch.bool).to(device, non_blocking=True)


class TorchLinearAttention:
    name = "torch"
    captures_graphs = True  # its decode step reads no host value and has no data-dependent shape

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._gathered: dict = {}  # CPU only: (state shape, dtype) -> the decode step's state buffer

    def capturable(self) -> "TorchLinearAttention":
        return self

    def _gather(self, state_SHKV: torch.Tensor, slots_B: torch.Tensor) -> torch.Tensor:
        """state_SHKV[slots_B], a copy the step may overwrite. On the CPU into one buffer kept for
        the largest batch so far (the layers run one after another): a fresh allocation of
        megabytes is page faults on first touch, which cost several times the copy; CUDA's caching
        allocator has no such cost."""
        if state_SHKV.device.type != "cpu":
            return state_SHKV.index_select(0, slots_B)
        B, key = slots_B.shape[0], (tuple(state_SHKV.shape[1:]), state_SHKV.dtype)
        buf = self._gathered.get(key)
        if buf is None or buf.shape[0] < B:
            buf = self._gathered[key] = torch.empty((B, *key[0]), dtype=state_SHKV.dtype)
        return torch.index_select(state_SHKV, 0, slots_B, out=buf[:B])

    # ---- the short convolution ----------------------------------------------------------------------

    def causal_conv1d(self, x_TC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None,
                      conv_state_SCW: torch.Tensor, slots_B: torch.Tensor, query_lens_cpu, context_lens_cpu,
                      activation: str | None = "silu") -> torch.Tensor:
        nd = leading_decodes(query_lens_cpu)
        B = len(query_lens_cpu)
        if nd == B:
            return self._conv_step(x_TC, weight_CK, bias_C, conv_state_SCW, slots_B, context_lens_cpu, activation)
        y_TC = torch.empty_like(x_TC)
        if nd:
            y_TC[:nd] = self._conv_step(x_TC[:nd], weight_CK, bias_C, conv_state_SCW, slots_B[:nd],
                                        context_lens_cpu[:nd], activation)
        start = nd
        for b in range(nd, B):
            L = query_lens_cpu[b]
            if L:
                y_TC[start:start + L] = self._conv_sequence(x_TC[start:start + L], weight_CK, bias_C, conv_state_SCW,
                                                            slots_B[b:b + 1], context_lens_cpu[b] > 0, activation)
            start += L
        return y_TC

    @staticmethod
    def _conv_step(x_BC, weight_CK, bias_C, conv_state_SCW, slots_B, context_lens_cpu, activation):
        """One row per sequence: the gathered windows times the filters, the windows shifted back."""
        prev_BCW = conv_state_SCW.index_select(0, slots_B)
        keep_B = continuing_mask(context_lens_cpu, x_BC.device)
        if keep_B is not None:
            prev_BCW = torch.where(keep_B[:, None, None], prev_BCW, 0)
        full_BCK = torch.cat([prev_BCW.float(), x_BC.float()[:, :, None]], dim=-1)
        y_BC = (full_BCK * weight_CK.float()).sum(-1)
        conv_state_SCW.index_copy_(0, slots_B, full_BCK[:, :, 1:].to(conv_state_SCW.dtype))
        return _bias_act(y_BC, bias_C, activation).to(x_BC.dtype)

    @staticmethod
    def _conv_sequence(x_LC, weight_CK, bias_C, conv_state_SCW, slot_1, continues: bool, activation):
        """One sequence's rows: torch's depthwise conv1d over its state and rows."""
        C, KW = weight_CK.shape
        if continues:
            prev_CW = conv_state_SCW.index_select(0, slot_1)[0].float()
        else:
            prev_CW = torch.zeros(C, KW - 1, dtype=torch.float32, device=x_LC.device)
        full_CN = torch.cat([prev_CW, x_LC.float().T], dim=1)
        y_CL = F.conv1d(full_CN[None], weight_CK.float()[:, None, :], groups=C)[0]
        conv_state_SCW.index_copy_(0, slot_1, full_CN[None, :, full_CN.shape[1] - (KW - 1):].to(conv_state_SCW.dtype))
        return _bias_act(y_CL.T, bias_C, activation).to(x_LC.dtype)

    # ---- the gated delta rule -----------------------------------------------------------------------

    def gated_delta_rule(self, q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                         beta_TH: torch.Tensor, state_SHKV: torch.Tensor, slots_B: torch.Tensor, query_lens_cpu,
                         context_lens_cpu, scale: float, use_qk_l2norm: bool = True) -> torch.Tensor:
        nd = leading_decodes(query_lens_cpu)
        B = len(query_lens_cpu)
        if nd == B:
            return self._decode_rule(q_THK, k_THK, v_THV, g_TH, beta_TH, state_SHKV, slots_B, context_lens_cpu, scale,
                                     use_qk_l2norm).to(v_THV.dtype)
        o_THV = torch.empty(v_THV.shape, dtype=v_THV.dtype, device=v_THV.device)
        if nd:
            o_THV[:nd] = self._decode_rule(q_THK[:nd], k_THK[:nd], v_THV[:nd], g_TH[:nd], beta_TH[:nd], state_SHKV,
                                           slots_B[:nd], context_lens_cpu[:nd], scale, use_qk_l2norm)
        q, k = _normed(q_THK, k_THK, scale, use_qk_l2norm)
        v, g, beta = v_THV.float(), g_TH.float(), beta_TH.float()
        start = nd
        for b in range(nd, B):
            L = query_lens_cpu[b]
            if L:
                rows = slice(start, start + L)
                slot_1 = slots_B[b:b + 1]
                if context_lens_cpu[b] > 0:
                    S_HKV = state_SHKV.index_select(0, slot_1)[0].float()
                else:
                    S_HKV = q.new_zeros(q.shape[1], q.shape[2], v.shape[2])
                o_LHV, S_HKV = chunked_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], S_HKV)
                o_THV[rows] = o_LHV.to(o_THV.dtype)
                state_SHKV.index_copy_(0, slot_1, S_HKV[None].to(state_SHKV.dtype))
            start += L
        return o_THV

    def _decode_rule(self, q_BHK, k_BHK, v_BHV, g_BH, beta_BH, state_SHKV, slots_B, context_lens_cpu, scale: float,
                     use_qk_l2norm: bool) -> torch.Tensor:
        """The rule for sequences of one row each (the step's leading decodes): float32 o (B, H, V)."""
        q, k = _normed(q_BHK, k_BHK, scale, use_qk_l2norm)
        return self._delta_step(q, k, v_BHV.float(), g_BH.float(), beta_BH.float(), state_SHKV, slots_B,
                                context_lens_cpu)

    def _delta_step(self, q_BHK, k_BHK, v_BHV, g_BH, beta_BH, state_SHKV, slots_B, context_lens_cpu):
        """One token per sequence, all sequences at once (float32 inputs, q normalised and scaled).

        With S the gathered state and a = exp(g): Sᵀk and Sᵀq come from one batched product with
        the old state, so the new state a * S + k ⊗ delta is written once and never read again:
        pred = a * Sᵀk, delta = beta * (v - pred), o = a * Sᵀq + (k · q) * delta."""
        S_BHKV = self._gather(state_SHKV, slots_B).float()
        keep_B = continuing_mask(context_lens_cpu, q_BHK.device)
        if keep_B is not None:
            S_BHKV = torch.where(keep_B[:, None, None, None], S_BHKV, 0)
        decay_BH = g_BH.exp()
        reads_BH2V = torch.matmul(torch.stack([k_BHK, q_BHK], dim=-2), S_BHKV)
        delta_BHV = beta_BH[..., None] * (v_BHV - decay_BH[..., None] * reads_BH2V[..., 0, :])
        o_BHV = decay_BH[..., None] * reads_BH2V[..., 1, :] + (k_BHK * q_BHK).sum(-1, keepdim=True) * delta_BHV
        S_BHKV.mul_(decay_BH[..., None, None]).addcmul_(k_BHK[..., :, None], delta_BHV[..., None, :])
        state_SHKV.index_copy_(0, slots_B, S_BHKV.to(state_SHKV.dtype))
        return o_BHV

    def pointwise(self, fn, *xs: torch.Tensor) -> torch.Tensor:
        """fn(*xs) for the layer's elementwise gates (here so that a batch-invariant backend can run
        them in its own form)."""
        return fn(*xs)

    def warm_up(self, layer, dtype: torch.dtype) -> None:
        """Compile what this backend can launch for the layer ahead of serving: nothing for torch ops."""

    def __repr__(self) -> str:
        return type(self).__name__ + "()"


def _normed(q_THK, k_THK, scale: float, use_qk_l2norm: bool):
    """float32 q and k, l2-normalised if asked, q times scale."""
    q, k = q_THK.float(), k_THK.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * scale, k


def _bias_act(y, bias_C, activation):
    if bias_C is not None:
        y = y + bias_C.float()
    if activation == "silu":
        return F.silu(y)
    if activation is not None:
        raise ValueError(f"activation {activation!r} is not 'silu' or None")
    return y


def chunked_delta_rule(q_LHK: torch.Tensor, k_LHK: torch.Tensor, v_LHV: torch.Tensor, g_LH: torch.Tensor,
                       beta_LH: torch.Tensor, S_HKV: torch.Tensor, chunk: int = TORCH_CHUNK):
    """The gated delta rule over one sequence's L rows in blocks of `chunk` rows (float32; q
    already normalised and scaled): (o (L, H, V), final state (H, K, V)).

    Within a block, with G the running sum of g from the block's start and A the strictly lower
    (i > j) matrix beta_i (k_i · k_j) exp(G_i - G_j), the block's writes are the solutions of one
    unit lower-triangular system (I + A): u = (I + A)^-1 (beta v) and w = (I + A)^-1 (beta exp(G) k).
    Entering the block with state S, the corrected values are v' = u - w S, the outputs
    o = exp(G) q S + (causal exp(G_i - G_j) q kᵀ) v', and the state leaving it is
    exp(G_last) S + (exp(G_last - G) k)ᵀ v'. Only the state passes from block to block."""
    L, H, K = k_LHK.shape
    V = v_LHV.shape[-1]
    n = -(-L // chunk)
    pad = n * chunk - L

    def blocks(x):  # (L, H, ...) -> (H, n, chunk, ...), padded rows zero (g = 0: no decay past the end)
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, 0, 0, pad))
        return x.reshape(n, chunk, H, *x.shape[2:]).transpose(0, 2).transpose(1, 2)

    q, k, v = blocks(q_LHK), blocks(k_LHK), blocks(v_LHV)
    g, beta = blocks(g_LH[..., None])[..., 0], blocks(beta_LH[..., None])[..., 0]
    G = g.cumsum(-1)  # (H, n, chunk)
    idx = torch.arange(chunk, device=q.device)
    causal = idx[:, None] >= idx[None, :]
    gaps = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # exp(G_i - G_j), i >= j
    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * gaps).masked_fill(~causal.tril(-1), 0)
    eye = torch.eye(chunk, device=q.device)
    rhs = torch.cat([beta[..., None] * v, (beta * G.exp())[..., None] * k], dim=-1)
    uw = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    u, w = uw[..., :V], uw[..., V:]
    attn = (q @ k.transpose(-1, -2)) * gaps
    q_in = q * G.exp()[..., None]
    G_last = G[..., -1]  # (H, n)
    k_out = k * (G_last[..., None] - G).exp()[..., None]
    o = torch.empty(H, n, chunk, V, dtype=torch.float32, device=q.device)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ S_HKV
        o[:, i] = q_in[:, i] @ S_HKV + attn[:, i] @ v_new
        S_HKV = S_HKV * G_last[:, i].exp()[:, None, None] + k_out[:, i].transpose(-1, -2) @ v_new
    return o.reshape(H, n * chunk, V)[:, :L].transpose(0, 1), S_HKV


class TritonLinearAttention:
    name = "triton"
    captures_graphs = True

    def __init__(self, device: torch.device | str = "cuda"):
        self.device = torch.device(device)
        self._k = None

    @property
    def kernels(self):
        if self._k is None:  # lazy: triton is heavy
            self._k = importlib.import_module("moe_serve.kernels.gated_delta.triton_kernels")
        return self._k

    def capturable(self) -> "TritonLinearAttention":
        return self

    pointwise = TorchLinearAttention.pointwise

    def causal_conv1d(self, x_TC, weight_CK, bias_C, conv_state_SCW, slots_B, query_lens_cpu, context_lens_cpu,
                      activation: str | None = "silu") -> torch.Tensor:
        return self.kernels.causal_conv1d(x_TC, weight_CK, bias_C, conv_state_SCW, slots_B, query_lens_cpu,
                                          context_lens_cpu, activation)

    def gated_delta_rule(self, q_THK, k_THK, v_THV, g_TH, beta_TH, state_SHKV, slots_B, query_lens_cpu,
                         context_lens_cpu, scale: float, use_qk_l2norm: bool = True) -> torch.Tensor:
        return self.kernels.gated_delta_rule(q_THK, k_THK, v_THV, g_TH, beta_TH, state_SHKV, slots_B,
                                             query_lens_cpu, context_lens_cpu, scale, use_qk_l2norm)

    @staticmethod
    def steps() -> list[tuple[str, list[int], list[int]]]:
        """The kinds of step a layer launches differently, as (name, query lengths, context
        lengths): decode (the one-token kernels) and prefill chunks beside a decode (the chunked
        kernels and the convolution's prefill form). Fresh sequences and lengths are runtime
        values: they select no other variant."""
        return [("decode", [1, 1], [1, 2]), ("prefill", [1, 4, 70], [3, 0, 9])]

    def launch(self, shape: LinearAttentionShape, dtype: torch.dtype, query_lens: list[int],
               context_lens: list[int]) -> None:
        """The convolution and the delta rule for one step of a layer of this shape, as the layer
        calls them, over "meta" tensors: compiled, not run."""
        dev = torch.device("meta")
        T, B, H, Kd, Vd = sum(query_lens), len(query_lens), shape.heads, shape.k_dim, shape.v_dim
        slots = torch.empty(B, dtype=torch.int64, device=dev)
        conv_state = torch.empty(B + 1, shape.conv_dim, shape.conv_width - 1, dtype=shape.conv_state_dtype or dtype,
                                 device=dev)
        bias = torch.empty(shape.conv_dim, dtype=dtype, device=dev) if shape.conv_bias else None
        self.causal_conv1d(torch.empty(T, shape.conv_dim, dtype=dtype, device=dev),
                           torch.empty(shape.conv_dim, shape.conv_width, dtype=dtype, device=dev), bias, conv_state,
                           slots, query_lens, context_lens)
        q, k, v = (torch.empty(T, H, d, dtype=dtype, device=dev) for d in (Kd, Kd, Vd))
        g, beta = torch.empty(T, H, dtype=torch.float32, device=dev), torch.empty(T, H, dtype=dtype, device=dev)
        state = torch.empty(B + 1, H, Kd, Vd, dtype=shape.state_dtype, device=dev)
        self.gated_delta_rule(q, k, v, g, beta, state, slots, query_lens, context_lens, Kd ** -0.5)

    def warm_up(self, layer, dtype: torch.dtype) -> None:
        """Every variant the layer launches: one launch per kind of step (`steps`), of the shape
        the layer declares (`layer.linear_attention_shape`, a LinearAttentionShape)."""
        shape = getattr(layer, "linear_attention_shape", None)
        if not isinstance(shape, LinearAttentionShape):
            raise TypeError(f"{type(layer).__name__} declares op_kind 'linear_attention' but no "
                            "linear_attention_shape (a moe_serve.kernels.gated_delta.LinearAttentionShape) to warm up")
        for _, query_lens, context_lens in self.steps():
            self.launch(shape, dtype, query_lens, context_lens)

    def __repr__(self) -> str:
        return "TritonLinearAttention()"


class CpuCLinearAttention(TorchLinearAttention):
    """The torch backend with the decode step of float32 layers in C (moe_serve/kernels/cpu_ops/gated_delta.c):
    each sequence's conv window and recurrent state read and written once, in place in its slot,
    where torch's step gathers, updates and scatters them. Prefill chunks take the torch ops."""

    name = "cpu_c"
    captures_graphs = False  # a CPU backend: no graphs to capture

    @staticmethod
    def _conv_step(x_BC, weight_CK, bias_C, conv_state_SCW, slots_B, context_lens_cpu, activation):
        if activation in ("silu", None) and cpu_ops.conv_step_fits(x_BC, weight_CK, bias_C, conv_state_SCW):
            return cpu_ops.conv_step(x_BC, weight_CK, bias_C, conv_state_SCW, slots_B, context_lens_cpu,
                                     activation == "silu")
        return TorchLinearAttention._conv_step(x_BC, weight_CK, bias_C, conv_state_SCW, slots_B, context_lens_cpu,
                                               activation)

    def _decode_rule(self, q_BHK, k_BHK, v_BHV, g_BH, beta_BH, state_SHKV, slots_B, context_lens_cpu, scale: float,
                     use_qk_l2norm: bool) -> torch.Tensor:
        if cpu_ops.gated_delta_step_fits(q_BHK, k_BHK, v_BHV, state_SHKV):
            return cpu_ops.gated_delta_step(q_BHK, k_BHK, v_BHV, g_BH, beta_BH, state_SHKV, slots_B, context_lens_cpu,
                                            scale, use_qk_l2norm, L2NORM_EPS)
        return super()._decode_rule(q_BHK, k_BHK, v_BHV, g_BH, beta_BH, state_SHKV, slots_B, context_lens_cpu, scale,
                                    use_qk_l2norm)

    def __repr__(self) -> str:
        return "CpuCLinearAttention()"


# By name, for tests and benchmarks that call one backend directly (the engine's table is in platform.py).
_BY_NAME = {cls.name: cls for cls in (TorchLinearAttention, CpuCLinearAttention, TritonLinearAttention)}


def get_backend(name: str, device: torch.device | str = "cpu"):
    if name not in _BY_NAME:
        raise ValueError(f"linear_attention_backend={name!r} is not one of {tuple(_BY_NAME)}")
    return _BY_NAME[name](device)
