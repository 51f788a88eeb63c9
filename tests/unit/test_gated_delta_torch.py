"""Gated DeltaNet: the reference (moe_serve/kernels/gated_delta/reference.py) against transformers' own torch
functions for Qwen3-Next, run one sequence at a time, and the torch backend against the reference.

Batches are ragged: fresh sequences (context 0, whose slot holds garbage that must not be read),
continuing ones, one-row decodes, zero-length entries (slot untouched) and sequences shorter than
the convolution's window (older state entries carried on).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from moe_serve.kernels.gated_delta import TorchLinearAttention
from moe_serve.kernels.gated_delta import reference as ref
from tests.gated_delta_batch import DIMS, Batch
from tests.sync_guard import NoHostSync



def torch_path(f):
    """transformers' own torch function under its wrappers, which would dispatch to FLA or hub kernels
    where installed: functools.wraps layers (`__wrapped__`) and, with Hugging Face's kernels package
    installed (transformers 5.25 on), a module whose forward closes over the function (`func`)."""
    for _ in range(8):
        if hasattr(f, "__wrapped__"):
            f = f.__wrapped__
        elif isinstance(f, torch.nn.Module):
            fw = type(f).forward
            f = fw.__closure__[fw.__code__.co_freevars.index("func")].cell_contents
        else:
            return f
    raise RuntimeError(f"could not unwrap {f!r}")


hf_recurrent = torch_path(hf.torch_recurrent_gated_delta_rule)
hf_chunk = torch_path(hf.torch_chunk_gated_delta_rule)
hf_conv_update = torch_path(hf.causal_conv1d_update)
hf_conv_fn = torch_path(hf.causal_conv1d_fn)
assert hf_recurrent.__module__ == hf.__name__ and hf_recurrent.__name__ == "torch_recurrent_gated_delta_rule"


def hf_delta(batch: Batch, b: int, oracle):
    """transformers' gated delta rule for sequence b alone: (o (L, H, V), final state (H, K, V))."""
    r, slot = batch.rows(b), batch.slots[b]
    init = batch.state[slot][None].float() if batch.context_lens[b] > 0 else None
    o, S = oracle(batch.q[r][None], batch.k[r][None], batch.v[r][None], batch.g[r][None], batch.beta[r][None],
                  initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[0], S[0]


def hf_conv(batch: Batch, b: int):
    """transformers' convolution for sequence b alone: (y (L, C), new conv state (C, K - 1))."""
    x = batch.x[batch.rows(b)].T[None]  # (1, C, L)
    if batch.context_lens[b] > 0:
        state = batch.conv_state[batch.slots[b]][None].clone()
        y = hf_conv_update(x, state, batch.w, batch.bias, "silu")
    else:  # a fresh sequence: the zero-padded convolution, and the state its last inputs
        y = hf_conv_fn(x, batch.w, batch.bias, "silu")
        state = torch.nn.functional.pad(x, (DIMS.KW - 1, 0))[..., -(DIMS.KW - 1):]
    return y[0].T, state[0]


RAGGED = dict(query_lens=[5, 1, 0, 70, 3, 1, 2], context_lens=[0, 4, 7, 9, 0, 0, 30])


@pytest.mark.parametrize("oracle", [hf_recurrent, hf_chunk], ids=["recurrent", "chunk"])
def test_reference_delta_rule_matches_transformers(oracle):
    batch = Batch(**RAGGED)
    before = batch.state.clone()
    out = batch.delta(ref.gated_delta_rule)
    for b, n in enumerate(batch.query_lens):
        slot = batch.slots[b]
        if n == 0:
            assert torch.equal(batch.state[slot], before[slot])  # no rows: untouched
            continue
        batch.state[slot], live = before[slot], batch.state[slot].clone()
        want_o, want_S = hf_delta(batch, b, oracle)
        batch.state[slot] = live
        torch.testing.assert_close(out[batch.rows(b)], want_o, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(live, want_S, rtol=1e-4, atol=1e-5)
    untouched = [s for s in range(DIMS.slots) if s not in batch.slots.tolist()]
    assert torch.equal(batch.state[untouched], before[untouched])


def test_reference_delta_rule_half_precision_state():
    """bf16 inputs and a bf16 state cache: math in float32, o in v's dtype, the state rounded once."""
    batch = Batch(**RAGGED, dtype=torch.bfloat16, state_dtype=torch.bfloat16)
    before = batch.state.clone()
    out = batch.delta(ref.gated_delta_rule)
    assert out.dtype == torch.bfloat16 and batch.state.dtype == torch.bfloat16
    for b, n in enumerate(batch.query_lens):
        if n == 0:
            continue
        slot = batch.slots[b]
        live = batch.state[slot].clone()
        batch.state[slot] = before[slot]
        want_o, want_S = hf_delta(batch, b, hf_recurrent)
        batch.state[slot] = live
        torch.testing.assert_close(out[batch.rows(b)].float(), want_o.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(live.float(), want_S, rtol=2e-2, atol=2e-2)


def test_reference_conv_matches_transformers():
    batch = Batch(**RAGGED)
    before = batch.conv_state.clone()
    y = batch.conv(ref.causal_conv1d)
    for b, n in enumerate(batch.query_lens):
        slot = batch.slots[b]
        if n == 0:
            assert torch.equal(batch.conv_state[slot], before[slot])
            continue
        live = batch.conv_state[slot].clone()
        batch.conv_state[slot] = before[slot]
        want_y, want_state = hf_conv(batch, b)
        batch.conv_state[slot] = live
        torch.testing.assert_close(y[batch.rows(b)], want_y, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(live, want_state, rtol=0, atol=0)
    # one row continuing: the state shifts by one, keeping its two newest entries
    b = batch.query_lens.index(1)
    assert torch.equal(batch.conv_state[batch.slots[b], :, :2], before[batch.slots[b], :, 1:])


def test_reference_conv_without_activation_or_bias():
    batch = Batch([4, 2], [0, 5])
    batch.bias = None
    x1 = torch.cat([batch.conv_state[batch.slots[1]].T, batch.x[4:]])  # (K - 1 + 2, C)
    y = batch.conv(ref.causal_conv1d, activation=None)
    want = torch.stack([(x1[t:t + DIMS.KW] * batch.w.T).sum(0) for t in range(2)])
    torch.testing.assert_close(y[4:], want)


@pytest.mark.parametrize("fn_name", ["reference", "torch"])
def test_two_steps_equal_one(fn_name):
    """Sequences split in two steps give the outputs and final states of one step (both ops)."""
    ops = ref if fn_name == "reference" else TorchLinearAttention()
    q_lens, ctx, cut = [9, 70, 2, 1, 0], [0, 3, 0, 5, 0], [4, 65, 2, 0, 0]
    whole = Batch(q_lens, ctx, seed=3)
    o_whole, y_whole = whole.delta(ops.gated_delta_rule), whole.conv(ops.causal_conv1d)
    split = Batch(q_lens, ctx, seed=3)  # the same inputs and caches, run in two steps
    o_split, y_split = torch.empty_like(o_whole), torch.empty_like(y_whole)
    for first in (True, False):
        lens = [c if first else n - c for n, c in zip(q_lens, cut)]
        rows = torch.cat([torch.arange(whole.qsl[b], whole.qsl[b + 1])[:c] if first else
                          torch.arange(whole.qsl[b], whole.qsl[b + 1])[c:] for b, c in enumerate(cut)])
        step = split.part(rows, lens, ctx if first else [x + c for x, c in zip(ctx, cut)])
        o_split[rows], y_split[rows] = step.delta(ops.gated_delta_rule), step.conv(ops.causal_conv1d)
    torch.testing.assert_close(o_split, o_whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(split.state, whole.state, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y_split, y_whole, rtol=1e-5, atol=1e-6)
    assert torch.equal(split.conv_state, whole.conv_state)


# ---- the torch backend ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,state_dtype,tol", [(torch.float32, torch.float32, 2e-5),
                                                   (torch.bfloat16, torch.float32, 2e-2),
                                                   (torch.bfloat16, torch.bfloat16, 2e-2)], ids=str)
@pytest.mark.parametrize("lens", [RAGGED, dict(query_lens=[1, 1, 1, 1], context_lens=[3, 1, 0, 8]),
                                  dict(query_lens=[1, 1, 200, 1, 64], context_lens=[2, 5, 0, 0, 64])],
                         ids=["ragged", "decode", "decodes-then-prefills"])
def test_torch_backend_matches_reference(lens, dtype, state_dtype, tol):
    ops = TorchLinearAttention()
    want = Batch(**lens, dtype=dtype, state_dtype=state_dtype)
    got = want.copy_caches()
    o_want, o_got = want.delta(ref.gated_delta_rule), got.delta(ops.gated_delta_rule)
    assert o_got.dtype == dtype
    torch.testing.assert_close(o_got.float(), o_want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got.state.float(), want.state.float(), rtol=tol, atol=tol)
    y_want, y_got = want.conv(ref.causal_conv1d), got.conv(ops.causal_conv1d)
    torch.testing.assert_close(y_got.float(), y_want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got.conv_state.float(), want.conv_state.float(), rtol=tol, atol=tol)


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def test_torch_decode_step_is_one_batched_step():
    """A decode step (every sequence one row) launches the same ops whatever the batch size: no
    loop over sequences."""
    ops, counts = TorchLinearAttention(), []
    for B in (2, 9):
        batch = Batch([1] * B, [5] * B, slots=list(range(B)))
        with CountOps() as c:
            batch.delta(ops.gated_delta_rule), batch.conv(ops.causal_conv1d)
        counts.append(c.n)
    assert counts[0] == counts[1], counts


def test_torch_decode_step_reads_nothing_on_the_host():
    """Every sequence one row, all continuing (what a captured decode step is given): no device
    value read on the host, no data-dependent shape; padded rows may share one scratch slot."""
    lens = dict(query_lens=[1] * 5, context_lens=[3, 1, 2, 8, 4], slots=[4, 0, 7, 9, 9])
    ops = TorchLinearAttention()
    want = Batch(**lens)
    got = want.copy_caches()
    with NoHostSync():
        o_got, y_got = got.delta(ops.gated_delta_rule), got.conv(ops.causal_conv1d)
    want = want.part(torch.arange(4), [1] * 4, lens["context_lens"][:4], want.slots[:4])  # without the duplicate
    o_want, y_want = want.delta(ref.gated_delta_rule), want.conv(ref.causal_conv1d)
    torch.testing.assert_close(o_got[:4], o_want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(y_got[:4], y_want)
    real = [4, 0, 7]
    torch.testing.assert_close(got.state[real], want.state[real], rtol=2e-5, atol=2e-5)
    assert torch.equal(got.conv_state[real], want.conv_state[real])
