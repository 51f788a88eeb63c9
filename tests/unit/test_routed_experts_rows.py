"""The front end's assembly of routed-expert chunks (moe_serve/routed_experts.py): rows in order,
recomputed rows replacing earlier ones, both response forms, and the refusals' wording."""
import base64

import numpy as np
import pytest

from moe_serve.protocol import RoutedExpertRows
from moe_serve.routed_experts import RoutedExperts, positions_of, refusal
from moe_serve.sampling_params import SamplingParams


def chunk(start: int, rows: np.ndarray) -> RoutedExpertRows:
    return RoutedExpertRows(start, rows.shape[1], rows.shape[2], rows.astype("<i2").tobytes())


def test_chunks_assemble_and_recomputed_rows_replace():
    a = np.arange(5 * 2 * 3).reshape(5, 2, 3)
    r = RoutedExperts()
    r.add(chunk(0, a[:3]))
    r.add(chunk(3, a[3:]))
    r.add(chunk(1, a[1:4] + 100))  # positions 1..3 recomputed (preemption): their rows replace
    want = a.copy()
    want[1:4] += 100
    assert r.num_positions == 5
    assert np.array_equal(r.as_array(), want)
    assert r.encoded(5) == want.tolist()
    assert np.array_equal(np.frombuffer(base64.b64decode(r.encoded(4, "base64")), "<i2").reshape(-1, 2, 3), want[:4])
    with pytest.raises(ValueError, match="position 9"):
        r.add(chunk(9, a[:1]))


def test_positions_and_refusals():
    assert positions_of(7, 3) == 9
    assert "no MoE layers" in refusal(False) and "return_routed_experts" in refusal(False)
    assert refusal(True) is None  # disaggregated requests too: the prefill instance sends its rows
    with pytest.raises(ValueError, match="return_routed_experts"):
        SamplingParams(return_routed_experts=1)


def test_a_disaggregated_request_takes_its_prompt_rows_from_its_kv_done():
    """Decode side: the prefill instance's rows come with an ok KVDone and fill the positions the
    request did not compute, once; a failed transfer's or another model's rows are not taken."""
    from types import SimpleNamespace

    from moe_serve.engine.features.routed_experts import UNKNOWN, RoutedExperts
    from moe_serve.protocol import KVDone, RoutedExpertRows

    f = RoutedExperts(SimpleNamespace(num_blocks=4, load_hooks=[]), num_layers=2, top_k=3, block_size=4,
                      prefix_caching=False)
    req = SimpleNamespace(request_id="a", num_tokens=7, params=SamplingParams(return_routed_experts=True))
    f.on_request_added(req)
    seq = f._live["a"]
    a = np.arange(6 * 2 * 3, dtype=np.int16).reshape(6, 2, 3)
    f.on_input("kv_done", [KVDone("a", False, "failed", True, RoutedExpertRows(0, 2, 3, a.tobytes())),
                           KVDone("b", True, "", True, RoutedExpertRows(0, 2, 3, a.tobytes()))])
    assert seq.remote is None  # not ok: the decode side computes (and records) the prompt itself
    f.on_input("kv_done", [KVDone("a", True, "", True, RoutedExpertRows(0, 3, 2, a.tobytes()))])
    assert seq.remote is None  # not this model's shape
    f.on_input("kv_done", [KVDone("a", True, "", True, RoutedExpertRows(0, 2, 3, a.tobytes()))])
    f._fill(seq, 6)
    assert seq.valid == 6 and np.array_equal(seq.rows[:6], a) and (seq.rows[6:] == UNKNOWN).all()
    assert seq.remote is None  # used once: a recompute after a preemption records its own rows
