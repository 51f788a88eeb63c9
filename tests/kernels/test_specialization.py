"""moe_serve/kernels/specialization.py derives a launch's compile key by Triton's rules: its written-out rules
(used where a Triton has no `native_specialize_impl`) agree with Triton's own function, and a
recorded launch keys exactly the arguments Triton keys (do_not_specialize honoured, constexpr
defaults filled in)."""
import pytest
import torch

from moe_serve.kernels import specialization as sp

VALUES = [0, 1, 2, 8, 15, 16, 17, 24, 48, 576, -16, -1, 2**31 - 1, 2**31, 2**33, 3.5, True, False,
          torch.empty(8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.bfloat16)[1:],
          torch.empty(8, dtype=torch.float32)[4:], torch.empty(4, dtype=torch.float8_e4m3fn),
          torch.empty(4, dtype=torch.int64, device="meta"), torch.empty((4, 4), dtype=torch.float16, device="meta")[:, 1:],
          torch.empty(4, dtype=torch.int32)]


def test_written_out_rules_agree_with_tritons_own():
    import triton._C.libtriton as lt

    if not hasattr(lt, "native_specialize_impl"):
        pytest.skip("this Triton has no native_specialize_impl to compare with")
    native = [sp.argument_spec(v, s) for v in VALUES for s in (True, False)]
    assert ("i32", "1") in native and ("i32", "D") in native and ("*bf16", "") in native  # all three marks met
    saved = lt.native_specialize_impl
    try:
        del lt.native_specialize_impl  # the import inside argument_spec now fails: the fallback runs
        written = [sp.argument_spec(v, s) for v in VALUES for s in (True, False)]
    finally:
        lt.native_specialize_impl = saved
    assert written == native


def test_a_recorded_launch_keys_what_triton_keys():
    from attention.backends import triton_paged as tp

    kc = torch.empty(4, 16, 2, 16, device="meta")
    from attention.metadata import AttentionMetadata

    meta = AttentionMetadata.build([1, 1], [17, 3], [[0, 1], [2]], 16, device="meta")
    with sp.record((sp.ATTN,)) as launches:
        tp.paged_attention(torch.empty(2, 4, 16, device="meta"), kc, kc, meta, 0.25, num_splits=1)
    (launch,) = launches
    marks, types = launch.marks, launch.types
    # Per-step integers Triton leaves alone are never marked, whatever their value...
    assert all(marks[n] == "" for n in tp._PER_STEP_ATTN_ARGS)
    # ...and the others are: unit strides become the constant 1, sizes divisible by 16 are marked.
    assert marks["stride_qd"] == marks["stride_kd"] == "1" and marks["HD"] == "D" and marks["QH"] == ""
    assert types["q_ptr"] == "*fp32" and types["scale_log2"] == "fp32" and marks["scale_log2"] == ""
    constexprs = dict(launch.constexprs)
    assert constexprs["BLOCK_Q"] == 1 and constexprs["SPLIT_K"] is False and "UPCAST" in constexprs
    assert launch.grid is not None and launch == sp.Launch(launch.kernel, launch.args, launch.constexprs,
                                                           launch.options, grid=None)  # the grid is not keyed
