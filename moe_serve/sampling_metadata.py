"""Per-request sampling parameters as rows of preallocated host tensors, and one step's
`SamplingMetadata` gathered from them.

Shape legend: R rows of the persistent batch (max_num_seqs), S rows sampled this step, K the widest
per-row token list (logit_bias entries, min_tokens stop ids), V vocabulary, P penalized rows,
Q seeded rows, L longest token row among the penalized rows.

A row's parameters are written once, when its request is added. Counters of how many rows use each
feature (random sampling, seeds, top-k, top-p, min-p, penalties, bias, min_tokens, logprobs) are
kept as rows come and go, so a step whose batch has no row with a feature skips it without looking
at any request; the sampler then gets None for that part.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields

import torch

from moe_serve.request import Request
from moe_serve.seeded_random import seed_key


@dataclass
class SamplingMetadata:
    """One step's sampling inputs, row i = the i-th sampled request. None: no row needs that part."""

    temperature_S: torch.Tensor | None = None  # float32; None when no row samples at random
    top_k_S: torch.Tensor | None = None  # int64, V where a row has no cut
    top_p_S: torch.Tensor | None = None  # float32, 1 where a row has no cut
    min_p_S: torch.Tensor | None = None  # float32, 0 where a row has no cut
    seeded_Q: torch.Tensor | None = None  # int64 indices (into S) of the random rows that have a seed
    seed_key_Q: torch.Tensor | None = None  # int32: the seed, mixed (`seeded_random.seed_key`)
    out_pos_Q: torch.Tensor | None = None  # int64: index of the output token being sampled
    penalized_P: torch.Tensor | None = None  # int64 indices (into S) of rows with any penalty
    tokens_PL: torch.Tensor | None = None  # int64: those rows' prompt + output tokens, padded past num_tokens
    prompt_lens_P: torch.Tensor | None = None  # int64
    num_tokens_P: torch.Tensor | None = None  # int64
    frequency_P: torch.Tensor | None = None  # float32
    presence_P: torch.Tensor | None = None  # float32
    repetition_P: torch.Tensor | None = None  # float32
    bias_index_N: torch.Tensor | None = None  # int64 flat index row * V + token of each logit_bias entry
    bias_value_N: torch.Tensor | None = None  # float32
    banned_index_M: torch.Tensor | None = None  # int64 flat index of EOS / stop ids masked by min_tokens
    logprobs_cpu: list[int] | None = None  # host: top-N logprobs per row (-1: none); None: no row
    # Structured outputs: (index into S, GrammarState[, draft tokens before the row]) of each
    # constrained row; None: no row. The runner fills their bitmasks (structured_output/bitmask.py)
    # into the two device tensors below.
    grammar_cpu: list[tuple[int, object]] | None = None
    grammar_rows_G: torch.Tensor | None = None  # int64 indices (into S) of the constrained rows
    grammar_bitmask_GW: torch.Tensor | None = None  # int32 bit j of word w: token 32 w + j allowed
    any_greedy_cpu: bool = True  # host: some row has temperature 0 (else its argmax is not needed)

    def tensor_fields(self) -> list[str]:
        """The names of the tensors this step has (the fields that are not None), to move in one copy."""
        return [name for name in _TENSOR_FIELDS if getattr(self, name) is not None]


_TENSOR_FIELDS = tuple(f.name for f in fields(SamplingMetadata)
                       if not f.name.endswith("_cpu") and not f.name.startswith("grammar_"))


