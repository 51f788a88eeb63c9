"""bench/gpu_check.sh must run on a bare GPU machine that has only torch and Triton.

Without a GPU here: the modules it runs import (and decode_sol's model-only path runs its smoke
config) with msgspec, tqdm, tokenizers and safetensors made unimportable, and the script itself
exits 2 with its message.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("msgspec", "tqdm", "tokenizers", "safetensors", "jinja2")
# A meta-path finder that refuses the blocked packages, installed before anything else imports.
BLOCKER = f"""
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {BLOCKED!r}:
            raise ImportError(f'{{name}} is blocked (bare machine)', name=name)
        return None
sys.meta_path.insert(0, _Block())
for m in list(sys.modules):
    if m.split('.')[0] in {BLOCKED!r}:
        del sys.modules[m]
"""


def run_bare(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-c", BLOCKER + code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_blocker_blocks():
    r = run_bare("import msgspec")
    assert r.returncode != 0 and "blocked" in r.stderr


def test_gpu_check_modules_import_without_engine_dependencies():
    code = """
import importlib.util, runpy, sys
for path in ("bench/kernels.py", "bench/decode_sol.py"):
    spec = importlib.util.spec_from_file_location("m_" + path.split("/")[1][:-3], path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
import moe_serve.kernels.aot_check, bench.sol
# what bench/kernels.py's checks import when they run (on the GPU machine, without the engine's dependencies)
import attention.backends.dsa, attention.backends.triton_dsa, moe_serve.kernels.fp8_quant, moe_serve.kernels.fp8_linear
import moe_serve.kernels.gated_delta.reference, moe_serve.kernels.gated_delta.triton_kernels, moe_serve.kernels.grouped_gemm.masked
import moe_serve.quantization.fp8
from bench.decode_sol import ModelOnlyDecoder, engine_importable
assert engine_importable() in ("msgspec", "tqdm", "tokenizers"), engine_importable()
bad = [m for m in sys.modules if m.split('.')[0] in %r]
assert not bad, bad
print("imports ok")
""" % (BLOCKED,)
    r = run_bare(code)
    assert r.returncode == 0 and "imports ok" in r.stdout, r.stderr[-3000:]


def test_decode_sol_smoke_runs_model_only_without_engine_dependencies():
    code = """
import sys
sys.argv = ["decode_sol.py", "--smoke", "--output-len", "4", "--batch", "3"]
import runpy
try:
    runpy.run_path("bench/decode_sol.py", run_name="__main__")
except SystemExit as e:
    sys.exit(e.code)
"""
    r = run_bare(code)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "measuring the model alone" in out and "[model-only] batch   3" in out, out[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only exit")
def test_gpu_check_exits_2_without_a_gpu():
    r = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no CUDA GPU" in r.stderr, r.stderr


def test_model_only_decode_equals_the_engine_greedy_tokens(tmp_path, monkeypatch):
    """decode_sol's model-only loop (device-side metadata advance) generates what moe_serve.LLM does
    with the same dummy weights."""
    import importlib.util

    import moe_serve.runner.loading as loading

    # install_device_dummy_init replaces the engine's initialiser for this process: put it back after
    # (decode_sol's draws floats only; a later MXFP4 model's packed uint8 blocks would meet it)
    monkeypatch.setattr(loading, "init_dummy_weights", loading.init_dummy_weights)

    spec = importlib.util.spec_from_file_location("decode_sol_under_test", ROOT / "bench" / "decode_sol.py")
    ds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ds)
    from moe_serve import LLM, SamplingParams

    ds.write_checkpoint(ds.SMOKE, str(tmp_path))
    assert ds.install_device_dummy_init()
    prompts = [[5, 9, 100, 200, 33, 44, 7, 8], [3, 4, 5, 6, 7, 8, 9, 10]]
    llm = LLM(model=str(tmp_path), dtype="float32", load_format="dummy", device="cpu", kv_cache_memory=16 << 20,
              max_model_len=256, show_progress=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    dec = ds.ModelOnlyDecoder(ds.SMOKE, torch.device("cpu"), "auto", "auto", 2, 40, dtype=torch.float32)
    assert dec.generate(prompts, 12, use_graph=False) == [list(o.outputs[0].token_ids) for o in outs]
