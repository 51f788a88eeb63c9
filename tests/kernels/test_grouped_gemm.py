"""Triton grouped GEMM and its routing alignment against the float64 oracle.

Without a GPU the kernels run under the Triton interpreter on the CPU (TRITON_INTERPRET=1 is set
before the kernel modules are imported; see conftest.py); with one they are compiled and run on it.
Shapes are small and odd: the interpreter is slow, and edges are where masking bugs live.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules: see conftest.py

import json

import pytest

from moe_serve.kernels.grouped_gemm import config as cfg_mod
from moe_serve.kernels.grouped_gemm import fused_experts
from moe_serve.kernels.grouped_gemm import triton_kernel as tk
from moe_serve.kernels.grouped_gemm.align import align_block_size, max_padded_pairs
from moe_serve.kernels.grouped_gemm.reference import fused_experts_float64

DEVICE = "cpu" if tk.INTERPRETED or not torch.cuda.is_available() else "cuda"
# Norm-wise relative error bounds against the float64 oracle. bf16 is looser than the usual 1e-2:
# the interpreter truncates fp32 -> bf16 where GPUs round to nearest, which doubles that error, and
# h and y are each stored once in bf16 on the way (the torch reference rounds just as often).
RTOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
SMALL = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1, "num_warps": 4,
         "num_stages": 2}
TALL = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 3, "num_warps": 4,
        "num_stages": 2}


def routing(T: int, E: int, K: int, gen: torch.Generator, skip_frac: float = 0.0, zero_experts=()):
    """Softmax top-k routing over E experts; some experts never chosen, some pairs sent to -1."""
    logits = torch.randn(T, E, generator=gen)
    for e in zero_experts:
        logits[:, e] = float("-inf")
    weights, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    skip = torch.rand(T, K, generator=gen) < skip_frac
    return weights, torch.where(skip, -1, ids).to(torch.int32)


def layer(T, D, F, E, dtype, gen):
    x = torch.randn(T, D, generator=gen).to(dtype)
    w13 = (torch.randn(E, 2 * F, D, generator=gen) / D ** 0.5).to(dtype)
    w2 = (torch.randn(E, D, F, generator=gen) / F ** 0.5).to(dtype)
    return x, w13, w2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


@pytest.fixture
def poisoned_workspace(monkeypatch):
    """Every workspace buffer the kernels allocate starts as NaN, so a read of an unwritten row shows."""
    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    monkeypatch.setattr(tk, "_empty", nan_empty)


# ---- align.py -------------------------------------------------------------------------------------

@pytest.mark.parametrize("T,E,K,block_m,skip", [(1, 3, 1, 16, 0.0), (1, 10, 8, 16, 0.3), (37, 7, 3, 16, 0.2),
                                                (50, 5, 2, 32, 0.5), (9, 4, 2, 16, 1.0), (0, 4, 2, 16, 0.0)])
def test_align_invariants(T, E, K, block_m, skip):
    gen = torch.Generator().manual_seed(T * 100 + E)
    _, ids = routing(T, E, K, gen, skip, zero_experts=(1,) if E > 3 else ())
    r = align_block_size(ids, E, block_m)
    P = T * K
    S = r.sorted_pair_ids_S.shape[0]
    sorted_ids = r.sorted_pair_ids_S.tolist()
    experts = r.expert_ids_B.tolist()
    total = int(r.num_padded)
    flat = ids.reshape(-1).tolist()
    counts = [sum(1 for e in flat if e == x) for x in range(E)]
    assert r.num_pairs == P and S == max_padded_pairs(P, E, block_m) and S % block_m == 0
    assert len(experts) == S // block_m
    assert total == sum((c + block_m - 1) // block_m * block_m for c in counts) <= S
    # Every pair routed here appears exactly once; skipped pairs never; the rest is the sentinel.
    real = [p for p in sorted_ids if p != P]
    assert sorted(real) == [p for p in range(P) if flat[p] >= 0]
    for b, e in enumerate(experts):
        block = sorted_ids[b * block_m:(b + 1) * block_m]
        if b * block_m >= total:
            assert e == -1 and all(p == P for p in block)
        else:
            assert 0 <= e < E and all(flat[p] == e for p in block if p != P)
            assert block[0] != P  # padding only trails an expert's run, so no block is all padding
    # Runs are in expert order, each pair order preserved (stable), each run padded to block_m.
    pos = 0
    for e in range(E):
        run = [p for p in sorted_ids[pos:pos + (counts[e] + block_m - 1) // block_m * block_m] if p != P]
        assert run == [p for p in range(P) if flat[p] == e]
        pos += (counts[e] + block_m - 1) // block_m * block_m


# ---- fused_experts_triton -------------------------------------------------------------------------

CASES = {
    # name: (T, D, F, E, K, skip fraction, experts that get no token, config)
    "one_token_top1": (1, 40, 24, 3, 1, 0.0, (), SMALL),
    "one_token_top8": (1, 48, 40, 10, 8, 0.25, (), SMALL),
    "odd_sizes_skips": (13, 40, 24, 6, 2, 0.3, (2, 4), SMALL),
    "grouped_order_tall_blocks": (37, 24, 20, 5, 3, 0.1, (0,), TALL),
    "default_config": (9, 33, 17, 7, 2, 0.2, (3,), None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_experts_matches_oracle(case, dtype, poisoned_workspace):
    T, D, F, E, K, skip, zero, config = CASES[case]
    gen = torch.Generator().manual_seed(len(case) * 7 + T)
    x, w13, w2 = layer(T, D, F, E, dtype, gen)
    weights, ids = routing(T, E, K, gen, skip, zero)
    ref = fused_experts_float64(x, w13, w2, weights, ids)
    out = torch.full((T, D), float("nan"), dtype=dtype, device=DEVICE)
    got = tk.fused_experts_triton(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE),
                                  ids.to(DEVICE), config, out_TD=out)
    assert got is out and got.dtype == dtype
    assert rel_err(got, ref) < RTOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", cfg_mod.DEFAULT_CONFIGS, ids=lambda c: f"BM{c['BLOCK_SIZE_M']}")
def test_each_default_config_matches_oracle(config, dtype, poisoned_workspace):
    """Decode (BM=16), middle (BM=32) and prefill (BM=64) defaults, each forced: ragged expert runs
    longer than one row block, N and K tails smaller than the tiles, skipped pairs."""
    T, D, F, E, K = 45, 72, 40, 3, 2
    gen = torch.Generator().manual_seed(config["BLOCK_SIZE_M"])
    x, w13, w2 = layer(T, D, F, E, dtype, gen)
    weights, ids = routing(T, E, K, gen, 0.1)
    out = torch.full((T, D), float("nan"), dtype=dtype, device=DEVICE)
    got = tk.fused_experts_triton(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE),
                                  ids.to(DEVICE), config, out_TD=out)
    assert rel_err(got, fused_experts_float64(x, w13, w2, weights, ids)) < RTOL[dtype]


def test_zero_tokens_and_all_skipped(poisoned_workspace):
    gen = torch.Generator().manual_seed(1)
    x, w13, w2 = layer(3, 24, 16, 4, torch.float32, gen)
    empty = tk.fused_experts_triton(x[:0].to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), torch.empty(0, 2, device=DEVICE),
                                    torch.empty(0, 2, dtype=torch.int32, device=DEVICE))
    assert empty.shape == (0, 24)
    ids = torch.full((3, 2), -1, dtype=torch.int32)
    out = torch.full((3, 24), float("nan"), device=DEVICE)
    tk.fused_experts_triton(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), torch.rand(3, 2).to(DEVICE),
                            ids.to(DEVICE), SMALL, out_TD=out)
    assert torch.equal(out.cpu(), torch.zeros(3, 24))


def test_public_op_and_strided_input():
    gen = torch.Generator().manual_seed(2)
    x, w13, w2 = layer(6, 32, 16, 5, torch.float32, gen)
    x_strided = torch.randn(6, 64, generator=gen)[:, ::2]  # non-unit column stride
    weights, ids = routing(6, 5, 2, gen, 0.2)
    got = fused_experts(x_strided.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE),
                        ids.long().to(DEVICE), backend="triton")
    assert rel_err(got, fused_experts_float64(x_strided, w13, w2, weights, ids)) < RTOL[torch.float32]


def test_shape_errors_name_the_arguments():
    x, w13, w2 = (t.to(DEVICE) for t in layer(2, 16, 8, 3, torch.float32, torch.Generator().manual_seed(0)))
    ids = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    ones = torch.ones(2, 1, device=DEVICE)
    with pytest.raises(ValueError, match="w2_EDF"):
        tk.fused_experts_triton(x, w13, w2[:, :, :4], ones, ids)
    with pytest.raises(ValueError, match="BLOCK_SIZE_N=24"):
        tk.fused_experts_triton(x, w13, w2, ones, ids, {**SMALL, "BLOCK_SIZE_N": 24})


# ---- configs and the tuner ------------------------------------------------------------------------

def test_config_loader_picks_nearest_batch_size(tmp_path, monkeypatch):
    monkeypatch.setattr(cfg_mod, "CONFIG_DIR", tmp_path)
    cfg_mod.load_configs.cache_clear()
    name = cfg_mod.config_file_name(6, 24, 40, torch.bfloat16, "cpu")
    table = {"1": SMALL, "64": TALL}
    (tmp_path / name).write_text(json.dumps(table))
    try:
        assert cfg_mod.get_config(6, 24, 40, torch.bfloat16, 2, 2, torch.device("cpu")) == SMALL
        assert cfg_mod.get_config(6, 24, 40, torch.bfloat16, 50, 2, torch.device("cpu")) == TALL
        # Another shape or dtype has no file: the default config.
        assert cfg_mod.get_config(6, 24, 40, torch.float16, 2, 2, torch.device("cpu")) == \
            cfg_mod.default_config(2, 6, 2)
        (tmp_path / name).write_text(json.dumps({"8": {**SMALL, "BLOCK_SIZE_K": 8}}))
        cfg_mod.load_configs.cache_clear()
        with pytest.raises(ValueError, match=r"\[8\]: BLOCK_SIZE_K=8"):
            cfg_mod.get_config(6, 24, 40, torch.bfloat16, 2, 2, torch.device("cpu"))
    finally:
        cfg_mod.load_configs.cache_clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error path")
def test_tune_exits_2_without_a_gpu(capsys):
    from moe_serve.kernels.grouped_gemm.tune import main

    assert main(["--E", "8", "--N", "64", "--K", "64", "--dtype", "bf16"]) == 2
    assert "CUDA" in capsys.readouterr().err


@pytest.mark.skipif(not tk.INTERPRETED, reason="checks the interpreter set-up")
def test_interpreter_switch_survives_an_earlier_triton_import():
    """conftest.py must work even when triton and a kernel module were imported in compiled mode first."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import os, sys, torch\n"
        "import triton, moe_serve.kernels.grouped_gemm.triton_kernel as tk\n"
        "assert not tk.INTERPRETED\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "import tests.kernels.conftest\n"
        "tk = sys.modules['moe_serve.kernels.grouped_gemm.triton_kernel']\n"
        "x, w13, w2 = torch.randn(3, 16), torch.randn(2, 32, 16), torch.randn(2, 16, 16)\n"
        "ids, w = torch.tensor([[0], [1], [-1]]), torch.ones(3, 1)\n"
        "from moe_serve.kernels.grouped_gemm.reference import fused_experts_reference as ref\n"
        "assert torch.allclose(tk.fused_experts_triton(x, w13, w2, w, ids), ref(x, w13, w2, w, ids), atol=1e-4)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
