"""Kernel backends are chosen once, by name, in moe_serve/platform.py, and bound to the layers:
a new backend for one kind of op is one class plus one entry in platform.OPS, layers never ask
which device they run on, and every name is honoured or refused naming its flag."""
from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import pytest
import torch

from moe_serve.kernels import cpu_ops
from moe_serve.kernels.norm import TorchNorm
from moe_serve import LLM, SamplingParams, platform
from moe_serve.layers.norm import RMSNorm

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [{"prompt_token_ids": [5, 77, 301, 42]}, {"prompt_token_ids": [9, 8, 7, 6, 5, 4, 3, 200, 100]}]


class Float64Norm(TorchNorm):
    """A test backend: RMSNorm computed in float64 (an independent oracle of the float32 ops),
    counting its calls. Registered the way a real one is: one entry in platform.OPS["norm"]."""

    name = "float64"
    calls = 0

    def rms_norm(self, x, weight, eps):
        type(self).calls += 1
        xd = x.double()
        return (weight.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _generate(path: str, **kw) -> tuple[LLM, list[list[int]]]:
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 22, show_progress=False, **kw)
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in out]


def test_a_new_backend_is_one_class_and_one_table_entry(checkpoints, monkeypatch, caplog):
    monkeypatch.setitem(platform.OPS["norm"], "float64", Float64Norm)
    Float64Norm.calls = 0
    with caplog.at_level(logging.INFO, logger="moe_serve.platform"):
        llm, got = _generate(checkpoints["qwen3_moe"], norm_backend="float64", moe_backend="torch",
                             attention_backend="torch", linear_backend="torch")
    assert "norm_backend=float64" in caplog.text
    model = llm.engine.runner.model
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(isinstance(m.ops, Float64Norm) for m in norms)
    # every norm of every step ran in it: the final norm and two per layer at least, each step
    n_layers = model.num_hidden_layers
    assert Float64Norm.calls >= 6 * (2 * n_layers + 1)
    _, want = _generate(checkpoints["qwen3_moe"], moe_backend="torch", attention_backend="torch",
                        linear_backend="torch", norm_backend="torch")
    assert got == want


def _kinds(llm: LLM) -> dict[str, str]:
    return {type(m).op_kind: m.ops.name for m in llm.engine.runner.model.modules()
            if getattr(type(m), "op_kind", None)}


def test_cpu_default_and_torch_backends_agree_and_are_the_ones_bound(checkpoints):
    """The CPU default is cpu_c for every kind that has it where our C kernels built (torch ops
    where they did not: no compiler, a forced ISA this CPU lacks, MOE_SERVE_CPU_OPS=0); torch ops only when asked;
    both give the same greedy tokens (the C kernels sum in another order, the choices agree)."""
    llm_auto, got_auto = _generate(checkpoints["deepseek_v3"])
    default = "cpu_c" if cpu_ops.available() else "torch"
    assert _kinds(llm_auto) == {"experts": default, "attention": default, "linear": default, "norm": default}
    llm_t, got_t = _generate(checkpoints["deepseek_v3"], moe_backend="torch", attention_backend="torch",
                             linear_backend="torch", norm_backend="torch")
    assert set(_kinds(llm_t).values()) == {"torch"}
    assert got_auto == got_t
    if not cpu_ops.available():  # asked for by name where they did not build: refused, naming the flag
        with pytest.raises(ValueError, match="moe_backend='cpu_c'.*not available"):
            _generate(checkpoints["deepseek_v3"], moe_backend="cpu_c")


