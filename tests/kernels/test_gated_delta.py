"""Triton Gated DeltaNet kernels (moe_serve/kernels/gated_delta/triton_kernels.py) against the reference.

Without a GPU the kernels run under the Triton interpreter on the CPU (TRITON_INTERPRET=1 is set
before the kernel modules are imported; see conftest.py); with one they are compiled. Sizes are
tiny but cover the shapes' edges: key and value dims that are not powers of two (masked tiles),
several value tiles per head, sequences spanning more than one chunk, fresh sequences whose slot
holds garbage, zero-length sequences, decodes ahead of prefill chunks, and a sequence carried
across two steps.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules: see conftest.py

import pytest

from moe_serve.kernels import specialization as sp
from moe_serve.kernels.gated_delta import LinearAttentionShape, TritonLinearAttention
from moe_serve.kernels.gated_delta import reference as ref
from moe_serve.kernels.gated_delta import triton_kernels as tk
from tests.gated_delta_batch import Batch, Dims

DEVICE = "cpu" if tk.INTERPRETED or not torch.cuda.is_available() else "cuda"
DIMS = Dims(H=2, K=24, V=40, C=20, KW=4, slots=12)
# (dtype, state dtype, tolerance): for half-precision models the prefill's products take half-precision
# operands (rounded alike under the interpreter), accumulating in float32
CASES = [(torch.float32, torch.float32, 2e-4), (torch.bfloat16, torch.float32, 3e-2),
         (torch.bfloat16, torch.bfloat16, 3e-2)]
IDS = ["fp32", "bf16-fp32state", "bf16-bf16state"]
RAGGED = dict(query_lens=[1, 1, 5, 0, 70, 2, 1], context_lens=[3, 0, 0, 4, 9, 7, 0])


def run_both(lens, dtype=torch.float32, state_dtype=torch.float32, seed=0):
    """(reference batch, kernel batch) after one step of both ops, from the same inputs and caches."""
    want = Batch(**lens, dtype=dtype, state_dtype=state_dtype, dims=DIMS, seed=seed)
    got = want.copy_caches()
    got.slots, got.q, got.k, got.v, got.g, got.beta, got.x, got.w, got.bias = (
        t.to(DEVICE) for t in (want.slots, want.q, want.k, want.v, want.g, want.beta, want.x, want.w, want.bias))
    got.state, got.conv_state = got.state.to(DEVICE), got.conv_state.to(DEVICE)
    ops = TritonLinearAttention(DEVICE)
    want.o, want.y = want.delta(ref.gated_delta_rule), want.conv(ref.causal_conv1d)
    got.o, got.y = got.delta(ops.gated_delta_rule), got.conv(ops.causal_conv1d)
    return want, got


def close(got, want, tol):
    torch.testing.assert_close(got.float().cpu(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,state_dtype,tol", CASES, ids=IDS)
def test_ragged_batch_matches_reference(dtype, state_dtype, tol):
    """Decodes (one fresh) ahead of prefill chunks: one fresh, one of 70 rows (two chunks), one
    continuing, one empty (its slot untouched); outputs, states and conv states as the reference."""
    want, got = run_both(RAGGED, dtype, state_dtype)
    assert got.o.dtype == dtype and got.y.dtype == dtype
    close(got.o, want.o, tol)
    close(got.state, want.state, tol)
    close(got.y, want.y, tol)
    assert torch.equal(got.conv_state.cpu(), want.conv_state)  # copies of inputs: exact


@pytest.mark.parametrize("context_lens", [[5, 2, 9], [5, 0, 9]], ids=["continuing", "one-fresh"])
def test_decode_rows_match_reference(context_lens):
    """Every sequence one row: the recurrent kernel and the convolution's decode form, with every
    sequence continuing (no host table: what a graph holds) or one fresh."""
    want, got = run_both(dict(query_lens=[1, 1, 1], context_lens=context_lens))
    close(got.o, want.o, 2e-4)
    close(got.state, want.state, 2e-4)
    close(got.y, want.y, 2e-4)
    assert torch.equal(got.conv_state.cpu(), want.conv_state)


def test_state_carried_across_two_steps():
    """A prompt prefilled in two chunks, then a decode step, by the kernels, equals one reference
    step over the same rows."""
    lens = [67, 3]
    want = Batch(lens, [0, 0], dims=DIMS, seed=5)
    got = want.copy_caches()
    o_want, y_want = want.delta(ref.gated_delta_rule), want.conv(ref.causal_conv1d)
    ops = TritonLinearAttention(DEVICE)
    o_got, y_got = torch.empty_like(o_want), torch.empty_like(y_want)
    got.state, got.conv_state, got.slots = got.state.to(DEVICE), got.conv_state.to(DEVICE), got.slots.to(DEVICE)
    done = [0, 0]
    for step in ([40, 2], [26, 1], [1, 0]):  # the last: a decode of the first sequence alone...
        rows = torch.cat([torch.arange(start + d, start + d + n) for start, d, n in zip((0, lens[0]), done, step)])
        part = got.part(rows, step, list(done))
        for name in ("q", "k", "v", "g", "beta", "x", "w", "bias"):
            setattr(part, name, getattr(part, name).to(DEVICE))
        o_got[rows], y_got[rows] = part.delta(ops.gated_delta_rule).cpu(), part.conv(ops.causal_conv1d).cpu()
        done = [d + n for d, n in zip(done, step)]
    assert done == lens  # ...with the second sequence's empty entry behind it
    close(o_got, o_want, 2e-4)
    close(got.state, want.state, 2e-4)
    close(y_got, y_want, 2e-4)
    assert torch.equal(got.conv_state.cpu(), want.conv_state)


def test_zero_length_sequences_leave_their_slots_untouched():
    want, got = run_both(dict(query_lens=[0, 3, 0], context_lens=[2, 0, 0]))
    before = Batch([0, 3, 0], [2, 0, 0], dims=DIMS)
    for slot in (int(got.slots[0]), int(got.slots[2])):
        assert torch.equal(got.state[slot].cpu(), before.state[slot])
        assert torch.equal(got.conv_state[slot].cpu(), before.conv_state[slot])
    close(got.o, want.o, 2e-4)


def test_variants_do_not_depend_on_the_batch():
    """Over batch sizes, lengths, fresh sequences and decode / prefill mixes, the launches select
    one compiled variant per kernel and kind of step: nothing about the batch is a constexpr or a
    specialised integer (the launches are recorded, not run, on "meta" tensors)."""
    ops = TritonLinearAttention("cuda")
    steps = [([1] * B, [c + 1 for c in range(B)]) for B in (1, 2, 3, 17, 64)]
    steps += [([1] * 4, [0, 3, 0, 1])]
    steps += [([1, 1, 5, 0, 70], [2, 0, 0, 0, 9]), ([130], [0]), ([3, 9, 16, 1], [0, 1, 2, 3]),
              ([1] + [7] * 5, [1] * 6)]
    shape = LinearAttentionShape(heads=4, k_dim=32, v_dim=32, conv_dim=3 * 128, conv_width=4)
    with sp.record(sp.LINEAR_ATTENTION) as launches:
        for q_lens, ctx in steps:
            ops.launch(shape, torch.bfloat16, q_lens, ctx)
    by_kernel = {}
    for x in launches:
        by_kernel.setdefault(x.kernel, set()).add(x)
    # conv: decode and prefill forms; every other kernel one
    assert {k: len(v) for k, v in by_kernel.items()} == {sp.GDN_CONV: 2, sp.GDN_CONV_STATE: 1, sp.GDN_RECURRENT: 1,
                                                         sp.GDN_INVERSE: 1, sp.GDN_SCAN: 1}
