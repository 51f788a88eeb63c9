"""Placement and load files (validation names the field), ReplicaMap, and the placement CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from expert_parallel.placement.map import (Placement, PlacementError, ReplicaMap, load_expert_load, load_placement,
                                       save_expert_load, save_placement)

REPO = Path(__file__).resolve().parents[2]


# ---- validation ----------------------------------------------------------------------------------
def _placement(**over):
    fields = dict(physical_to_logical=[[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 0, 0]], gpus=2, nodes=1,
                  num_logical_experts=4)
    fields.update(over)
    return Placement(**fields)


@pytest.mark.parametrize("over, num_layers, field", [
    ({}, 3, "physical_to_logical has 2 layers but the model has 3"),
    (dict(physical_to_logical=[[0, 1, 2, 3, 0, 1], [0, 1, 2, 3]]), None, r"physical_to_logical\[1\] has 4 slots"),
    (dict(gpus=4), None, "slots=6 .* not divisible by gpus=4"),
    (dict(gpus=2, nodes=4), None, "gpus=2 is not divisible by nodes=4"),
    (dict(physical_to_logical=[[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 0, 1]]), None,
     r"physical_to_logical\[0\] gives no slot to logical expert 3"),
    (dict(physical_to_logical=[[0, 1, 2, 3, 4, 1], [0, 1, 2, 3, 0, 1]]), None,
     r"physical_to_logical\[0\]\[4\]=4 is not a logical expert id"),
    (dict(physical_to_logical=[[0, 1, 2, 3, -1, 1], [0, 1, 2, 3, 0, 1]]), None, r"physical_to_logical\[0\]\[4\]=-1"),
    (dict(physical_to_logical=[]), None, "physical_to_logical must be a non-empty list"),
    (dict(gpus=0), None, "gpus=0 must be a positive integer"),
    (dict(nodes="2"), None, "nodes='2' must be a positive integer"),
])
def test_validation_names_the_field(over, num_layers, field):
    with pytest.raises(PlacementError, match=field):
        _placement(**over).validate(num_layers)


def test_valid_placement_properties():
    p = _placement().validate(num_layers=2)
    assert (p.num_layers, p.slots, p.slots_per_gpu) == (2, 6, 3)
    assert Placement.identity(3, 4, gpus=2, nodes=2).physical_to_logical == [[0, 1, 2, 3]] * 3


def test_placement_file_roundtrip(tmp_path):
    p = _placement(metadata={"groups": 2, "note": "kept"})
    save_placement(p, tmp_path / "p.json")
    obj = json.loads((tmp_path / "p.json").read_text())
    assert obj["slots"] == 6 and obj["gpus"] == 2 and obj["nodes"] == 1 and obj["num_logical_experts"] == 4
    q = load_placement(tmp_path / "p.json", num_layers=2)
    assert q == p


@pytest.mark.parametrize("text, field", [
    ("{", "not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ('{"gpus": 2, "nodes": 1}', "no 'physical_to_logical' field"),
    ('{"physical_to_logical": [[0, 1]], "nodes": 1}', "no 'gpus' field"),
    ('{"physical_to_logical": [[0, 1]], "gpus": 1, "nodes": 1, "slots": 4}', "slots=4 but"),
    ('{"physical_to_logical": [[0, 1], 3], "gpus": 1, "nodes": 1}', "physical_to_logical must be a list"),
])
def test_placement_file_errors(tmp_path, text, field):
    (tmp_path / "p.json").write_text(text)
    with pytest.raises(PlacementError, match=field):
        load_placement(tmp_path / "p.json")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(PlacementError, match="does not exist"):
        load_placement(tmp_path / "nope.json")


def test_load_file_roundtrip(tmp_path):
    load = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    save_expert_load(tmp_path / "l.json", load, {"window_steps": 10})
    got, meta = load_expert_load(tmp_path / "l.json", num_layers=3, num_logical_experts=4)
    assert np.array_equal(got, load) and got.dtype == np.int64 and meta == {"window_steps": 10}


@pytest.mark.parametrize("obj, kwargs, field", [
    ({"load": []}, {}, "no 'expert_load' field"),
    ({"expert_load": []}, {}, "non-empty list of windows"),
    ({"expert_load": [[[1, 2]], [[1, 2], [3, 4]]]}, {}, r"expert_load\[1\] has 2 layers, expected 1"),
    ({"expert_load": [[[1, 2]]]}, {"num_layers": 2}, r"expert_load\[0\] has 1 layers, expected 2 \(the model"),
    ({"expert_load": [[[1, 2], [3]]]}, {}, r"expert_load\[0\]\[1\] has 1 experts, expected 2"),
    ({"expert_load": [[[1, 2]]]}, {"num_logical_experts": 3}, r"expert_load\[0\]\[0\] has 2 experts, expected 3"),
    ({"expert_load": [[[1, -2]]]}, {}, r"expert_load\[0\]\[0\]\[1\]=-2 is not a token count"),
    ({"expert_load": [[[1, 2.5]]]}, {}, r"expert_load\[0\]\[0\]\[1\]=2.5 is not a token count"),
    ({"expert_load": [[[1, 2]]], "window_steps": 4, "window_step_counts": [4, 2]}, {},
     r"window_step_counts has 2 entries, expected one per window \(1\)"),
    ({"expert_load": [[[1, 2]], [[1, 2]]], "window_steps": 4, "window_step_counts": [4, 5]}, {},
     r"window_step_counts\[1\]=5 must be a step count in 1..4"),
    ({"expert_load": [[[1, 2]]], "window_step_counts": [1]}, {}, "window_steps=None must be a positive integer"),
])
def test_load_file_errors(tmp_path, obj, kwargs, field):
    (tmp_path / "l.json").write_text(json.dumps(obj))
    with pytest.raises(PlacementError, match=field):
        load_expert_load(tmp_path / "l.json", **kwargs)


# ---- ReplicaMap ----------------------------------------------------------------------------------
@st.composite
def replica_cases(draw):
    E = draw(st.integers(1, 12))
    extra = draw(st.lists(st.integers(0, E - 1), max_size=12))
    p2l = list(range(E)) + extra
    perm = np.random.default_rng(draw(st.integers(0, 2**31))).permutation(len(p2l))
    p2l = [p2l[i] for i in perm]
    T, K = draw(st.integers(0, 40)), draw(st.integers(1, 4))
    ids = draw(st.lists(st.integers(-1, E - 1), min_size=T * K, max_size=T * K))
    return p2l, E, torch.tensor(ids, dtype=torch.int64).reshape(T, K), draw(st.integers(0, 7))


@settings(max_examples=150, deadline=None)
@given(replica_cases())
def test_replica_map_picks_valid_replicas_evenly(case):
    p2l, E, ids_TK, offset = case
    rmap = ReplicaMap(p2l, E)
    slots = rmap(ids_TK, offset=offset)
    assert slots.shape == ids_TK.shape and slots.dtype == ids_TK.dtype
    table = torch.tensor(p2l)
    valid = ids_TK >= 0
    # Same math: every slot holds the expert the router chose (padding passes through).
    assert torch.equal(table[slots[valid]], ids_TK[valid])
    assert torch.equal(slots[~valid], ids_TK[~valid])
    # Even: an expert's tokens spread over its replicas within one token of each other.
    for e in range(E):
        used = slots[valid & (ids_TK == e)]
        replicas = [s for s, x in enumerate(p2l) if x == e]
        per = torch.tensor([(used == s).sum().item() for s in replicas])
        assert per.max() - per.min() <= 1
    assert torch.equal(rmap(ids_TK, offset=offset), slots)  # deterministic


def test_replica_map_offset_rotates_the_first_replica():
    rmap = ReplicaMap([0, 1, 0, 0], 2)  # expert 0 in slots 0, 2, 3
    one = torch.tensor([[0]])
    assert [rmap(one, offset=r).item() for r in range(4)] == [0, 2, 3, 0]
    assert ReplicaMap([0, 1, 0, 0], 2, offset=1)(one).item() == 2


def test_replica_map_identity_and_from_placement():
    ids = torch.tensor([[1, 0], [3, 2]], dtype=torch.int32)
    assert ReplicaMap.identity(4)(ids) is ids
    rmap = _placement().replica_map(1)  # layer 1: [3, 2, 1, 0, 0, 0]
    assert rmap.num_slots == 6 and rmap(torch.tensor([[0], [0], [0], [1]])).flatten().tolist() == [3, 4, 5, 2]


@st.composite
def balanced_cases(draw):
    gpus, per_gpu = draw(st.integers(2, 5)), draw(st.integers(1, 4))
    S = gpus * per_gpu
    E = draw(st.integers(1, S))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    p2l = [int(x) for x in rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, S - E)]))]
    T, K = draw(st.integers(0, 60)), draw(st.integers(1, 3))
    hot = rng.dirichlet(np.full(E, 0.3))  # skewed, so replicated experts often carry most tokens
    ids = np.where(rng.random((T, K)) < 0.05, -1, rng.choice(E, (T, K), p=hot))
    return p2l, E, per_gpu, torch.tensor(ids, dtype=torch.int64), draw(st.integers(0, 7))


@settings(max_examples=120, deadline=None)
@given(balanced_cases())
def test_balanced_replica_split_serves_valid_replicas_and_evens_the_gpus(case):
    p2l, E, per_gpu, ids_TK, offset = case
    rmap = ReplicaMap(p2l, E, split="balanced", slots_per_gpu=per_gpu, min_copies=0)
    slots = rmap(ids_TK, offset=offset)
    table, valid = torch.tensor(p2l), ids_TK >= 0
    assert torch.equal(table[slots[valid]], ids_TK[valid])  # the expert the router chose
    assert torch.equal(slots[~valid], ids_TK[~valid])  # padding passes through
    assert torch.equal(rmap(ids_TK, offset=offset), slots)  # deterministic
    per_slot = torch.bincount(slots[valid], minlength=len(p2l))
    # slot_counts (what the placement's evaluation replays batches through) is what __call__ does.
    c_E = torch.bincount(ids_TK[valid], minlength=E)
    assert torch.equal(rmap.slot_counts(c_E[None], [offset])[0], per_slot)
    # Never worse than the even split beyond rounding (under one token per replica on a GPU).
    rr = torch.bincount(ReplicaMap(p2l, E)(ids_TK, offset=offset)[valid], minlength=len(p2l))
    gpu = lambda x: x.reshape(-1, per_gpu).sum(1)  # noqa: E731
    assert gpu(per_slot).max() <= gpu(rr).max() + 2 * per_gpu


def test_balanced_replica_split_fills_the_lighter_gpu():
    # GPU 0 holds expert 0 (10 tokens) and a replica of expert 2; GPU 1 expert 1 (2 tokens) and the
    # other replica of 2 (12 tokens): the balanced split gives 2 + 10, both GPUs carry 12. Round
    # robin gives 6 + 6: 16 and 8.
    ids = torch.tensor([0] * 10 + [1] * 2 + [2] * 12)[:, None]
    for offset in range(3):
        slots = ReplicaMap([0, 2, 1, 2], 3, split="balanced", slots_per_gpu=2, min_copies=0)(ids, offset=offset)
        assert torch.bincount(slots.flatten(), minlength=4).tolist() == [10, 2, 2, 10]
    rr = ReplicaMap([0, 2, 1, 2], 3)(ids)
    assert torch.bincount(rr.flatten(), minlength=4).tolist() == [10, 6, 2, 6]
    # Batches below min_copies (small decode steps) go round robin, in __call__ and slot_counts alike.
    small = ReplicaMap([0, 2, 1, 2], 3, split="balanced", slots_per_gpu=2, min_copies=25)
    assert torch.equal(small(ids), rr)
    assert small.slot_counts([[10, 2, 12]], [0])[0].tolist() == [10, 6, 2, 6]
    assert ReplicaMap([0, 2, 1, 2], 3, split="balanced", slots_per_gpu=2, min_copies=24).slot_counts(
        [[10, 2, 12]], [0])[0].tolist() == [10, 2, 2, 10]


def test_balanced_split_rounds_ties_differently_per_rank():
    # One token of a two-replica expert, GPUs otherwise idle: each rank's offset picks another
    # replica, so small decode batches do not all land on the same GPU.
    rmap = ReplicaMap([0, 1, 0, 1], 2, split="balanced", slots_per_gpu=2, min_copies=0)
    picks = {int(rmap(torch.tensor([[0]]), offset=r)) for r in range(2)}
    assert picks == {0, 2}


def test_balanced_split_settings_are_checked():
    with pytest.raises(PlacementError, match="split='even'"):
        ReplicaMap([0, 1, 0], 2, split="even")
    with pytest.raises(PlacementError, match="slots_per_gpu=2"):
        ReplicaMap([0, 1, 0], 2, split="balanced", slots_per_gpu=2)
    # One GPU (or no slots_per_gpu): nothing to balance, round robin.
    assert not ReplicaMap([0, 1, 0], 2, split="balanced", slots_per_gpu=3).balanced
    assert ReplicaMap([0, 1, 0, 1], 2, split="balanced", slots_per_gpu=2).balanced


def test_replica_map_rejects_a_missing_expert():
    with pytest.raises(PlacementError, match="no slot to logical expert 2"):
        ReplicaMap([0, 1, 0], 3)


def test_replica_map_builds_on_cpu_under_a_default_device():
    with torch.device("meta"):  # models are built under `with torch.device(...)`
        rmap = ReplicaMap([0, 1, 1], 2)
    assert rmap(torch.tensor([[1], [1]])).flatten().tolist() == [1, 2]


# ---- CLI -----------------------------------------------------------------------------------------
def _cli(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "expert_parallel.placement.cli", "placement", *map(str, args)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def load_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    popularity = rng.pareto(1.0, (3, 32)) + 0.05  # 3 layers, 32 experts, skewed
    windows = []
    for _ in range(6):
        p = popularity * rng.uniform(0.7, 1.3, popularity.shape)
        windows.append(rng.multinomial(20000, p / p.sum(-1, keepdims=True)))
    load = np.stack(windows)
    path = tmp_path_factory.mktemp("cli") / "load.json"
    save_expert_load(path, load)
    return path


def test_cli_tune_then_report(load_file, tmp_path):
    out = tmp_path / "p.json"
    r = _cli("tune", "--load", load_file, "--gpus", 4, "--nodes", 2, "--slots", 40, "--groups", 4,
             "--holdout", 1, "--out", out)
    assert r.returncode == 0, r.stderr
    p = load_placement(out, num_layers=3)
    assert (p.gpus, p.nodes, p.slots, p.metadata["groups"]) == (4, 2, 40, 4)
    r = _cli("report", "--load", load_file, "--placement", out, "--gpus", 4, "--nodes", 2)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "placement" in r.stdout and "greedy" in r.stdout and "no-replica" in r.stdout
    overall = next(line for line in lines if line.strip().startswith("overall")).split("|")
    ours, greedy, blind = (float(col.split()[0]) for col in overall[1:])
    assert 0 < blind <= 1 and 0 < greedy <= 1 and 0 < ours <= 1
    assert sum(line.strip()[:1].isdigit() for line in lines) == 3  # one row per layer
    assert "note:" not in r.stdout  # held out: the placement never saw the judged window


@pytest.mark.parametrize("args, field", [
    (["tune", "--gpus", 4, "--nodes", 2, "--slots", 42], "slots=42 is not divisible by gpus=4"),
    (["tune", "--gpus", 4, "--nodes", 3, "--slots", 40], "gpus=4 is not divisible by nodes=3"),
    (["tune", "--gpus", 4, "--nodes", 2, "--slots", 16], "slots=16 is fewer than num_logical_experts=32"),
    (["tune", "--gpus", 4, "--nodes", 2, "--slots", 40, "--num-layers", 5], "has 3 layers, expected 5"),
    (["tune", "--gpus", 4, "--nodes", 2, "--slots", 40, "--holdout", 6], "holdout=6"),
])
def test_cli_tune_errors(load_file, tmp_path, args, field):
    r = _cli(*args[:1], "--load", load_file, *args[1:], "--out", tmp_path / "p.json")
    assert r.returncode == 2
    assert field in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cli_report_errors(load_file, tmp_path):
    bad = tmp_path / "bad.json"
    cases = [
        ('{"physical_to_logical": [[0, 1]], "gpus": 1, "nodes": 1}', "has 3 layers but physical_to_logical has 1"),
        (json.dumps({"physical_to_logical": [list(range(31)) + [0] * 9] * 3, "gpus": 4, "nodes": 2,
                     "num_logical_experts": 32}), "gives no slot to logical expert 31"),
        (json.dumps({"physical_to_logical": [list(range(32)) + [0] * 8] * 3, "gpus": 8, "nodes": 2}),
         "--gpus=4 but the placement was made for gpus=8"),
        ("{not json", "is not valid JSON"),
    ]
    for text, field in cases:
        bad.write_text(text)
        r = _cli("report", "--load", load_file, "--placement", bad, "--gpus", 4, "--nodes", 2)
        assert r.returncode == 2 and field in r.stderr, (field, r.stderr)
    save_placement(Placement.identity(3, 32, gpus=4, nodes=2), bad)
    r = _cli("report", "--load", tmp_path / "missing.json", "--placement", bad, "--gpus", 4, "--nodes", 2)
    assert r.returncode == 2 and "missing.json' does not exist" in r.stderr


def test_replica_split_flag_reaches_the_moe_context(checkpoints):
    import argparse

    from moe_serve.engine.args import EngineArgs

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    for argv, want in (([], "balanced"), (["--replica-split", "round_robin"], "round_robin")):
        cfg = EngineArgs.from_cli(p.parse_args(argv), checkpoints["qwen3_moe"]).create_engine_config()
        assert cfg.parallel.replica_split == want
    with pytest.raises(SystemExit):
        p.parse_args(["--replica-split", "even"])
    with pytest.raises(ValueError, match="replica_split='even'"):
        EngineArgs(checkpoints["qwen3_moe"], replica_split="even").create_engine_config()
