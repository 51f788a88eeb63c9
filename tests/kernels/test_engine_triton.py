"""The engine with the Triton backends forced (here: Triton's interpreter on the CPU) gives the same
greedy tokens as with the torch backends, for an MHA/GQA model and for DeepSeek's MLA."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys
from moe_serve import LLM, SamplingParams
path, moe, attn = sys.argv[1], sys.argv[2], sys.argv[3]
prompts = [[5, 77, 301, 42], [9, 8, 7, 6, 5, 4, 3, 200, 100, 17, 18, 19, 20, 21, 22, 23, 24, 25], [450]]
llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=1 << 20, max_num_batched_tokens=8,
          moe_backend=moe, attention_backend=attn, show_progress=False)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=5))
print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def run(path: str, moe: str, attn: str) -> list[list[int]]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT, path, moe, attn], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_triton_backends_match_torch_backends(checkpoints, arch):
    ref = run(checkpoints[arch], "torch", "torch")
    assert run(checkpoints[arch], "triton", "triton") == ref


def test_triton_backends_for_gpt_oss(extra_checkpoints):
    """GPT-OSS (sliding-window and full layers, sinks, MXFP4 experts): the 18-token prompt and its
    decodes cross the 12-token window in blocks of 4, through the Triton attention kernel."""
    path = extra_checkpoints["gpt_oss_mxfp4"]
    assert run(path, "triton", "triton") == run(path, "torch", "torch")


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_triton_backends_for_dsa(extra_checkpoints, arch):
    """DeepSeek-V3.2 and GLM-5 (top-k 8): the 18-token prompt and its decodes select through the
    Triton indexer and attend through the sparse attention kernel (GLM-5's shared layers reusing
    the selection)."""
    path = extra_checkpoints[arch]
    assert run(path, "triton", "triton") == run(path, "torch", "torch")
