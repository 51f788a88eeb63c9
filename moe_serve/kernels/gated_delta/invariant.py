"""Batch-invariant linear-attention (Gated DeltaNet) backends (`--batch-invariant`; see
moe_serve/kernels/batch_invariant.py for the contract).

By default a decode token takes the recurrent one-token step and a prefill chunk the chunked form
of the rule (blocks of TORCH_CHUNK rows solved at once, the block grid anchored at the chunk's
start), which sum in other orders: a position's output and state then depend on whether it was
decoded, where chunked prefill cut the prompt, or whether it was recomputed after preemption.

Here every row, prefill or decode, takes the one-token recurrent step, a sequence's rows one after
another: the convolution's window and the delta rule's state pass from token to token exactly as
in decodes, so a position's output and the state after it depend on the sequence alone. The state
written to the slot at the end of a step is the one the default forms write (the state after the
step's last row), so prefix-cache snapshots and restores work on it unchanged.
- `InvariantCpuCLinearAttention`: our C one-token kernels (conv_step_f32, gated_delta_step_f32),
  which compute each (sequence, head) apart; the step's rows go in waves, wave i holding row i of
  every sequence that has one (row i - 1's state is in the slot by then);
- `InvariantTorchLinearAttention`: the torch one-token step, one row of one sequence per call (its
  shapes depend on nothing else); also the C backend's form for layers C does not take.
`pointwise` runs the layer's gates (sigmoid, softplus, silu) on rows padded to whole vectors
(`batch_invariant.elementwise`), as torch's scalar tail differs from its vector body.
"""
from __future__ import annotations

import torch

from moe_serve.kernels import cpu_ops
from moe_serve.kernels.batch_invariant import elementwise
from moe_serve.kernels.gated_delta import CpuCLinearAttention, TorchLinearAttention
from moe_serve.kernels.gated_delta.reference import L2NORM_EPS


def _starts(query_lens_cpu) -> list[int]:
    out = [0]
    for n in query_lens_cpu:
        out.append(out[-1] + int(n))
    return out


class InvariantTorchLinearAttention(TorchLinearAttention):
    """TorchLinearAttention's contract, batch-invariant: every row by the one-token step alone."""

    name = "torch+bi"
    batch_invariant = True
    captures_graphs = False  # host lengths pick the rows of each call

    def capturable(self) -> "InvariantTorchLinearAttention":
        return self

    def pointwise(self, fn, *xs: torch.Tensor) -> torch.Tensor:
        return elementwise(fn, *xs)

    def _rows(self, query_lens_cpu, context_lens_cpu):
        """(row, sequence, context before the row) for every row of the step, in row order."""
        qsl = _starts(query_lens_cpu)
        return [(qsl[b] + i, b, context_lens_cpu[b] + i) for b in range(len(query_lens_cpu))
                for i in range(query_lens_cpu[b])]

    def causal_conv1d(self, x_TC, weight_CK, bias_C, conv_state_SCW, slots_B, query_lens_cpu, context_lens_cpu,
                      activation: str | None = "silu") -> torch.Tensor:
        y_TC = torch.empty_like(x_TC)
        for t, b, ctx in self._rows(query_lens_cpu, context_lens_cpu):
            y_TC[t:t + 1] = self._conv_step(x_TC[t:t + 1].clone(), weight_CK, bias_C, conv_state_SCW,
                                            slots_B[b:b + 1], [ctx], activation)
        return y_TC

    def gated_delta_rule(self, q_THK, k_THK, v_THV, g_TH, beta_TH, state_SHKV, slots_B, query_lens_cpu,
                         context_lens_cpu, scale: float, use_qk_l2norm: bool = True) -> torch.Tensor:
        o_THV = torch.empty(v_THV.shape, dtype=v_THV.dtype, device=v_THV.device)
        for t, b, ctx in self._rows(query_lens_cpu, context_lens_cpu):
            r = slice(t, t + 1)
            o_THV[r] = self._decode_rule(q_THK[r].clone(), k_THK[r].clone(), v_THV[r].clone(), g_TH[r].clone(),
                                         beta_TH[r].clone(), state_SHKV, slots_B[b:b + 1], [ctx], scale,
                                         use_qk_l2norm).to(o_THV.dtype)
        return o_THV

    def __repr__(self) -> str:
        return "InvariantTorchLinearAttention()"


class InvariantCpuCLinearAttention(CpuCLinearAttention):
    """CpuCLinearAttention's contract, batch-invariant: every row by the C one-token kernels in
    waves (module docstring); layers the kernels do not take run InvariantTorchLinearAttention's form."""

    name = "cpu_c+bi"
    batch_invariant = True

    def capturable(self) -> InvariantTorchLinearAttention:
        return InvariantTorchLinearAttention(self.device)

    pointwise = InvariantTorchLinearAttention.pointwise

    @staticmethod
    def _waves(query_lens_cpu, context_lens_cpu):
        """Per wave i: the rows (int64), sequences and contexts of row i of each sequence with one."""
        qsl = _starts(query_lens_cpu)
        for i in range(max(query_lens_cpu, default=0)):
            seqs = [b for b, n in enumerate(query_lens_cpu) if n > i]
            yield (torch.tensor([qsl[b] + i for b in seqs], dtype=torch.int64), torch.tensor(seqs, dtype=torch.int64),
                   [context_lens_cpu[b] + i for b in seqs])

    def causal_conv1d(self, x_TC, weight_CK, bias_C, conv_state_SCW, slots_B, query_lens_cpu, context_lens_cpu,
                      activation: str | None = "silu") -> torch.Tensor:
        if not (activation in ("silu", None) and cpu_ops.conv_step_fits(x_TC, weight_CK, bias_C, conv_state_SCW)):
            return InvariantTorchLinearAttention.causal_conv1d(self, x_TC, weight_CK, bias_C, conv_state_SCW, slots_B,
                                                               query_lens_cpu, context_lens_cpu, activation)
        y_TC = torch.empty_like(x_TC)
        for rows, seqs, ctx in self._waves(query_lens_cpu, context_lens_cpu):
            y_TC[rows] = cpu_ops.conv_step(x_TC.index_select(0, rows), weight_CK, bias_C, conv_state_SCW,
                                           slots_B.index_select(0, seqs), ctx, activation == "silu")
        return y_TC

    def gated_delta_rule(self, q_THK, k_THK, v_THV, g_TH, beta_TH, state_SHKV, slots_B, query_lens_cpu,
                         context_lens_cpu, scale: float, use_qk_l2norm: bool = True) -> torch.Tensor:
        if not cpu_ops.gated_delta_step_fits(q_THK.contiguous(), k_THK.contiguous(), v_THV.contiguous(), state_SHKV):
            return InvariantTorchLinearAttention.gated_delta_rule(self, q_THK, k_THK, v_THV, g_TH, beta_TH, state_SHKV,
                                                                  slots_B, query_lens_cpu, context_lens_cpu, scale,
                                                                  use_qk_l2norm)
        o_THV = torch.empty(v_THV.shape, dtype=v_THV.dtype, device=v_THV.device)
        for rows, seqs, ctx in self._waves(query_lens_cpu, context_lens_cpu):
            pick = (t.index_select(0, rows) for t in (q_THK, k_THK, v_THV, g_TH, beta_TH))
            o_THV[rows] = cpu_ops.gated_delta_step(*pick, state_SHKV, slots_B.index_select(0, seqs), ctx, scale,
                                                   use_qk_l2norm, L2NORM_EPS).to(o_THV.dtype)
        return o_THV

    def __repr__(self) -> str:
        return "InvariantCpuCLinearAttention()"
