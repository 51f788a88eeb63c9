"""Sampling for a whole batch at once: greedy, temperature, top-k, top-p, min-p, per-request seeds,
and log-probabilities (of the model's own distribution, before any sampling transform)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_serve.request import Request


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: (logprob of the chosen token, [(token id, logprob), ...] top-N) or None.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits_BV: torch.Tensor, requests: list[Request]) -> SampleResult:
        B, V = logits_BV.shape
        logits_BV = logits_BV.to(torch.float32)
        want_lp = [r.params.logprobs is not None for r in requests]
        logprobs_BV = torch.log_softmax(logits_BV, dim=-1) if any(want_lp) else None

        temps = torch.tensor([r.params.temperature for r in requests], dtype=torch.float32, device=logits_BV.device)
        greedy = temps == 0
        chosen = torch.argmax(logits_BV, dim=-1)
        if not bool(greedy.all()):
            x = logits_BV / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
            x = self._apply_top_k_top_p_min_p(x, requests)
            probs = torch.softmax(x, dim=-1)
            # Exponential race: argmax(p / q), q ~ Exp(1), draws from p; each row uses its own
            # generator when seeded so its stream does not depend on its neighbours.
            q = torch.empty_like(probs)
            for i, r in enumerate(requests):
                if greedy[i]:
                    q[i].fill_(1.0)
                elif r.params.seed is not None:
                    if r.generator is None:
                        r.generator = torch.Generator(device=logits_BV.device).manual_seed(r.params.seed)
                    q[i].exponential_(generator=r.generator)
                else:
                    q[i].exponential_(generator=self.generator)
            sampled = torch.argmax(probs / q, dim=-1)
            chosen = torch.where(greedy, chosen, sampled)
        ids = chosen.tolist()
        lps: list = [None] * B
        if logprobs_BV is not None:
            n_top = max((r.params.logprobs or 0) for r in requests)
            chosen_lp = logprobs_BV.gather(1, chosen[:, None]).squeeze(1).tolist()
            top_v, top_i = (torch.topk(logprobs_BV, n_top, dim=-1) if n_top else (None, None))
            for i, r in enumerate(requests):
                if not want_lp[i]:
                    continue
                n = r.params.logprobs
                top = list(zip(top_i[i, :n].tolist(), top_v[i, :n].tolist())) if n else []
                lps[i] = (chosen_lp[i], top)
        return SampleResult(ids, lps)

    @staticmethod
    def _apply_top_k_top_p_min_p(x_BV: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        B, V = x_BV.shape
        dev = x_BV.device
        top_k = torch.tensor([r.params.top_k if r.params.top_k and r.params.top_k > 0 else V for r in requests],
                             device=dev).clamp(max=V)
        top_p = torch.tensor([r.params.top_p for r in requests], dtype=torch.float32, device=dev)
        min_p = torch.tensor([r.params.min_p for r in requests], dtype=torch.float32, device=dev)
        if bool((top_k < V).any()) or bool((top_p < 1).any()):
            sorted_x, order = torch.sort(x_BV, dim=-1, descending=True)
            rank = torch.arange(V, device=dev)[None, :]
            drop = rank >= top_k[:, None]
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            probs = torch.softmax(sorted_x, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            before = torch.cumsum(probs, dim=-1) - probs
            drop = before >= top_p[:, None]
            drop[:, 0] = False
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            x_BV = torch.full_like(x_BV, float("-inf")).scatter(1, order, sorted_x)
        if bool((min_p > 0).any()):
            probs = torch.softmax(x_BV, dim=-1)
            thresh = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            x_BV = x_BV.masked_fill(probs < thresh, float("-inf"))
        return x_BV
