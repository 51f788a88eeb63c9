"""DeepEP glue that runs without DeepEP: the normal / low-latency choice from the engine's per-step
maximum (no collective per MoE layer), and the low-latency receive presented as a DispatchOutput."""
import pytest
import torch
import torch.distributed as dist

from expert_parallel.dispatch import deepep
from expert_parallel.dispatch.base import Dispatcher


def test_choose_mode_from_the_group_maximum():
    assert deepep.choose_mode("auto", 128, 128, 3) == "low_latency"
    assert deepep.choose_mode("auto", 129, 128, 3) == "normal"
    assert deepep.choose_mode("auto", 0, 128) == "low_latency"  # every rank idle: the cheap kernels
    assert deepep.choose_mode("normal", None, 128, 500) == "normal"
    assert deepep.choose_mode("low_latency", None, 128, 5) == "low_latency"
    with pytest.raises(ValueError, match="largest T"):
        deepep.choose_mode("auto", 4, 128, 5)  # a stale maximum below this call's T
    with pytest.raises(ValueError, match="not one of"):
        deepep.choose_mode("fast", 4, 128)


def test_dispatcher_uses_the_step_maximum_without_a_collective():
    # No process group exists in this process: a per-layer all_reduce would raise.
    assert not dist.is_initialized()
    d = object.__new__(deepep.DeepEPDispatcher)  # no deep_ep / CUDA here; only the decision state
    d.mode, d.max_low_latency_tokens, d._step_max_tokens, d.group = "auto", 64, None, None
    d.set_step_max_tokens(64)
    assert [d._choose_mode(T, torch.device("cpu")) for T in (0, 17, 64)] == ["low_latency"] * 3
    d.set_step_max_tokens(65)
    assert d._choose_mode(1, torch.device("cpu")) == "normal"
    d.set_step_max_tokens(None)
    with pytest.raises((RuntimeError, ValueError)):  # unknown maximum: falls back to agreeing itself
        d._choose_mode(1, torch.device("cpu"))


def test_other_dispatchers_accept_the_step_maximum():
    assert Dispatcher.set_step_max_tokens(None, 5) is None  # the base's no-op


def test_low_latency_output_layout():
    E, C, D = 3, 4, 5
    x = torch.arange(E * C * D, dtype=torch.float32).reshape(E, C, D).to(torch.bfloat16)
    counts = torch.tensor([2, 0, 4], dtype=torch.int32)
    out = deepep.low_latency_output(x, counts, "h", torch.bfloat16)
    assert out.expert_major[0].data_ptr() == x.data_ptr() and out.x_RD.data_ptr() == x.data_ptr()  # no copy
    assert out.expert_major[1] is counts and out.handle == "h"
    assert out.topk_ids_RK.reshape(E, C).tolist() == [[0, 0, -1, -1], [-1] * 4, [2, 2, 2, 2]]
    assert torch.all(out.topk_weights_RK == 1) and out.x_RD.shape == (E * C, D)
    f32 = deepep.low_latency_output(x, counts, "h", torch.float32)
    assert f32.x_RD.dtype == f32.expert_major[0].dtype == torch.float32
    assert torch.equal(f32.x_RD, x.float().reshape(E * C, D))
