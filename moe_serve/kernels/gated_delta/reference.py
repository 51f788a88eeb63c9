"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) in plain torch: the reference every
backend is tested against.

A step's sequences are packed along T as in paged attention: sequence b owns rows
qsl[b] : qsl[b+1] (query_lens_cpu[b] rows, qsl their running sum), and its state lives at slot
slots_B[b] of the layer's state caches. context_lens_cpu[b] is what the sequence computed before
this step: 0 means a fresh start (the initial state is zeros and the cache slot is not read, so a
slot can be handed over without clearing it), > 0 continues from the cached state. Both ops write
the state after this step's rows back to the slot in place; a sequence with no rows this step
leaves its slot untouched.

- `causal_conv1d`: the depthwise causal convolution (width K) in front of q/k/v, its state the
  last K - 1 inputs before the step, (num_slots, C, K - 1).
- `gated_delta_rule`: per token, with q, k optionally l2-normalised over the head dimension
  (eps 1e-6) and q scaled:
      S = exp(g) * S;  S = S + k ⊗ (beta * (v - Sᵀ k));  o = Sᵀ q
  S is (K, V) per head, (num_slots, H, K, V) in the cache (the orientation of transformers'
  `torch_recurrent_gated_delta_rule`); math in float32.

Written for clarity, token by token: the backends (moe_serve/kernels/gated_delta/__init__.py) hold the fast
forms, a vectorised decode step and the chunked prefill.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6


def _starts(query_lens_cpu) -> list[int]:
    """qsl: the first row of each sequence, and the total row count last."""
    qsl = [0]
    for n in query_lens_cpu:
        qsl.append(qsl[-1] + int(n))
    return qsl


def _check_batch(T: int, slots_B: torch.Tensor, query_lens_cpu, context_lens_cpu) -> list[int]:
    B = slots_B.shape[0]
    if len(query_lens_cpu) != B or len(context_lens_cpu) != B:
        raise ValueError(f"{B} slots but {len(query_lens_cpu)} query lengths and {len(context_lens_cpu)} "
                         "context lengths: one of each per sequence")
    qsl = _starts(query_lens_cpu)
    if qsl[-1] != T:
        raise ValueError(f"query lengths sum to {qsl[-1]} rows, the input has {T}")
    return qsl


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (transformers' and FLA's form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv1d(x_TC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None,
                  conv_state_SCW: torch.Tensor, slots_B: torch.Tensor, query_lens_cpu, context_lens_cpu,
                  activation: str | None = "silu") -> torch.Tensor:
    """Depthwise causal convolution of each sequence's rows, continuing from its conv state.

    Args:
        x_TC: (T, C) packed inputs of the step's sequences.
        weight_CK: (C, K) one filter of width K per channel; bias_C: (C,) or None.
        conv_state_SCW: (num_slots, C, W = K - 1), the last W inputs of each slot's sequence
            (oldest first); updated in place with the last W inputs after this step.
        slots_B: (B,) int64 slot of each sequence; query_lens_cpu, context_lens_cpu: B host ints.
        activation: "silu" or None.
    Returns:
        (T, C) in x's dtype; computed in float32.
    """
    T, C = x_TC.shape
    W = weight_CK.shape[1] - 1
    if conv_state_SCW.shape[1:] != (C, W):
        raise ValueError(f"conv state {tuple(conv_state_SCW.shape)} is not (slots, C={C}, K-1={W})")
    if activation not in ("silu", None):
        raise ValueError(f"activation {activation!r} is not 'silu' or None")
    qsl = _check_batch(T, slots_B, query_lens_cpu, context_lens_cpu)
    y_TC = torch.empty_like(x_TC)
    w_CK = weight_CK.float()
    for b, slot in enumerate(slots_B.tolist()):
        L = qsl[b + 1] - qsl[b]
        if L == 0:
            continue
        if context_lens_cpu[b] > 0:
            prev_WC = conv_state_SCW[slot].float().T
        else:
            prev_WC = torch.zeros(W, C, dtype=torch.float32, device=x_TC.device)
        full_NC = torch.cat([prev_WC, x_TC[qsl[b]:qsl[b + 1]].float()])  # N = W + L
        # y[t] = sum_j w[:, j] * full[t + j]: the input at row t sits at full[t + W], the window's end
        windows_LCK = full_NC.unfold(0, W + 1, 1)
        y_LC = (windows_LCK * w_CK).sum(-1)
        if bias_C is not None:
            y_LC = y_LC + bias_C.float()
        if activation == "silu":
            y_LC = F.silu(y_LC)
        y_TC[qsl[b]:qsl[b + 1]] = y_LC.to(x_TC.dtype)
        if W:
            conv_state_SCW[slot] = full_NC[-W:].T.to(conv_state_SCW.dtype)
    return y_TC


def gated_delta_rule(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                     beta_TH: torch.Tensor, state_SHKV: torch.Tensor, slots_B: torch.Tensor, query_lens_cpu,
                     context_lens_cpu, scale: float, use_qk_l2norm: bool = True) -> torch.Tensor:
    """The gated delta rule over each sequence's rows, token by token, from its cached state.

    Args:
        q_THK, k_THK: (T, H, K) queries and keys (k heads already repeated to the H value heads).
        v_THV: (T, H, V) values.
        g_TH: (T, H) log decay (<= 0): the state is multiplied by exp(g) before each token.
        beta_TH: (T, H) write strength of each token.
        state_SHKV: (num_slots, H, K, V) recurrent states, float32 or the model dtype; the final
            state of each sequence with rows this step is written back to its slot.
        slots_B, query_lens_cpu, context_lens_cpu: the batch (module docstring).
        scale: multiplies q (after the l2 norm), usually K ** -0.5.
        use_qk_l2norm: l2-normalise q and k over K first.
    Returns:
        (T, H, V) in v's dtype.
    """
    T, H, K = q_THK.shape
    V = v_THV.shape[-1]
    if state_SHKV.shape[1:] != (H, K, V):
        raise ValueError(f"state {tuple(state_SHKV.shape)} is not (slots, H={H}, K={K}, V={V})")
    qsl = _check_batch(T, slots_B, query_lens_cpu, context_lens_cpu)
    q, k, v, g, beta = (t.float() for t in (q_THK, k_THK, v_THV, g_TH, beta_TH))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    o_THV = torch.empty(T, H, V, dtype=v_THV.dtype, device=v_THV.device)
    for b, slot in enumerate(slots_B.tolist()):
        if qsl[b + 1] == qsl[b]:
            continue
        if context_lens_cpu[b] > 0:
            S_HKV = state_SHKV[slot].float()
        else:
            S_HKV = torch.zeros(H, K, V, dtype=torch.float32, device=v_THV.device)
        for t in range(qsl[b], qsl[b + 1]):
            S_HKV = S_HKV * g[t].exp()[:, None, None]
            pred_HV = torch.einsum("hkv,hk->hv", S_HKV, k[t])
            delta_HV = beta[t][:, None] * (v[t] - pred_HV)
            S_HKV = S_HKV + k[t][:, :, None] * delta_HV[:, None, :]
            o_THV[t] = torch.einsum("hkv,hk->hv", S_HKV, q[t]).to(v_THV.dtype)
        state_SHKV[slot] = S_HKV.to(state_SHKV.dtype)
    return o_THV
