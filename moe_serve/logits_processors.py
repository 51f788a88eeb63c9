"""Per-request logit adjustments as batched tensor ops: logit_bias, min_tokens bans, and the
repetition / frequency / presence penalties. Each is skipped entirely when no sampled row needs it
(its `SamplingMetadata` part is None).

Order (vLLM's): bias and min_tokens bans first, then penalties, then (in the sampler) temperature.
Shapes: S sampled rows, V vocabulary, P penalized rows, L their longest token row.
"""
from __future__ import annotations

import torch

from moe_serve.sampling_metadata import SamplingMetadata


def needs_processing(md: SamplingMetadata) -> bool:
    return md.bias_index_N is not None or md.banned_index_M is not None or md.penalized_P is not None


def process_logits(logits_SV: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The logits after bias, bans and penalties (a new float32 tensor when anything applies)."""
    if not needs_processing(md):
        return logits_SV
    x_SV = logits_SV.to(torch.float32, copy=True)
    flat = x_SV.view(-1)
    if md.bias_index_N is not None:
        flat.index_add_(0, md.bias_index_N, md.bias_value_N)
    if md.banned_index_M is not None:  # EOS / stop ids of rows that have not reached min_tokens
        flat.index_fill_(0, md.banned_index_M, float("-inf"))
    if md.penalized_P is not None:
        x_SV[md.penalized_P] = apply_penalties(
            x_SV[md.penalized_P], md.tokens_PL, md.prompt_lens_P, md.num_tokens_P,
            md.frequency_P, md.presence_P, md.repetition_P)
    return x_SV


def apply_penalties(x_PV: torch.Tensor, tokens_PL: torch.Tensor, prompt_lens_P: torch.Tensor,
                    num_tokens_P: torch.Tensor, frequency_P: torch.Tensor, presence_P: torch.Tensor,
                    repetition_P: torch.Tensor) -> torch.Tensor:
    """Penalized logits of P rows.

    tokens_PL holds each row's prompt then output tokens; entries at or past num_tokens_P are
    padding. Repetition (HF/vLLM): a token seen in the prompt or output has a positive logit divided
    by the penalty, a negative one multiplied. Frequency and presence (OpenAI): subtract
    frequency * count + presence * (count > 0), counting output tokens only.
    """
    P, V = x_PV.shape
    pos_L = torch.arange(tokens_PL.shape[1], device=x_PV.device)
    seen_PL = pos_L[None, :] < num_tokens_P[:, None]
    output_PL = seen_PL & (pos_L[None, :] >= prompt_lens_P[:, None])
    # Padding and prompt tokens go to an extra column V that is dropped afterwards.
    spill = torch.full_like(tokens_PL, V)
    counts_PV = torch.zeros((P, V + 1), dtype=x_PV.dtype, device=x_PV.device).scatter_add_(
        1, torch.where(output_PL, tokens_PL, spill), torch.ones_like(tokens_PL, dtype=x_PV.dtype))[:, :V]
    seen_PV = torch.zeros((P, V + 1), dtype=torch.bool, device=x_PV.device).scatter_(
        1, torch.where(seen_PL, tokens_PL, spill), True)[:, :V]
    rep = repetition_P[:, None]
    x_PV = torch.where(seen_PV, torch.where(x_PV > 0, x_PV / rep, x_PV * rep), x_PV)
    return x_PV - frequency_P[:, None] * counts_PV - presence_P[:, None] * (counts_PV > 0).to(x_PV.dtype)
