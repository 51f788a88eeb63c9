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


# MLA runs through the Triton backends in the DSA models below (GLM-5 here, DeepSeek-V3.2 in the
# host-read test).
@pytest.mark.parametrize("arch", ["qwen3_moe"])
def test_triton_backends_match_torch_backends(checkpoints, arch):
    ref = run(checkpoints[arch], "torch", "torch")
    assert run(checkpoints[arch], "triton", "triton") == ref


def test_triton_backends_for_gpt_oss(extra_checkpoints):
    """GPT-OSS (sliding-window and full layers, sinks, MXFP4 experts): the 18-token prompt and its
    decodes cross the 12-token window in blocks of 4, through the Triton attention kernel."""
    path = extra_checkpoints["gpt_oss_mxfp4"]
    assert run(path, "triton", "triton") == run(path, "torch", "torch")


@pytest.mark.parametrize("arch", ["glm_moe_dsa"])
def test_triton_backends_for_dsa(extra_checkpoints, arch):
    """GLM-5 (top-k 8): the 18-token prompt and its decodes select through the Triton indexer and
    attend through the sparse attention kernel, its shared layers reusing the selection (DeepSeek-V3.2's
    unshared layers run through them in the host-read test below)."""
    path = extra_checkpoints[arch]
    assert run(path, "triton", "triton") == run(path, "torch", "torch")


GUARDED = r"""
import json, sys
from moe_serve import LLM, SamplingParams
from moe_serve.platform import capturable
from moe_serve.protocol import NewRequest
from tests.sync_guard import NoHostSync
out = {}
for path in sys.argv[1:]:
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 20, moe_backend="triton", attention_backend="triton",
              linear_attention_backend="triton", show_progress=False)
    core, model = llm.engine, llm.engine.runner.model
    plain, guarded = model.forward, []

    def forward(ids_T, positions_T, meta, step, plain=plain, guarded=guarded, model=model):
        if meta.is_decode_only:  # what a captured step runs: the capturable forms, under the guard
            guarded.append(ids_T.shape[0])
            with NoHostSync(), capturable(model):
                return plain(ids_T, positions_T, meta, step)
        return plain(ids_T, positions_T, meta, step)

    model.forward = forward
    for i, p in enumerate([[5, 77, 301, 42], [9, 8, 7, 6, 5, 4], [450, 12, 13]]):
        core.add_request(NewRequest(str(i), p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    while core.has_unfinished():
        core.step()
    out[path] = guarded
print(json.dumps(out))
"""


def test_decode_through_the_triton_backends_reads_nothing_on_the_host(extra_checkpoints):
    """The decode step a CUDA graph would hold, run through the Triton backends (the interpreter
    here) under the sync guard: MLA with DSA's indexer and sparse kernel, GPT-OSS's sliding and
    sink layers with its MXFP4 experts on the grouped-GEMM path, Qwen3-Next's Triton linear
    attention beside gated attention. (The CPU guard cannot see a read inside an aten kernel, such
    as CUDA's bincount: it refuses the op itself.)"""
    paths = [extra_checkpoints[a] for a in ("deepseek_v32", "gpt_oss_mxfp4", "qwen3_next")]
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", GUARDED, *paths], capture_output=True, text=True, env=env, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0, r.stderr[-3000:]
    guarded = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(g and max(g) == 3 for g in guarded.values()), guarded  # whole-batch decode steps ran guarded


VERIFY = r"""
import json, sys
from moe_serve import LLM, SamplingParams
from moe_serve.cuda_graph import DecodeGraphs
from moe_serve.platform import capturable
from tests.models.test_mtp import prompts
from tests.sync_guard import NoHostSync
path, backend, static = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_seqs=8, moe_backend=backend, attention_backend=backend,
          show_progress=False, pad_decode=static, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
runner = llm.engine.runner
model, plain, guarded = runner.model, runner.model.forward, []
if static:
    runner.verify_graphs = DecodeGraphs(model, runner.verify_pad_sizes, runner.batch.max_blocks,
                                        runner.batch.block_size, runner.batch.max_model_len, runner.scratch_block,
                                        runner.device, query_len=3)

    def forward(ids_T, positions_T, meta, step):
        if set(meta.query_lens_cpu) == {3}:  # what a captured verify graph runs, under the guard
            guarded.append(meta.num_seqs)
            with NoHostSync(), capturable(model):
                return plain(ids_T, positions_T, meta, step)
        return plain(ids_T, positions_T, meta, step)

    model.forward = forward
ps = prompts(3, seed=4)
sps = [SamplingParams(max_tokens=5 + 2 * i, temperature=0, ignore_eos=True) for i in range(3)]
outs = llm.generate([{"prompt_token_ids": p} for p in ps], sps, use_tqdm=False)
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "guarded": guarded}))
"""


def test_verify_graph_buffers_through_the_triton_backends(extra_checkpoints):
    """Speculative decoding's verify step as a captured graph holds it (3 tokens per sequence,
    padded to the verify ladder, the static buffers with host lengths at max_model_len), through
    the Triton backends under the sync guard: the tokens equal the torch backends' unpadded run."""
    path = extra_checkpoints["deepseek_v3_mtp_copy"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def run_verify(backend: str, static: bool) -> dict:
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        r = subprocess.run([sys.executable, "-c", VERIFY, path, backend, "1" if static else "0"], capture_output=True,
                           text=True, env=env, timeout=600, cwd=root)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    want = run_verify("torch", False)["tokens"]
    got = run_verify("triton", True)
    assert got["tokens"] == want
    assert got["guarded"] and set(got["guarded"]) <= {1, 2, 4} and 4 in got["guarded"]  # 3 sequences padded to 4
