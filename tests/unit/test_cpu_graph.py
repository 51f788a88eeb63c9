"""CPU decode graphs (moe_serve/cpu_graph.py): a decode forward recorded once per ladder size and
replayed over the static buffers gives exactly what the eager forward gives, step after step, with
new inputs each time; what a recording cannot hold fails the capture instead of replaying stale
values."""
import random

import pytest
import torch

from moe_serve import LLM, SamplingParams
from moe_serve.cpu_graph import CaptureError, CpuGraph


def _generate(path, eager: bool, prompts, n: int, dtype: str = "float32", monkeypatch=None, **kw):
    llm = LLM(path, dtype=dtype, kv_cache_memory=1 << 22, show_progress=False, enforce_eager=eager, **kw)
    graphs = llm.engine.runner.graphs
    replays = []
    if graphs is not None:
        plain = CpuGraph.replay

        def counted(self):
            replays.append(next(B for B, (g, _) in graphs.graphs.items() if g is self))
            return plain(self)

        monkeypatch.setattr(CpuGraph, "replay", counted)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=n + 3 * i, ignore_eos=True, logprobs=2)
                         for i in range(len(prompts))])
    got = [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
           for o in outs]
    return got, graphs, replays


@pytest.mark.parametrize("arch,dtype", [("qwen3_moe", "float32"), ("mixtral", "float32"), ("qwen3_moe", "bfloat16")])
def test_cpu_graph_decode_equals_eager(checkpoints, arch, dtype, monkeypatch):
    """Eleven sequences of different lengths, one finishing every third step: the decode batch
    shrinks through the ladder (padded sizes included: 11 .. 9 -> 16), contexts cross block
    boundaries. Every token and its logprobs equal the eager engine's, and the graphs did run. In
    bfloat16 (float32 activations over bf16 weights and embedding table: the rows' widening is a `to`
    that inference mode dispatches as an op that may alias its input, and does not). The recordings
    hold the LM head over every row (padding's too), which the eager steps run on the sampled rows."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(3, 30))] for _ in range(11)]
    eager, none, _ = _generate(checkpoints[arch], True, prompts, 12, dtype)
    graphed, graphs, replays = _generate(checkpoints[arch], False, prompts, 12, dtype, monkeypatch)
    assert none is None and graphs is not None
    # each size recorded by its first step (1 at start-up), replayed by the next ones
    assert set(graphs.graphs) == set(range(1, 9)) | {16} == set(replays), (sorted(graphs.graphs), sorted(set(replays)))
    # and each recorded its LM head too: the graphed steps' logits came from the recordings
    assert set(graphs.logits) == set(graphs.graphs)
    assert all(graphs.logits[B].shape[0] == B for B in graphs.logits)
    for (toks_e, lp_e), (toks_g, lp_g) in zip(eager, graphed):
        assert toks_g == toks_e
        for a, b in zip(lp_e, lp_g):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 1e-5 for t in a)


def test_cpu_graph_not_captured_for_layers_that_decide_on_the_host(checkpoints):
    """MLA (DeepSeek-V3) attends through paths that read host lengths: its decode steps stay eager."""
    llm = LLM(checkpoints["deepseek_v3"], dtype="float32", kv_cache_memory=1 << 22, show_progress=False)
    assert llm.engine.runner.graphs is None
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_cpu_graph_replays_ops_into_their_tensors():
    """Ops that make new tensors are computed again into them (their out= form where one takes the
    same argument types, or the op and a copy: `to`, which inference mode dispatches as an op that
    may alias), ops that write into an
    argument are repeated, views are left alone; the replay equals the eager function on new inputs."""
    w = torch.randn(64, 16, dtype=torch.float64)
    ids = torch.tensor([3, 9])
    x = torch.randn(2, 16, dtype=torch.float64)

    def fn():
        rows = torch.nn.functional.embedding(ids, w).to(torch.float32)  # a copy, then a dtype change
        h = rows + x.t().contiguous().t().float()  # a copy of a transposed view
        vals, idx = torch.topk(h, 4, dim=-1)  # two outputs (topk.values)
        acc = torch.zeros(2, 16)
        acc.index_add_(1, idx[0], vals)  # writes into a tensor the recording made
        acc += 1
        gated = torch.where(h[:, :8] > 0, h[:, :8], 8)  # where.ScalarOther: its out form takes a tensor
        return acc[:, :8] * torch.softmax(gated, dim=-1)  # a view of a made tensor

    with torch.inference_mode():
        g = CpuGraph()
        g.capture(fn)
        for _ in range(3):
            ids.copy_(torch.randint(0, 64, (2,)))
            x.copy_(torch.randn(2, 16, dtype=torch.float64))
            want = fn()
            got = g.replay()
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert g.memory_bytes > 0


@pytest.mark.parametrize("read", ["item", "int", "tolist", "nonzero", "mask"])
def test_cpu_graph_refuses_host_reads(read):
    """Host reads of values, and ops whose output shape depends on the values, fail the capture."""
    t = torch.tensor([2.0, 3.0])

    def fn():
        y = t * 2
        return {"item": lambda: y[0].item(), "int": lambda: int(y[0]), "tolist": lambda: y.tolist(),
                "nonzero": lambda: torch.nonzero(y > 5), "mask": lambda: y[y > 5]}[read]()

    with torch.inference_mode(), pytest.raises(CaptureError, match="host|depends on the values"):
        CpuGraph().capture(fn)
    assert t.tolist() == [2.0, 3.0]  # the recording's guards are gone afterwards


def test_cpu_graph_flags(checkpoints):
    """--enforce-eager keeps the CPU eager too; --max-capture-size sets the CPU ladder's top."""
    llm = LLM(checkpoints["qwen3_moe"], dtype="float32", kv_cache_memory=1 << 22, show_progress=False,
              max_capture_size=4)
    assert llm.engine.runner.pad_sizes == llm.engine.runner.graphs.sizes == [1, 2, 3, 4]
    assert LLM(checkpoints["qwen3_moe"], dtype="float32", kv_cache_memory=1 << 22, show_progress=False,
               enforce_eager=True).engine.runner.graphs is None


