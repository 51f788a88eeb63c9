"""Multi-token prediction (MTP) drafts: the checkpoint's own next-token layer, as DeepSeek-V3 and
GLM-4.5 ship it after their last decoder layer (`model.layers.{num_hidden_layers}.*` on the Hub;
DeepSeek-V4's `mtp.0.*` differs in its input projections and hyper-connections:
models/deepseek_v4.py V4MTPLayer, which this module runs the same way):

    x_p  = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)])      h_p: the target's final (normed)
    g_p  = block(x_p)   (a full decoder layer: MLA + MoE)           hidden state at position p
    logits_p = shared_head.head(shared_head.norm(g_p))  -> a draft for t_{p+2}

The block's attention has a paged cache of its own (one more layer in the target's cache group,
same block tables). How a step drafts (`MtpDrafter.propose`):

1. Over every token the target just computed (same positions, slots and metadata), the layer runs
   with the token that follows each position: the next prompt token, or at a sampled position the
   token sampled there. This fills the layer's cache exactly where the target's cache was filled,
   and the row of each request's last accepted token gives its first draft (argmax).
2. K - 1 more passes, one token per drafting request, each on the previous pass's draft and hidden
   state at the next position (the layer runs again: checkpoints carry one MTP layer). These write
   the layer's cache past the accepted tokens, in slots the scheduler reserved ahead
   (`lookahead_tokens`); the next step's pass 1 rewrites them with the verified tokens before any
   read, which is also how rejected drafts roll back here.

`MtpProposer` is this method's `Proposer` (spec_decode/base.py): it takes the step's hidden states
and inputs the model runner kept (`ModelRunner.take_last_step`) and runs the drafter over them.

Drafts are the argmax, one token per position, so verification by sampling and comparing
(spec_decode.accept) keeps greedy output identical and sampled output exactly distributed. With
expert parallelism every rank runs pass 1 and K - 1 further passes in every step (empty ones where
it has nothing to draft): the MoE block's collectives stay in lockstep.

As in vLLM, the layer's input embedding is zeroed at position 0. Prefix-cache hits reuse this
layer's cache entries with the target's: the entry of a block's last position was written with the
token that followed it then, so after a hit on a different continuation the first drafts can be
worse (never the output).
"""
from __future__ import annotations

import torch
from torch import nn

from attention.metadata import AttentionMetadata
from expert_parallel.runtime.layer import run_to_end
from expert_parallel.runtime.step import NO_STEP, MoEStep
from moe_serve.layers.embedding import LMHead
from moe_serve.layers.linear import Linear
from moe_serve.layers.norm import RMSNorm
from moe_serve.spec_decode.base import Proposer, StepView, decodes_next


def one_mtp_layer(hf: dict) -> int:
    """The checkpoint's count of multi-token-prediction layers, which must be one (as on every
    released checkpoint that has them); a ValueError naming the field otherwise."""
    n = int(hf.get("num_nextn_predict_layers") or 0)
    if n != 1:
        raise ValueError(f"speculative_config.method='mtp' needs a checkpoint with one multi-token-prediction "
                         f"layer; {(hf.get('architectures') or ['this model'])[0]} has num_nextn_predict_layers={n}"
                         + ("" if n else " (use method 'ngram')"))
    return n


def place_mtp_experts(moe, num_experts: int, moe_index: int) -> None:
    """A placement tuned for the model's own MoE layers has none for the MTP layer's (the
    moe_index-th): it gets the default one."""
    if moe.physical_to_logical is not None and len(moe.physical_to_logical) == moe_index:
        from expert_parallel.runtime.layer import default_physical_to_logical

        moe.physical_to_logical.append(default_physical_to_logical(num_experts, moe.dispatcher.num_slots))


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, eps: float, dtype):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps, dtype)
        self.head = LMHead(vocab_size, hidden_size, dtype)


class MTPLayer(nn.Module):
    """One multi-token-prediction layer, with the Hub's module names (enorm, hnorm, eh_proj,
    shared_head) and its decoder layer as `block`."""

    def __init__(self, hidden_size: int, vocab_size: int, eps: float, block: nn.Module, dtype):
        super().__init__()
        self.enorm = RMSNorm(hidden_size, eps, dtype)
        self.hnorm = RMSNorm(hidden_size, eps, dtype)
        self.eh_proj = Linear(2 * hidden_size, hidden_size, dtype=dtype)
        self.block = block
        self.shared_head = SharedHead(hidden_size, vocab_size, eps, dtype)

    def forward(self, embed: nn.Module, rotary, ids_T: torch.Tensor, positions_T: torch.Tensor,
                prev_h_TD: torch.Tensor, meta: AttentionMetadata, step: MoEStep = NO_STEP) -> torch.Tensor:
        """g (T, D): the block's output for tokens ids_T at positions_T given the hidden states
        before them (the target's, or this layer's own on a chained pass)."""
        e = embed(ids_T)
        e = e.masked_fill((positions_T == 0)[:, None], 0)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(prev_h_TD)], dim=-1))
        return run_to_end(self.block.stages(x, positions_T, meta, step, rotary.cos_sin(positions_T)))

    def draft_ids(self, g_BD: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(g_BD)).argmax(dim=-1)


