"""Sampling for a whole batch at once, as tensor ops driven by per-row parameter tensors
(`SamplingMetadata`, gathered by the input batch): logit_bias, min_tokens, penalties, the grammar's
token bitmask on the rows with structured outputs (none at all when no row has one), then greedy
or temperature / top-k / top-p / min-p sampling with per-request seeds, and log-probabilities of
the model's own distribution (before any of those transforms).

No Python loop over rows touches a tensor, and the only device->host reads are the sampled ids
(and, when some row asked for them, one read of the logprob values).

Prompt logprobs (`prompt_logprobs`) take the hidden states of only the prompt positions whose
request asked for them, through the LM head in slices of bounded size, and return each next
prompt token's logprob, its rank and the top-n in one read.

Random rows draw by an exponential race: argmax(p / q) with q ~ Exp(1) i.i.d. per token draws a
token with probability p. Unseeded rows take q from the engine's generator; seeded rows from a
counter-based hash of (seed, output position, token id) (`seeded_random.py`), so they do not
depend on the rest of the batch. Greedy rows take the argmax of the processed logits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from moe_serve.logits_processors import process_logits
from moe_serve.sampling_metadata import SamplingMetadata
from moe_serve.structured_output.bitmask import apply_token_bitmask_
from moe_serve.seeded_random import seeded_exponential


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: (logprob of the chosen token, [(token id, logprob), ...] top-N) or None.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]
    # Prompt logprobs computed this step: request id -> the entries of its prompt tokens, in order
    # (protocol.TokenLogprob; filled by the model runner).
    prompt_logprobs: dict = field(default_factory=dict)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits_SV: torch.Tensor, md: SamplingMetadata) -> SampleResult:
        """Sample one token per row of logits_SV (float32 from the LM head)."""
        raw_SV = logits_SV.to(torch.float32)
        x_SV = process_logits(raw_SV, md)
        if md.grammar_bitmask_GW is not None:  # structured outputs: before temperature and top-k/p
            if x_SV is raw_SV and md.logprobs_cpu is not None:
                x_SV = x_SV.clone()  # logprobs are the model's: keep raw_SV unmasked
            apply_token_bitmask_(x_SV, md.grammar_bitmask_GW, md.grammar_rows_G)
        chosen_S = self.choose(x_SV, md)
        ids = chosen_S.tolist()  # the step's one device->host read
        lps = _logprobs(raw_SV, chosen_S, md.logprobs_cpu) if md.logprobs_cpu is not None else [None] * len(ids)
        return SampleResult(ids, lps)

    def choose(self, x_SV: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Token ids (S,) on the device from processed logits: greedy rows (temperature 0) take
        the argmax, the others sample."""
        if md.temperature_S is None:
            return torch.argmax(x_SV, dim=-1)
        greedy_S = torch.argmax(x_SV, dim=-1) if md.any_greedy_cpu else None
        temp_S = md.temperature_S
        is_greedy_S = temp_S == 0
        x_SV = x_SV / torch.where(is_greedy_S, torch.ones_like(temp_S), temp_S)[:, None]
        x_SV = _top_k_top_p(x_SV, md.top_k_S, md.top_p_S)
        if md.min_p_S is not None:
            probs_SV = torch.softmax(x_SV, dim=-1)
            keep_SV = probs_SV >= probs_SV.max(dim=-1, keepdim=True).values * md.min_p_S[:, None]
            x_SV = x_SV.masked_fill(~keep_SV, float("-inf"))
        probs_SV = torch.softmax(x_SV, dim=-1)
        # Exp(1) as -log(U): on the CPU three times faster than exponential_. U is in [0, 1), so q
        # is never 0 (U = 0 gives q = inf, which only loses that one token a 2**-24 chance).
        q_SV = torch.empty_like(probs_SV).uniform_(generator=self.generator).log_().neg_()
        if md.seeded_Q is not None:
            q_SV[md.seeded_Q] = seeded_exponential(md.seed_key_Q, md.out_pos_Q, x_SV.shape[1])
        sampled_S = torch.argmax(probs_SV / q_SV, dim=-1)
        return sampled_S if greedy_S is None else torch.where(is_greedy_S, greedy_S, sampled_S)


