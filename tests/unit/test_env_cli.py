"""`moe-serve env --json` names this machine's ISA and the kernel set the engine then uses, and says
why the C kernels are off when they are (MOE_SERVE_CPU_OPS=0 stands in for a machine without them)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra) -> dict:
    r = subprocess.run([sys.executable, "-m", "moe_serve.entrypoints.cli", "env", "--json", "--world-size", "2"],
                       cwd=ROOT, env=dict(os.environ, **extra), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next(line for line in f if line.startswith(("flags", "Features"))).split(":", 1)[1].split())


@pytest.mark.parametrize("cpu_ops_env, backend", [({}, None), ({"MOE_SERVE_CPU_OPS": "0"}, "torch")],
                         ids=["as-is", "c-kernels-off"])
def test_env_names_the_isa_and_the_kernels_the_engine_uses(checkpoints, cpu_ops_env, backend):
    from moe_serve.kernels import cpu_ops
    from moe_serve.entrypoints.env import ISA_FLAGS

    env = _env(**cpu_ops_env)
    assert env["cpu"]["isa"] == [f for f in ISA_FLAGS if f in _cpu_flags()]
    if backend == "torch":
        assert not env["cpu_kernels"]["available"] and "MOE_SERVE_CPU_OPS=0" in env["cpu_kernels"]["reason"]
    else:
        assert env["cpu_kernels"]["available"] == cpu_ops.available()
    assert env["platform"]["world_size"] == 2 and env["platform"]["all2all_backend"] in ("all_to_all", "allgather")
    # The engine started in the same environment runs the backends env named.
    code = ("import json, sys; from moe_serve import LLM; "
            "c = LLM(sys.argv[1], dtype='float32', kv_cache_memory=1 << 20, show_progress=False).engine.cfg; "
            "print(json.dumps([c.moe_backend, c.attention_backend, c.linear_backend, c.norm_backend, "
            "c.linear_attention_backend, str(c.device)]))")
    r = subprocess.run([sys.executable, "-c", code, checkpoints["qwen3_moe"]], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, **cpu_ops_env), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    pl = env["platform"]
    used = json.loads(r.stdout.strip().splitlines()[-1])
    assert used == [pl["moe_backend"], pl["attention_backend"], pl["linear_backend"], pl["norm_backend"],
                    pl["linear_attention_backend"], pl["device"]]
    if backend is not None:
        assert set(used[:5]) == {backend}