class MtpDrafter:
    """Runs a model's MTP layer after each step (see the module docstring). `model.mtp` holds the
    layer; `batch` is the runner's InputBatch, whose rows hold the block tables."""

    def __init__(self, model: nn.Module, batch, k: int, moe_ctx):
        self.model, self.batch, self.k, self.moe_ctx = model, batch, k, moe_ctx
        self.world_size = moe_ctx.dispatcher.world_size
        self.layer: MTPLayer = model.mtp[0]

    def _run(self, ids, pos, prev_h, meta, step=NO_STEP):
        # rotary: the stack's shared RoPE (None where the layer keeps its own, as DeepSeek-V4's does)
        stack = self.model.model
        return self.layer(stack.embed_tokens, getattr(stack, "rotary", None), ids, pos, prev_h, meta, step)

    @torch.inference_mode()
    def propose(self, *args) -> dict[int, list[int]]:
        # The decode speed-of-light meter marks the experts of the one-token decode step only.
        hits, self.moe_ctx.experts_hit_LS = self.moe_ctx.experts_hit_LS, None
        try:
            return self._propose(*args)
        finally:
            self.moe_ctx.experts_hit_LS = hits

    def _propose(self, h_TD: torch.Tensor, step_inputs, moe_step: MoEStep, next_ids_T: torch.Tensor,
                draft_rows: list[tuple[int, int, int]]) -> dict[int, list[int]]:
        """h_TD: the target's hidden states of the step (packed, padded rows included); step_inputs:
        its StepInputs; next_ids_T (host, len = real tokens): the token after each position;
        draft_rows: (batch row, index into the packed tokens of the last accepted token, its
        position) for each request that decodes next. Returns {batch row: drafts}."""
        dev = h_TD.device
        T_all = h_TD.shape[0]
        ids = torch.zeros(T_all, dtype=torch.int64)
        ids[:next_ids_T.shape[0]] = next_ids_T
        ids = ids.to(dev, non_blocking=True)
        outs, off = [], 0
        mb_step = moe_step if len(step_inputs.batches) == 1 else None
        for i, (_, pos, meta) in enumerate(step_inputs.batches):
            n = pos.shape[0]
            s = mb_step if mb_step is not None else MoEStep(moe_step.max_tokens_any_rank, None, None, False)
            outs.append(self._run(ids[off:off + n], pos, h_TD[off:off + n], meta, s))
            off += n
        g = outs[0] if len(outs) == 1 else torch.cat(outs)
        if not draft_rows and self.world_size == 1:
            return {}
        idx = torch.tensor([r[1] for r in draft_rows], dtype=torch.int64).to(dev)
        g_B = g.index_select(0, idx)
        drafts = [self.layer.draft_ids(g_B)] if draft_rows else []
        rows = [r[0] for r in draft_rows]
        pos_B = [r[2] for r in draft_rows]
        live = list(range(len(rows)))  # which of draft_rows still draft, in the current pass
        for j in range(1, self.k):
            # This pass writes position pos + j: only where the request holds a slot for it.
            keep = [b for b in live if self.batch.can_write(rows[b], pos_B[b] + j)]
            if not keep and self.world_size == 1:
                break
            sel = [live.index(b) for b in keep]
            ids_B = drafts[-1][sel] if keep else torch.zeros(0, dtype=torch.int64, device=dev)
            prev = g_B[sel] if keep else g_B[:0]
            pos_dev, meta = self.batch.one_token_batch([(rows[b], pos_B[b] + j) for b in keep])
            g_B = self._run(ids_B, pos_dev, prev, meta)
            if not keep:
                live = []
                continue
            drafts.append(self.layer.draft_ids(g_B))
            live = keep
        # One read back: every pass's drafts.
        host = [d.tolist() for d in drafts]
        result: dict[int, list[int]] = {r: [] for r in rows}
        alive = list(range(len(rows)))
        for j, d in enumerate(host):
            if j > 0:
                alive = [b for b in alive if self.batch.can_write(rows[b], pos_B[b] + j)]
            for b, tok in zip(alive, d):
                result[rows[b]].append(int(tok))
        return result


class MtpProposer(Proposer):
    """MTP drafts after every step, empty or not: under expert parallelism every rank runs the
    drafter's passes each step (its MoE block is collective). Asks the runner to keep each step's
    hidden states and inputs, which the passes read."""

    def __init__(self, runner, k: int):
        self.runner, self.batch = runner, runner.batch
        self.drafter = MtpDrafter(runner.model, runner.batch, k, runner.moe_ctx)
        self.lookahead_tokens = k - 1  # the chained passes write up to K - 1 positions past a piece
        runner.keep_last_step = True

    def propose(self, view: StepView):
        rows, reqs = [], []
        for s in view.out.scheduled:
            r = s.request
            j = view.last_accepted.get(r.request_id)
            if j is None or r.is_finished or not decodes_next(r):
                continue
            row = self.batch.row_of[r.request_id]
            rows.append((row, self.batch.last_logits_idx[j], r.num_computed_tokens - 1))
            reqs.append((r, row))
        drafts = self._run(rows, view.result.token_ids)
        return [(r, drafts.get(row, [])) for r, row in reqs]

    def propose_empty(self) -> None:
        self._run([], [])

    def _run(self, draft_rows: list[tuple[int, int, int]], sampled: list[int]) -> dict[int, list[int]]:
        """draft_rows: (batch row, packed index of the last accepted token, its position) per
        request that decodes next; sampled: the step's sampled tokens in sampling-row order.
        Returns {batch row: drafts}."""
        h, step, moe, pieces = self.runner.take_last_step()
        return self.drafter.propose(h, step, moe, self.batch.next_token_ids(pieces, sampled), draft_rows)