def test_names_are_resolved_or_refused_naming_the_flag(monkeypatch):
    cpu = torch.device("cpu")
    c = platform.choose("cpu", moe_backend="torch", attention_backend="reference")  # the old name is an alias
    assert (c.moe_backend, c.attention_backend, c.dist_backend) == ("torch", "torch", "gloo")
    with pytest.raises(ValueError, match="moe_backend='cuda_magic'"):
        platform.choose("cpu", moe_backend="cuda_magic")
    with pytest.raises(ValueError, match="norm_backend='triton'"):
        platform.choose("cpu", norm_backend="triton")  # no Triton norm: refused, not ignored
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    with pytest.raises(ValueError, match="linear_backend='cpu_c'.*not available"):
        platform.choose("cpu", linear_backend="cpu_c")
    with pytest.raises(ValueError, match="linear_attention_backend='cpu_c'"):
        platform.choose("cpu", linear_attention_backend="cpu_c")  # no C linear attention
    auto = platform.choose("cpu")
    assert {auto.moe_backend, auto.attention_backend, auto.linear_backend, auto.norm_backend,
            auto.linear_attention_backend} == {"torch"}
    assert platform.choose("cpu", linear_attention_backend="triton").linear_attention_backend == "triton"
    ops = platform.resolve_ops(cpu, "torch", "torch", "torch", "torch")
    assert ops.table() == "experts=torch, attention=torch, linear=torch, norm=torch, linear_attention=torch"
    assert not ops.compiles_kernels and not ops.captures_graphs


def test_cli_takes_every_backend_name():
    import argparse

    from moe_serve.engine.args import EngineArgs

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    ns = p.parse_args(["--moe-backend", "cpu_c", "--attention-backend", "triton", "--linear-backend", "torch",
                       "--norm-backend", "cpu_c", "--linear-attention-backend", "triton"])
    args = EngineArgs.from_cli(ns, "m")
    assert (args.moe_backend, args.attention_backend, args.linear_backend, args.norm_backend,
            args.linear_attention_backend) == ("cpu_c", "triton", "torch", "cpu_c", "triton")
    with pytest.raises(SystemExit):
        p.parse_args(["--norm-backend", "triton"])
    assert p.parse_args(["--linear-attention-backend", "cpu_c"]).linear_attention_backend == "cpu_c"
    with pytest.raises(SystemExit):
        p.parse_args(["--linear-attention-backend", "reference"])


def test_capturable_forms_run_no_c_kernel_and_read_no_host_ids(checkpoints):
    llm, _ = _generate(checkpoints["qwen3_moe"])
    model = llm.engine.runner.model
    held = {id(m): m.ops for m in model.modules() if getattr(type(m), "op_kind", None)}
    with platform.capturable(model):
        for m in model.modules():
            if getattr(type(m), "op_kind", None):
                assert m.ops.name in ("torch", "triton")
                if m.op_kind == "experts":
                    assert m.ops.host_reads is False
    assert {id(m): m.ops for m in model.modules() if getattr(type(m), "op_kind", None)} == held


# What a forward path may not do outside the backend objects: ask which device it is on, or
# whether a library is there. The backends (attention/backends/__init__.py, moe_serve/kernels/grouped_gemm/
# __init__.py, moe_serve/kernels/linear.py, moe_serve/kernels/norm.py) and start-up code (platform, runner) may.
FORWARD_PATHS = ["moe_serve/layers", "moe_serve/models", "attention/layer.py", "attention/metadata.py",
                 "attention/backends/reference.py", "moe_serve/kernels/gated_delta/reference.py",
                 "expert_parallel/runtime/layer.py", "expert_parallel/runtime/router.py",
                 "expert_parallel/runtime/overlap.py",
                 "moe_serve/kernels/grouped_gemm/reference.py", "moe_serve/kernels/grouped_gemm/grouped_mm.py", "moe_serve/kernels/cpu_gemm.py"]
DEVICE_TESTS = r"is_cpu|is_cuda|device\.type|cuda\.is_available|cpu_ops\.|_available\(|suspended"


def test_no_device_or_library_test_in_forward_paths():
    out = subprocess.run(["grep", "-rnE", DEVICE_TESTS, *FORWARD_PATHS], cwd=ROOT, capture_output=True, text=True)
    hits = [line for line in out.stdout.splitlines()
            if not re.search(r":\s*#", line) and "def grouped_mm_available" not in line]
    assert hits == [], hits
