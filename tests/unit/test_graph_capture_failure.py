"""A decode-graph capture that fails (an injected error of a kind other than RuntimeError, as a
Triton compile error is) leaves the engine serving: no padding where it was only for the graphs,
padding kept where pad_decode asked for it, and the trial capture before the KV cache is sized
reserves nothing instead of aborting the start-up."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_serve import cuda_graph
from moe_serve.config import GraphConfig
from moe_serve.runner import graphs, memory
from moe_serve.spec_decode import verify


class CompileError(Exception):
    """Stands in for triton's CompilationError (not a RuntimeError)."""


class FailingGraphs:
    def __init__(self, *args, **kwargs):
        pass

    def capture(self, agree):
        raise CompileError("ptxas fatal: out of registers")


def _cfg(pad_decode, speculative=None):
    return SimpleNamespace(graphs=GraphConfig(pad_decode=pad_decode), scheduler=SimpleNamespace(max_num_seqs=8),
                           cache=SimpleNamespace(block_size=16), device=torch.device("cuda"),  # the CUDA path, simulated
                           model=SimpleNamespace(max_model_len=64), speculative=speculative)


@pytest.mark.parametrize("pad_decode, padded", [(None, False), (True, True)])
def test_failed_capture_runs_eagerly(monkeypatch, caplog, pad_decode, padded):
    monkeypatch.setattr(cuda_graph, "DecodeGraphs", FailingGraphs)
    kv = SimpleNamespace(scratch_block=0, group_scratch={}, state_scratch=None, graph_estimate_bytes=0)
    moe_ctx = SimpleNamespace(dispatcher=None)
    batch = SimpleNamespace(max_blocks=4, max_model_len=64)
    pad_sizes, got = graphs.capture_decode_graphs(None, _cfg(pad_decode), moe_ctx, batch, kv, True)
    assert got is None
    assert pad_sizes == (cuda_graph.capture_sizes(8, None) if padded else [])
    assert "capture failed" in caplog.text and "CompileError" in caplog.text


@pytest.mark.parametrize("pad_decode, padded", [(None, False), (True, True)])
def test_failed_verify_capture_runs_eagerly(monkeypatch, caplog, pad_decode, padded):
    """Speculative decoding's verify graphs (3 tokens per sequence) fail the same way."""
    from moe_serve.spec_decode import SpeculativeConfig

    monkeypatch.setattr(cuda_graph, "DecodeGraphs", FailingGraphs)
    kv = SimpleNamespace(scratch_block=0, group_scratch={}, state_scratch=None, graph_estimate_bytes=0)
    batch = SimpleNamespace(max_blocks=4, max_model_len=64)
    cfg = _cfg(pad_decode, SpeculativeConfig("mtp", 2))
    got = verify.capture_verify_graphs(None, cfg, SimpleNamespace(dispatcher=None), batch, kv, True)
    assert got == ((3, cuda_graph.verify_capture_sizes(8, None, 3), None) if padded else (0, [], None))
    assert "verify CUDA graph capture failed" in caplog.text and "CompileError" in caplog.text


def test_failed_trial_capture_reserves_nothing(monkeypatch, caplog):
    monkeypatch.setattr(cuda_graph, "DecodeGraphs", FailingGraphs)
    monkeypatch.setattr(memory, "_bind_temporary", lambda *a: None)
    monkeypatch.setattr(memory, "_unbind", lambda *a: None)
    probe = SimpleNamespace(free_bytes=lambda: 1 << 30)
    got = memory.profile_graph_memory(None, [], _cfg(None), SimpleNamespace(dispatcher=None), probe)
    assert got == 0 and "CompileError" in caplog.text
