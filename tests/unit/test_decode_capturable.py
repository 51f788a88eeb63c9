"""The decode forward of every architecture at EP 1 reads nothing back to the host and has no
data-dependent shapes (what a CUDA graph needs): the model forward of a decode step runs under a
guard that fails on such ops, and its tokens equal the unguarded run's."""
import pytest

from moe_serve import LLM, SamplingParams
from moe_serve.protocol import NewRequest
from moe_serve.platform import capturable
from tests.sync_guard import NoHostSync

PROMPTS = [[5, 77, 301, 42], [9, 8, 7, 6, 5, 4], [450, 12, 13]]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_decode_forward_has_no_host_sync(checkpoints, arch, monkeypatch):
    def run(guard: bool) -> list[list[int]]:
        # eager: the check runs the capturable path a CUDA graph would hold (a CPU graph replay
        # would not go through model.forward)
        llm = LLM(checkpoints[arch], dtype="float32", kv_cache_memory=1 << 20, show_progress=False, enforce_eager=True)
        core, model = llm.engine, llm.engine.runner.model
        guarded = []
        if guard:
            plain = model.forward

            def forward(ids_T, positions_T, meta, step):
                if meta.is_decode_only:  # prefill may sync; the captured decode step may not
                    guarded.append(ids_T.shape[0])
                    with NoHostSync(), capturable(model):
                        return plain(ids_T, positions_T, meta, step)
                return plain(ids_T, positions_T, meta, step)

            monkeypatch.setattr(model, "forward", forward)
        for i, p in enumerate(PROMPTS):
            core.add_request(NewRequest(str(i), p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)))
        toks = {str(i): [] for i in range(len(PROMPTS))}
        while core.has_unfinished():
            for o in core.step():
                toks[o.request_id] += o.new_token_ids
        if guard:
            assert guarded and max(guarded) == len(PROMPTS)  # decode steps of the whole batch ran guarded
        return [toks[str(i)] for i in range(len(PROMPTS))]

    assert run(guard=True) == run(guard=False)
