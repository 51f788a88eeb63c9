"""DeepEP glue that runs without DeepEP: the normal / low-latency choice from the engine's per-step
maximum (no collective per MoE layer), and the low-latency receive presented as a DispatchOutput."""
import pytest
import torch
import torch.distributed as dist

from expert_parallel.runtime.dispatch import deepep
from expert_parallel.runtime.dispatch.base import Dispatcher
from expert_parallel.runtime.step import NO_STEP, MoEStep


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
    d.mode, d.max_low_latency_tokens, d.group = "auto", 64, None
    cpu = torch.device("cpu")
    assert [d._choose_mode(T, cpu, MoEStep(max_tokens_any_rank=64)) for T in (0, 17, 64)] == ["low_latency"] * 3
    assert d._choose_mode(1, cpu, MoEStep(max_tokens_any_rank=65)) == "normal"
    with pytest.raises((RuntimeError, ValueError)):  # unknown maximum: falls back to agreeing itself
        d._choose_mode(1, cpu, NO_STEP)


def test_every_dispatcher_takes_the_step():
    # The step is an argument of dispatch on every backend (none keeps per-step state).
    import inspect

    from expert_parallel.runtime.dispatch import all_to_all, allgather, local, reference

    for cls in (Dispatcher, deepep.DeepEPDispatcher, all_to_all.AllToAllDispatcher, allgather.AllGatherDispatcher,
                local.LocalDispatcher, reference.ReferenceDispatcher):
        assert "step" in inspect.signature(cls.dispatch).parameters, cls
        assert "step" in inspect.signature(cls.dispatch_async).parameters, cls
        assert not any(n.startswith("set_st") for n in dir(cls)), cls


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
