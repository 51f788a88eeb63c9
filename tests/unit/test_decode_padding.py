"""Decode steps padded to the capture ladder (moe_serve/cuda_graph.py), run eagerly on the CPU with
the padding forced on: the same tokens as the unpadded engine (greedy, a penalty and seeded
sampling; batches that are not ladder sizes, that shrink as requests finish and grow as others
arrive), padded rows write KV only into the scratch block, and the padded decode forward has no
host sync (what the captured CUDA graph needs)."""
from __future__ import annotations

import argparse

import pytest
import torch

from moe_serve.platform import capturable
from moe_serve import LLM, SamplingParams
from moe_serve.cuda_graph import DecodeGraphs, capture_sizes, padded_size
from moe_serve.engine.args import EngineArgs
from moe_serve.protocol import NewRequest
from tests.sync_guard import NoHostSync

FIRST = [[5, 77, 301, 42], [9, 8, 7, 6, 5, 4], [450, 12, 13]]
LATER = [[33, 34, 35], [100, 101, 102, 103, 104], [7, 7, 7, 7], [61, 62], [250, 251, 252, 253, 254, 255, 256]]
PARAMS = [dict(temperature=0, max_tokens=9), dict(temperature=0, max_tokens=3, repetition_penalty=1.3),
          dict(temperature=0.8, seed=11, max_tokens=6), dict(temperature=0, max_tokens=7),
          dict(temperature=0, max_tokens=2, presence_penalty=0.5), dict(temperature=0.7, seed=3, max_tokens=8),
          dict(temperature=0, max_tokens=5), dict(temperature=0, max_tokens=4)]


def test_capture_ladder():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]  # the cap itself closes the ladder
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1024)[-3:] == [496, 504, 512]  # default cap
    assert capture_sizes(64, max_capture_size=10) == [1, 2, 4, 8, 10]
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (0, 1, 2, 3, 5, 8, 9, 17, 64, 65)] == [None, 1, 2, 4, 8, 8, 16, 24, 64, None]


def test_enforce_eager_and_capture_size_flags(checkpoints):
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    ns = p.parse_args(["--enforce-eager", "--max-capture-size", "8", "--pad-decode"])
    g = EngineArgs.from_cli(ns, checkpoints["qwen3_moe"]).create_engine_config().graphs
    assert (g.enforce_eager, g.max_capture_size, g.pad_decode) == (True, 8, True)
    g = EngineArgs.from_cli(p.parse_args([]), checkpoints["qwen3_moe"]).create_engine_config().graphs
    assert (g.enforce_eager, g.max_capture_size, g.pad_decode) == (False, None, None)
    with pytest.raises(ValueError, match="max_capture_size"):
        EngineArgs(checkpoints["qwen3_moe"], max_capture_size=0).create_engine_config()
    # LLM keywords reach the runner: the ladder follows max_capture_size; eager, the CPU pads only
    # when asked; by default it records its decode steps (moe_serve/cpu_graph.py) over the CPU ladder.
    llm = LLM(checkpoints["qwen3_moe"], dtype="float32", kv_cache_memory=1 << 20, show_progress=False,
              pad_decode=True, max_capture_size=6, enforce_eager=True)
    assert llm.engine.runner.pad_sizes == [1, 2, 4, 6] and llm.engine.runner.graphs is None
    assert LLM(checkpoints["qwen3_moe"], dtype="float32", kv_cache_memory=1 << 20, show_progress=False,
               enforce_eager=True).engine.runner.pad_sizes == []
    runner = LLM(checkpoints["qwen3_moe"], dtype="float32", kv_cache_memory=1 << 20, show_progress=False,
                 max_num_seqs=64).engine.runner
    assert runner.pad_sizes == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32] == runner.graphs.sizes and list(runner.graphs.graphs) == [1]


def _caches(runner) -> list[torch.Tensor]:
    return [t for _, t in _group_caches(runner)]


def _group_caches(runner) -> list[tuple[int, torch.Tensor]]:
    """(cache group, tensor) of every paged attention layer's cache."""
    return [(layer.cache_group, t) for layer in runner.attn_layers
            for t in ([layer.k_cache, layer.v_cache] if hasattr(layer, "k_cache") else [layer.latent_cache])]


