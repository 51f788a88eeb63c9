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
    assert "no MoE layers" in refusal(False, False)
    assert "kv_transfer_params" in refusal(True, True) and "return_routed_experts" in refusal(True, True)
    assert refusal(True, False) is None
    with pytest.raises(ValueError, match="return_routed_experts"):
        SamplingParams(return_routed_experts=1)


def test_the_core_refuses_a_disaggregated_request_that_asks():
    from types import SimpleNamespace

    from moe_serve.engine.features.routed_experts import RoutedExperts

    f = RoutedExperts(SimpleNamespace(num_blocks=4, load_hooks=[]), num_layers=2, top_k=3, block_size=4,
                      prefix_caching=True)
    asks = SimpleNamespace(params=SamplingParams(return_routed_experts=True))
    with pytest.raises(ValueError, match="return_routed_experts"):
        f.admit(asks, SimpleNamespace(kv=object()))
    f.admit(asks, SimpleNamespace(kv=None))
    f.admit(SimpleNamespace(params=SamplingParams()), SimpleNamespace(kv=object()))