def _top_k_top_p(x_SV: torch.Tensor, top_k_S: torch.Tensor | None, top_p_S: torch.Tensor | None) -> torch.Tensor:
    """Mask to -inf what falls outside each row's top-k and then its top-p nucleus (V / 1.0 = off)."""
    if top_k_S is None and top_p_S is None:
        return x_SV
    S, V = x_SV.shape
    sorted_SV, order_SV = torch.sort(x_SV, dim=-1, descending=True)
    if top_k_S is not None:
        rank_V = torch.arange(V, device=x_SV.device)
        sorted_SV = sorted_SV.masked_fill(rank_V[None, :] >= top_k_S[:, None], float("-inf"))
    if top_p_S is not None:
        probs_SV = torch.softmax(sorted_SV, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        before_SV = torch.cumsum(probs_SV, dim=-1) - probs_SV
        drop_SV = before_SV >= top_p_S[:, None]
        drop_SV[:, 0] = False
        sorted_SV = sorted_SV.masked_fill(drop_SV, float("-inf"))
    return torch.full_like(x_SV, float("-inf")).scatter(1, order_SV, sorted_SV)


def _logprobs(raw_SV: torch.Tensor, chosen_S: torch.Tensor, want: list[int]) -> list:
    """Per row: (chosen token's logprob, top-N (id, logprob)) of the raw distribution, or None
    where the row asked for none (-1). One device->host read."""
    lp_SV = torch.log_softmax(raw_SV, dim=-1)
    n_top = max(want)
    cols = [lp_SV.gather(1, chosen_S[:, None])]
    if n_top > 0:
        top_v, top_i = torch.topk(lp_SV, n_top, dim=-1)
        cols += [top_v, top_i.to(lp_SV.dtype)]  # ids are exact in float32 below 2**24
    host = torch.cat(cols, dim=1).tolist()
    out: list = []
    for row, n in zip(host, want):
        if n < 0:
            out.append(None)
            continue
        ids = row[1 + n_top:1 + n_top + n]
        out.append((row[0], [(int(i), v) for i, v in zip(ids, row[1:1 + n])]))
    return out


# The most float32 logits one slice of prompt rows materializes (256 MiB): a long prompt's chunk
# at a large vocabulary would otherwise make a (tokens x vocab) tensor of gigabytes.
PROMPT_LOGITS_BYTES = 1 << 28


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], h_PD: torch.Tensor,
                    targets_P: torch.Tensor, n_top: int, vocab_size: int,
                    max_bytes: int = PROMPT_LOGITS_BYTES) -> list[list[float]]:
    """Per prompt row: [logprob of its next prompt token, that token's rank (1 = the most likely;
    1 + the tokens strictly more likely), top n_top logprobs..., their token ids...] of the raw
    distribution, log_softmax in float32. h_PD: the hidden states of the rows (P, D); targets_P:
    the token that follows each (int64). The LM head runs on slices of rows whose float32 logits
    fit in max_bytes; one device->host read at the end."""
    step = max(1, max_bytes // (4 * vocab_size))
    parts = []
    for i in range(0, h_PD.shape[0], step):
        lp_MV = torch.log_softmax(compute_logits(h_PD[i:i + step]).to(torch.float32), dim=-1)
        tgt_M1 = lp_MV.gather(1, targets_P[i:i + step, None])
        cols = [tgt_M1, (lp_MV > tgt_M1).sum(dim=1, keepdim=True).to(torch.float32) + 1]
        if n_top > 0:
            top_v, top_i = torch.topk(lp_MV, min(n_top, lp_MV.shape[-1]), dim=-1)
            cols += [top_v, top_i.to(torch.float32)]  # ids and ranks are exact in float32 below 2**24
        parts.append(torch.cat(cols, dim=1))
    return torch.cat(parts).tolist() if parts else []
