"""Two-batch overlap: hide one micro-batch's dispatch/combine behind the other's compute.

A step's tokens are split into micro-batches A and B (balanced by cost, see `split_point`). Each
runs the model as a generator (`DecoderStack.stages`) that yields right after it *starts* an MoE
dispatch or combine. `run_interleaved` resumes A and B in turn, so per MoE layer the order is:

    A: attention, router, start dispatch(A)      -- A's tokens travel while --
    B: attention, router, start dispatch(B)
    A: wait dispatch(A), experts(A), start combine(A)   -- B's dispatch in flight meanwhile
    B: wait dispatch(B), experts(B), start combine(B)   -- A's combine in flight meanwhile
    A: wait combine(A), next layer's attention, ...

Every rank splits (an idle rank's micro-batches are empty) and takes the same number of yields,
so collectives are issued in the same order everywhere. Whether to split is agreed over the EP
group (`Dispatcher.agree_max`) because it changes that order. A sequence may be cut between A and
B: B's part attends to A's part through the paged cache, which A's attention of the same layer
has written before B's runs.
"""
from __future__ import annotations

# A query token attending over this many earlier tokens costs about as much again as its share of
# the dense and expert work; used to balance prefill-heavy micro-batches.
ATTENTION_TOKENS_PER_UNIT = 2048


def split_point(positions: list[int]) -> int:
    """Index s that splits tokens [0, s) / [s, T) into two halves of about equal cost, where a
    token at position p costs 1 + p / ATTENTION_TOKENS_PER_UNIT."""
    costs = [1.0 + p / ATTENTION_TOKENS_PER_UNIT for p in positions]
    half = sum(costs) / 2
    acc = 0.0
    for i, c in enumerate(costs):
        if acc + c / 2 >= half:
            return i
        acc += c
    return len(positions)


def split_pieces(pieces: list[tuple], s: int) -> tuple[list[tuple], list[tuple]]:
    """Cut the packed list of (request, start, num_tokens, samples) pieces at token s."""
    a, b = [], []
    pos = 0
    for req, start, n, samples in pieces:
        if pos + n <= s:
            a.append((req, start, n, samples))
        elif pos >= s:
            b.append((req, start, n, samples))
        else:  # the sequence is cut: its first part cannot sample, its second part may
            k = s - pos
            a.append((req, start, k, False))
            b.append((req, start + k, n - k, samples))
        pos += n
    return a, b


def run_interleaved(generators: list) -> list:
    """Resume each generator in turn until all finish; returns their return values in order."""
    results = [None] * len(generators)
    alive = list(range(len(generators)))
    while alive:
        for i in list(alive):
            try:
                next(generators[i])
            except StopIteration as stop:
                results[i] = stop.value
                alive.remove(i)
    return results