class SamplingRows:
    """Sampling parameters of the persistent batch's rows (host memory)."""

    def __init__(self, max_rows: int, vocab_size: int, num_tokens_R: torch.Tensor,
                 num_prompt_R: torch.Tensor, token_ids_RL: torch.Tensor):
        R, self.V = max_rows, vocab_size
        # Views of the input batch's token rows: penalties read them, min_tokens reads the counts.
        self.num_tokens_R, self.num_prompt_R, self.token_ids_RL = num_tokens_R, num_prompt_R, token_ids_RL
        f32 = dict(dtype=torch.float32)
        self.temperature_R = torch.zeros(R, **f32)
        self.top_k_R = torch.full((R,), vocab_size, dtype=torch.int64)
        self.top_p_R = torch.ones(R, **f32)
        self.min_p_R = torch.zeros(R, **f32)
        self.frequency_R = torch.zeros(R, **f32)
        self.presence_R = torch.zeros(R, **f32)
        self.repetition_R = torch.ones(R, **f32)
        self.min_tokens_R = torch.zeros(R, dtype=torch.int64)
        self.seed_key_R = torch.zeros(R, dtype=torch.int32)
        self.logprobs_R = torch.full((R,), -1, dtype=torch.int64)
        self.flags = {name: torch.zeros(R, dtype=torch.bool) for name in ("seeded", "penalty")}
        # Padded per-row token lists (-1 = empty slot), widened when a request needs more room.
        self.bias_ids_RK = torch.full((R, 0), -1, dtype=torch.int64)
        self.bias_values_RK = torch.zeros((R, 0), **f32)
        self.stop_ids_RK = torch.full((R, 0), -1, dtype=torch.int64)
        self.count: Counter[str] = Counter()
        self._features: list[tuple[str, ...]] = [()] * R
        self._grammar_R: list[object | None] = [None] * R  # each row's GrammarState, if constrained

    # --- rows -----------------------------------------------------------------------------------
    def add(self, row: int, req: Request) -> None:
        """Write req's parameters into `row` (a free row: neutral values everywhere)."""
        p, V = req.params, self.V
        random = p.temperature > 0
        feats = {"random": random, "seeded": random and p.seed is not None,
                 "top_k": random and 0 < p.top_k < V, "top_p": random and p.top_p < 1.0,
                 "min_p": random and p.min_p > 0.0, "penalty": p.has_penalties,
                 "bias": bool(p.logit_bias), "logprobs": p.logprobs is not None,
                 "grammar": req.grammar is not None}
        self._grammar_R[row] = req.grammar
        self.temperature_R[row] = p.temperature
        if feats["top_k"]:
            self.top_k_R[row] = p.top_k
        if feats["top_p"]:
            self.top_p_R[row] = p.top_p
        if feats["min_p"]:
            self.min_p_R[row] = p.min_p
        if feats["seeded"]:
            self.seed_key_R[row] = seed_key(p.seed)
        if feats["penalty"]:
            self.frequency_R[row] = p.frequency_penalty
            self.presence_R[row] = p.presence_penalty
            self.repetition_R[row] = p.repetition_penalty
        if feats["bias"]:
            items = [(t, b) for t, b in p.logit_bias.items() if t < V]  # ids were validated upstream
            self.bias_ids_RK, self.bias_values_RK = _widen(self.bias_ids_RK, len(items), -1), \
                _widen(self.bias_values_RK, len(items), 0.0)
            self.bias_ids_RK[row, :len(items)] = torch.tensor([t for t, _ in items], dtype=torch.int64)
            self.bias_values_RK[row, :len(items)] = torch.tensor([b for _, b in items], dtype=torch.float32)
        # min_tokens masks what would end the request early: EOS (unless ignored) and stop ids.
        stops = sorted({t for t in p.stop_token_ids if t < V} |
                       (set() if p.ignore_eos else {t for t in req.eos_token_ids if t < V}))
        feats["min_tokens"] = p.min_tokens > 0 and bool(stops)
        if feats["min_tokens"]:
            self.min_tokens_R[row] = p.min_tokens
            self.stop_ids_RK = _widen(self.stop_ids_RK, len(stops), -1)
            self.stop_ids_RK[row, :len(stops)] = torch.tensor(stops, dtype=torch.int64)
        if feats["logprobs"]:
            self.logprobs_R[row] = p.logprobs
        for name, flag in self.flags.items():
            flag[row] = feats[name]
        self._features[row] = tuple(k for k, on in feats.items() if on)
        self.count.update(self._features[row])

    def remove(self, row: int) -> None:
        """Reset `row` to neutral values (what `add` assumes of a free row)."""
        self.count.subtract(self._features[row])
        self._features[row] = ()
        self._grammar_R[row] = None
        self.top_k_R[row] = self.V
        self.top_p_R[row] = 1.0
        self.repetition_R[row] = 1.0
        for t in (self.temperature_R, self.min_p_R, self.frequency_R, self.presence_R, self.min_tokens_R):
            t[row] = 0
        self.logprobs_R[row] = -1
        for flag in self.flags.values():
            flag[row] = False
        self.bias_ids_RK[row] = -1
        self.bias_values_RK[row] = 0.0
        self.stop_ids_RK[row] = -1

    # --- one step -------------------------------------------------------------------------------
    def build(self, rows: list[int], offsets: list[int] | None = None) -> SamplingMetadata:
        """Gather the sampled rows' parameters (host tensors; the caller moves them in one copy).
        offsets: per sampled row, how many tokens past the row's known ones it samples at (draft
        tokens, which the input batch wrote after them): its output position, min_tokens and
        penalties count those as outputs."""
        V, c = self.V, self.count
        md = SamplingMetadata()
        if not any(c[k] > 0 for k in _ANY_ROW):  # greedy rows with no extra: nothing to gather (on a
            return md  # CPU decode step, each tiny op here costs tens of us on caches gone cold)
        idx_S = torch.tensor(rows, dtype=torch.int64)
        off_S = torch.tensor(offsets, dtype=torch.int64) if offsets is not None else torch.zeros(len(rows), dtype=torch.int64)
        if c["seeded"] > 0 or c["min_tokens"] > 0:
            out_len_S = (self.num_tokens_R - self.num_prompt_R)[idx_S] + off_S  # output tokens before each row's
        temperature_S = self.temperature_R[idx_S] if c["random"] > 0 else None
        # Host tensors, so these checks cost no sync: a random row that is mid-prefill this step
        # does not make the others pay for sampling.
        if temperature_S is not None and bool((temperature_S > 0).any()):
            md.temperature_S = temperature_S
            md.any_greedy_cpu = bool((temperature_S == 0).any())
            md.top_k_S = self.top_k_R[idx_S] if c["top_k"] > 0 else None
            md.top_p_S = self.top_p_R[idx_S] if c["top_p"] > 0 else None
            md.min_p_S = self.min_p_R[idx_S] if c["min_p"] > 0 else None
            if c["seeded"] > 0:
                q = self.flags["seeded"][idx_S].nonzero().squeeze(1)
                if q.numel():
                    md.seeded_Q, md.seed_key_Q = q, self.seed_key_R[idx_S[q]]
                    md.out_pos_Q = out_len_S[q]
        if c["penalty"] > 0:
            p = self.flags["penalty"][idx_S].nonzero().squeeze(1)
            if p.numel():
                rows_P = idx_S[p]
                md.penalized_P, md.num_tokens_P = p, self.num_tokens_R[rows_P] + off_S[p]
                md.tokens_PL = self.token_ids_RL[rows_P, :int(md.num_tokens_P.max())].long()
                md.prompt_lens_P = self.num_prompt_R[rows_P]
                md.frequency_P, md.presence_P = self.frequency_R[rows_P], self.presence_R[rows_P]
                md.repetition_P = self.repetition_R[rows_P]
        if c["bias"] > 0:
            md.bias_index_N, md.bias_value_N = _flat(self.bias_ids_RK[idx_S], V, self.bias_values_RK[idx_S])
        if c["min_tokens"] > 0:
            ids_SK = self.stop_ids_RK[idx_S]
            early_S = out_len_S < self.min_tokens_R[idx_S]
            md.banned_index_M, _ = _flat(ids_SK.masked_fill(~early_S[:, None], -1), V)
        if c["logprobs"] > 0:
            md.logprobs_cpu = self.logprobs_R[idx_S].tolist()
        if c["grammar"] > 0:
            g = self._grammar_R
            known = self.num_tokens_R
            md.grammar_cpu = [(i, g[r]) if not offsets or not offsets[i] else
                              (i, g[r], self.token_ids_RL[r, int(known[r]):int(known[r]) + offsets[i]].tolist())
                              for i, r in enumerate(rows) if g[r] is not None] or None
        return md


# The features that put anything in a step's SamplingMetadata (SamplingRows.add's names).
_ANY_ROW = ("random", "penalty", "bias", "min_tokens", "logprobs", "grammar")


def _widen(t_RK: torch.Tensor, k: int, fill) -> torch.Tensor:
    """t with at least k columns (new columns filled with `fill`); rare, so a plain reallocation."""
    if t_RK.shape[1] >= k:
        return t_RK
    wider = torch.full((t_RK.shape[0], k), fill, dtype=t_RK.dtype)
    wider[:, :t_RK.shape[1]] = t_RK
    return wider


def _flat(ids_SK: torch.Tensor, V: int, values_SK: torch.Tensor | None = None):
    """(flat index row * V + id, value) of the non-empty (id >= 0) entries; (None, None) if none."""
    keep = ids_SK >= 0
    if not bool(keep.any()):
        return None, None
    rows_SK = torch.arange(ids_SK.shape[0], dtype=torch.int64)[:, None].expand_as(ids_SK)
    flat = (rows_SK * V + ids_SK)[keep]
    return flat, (values_SK[keep] if values_SK is not None else None)
