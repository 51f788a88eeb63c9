"""The dispatch backend the platform picks, and why, for the sizes DeepEP's kernels are built for
(DeepEP V1's launch.cuh: 2/4/8 ranks in a node, 2/4/8/16 nodes of 8, low-latency hidden sizes
2048...8192): DeepEP only where it runs, with the reason logged either way."""
import logging

import pytest

from moe_serve import platform


@pytest.mark.parametrize("world,hidden,backend,low_latency", [
    (8, 7168, "deepep", True),  # DeepSeek-V3 on one H100 node
    (4, 2048, "deepep", True),  # Qwen3-30B-A3B
    (16, 7168, "deepep", True),  # two nodes
    (2, 576, "deepep", False),  # the built-in default model: normal kernels only
    (6, 7168, "all_to_all", False),  # no intranode kernel for 6 ranks
    (24, 7168, "all_to_all", False),  # 3 nodes: no RDMA kernel
    (12, 7168, "all_to_all", False),  # not whole nodes of 8
])
def test_deepep_chosen_only_where_its_kernels_run(world, hidden, backend, low_latency, caplog):
    got, why = platform.choose_all2all("auto", True, world, hidden, deepep_installed=True)
    assert got == backend, why
    usable, ll, _ = platform.deepep_support(hidden, world)
    assert usable == (backend == "deepep") and ll == low_latency
    assert str(world) in why or str(hidden) in why


def test_reasons_name_what_ruled_deepep_out():
    assert platform.choose_all2all("auto", False, 4, 7168, True) == (
        "all_to_all", "CPU: torch.distributed all_to_all over gloo (DeepEP needs CUDA)")
    backend, why = platform.choose_all2all("auto", True, 4, 7168, deepep_installed=False)
    assert backend == "all_to_all" and "not installed" in why
    assert platform.choose_all2all("auto", True, 1, 7168, True)[0] == "local"
    assert platform.choose_all2all("allgather", True, 4, 7168, True)[0] == "allgather"
    with pytest.raises(ValueError, match="6"):
        platform.choose_all2all("deepep", True, 6, 7168, True)


def test_choice_is_logged_with_its_reason(caplog):
    with caplog.at_level(logging.INFO, logger="moe_serve.platform"):
        platform.choose("cpu", world_size=2, hidden_size=128)
    assert "all2all_backend=all_to_all (CPU" in caplog.text


def test_an_indexed_cuda_device_becomes_the_current_device(monkeypatch):
    """--device cuda:N: the process's current device is set (streams, graphs and Triton launches go
    to the current device); a bare "cuda" and the CPU leave it as it is."""
    import torch

    from moe_serve import platform

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for dev in (torch.device("cuda", 3), torch.device("cuda"), torch.device("cpu")):
        platform.use_device(dev)
    assert calls == [torch.device("cuda", 3)]


def test_the_engine_takes_its_device_before_building_anything(checkpoints, monkeypatch):
    from moe_serve import LLM, platform
    from moe_serve.runner import loading

    order = []
    monkeypatch.setattr(platform, "use_device", lambda d: order.append(("device", str(d))))
    build = loading.build_model
    monkeypatch.setattr("moe_serve.engine.core.build_model", lambda *a: order.append(("model",)) or build(*a))
    LLM(checkpoints["qwen3_moe"], dtype="float32", kv_cache_memory=1 << 20, show_progress=False)
    assert order == [("device", "cpu"), ("model",)]
