"""KV-cache sizing after a profiling forward. On CUDA the runner runs the largest step
(max_num_batched_tokens dummy tokens) before sizing the cache and gives it what is left after that
step's peak; on the CPU it does not by default. Here the CPU runs the same path with a probe of its
own: the profiling forward must see max_num_batched_tokens tokens, the cache must be sized from the
probe's numbers, and generation afterwards must be unaffected by the temporary caches."""
import pytest
import torch

from moe_serve import LLM, SamplingParams
from moe_serve.runner import memory as mr

N_TOKENS = 96


class RecordingProbe:
    """Free and peak bytes as given; records the widest token-id input any module saw in between."""

    def __init__(self, free: int, peak: int):
        self.free, self.peak, self.calls, self.widest = free, peak, [], 0
        self._hook = None

    def _see(self, module, args, output):
        for a in args:
            if isinstance(a, torch.Tensor) and a.dtype == torch.int64 and a.dim() == 1:
                self.widest = max(self.widest, a.numel())

    def reset(self):
        self.calls.append("reset")
        self._hook = torch.nn.modules.module.register_module_forward_hook(self._see)

    def peak_bytes(self):
        self.calls.append("peak")
        self._hook.remove()
        return self.peak

    def free_bytes(self):
        self.calls.append("free")
        return self.free


@pytest.mark.parametrize("max_model_len", [None, 40], ids=["one-sequence", "three-sequences"])
def test_profiling_forward_sizes_the_kv_cache(checkpoints, monkeypatch, max_model_len):
    # max_model_len 40 < 96 tokens: the profiling step is three prefills (40, 40, 16).
    probe = RecordingProbe(free=24 << 20, peak=4 << 20)
    monkeypatch.setattr(mr, "memory_probe", lambda device: probe)
    kw = {"max_model_len": max_model_len} if max_model_len else {}
    llm = LLM(checkpoints["qwen3_moe"], dtype="float32", max_num_batched_tokens=N_TOKENS, memory_fraction=0.5,
              show_progress=False, **kw)
    runner = llm.engine.runner
    assert probe.calls == ["reset", "peak", "free"] and probe.widest == N_TOKENS
    assert runner.profile_peak_bytes == 4 << 20
    assert runner.graph_estimate_bytes == 0  # no decode graphs on the CPU: nothing reserved for them
    per_block = runner.kv_cache_bytes // runner.num_blocks
    assert runner.num_blocks == mr.kv_budget_after_profile(24 << 20, 4 << 20, 0.5) // per_block == (8 << 20) // per_block
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 30))}, {"prompt_token_ids": [5, 6, 7]}]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    monkeypatch.undo()
    plain = LLM(checkpoints["qwen3_moe"], dtype="float32", max_num_batched_tokens=N_TOKENS, kv_cache_memory=1 << 22,
                show_progress=False, **kw)
    assert plain.engine.runner.profile_peak_bytes is None  # an explicit budget: no profiling
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]


def test_cpu_default_does_not_profile():
    assert mr.memory_probe(torch.device("cpu")) is None
    assert mr.kv_budget_after_profile(10, 20, 0.9) == 0


def test_graph_memory_estimate():
    """The ladder's graphs: the largest capture's pool (shared by all) plus, for each other graph,
    what the smallest capture took; a ladder of one graph is its capture."""
    assert mr.graph_memory_estimate(300 << 20, 2 << 20, 10) == (300 << 20) + 9 * (2 << 20)
    assert mr.graph_memory_estimate(5 << 20, 5 << 20, 1) == 5 << 20
    assert mr.kv_budget_after_profile(1000, 100 + 50, 0.9) == 750  # peak and graphs both come off
