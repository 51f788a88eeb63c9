"""ExpertLoadRecorder: counts match bincount, windows close on schedule, reduce_fn, dump format."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from expert_parallel.placement.load_stats import ExpertLoadRecorder
from expert_parallel.placement.map import check_expert_load, load_expert_load


def _ids(rng, T, K, E):
    return torch.from_numpy(rng.integers(0, E, (T, K)))


def test_windows_hold_the_bincount_of_each_window():
    rng = np.random.default_rng(0)
    rec = ExpertLoadRecorder(num_layers=2, num_logical_experts=5, window_steps=3)
    rec.start()
    expected, current = [], torch.zeros(2, 5, dtype=torch.int64)
    for step in range(7):
        for layer in range(2):
            ids = _ids(rng, int(rng.integers(0, 6)), 2, 5)
            rec.record(layer, ids)
            current[layer] += torch.bincount(ids.flatten(), minlength=5)
        rec.end_step()
        if (step + 1) % 3 == 0:
            expected.append(current.clone())
            current.zero_()
    assert rec.num_windows == 2  # the 7th step's partial window is not closed
    assert torch.equal(rec.windows(), torch.stack(expected))


def test_negative_ids_are_ignored_and_dtypes_accepted():
    rec = ExpertLoadRecorder(1, 4, window_steps=1)
    rec.start()
    rec.record(0, torch.tensor([[0, -1], [3, 3]], dtype=torch.int32))
    rec.end_step()
    assert rec.windows()[0, 0].tolist() == [1, 0, 0, 2]


def test_nothing_is_recorded_unless_started_and_stop_keeps_the_partial_window():
    rec = ExpertLoadRecorder(1, 3, window_steps=2)
    rec.record(0, torch.tensor([[1]]))
    rec.end_step()
    rec.end_step()
    assert rec.num_windows == 0 and not rec.active
    rec.start()
    for _ in range(3):
        rec.record(0, torch.tensor([[2]]))
        rec.end_step()
    rec.stop()  # one full window of 2 steps, then 1 step of the next: kept, with its count
    assert rec.windows()[:, 0].tolist() == [[0, 0, 2], [0, 0, 1]]
    assert rec.window_step_counts() == [2, 1]
    rec.stop()  # nothing open: nothing added
    assert rec.num_windows == 2
    rec.start()  # a fresh start forgets the old windows
    assert rec.num_windows == 0 and rec.window_step_counts() == []


@pytest.mark.parametrize("window_steps, steps", [(100, 60), (4, 9), (3, 3)])
def test_a_recording_shorter_than_a_window_is_kept(window_steps, steps, tmp_path):
    """dump() of a running recording shows the open window without closing it; stop() closes it."""
    rng = np.random.default_rng(steps)
    rec = ExpertLoadRecorder(2, 5, window_steps=window_steps)
    rec.start()
    per_step = []
    for _ in range(steps):
        step = torch.zeros(2, 5, dtype=torch.int64)
        for layer in range(2):
            ids = _ids(rng, int(rng.integers(1, 6)), 2, 5)
            rec.record(layer, ids)
            step[layer] += torch.bincount(ids.flatten(), minlength=5)
        rec.end_step()
        per_step.append(step)
    full, rest = divmod(steps, window_steps)
    want = [sum(per_step[w * window_steps:(w + 1) * window_steps]) for w in range(full)]
    want_steps = [window_steps] * full
    if rest:
        want.append(sum(per_step[full * window_steps:]))
        want_steps.append(rest)
    dumped = rec.dump(tmp_path / "load.json")
    assert dumped["expert_load"] == torch.stack(want).tolist() and dumped["window_step_counts"] == want_steps
    assert rec.num_windows == full and rec.active  # the dump closed nothing
    load, meta = load_expert_load(tmp_path / "load.json", num_layers=2, num_logical_experts=5)
    assert load.tolist() == dumped["expert_load"] and meta["window_step_counts"] == want_steps
    rec.stop()
    assert rec.windows().tolist() == torch.stack(want).tolist() and rec.window_step_counts() == want_steps


@pytest.mark.parametrize("in_place", [True, False])
def test_reduce_fn_is_applied_to_each_window(in_place):
    seen = []

    def double(t):  # stands in for an all_reduce over two identical ranks
        seen.append(t.shape)
        if in_place:
            t.mul_(2)
            return None
        return t * 2

    rec = ExpertLoadRecorder(2, 3, window_steps=1, reduce_fn=double)
    rec.start()
    rec.record(1, torch.tensor([[0, 2]]))
    rec.end_step()
    assert seen == [torch.Size([2, 3])]
    assert rec.windows()[0].tolist() == [[0, 0, 0], [2, 0, 2]]


def test_max_windows_keeps_the_newest():
    rec = ExpertLoadRecorder(1, 2, window_steps=1, max_windows=2)
    rec.start()
    for e in (0, 1, 1):
        rec.record(0, torch.tensor([[e]]))
        rec.end_step()
    assert rec.windows()[:, 0].tolist() == [[0, 1], [0, 1]]
    assert rec.window_step_counts() == [1, 1]


def test_dump_writes_the_load_format(tmp_path):
    rec = ExpertLoadRecorder(2, 3, window_steps=1)
    rec.start()
    for _ in range(2):
        rec.record(0, torch.tensor([[0, 1]]))
        rec.end_step()
    obj = rec.dump(tmp_path / "load.json", metadata={"model": "tiny"})
    assert check_expert_load(obj).shape == (2, 2, 3)
    load, meta = load_expert_load(tmp_path / "load.json", num_layers=2, num_logical_experts=3)
    assert load[1].tolist() == [[1, 1, 0], [0, 0, 0]]
    assert meta == {"model": "tiny", "window_steps": 1, "num_layers": 2, "num_logical_experts": 3,
                    "window_step_counts": [1, 1]}
    assert json.loads((tmp_path / "load.json").read_text())["expert_load"] == load.tolist()


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_layers=0, num_logical_experts=4, window_steps=1), "num_layers=0"),
    (dict(num_layers=1, num_logical_experts=4, window_steps=0), "window_steps=0"),
    (dict(num_layers=1, num_logical_experts=4, window_steps=1, max_windows=0), "max_windows=0"),
])
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ExpertLoadRecorder(**kwargs)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 9), st.integers(1, 3), st.lists(st.integers(0, 12), max_size=12),
       st.integers(0, 2**31))
def test_window_totals_equal_the_recorded_copies(layers, experts, window_steps, batch_sizes, seed):
    rng = np.random.default_rng(seed)
    rec = ExpertLoadRecorder(layers, experts, window_steps)
    rec.start()
    total = 0
    for T in batch_sizes:
        layer = int(rng.integers(0, layers))
        rec.record(layer, _ids(rng, T, 2, experts))
        rec.end_step()
        total += 2 * T
    closed = len(batch_sizes) // window_steps
    assert rec.num_windows == closed
    recorded = sum(2 * T for T in batch_sizes[: closed * window_steps])
    assert int(rec.windows().sum()) == recorded <= total