def _run(path: str, pad: bool, static_buffers: bool = False):
    """Tokens per request, the decode batch sizes the model saw (real, padded), the blocks the
    allocator gave requests, and the runner. Padded decode forwards run under the no-sync guard.
    static_buffers: padded steps go through DecodeGraphs (uncaptured on the CPU: the model runs
    eagerly on the static buffers and metadata a captured graph reads)."""
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_seqs=16, show_progress=False, pad_decode=pad,
              enforce_eager=pad)  # padded and eager (no CPU recording)
    core, runner = llm.engine, llm.engine.runner
    if static_buffers:
        # From batch 2: the torch backend's one-decode path sizes its gather from host lengths, so
        # batch 1 is not graph-safe on it (which is why only the Triton backend is captured).
        runner.pad_sizes = [2, 4, 8, 16]
        runner.graphs = DecodeGraphs(runner.model, runner.pad_sizes, runner.batch.max_blocks, runner.batch.block_size,
                                     runner.batch.max_model_len, runner.scratch_block, runner.device,
                                     runner.batch.group_scratch, runner.batch.state_scratch)
    model, plain = runner.model, runner.model.forward
    seen: list[int] = []

    def forward(ids_T, positions_T, meta, step):
        if meta.is_decode_only:
            seen.append(ids_T.shape[0])
            with NoHostSync(), capturable(model):
                return plain(ids_T, positions_T, meta, step)
        return plain(ids_T, positions_T, meta, step)

    model.forward = forward
    used: dict[int, set[int]] = {g: set() for g in range(len(runner.group_scratch))}
    execute = runner.execute

    def execute_recording(out, *a, **kw):  # the blocks the allocator gave the scheduled requests, per group
        for s in out.scheduled:
            for g, table in enumerate([s.request.block_ids, *s.request.group_block_ids]):
                used[g].update(b for b in table if b != runner.group_scratch[g])  # freed windowed entries
        return execute(out, *a, **kw)

    runner.execute = execute_recording
    prompts = FIRST + LATER
    toks: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}

    def add(i):
        core.add_request(NewRequest(str(i), prompts[i], SamplingParams(ignore_eos=True, **PARAMS[i])))

    for i in range(len(FIRST)):
        add(i)
    step = 0
    while core.has_unfinished():
        if step == 3:  # the batch grows mid-run (3 -> 8 running), then shrinks as requests finish
            for i in range(len(FIRST), len(prompts)):
                add(i)
        for o in core.step():
            toks[o.request_id] += o.new_token_ids
        step += 1
    return [toks[str(i)] for i in range(len(prompts))], seen, used, runner


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_padded_decode_matches_unpadded(checkpoints, arch):
    want, seen_plain, used_plain, plain = _run(checkpoints[arch], pad=False)
    got, seen, used, runner = _run(checkpoints[arch], pad=True)
    assert got == want
    ladder = runner.pad_sizes
    assert ladder == [1, 2, 4, 8, 16]
    # Unpadded decode batches of sizes off the ladder ran; padded, every decode batch is a ladder size.
    assert set(seen_plain) - set(ladder) and set(seen) <= set(ladder)
    assert max(seen) == 8 and 4 in seen
    # KV: beyond the blocks requests were given, only the scratch block was written, and the
    # requests' blocks hold what the unpadded run wrote there.
    assert runner.scratch_block == runner.num_blocks and runner.group_scratch[0] == runner.num_blocks
    assert used == used_plain
    for (g, t), t_plain in zip(_group_caches(runner), _caches(plain)):
        scratch = runner.group_scratch[g]
        assert t.shape[0] == scratch + 1 and scratch not in used[g]
        others = [b for b in range(t.shape[0]) if b not in used[g] and b != scratch]
        assert not t[others].any()
        assert t[scratch, 0].any() and not t[scratch, 1:].any()  # padded rows write slot 0 only
        idx = sorted(used[g])
        torch.testing.assert_close(t[idx], t_plain[idx], rtol=1e-5, atol=1e-5)


def test_no_padding_while_expert_load_is_recorded(checkpoints):
    """Padded rows would count as routed tokens (and a graph replay would skip the hook)."""
    llm = LLM(checkpoints["qwen3_moe"], dtype="float32", kv_cache_memory=1 << 20, show_progress=False, pad_decode=True,
              enforce_eager=True)
    core, runner = llm.engine, llm.engine.runner
    rec = core.load_recorder or core.enable_load_recording(10)
    decode3 = [(0, 4, 1, True), (1, 6, 1, True), (2, 3, 1, True)]
    assert runner._pad_to(decode3, None, True) == (4, 1)
    assert runner._pad_to(decode3 + [(3, 0, 5, True)], None, True) is None  # a prefill in the step
    assert runner._pad_to(decode3, 3, False) is None  # another rank has one
    rec.start()
    assert runner._pad_to(decode3, None, True) is None
    rec.stop()
    assert runner._pad_to(decode3, None, True) == (4, 1)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_graph_static_buffers_match_unpadded(checkpoints, arch):
    """What a captured decode graph reads: the step's inputs copied into buffers sized for the
    largest ladder size, host lengths at max_model_len (the split count), block-table columns past
    the step's width stale. Run eagerly on the CPU, the tokens equal the unpadded engine's."""
    want, _, _, _ = _run(checkpoints[arch], pad=False)
    got, seen, _, runner = _run(checkpoints[arch], pad=True, static_buffers=True)
    assert got == want and set(seen) <= {2, 4, 8, 16} and 2 in seen
    assert runner.graphs.ids.shape[0] == 16 and not runner.graphs.graphs  # nothing captured on the CPU
