"""Token bitmasks of the constrained rows of a step: filled on the host by each row's matcher,
applied on the device to exactly those rows of the logits.

Bit j of word w in a row is token 32 * w + j: 1 allowed, 0 forbidden (xgrammar's layout, int32
words). Shapes: S sampled rows, G constrained rows among them, W = ceil(V / 32), V logits width.
"""
from __future__ import annotations

import torch


# From this many constrained rows on, the masks are filled by xgrammar's batch matcher (its own
# threads); below, one call per row costs less than handing the rows to threads.
BATCH_FILL_ROWS = 16


class BitmaskFiller:
    """A reusable host bitmask of up to max_rows rows, filled for the step's constrained rows."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        self.V, self.device = vocab_size, torch.device(device)
        self.W = -(-vocab_size // 32)
        self._host = torch.zeros((max_rows, self.W), dtype=torch.int32,
                                 pin_memory=self.device.type == "cuda")
        self._batch = None

    def fill(self, rows: list[tuple[int, object]]) -> tuple[torch.Tensor, torch.Tensor]:
        """rows: (index into S, GrammarState) of each constrained row, or (index, GrammarState, draft
        tokens) for a row that samples past draft tokens (the mask of the grammar after them).
        Returns (rows_G int64, bitmask_GW int32) on the device."""
        G = len(rows)
        host = self._host[:G]
        if any(len(r) > 2 for r in rows):  # speculative decoding: rows past draft tokens
            for g, (_, state, *ahead) in enumerate(rows):
                ahead = ahead[0] if ahead else []
                for t in ahead:  # the drafts before this row's position, allowed when proposed
                    state.matcher.accept_token(t)
                state.matcher.fill_next_token_bitmask(host, g)
                if ahead:
                    state.matcher.rollback(len(ahead))
        elif G >= BATCH_FILL_ROWS:
            if self._batch is None:
                import xgrammar as xgr

                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask([st.matcher for _, st in rows], host)
        else:
            for g, (_, state) in enumerate(rows):
                state.matcher.fill_next_token_bitmask(host, g)
        idx = torch.tensor([r[0] for r in rows], dtype=torch.int64)
        if self.device.type == "cpu":
            return idx, host.clone()
        # The host buffer is rewritten next step; the sampler's read of the sampled ids (after the
        # mask is applied) orders that after this copy.
        return idx.to(self.device, non_blocking=True), host.to(self.device, non_blocking=True)


def apply_token_bitmask_(x_SV: torch.Tensor, bitmask_GW: torch.Tensor, rows_G: torch.Tensor) -> None:
    """In place: -inf in row rows_G[g] of x_SV wherever bitmask_GW[g] forbids a token (ids past the
    mask's width too); the other rows are not touched."""
    sub_GV = x_SV.index_select(0, rows_G)
    mask_rows_(sub_GV, bitmask_GW)
    x_SV.index_put_((rows_G,), sub_GV)


def mask_rows_(x_GV: torch.Tensor, bitmask_GW: torch.Tensor, kernel: str | None = None) -> None:
    """In place: -inf in x_GV[g] wherever bitmask_GW[g] forbids a token. kernel "xgrammar" (its CPU
    kernel, the default on CPUs, about 3x faster there than the tensor ops) or "torch" (tensor ops
    on any device: no JIT compile on an accelerator)."""
    G, W = bitmask_GW.shape
    V = x_GV.shape[1]
    if kernel is None:
        kernel = "xgrammar" if x_GV.device.type == "cpu" and x_GV.dtype == torch.float32 else "torch"
    if kernel == "xgrammar":
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(x_GV, bitmask_GW, vocab_size=min(V, W * 32))
        if W * 32 < V:
            x_GV[:, W * 32:] = float("-inf")
        return
    shifts = torch.arange(32, device=bitmask_GW.device, dtype=torch.int32)
    allowed_GV = ((bitmask_GW[:, :, None] >> shifts) & 1).to(torch.bool).reshape(G, W * 32)
    if W * 32 < V:
        allowed_GV = torch.cat([allowed_GV, allowed_GV.new_zeros(G, V - W * 32)], dim=1)
    x_GV.masked_fill_(~allowed_GV[:, :V], float("-inf"))