def test_failed_recording_on_first_use_runs_eagerly(checkpoints, monkeypatch, caplog):
    """A size whose recording fails when a step first needs it: that step and the later ones run
    eagerly (on the static buffers), with the same tokens, and nothing more is recorded."""
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    want, _, _ = _generate(checkpoints["qwen3_moe"], True, prompts, 6)
    plain = CpuGraph.capture
    calls = []

    def capture(self, fn):
        calls.append(1)
        if len(calls) > 1:  # the start-up recording succeeds, the next one fails
            fn()  # part of a forward ran before the failure (its KV writes are repeated eagerly)
            raise CaptureError("the forward reads a tensor's value on the host (stand-in)")
        return plain(self, fn)

    monkeypatch.setattr(CpuGraph, "capture", capture)
    got, graphs, _ = _generate(checkpoints["qwen3_moe"], False, prompts, 6, monkeypatch=monkeypatch)
    assert got == want
    # batch 3's recording failed with its LM head, then once more without it (the failure came after
    # the forward, as far as the recording could tell); nothing was recorded after that
    assert list(graphs.graphs) == [1] and not graphs.record_lazily and len(calls) == 3
    assert graphs.logits.keys() == {1}
    assert "CPU recording of decode batch 3 failed" in caplog.text


@pytest.mark.skipif(not __import__("moe_serve.kernels.cpu_ops", fromlist=["x"]).available(),
                    reason="the C kernels did not build here (no C compiler)")
def test_cpu_graph_replays_runs_of_c_calls_from_c():
    """Consecutive C kernel calls are replayed by one call into replay.c (each kernel through its own
    C signature: void and int returns, int64, int, float and pointer arguments), torch ops between
    them from Python; the native replay equals the ctypes replay and the eager function bit for bit
    on new inputs, and a kernel's error code during a native run is raised naming the kernel."""
    from moe_serve import cpu_graph
    from moe_serve.kernels import cpu_ops
    from moe_serve.kernels.cpu_ops import quant
    from moe_serve.quantization.packed import quantize_reference

    g0 = torch.Generator().manual_seed(0)
    x, res = torch.randn(3, 64, generator=g0), torch.randn(3, 64, generator=g0)
    nw, w = torch.rand(64, generator=g0) + 0.5, torch.randn(48, 64, generator=g0)
    pw = quantize_reference(torch.randn(32, 48, generator=g0), 4, 16).compact()
    hits, ids = torch.zeros(9, dtype=torch.int32), torch.tensor([0, 3, -1])

    def fn():
        h, n = cpu_ops.rms_norm(x, nw, 1e-6, residual=res)  # void, a float argument
        y = cpu_ops.linear(n, w)  # void
        z = torch.tanh(y)  # a torch op between two runs
        q = quant.quant_linear(z, pw)  # int, int arguments
        cpu_ops.mark_slots(hits, ids)  # int
        return h, q

    with torch.inference_mode():
        g = CpuGraph()
        g.capture(fn)
        c_calls = [f.name for f, _, _ in g.calls if isinstance(f, cpu_graph._CCall)]
        assert c_calls == ["rms_norm_f32", "linear_f32", "quant_linear_f32", "mark_slots_i32"]
        for _ in range(3):
            x.copy_(torch.randn(3, 64))
            res.copy_(torch.randn(3, 64))
            want = [t.clone() for t in fn()]
            ctypes_replay = [t.clone() for t in g.replay(native=False)]
            native = g.replay()
            for a, b, c in zip(want, ctypes_replay, native):
                assert torch.equal(a, b) and torch.equal(a, c)
        runs = [f for f, _, _ in g.plan if isinstance(f, cpu_graph._NativeRun)]
        assert [r.names for r in runs] == [["rms_norm_f32", "linear_f32"], ["quant_linear_f32", "mark_slots_i32"]]
        assert not any(isinstance(f, cpu_graph._CCall) for f, _, _ in g.plan)
        ids[1] = 8  # past the 8 slots: mark_slots_i32 returns -1
        with pytest.raises(RuntimeError, match=r"cpu_ops.mark_slots_i32 failed during a decode graph replay \(code -1\)"):
            g.replay()
