"""The decode forward at EP 2 can be captured: a real 2-rank gloo job runs the engine's padded decode
steps (both ranks pad to the ladder size of the larger batch, the idle rank included) with each
rank's model forward under the guard that fails on any device-to-host read or data-dependent shape
(tests/sync_guard.py), so every MoE layer's dispatch and combine take the dispatcher's fixed-shape
exchange. The greedy tokens equal the single-process engine's on the same prompts."""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
# Rank 0 runs 3 sequences, rank 1 one that ends early: decode steps of 3 and 1 both pad to 4, then
# rank 1 runs empty padded forwards while rank 0 finishes.
PROMPTS = {0: [[5, 77, 301, 42], [9, 8, 7, 6, 5, 4], [450, 12, 13]], 1: [[31, 41, 59, 26, 5]]}
MAX_TOKENS = {0: 6, 1: 3}


def worker(path: str, backend: str, *rest: str) -> None:
    """rest: [speculative config JSON,] the result's path."""
    *spec, out_path = rest
    spec = spec[0] if spec else ""
    sys.path.insert(0, str(REPO))
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result = {"error": None}
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        rank = dist.get_rank()
        from moe_serve.engine.args import EngineArgs
        from moe_serve.engine.core import build_engine
        from moe_serve.platform import capturable
        from moe_serve.protocol import NewRequest
        from moe_serve.sampling_params import SamplingParams
        from moe_serve.scheduler import SchedulerOutput
        from tests.sync_guard import NoHostSync

        from moe_serve.engine.core_proc import agreed_shape, step_shape

        args = EngineArgs(model=path, dtype="float32", kv_cache_memory=1 << 20, pad_decode=True,
                          all2all_backend=backend, show_progress=False, speculative_config=spec or None)
        core = build_engine(args.create_engine_config(rank, WORLD))
        model, dispatcher = core.runner.model, core.moe_ctx.dispatcher
        guarded, static = [], []
        plain = model.forward

        def forward(ids_T, positions_T, meta, step):
            if meta.is_decode_only:
                guarded.append(ids_T.shape[0])
                static.append(step.static_rows)
                with NoHostSync(), capturable(model):
                    return plain(ids_T, positions_T, meta, step)
            if spec and set(meta.query_lens_cpu) == {3}:  # verify steps (the torch backends are not guarded)
                static.append(step.static_rows)
            return plain(ids_T, positions_T, meta, step)

        model.forward = forward
        for i, p in enumerate(PROMPTS[rank]):
            core.add_request(NewRequest(str(i), p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS[rank] + (6 if spec else 0),
                                                                  ignore_eos=True)))
        toks = {str(i): [] for i in range(len(PROMPTS[rank]))}
        while True:  # the core loop's per-step agreement, reduced to what padding needs
            sched = core.schedule() if core.has_unfinished() else None
            flags = torch.tensor([sched.num_batched_tokens if sched else 0, *step_shape(sched)])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            max_tok, q_max, neg_q_min = (int(v) for v in flags)
            if max_tok == 0:
                break
            for o in core.execute(sched or SchedulerOutput(), lockstep=True, max_tokens_any_rank=max_tok,
                                  uniform_len=agreed_shape(q_max, neg_q_min)):
                toks[o.request_id] += o.new_token_ids
        result.update(tokens=[toks[str(i)] for i in range(len(PROMPTS[rank]))], guarded=guarded, static=static)
        dist.destroy_process_group()
    except BaseException:
        result["error"] = traceback.format_exc()
    Path(out_path).write_text(json.dumps(result))


# Mixtral's path (GQA, softmax top-k) is Qwen3-MoE's; DeepSeek-V3 adds MLA and grouped routing.
# (The allgather dispatch serves through the launcher in test_launcher.py.)
@pytest.mark.parametrize("arch,backend", [("qwen3_moe", "all_to_all"), ("deepseek_v3", "all_to_all")])
def test_ep2_decode_forward_has_no_host_sync(checkpoints, tmp_path, arch, backend):
    from moe_serve import LLM, SamplingParams
    from tests.distributed.jobs import run_rank_scripts

    path = checkpoints[arch]
    res = run_rank_scripts(tmp_path, __file__, [path, backend], WORLD)
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 20, show_progress=False)
    for rank in range(WORLD):
        sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[rank], ignore_eos=True)
        want = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS[rank]],
                                                                    sp)]
        assert res[rank]["tokens"] == want, rank
    # Every decode step ran guarded, padded to 4 rows on both ranks (rank 1's empty steps too), with
    # the dispatcher told so: the same number of guarded steps on each rank, all of the same size.
    assert res[0]["guarded"] == res[1]["guarded"] and set(res[0]["guarded"]) == {4}
    assert len(res[0]["guarded"]) == MAX_TOKENS[0] - 1
    assert all(s == 4 for r in res for s in r["static"])


def test_ep2_verify_steps_pad_to_a_common_shape(extra_checkpoints, tmp_path):
    """MTP speculative decoding (K = 2) at EP 2: verify steps of 3 tokens per sequence pad to the
    verify ladder's size for the larger batch on both ranks (rank 1's empty steps too), every MoE
    layer told the fixed row count; the MTP passes run on both ranks every step; tokens equal the
    single-process plain engine's."""
    from moe_serve import LLM, SamplingParams
    from tests.distributed.jobs import run_rank_scripts

    path = extra_checkpoints["deepseek_v3_mtp_copy"]
    res = run_rank_scripts(tmp_path, __file__, [path, "all_to_all", '{"method": "mtp", "num_speculative_tokens": 2}'],
                           WORLD)
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 20, show_progress=False)
    for rank in range(WORLD):
        sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[rank] + 6, ignore_eos=True)
        want = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS[rank]],
                                                                    sp)]
        assert res[rank]["tokens"] == want, rank
    verify = [[s for s in r["static"] if s is not None and s % 3 == 0 and s > 3] for r in res]
    assert verify[0] and verify[0] == verify[1] and set(verify[0]) == {12}, res  # 3 (rank 0) and 1 (rank 1) pad to 4


if __name__ == "__main__":
    worker(*sys.argv[1:])
