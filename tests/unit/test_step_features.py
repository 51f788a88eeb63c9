"""The step-feature seam (moe_serve/engine/features/): a feature defined here, registered in one line
with no edit to the engine core, sees every step and exports its own stats; the per-turn agreement
packs each contributor's named fields into one vector and back, and two contributors' fields never
mix."""
from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_serve import LLM, SamplingParams
from moe_serve.engine import features
from moe_serve.engine.core_proc import TurnAgreement
from moe_serve.engine.features.regroup import Regroup, RegroupFields, Regrouping
from moe_serve.engine.features import FeatureSet, MinInt, StepFeature
from moe_serve.engine.features.agreement import Layout, combine
from moe_serve.engine.features.eplb import EplbAgreement
from moe_serve.engine.features.expert_load import LoadAgreement
from moe_serve.protocol import EngineStats


class ScheduledTokensStats(msgspec.Struct):
    tokens: int = 0
    steps: int = 0


class ScheduledTokens(StepFeature):
    """Counts the tokens each step scheduled."""

    name = "scheduled_tokens"

    def __init__(self):
        self.counts = ScheduledTokensStats()

    @classmethod
    def build(cls, ctx):
        return cls()

    def after_schedule(self, sched) -> None:
        if not sched.is_empty:
            self.counts.tokens += sum(s.num_tokens for s in sched.scheduled)
            self.counts.steps += 1

    def stats(self) -> ScheduledTokensStats:
        return msgspec.structs.replace(self.counts)


def test_a_feature_registered_in_one_line_counts_the_scheduled_tokens(checkpoints, monkeypatch):
    monkeypatch.setattr(features, "FEATURES", [*features.FEATURES, ScheduledTokens.build])  # the registration
    llm = LLM(checkpoints["qwen3_moe"], dtype="float32", num_kv_blocks=64, show_progress=False)
    rng = random.Random(5)
    # Distinct first tokens: no prefix-cache hits, so every prompt token is scheduled once.
    prompts = [[100 + i] + [rng.randrange(10, 500) for _ in range(rng.randrange(3, 20))] for i in range(5)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, 2, 5, 7, 9)],
                        use_tqdm=False)
    generated = [len(o.outputs[0].token_ids) for o in outs]
    assert generated == [1, 2, 5, 7, 9]
    # Each request's prompt once, then one token per generated token but the last (never fed back).
    expected = sum(len(p) for p in prompts) + sum(n - 1 for n in generated)
    stats = llm.engine.stats()
    assert stats.features["scheduled_tokens"] == ScheduledTokensStats(expected, stats.scheduler.num_steps)
    assert stats.scheduler.prefix_cache_hits == 0
    # Across the process boundary the feature's stats travel by name.
    sent = msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=EngineStats)
    assert sent.features["scheduled_tokens"] == {"tokens": expected, "steps": stats.scheduler.num_steps}


def test_the_feature_is_not_registered_for_engines_without_it(checkpoints):
    llm = LLM(checkpoints["qwen3_moe"], dtype="float32", num_kv_blocks=64, show_progress=False)
    assert llm.engine.features.get("scheduled_tokens") is None
    assert "scheduled_tokens" not in llm.engine.stats().features


# --- the agreement ------------------------------------------------------------------------------
class A(msgspec.Struct):
    flag: int = 0
    low: MinInt = 0


class B(msgspec.Struct):
    flag: int = 0
    other: int = 0
    low: MinInt = 0


ints = st.integers(min_value=-(1 << 62), max_value=1 << 62)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(ints, ints, ints, ints, ints), min_size=1, max_size=8))
def test_packed_fields_round_trip_and_combine_by_name(ranks):
    """Per contributor and field: MAX over ranks, MIN for MinInt fields; equal-named fields of two
    contributors stay apart."""
    per_rank = [[("a", A(a_flag, a_low)), ("b", B(b_flag, b_other, a_low ^ 1))]
                for a_flag, a_low, b_flag, b_other, _ in ranks]
    layout = Layout(per_rank[0])
    assert layout.slots == ["a.flag", "a.low", "b.flag", "b.other", "b.low"]
    assert layout.unpack(layout.pack(per_rank[0])) == dict(per_rank[0])
    agreed = layout.unpack(combine([layout.pack(parts) for parts in per_rank]))
    assert agreed["a"] == A(max(p[0][1].flag for p in per_rank), min(p[0][1].low for p in per_rank))
    assert agreed["b"] == B(max(p[1][1].flag for p in per_rank), max(p[1][1].other for p in per_rank),
                            min(p[1][1].low for p in per_rank))


def test_the_engines_contributors_have_distinct_slots():
    parts = [("turn", TurnAgreement()), ("regroup", RegroupFields()), ("expert_load", LoadAgreement()),
             ("eplb", EplbAgreement())]
    slots = Layout(parts).slots
    assert len(slots) == len(set(slots)) == 12
    assert "eplb.digest_min" in slots and "turn.q_min" in slots and "expert_load.dump" in slots
    assert "regroup.size" in slots and not any(s.startswith("turn.regroup") for s in slots)


def test_regroup_is_agreed_as_a_loop_feature():
    """A regroup asked on one rank (a replacement waits: 0; "scale" to n: n) is agreed with MAX and
    raised on every rank at the same turn; nothing asked agrees on -1 and raises nothing."""
    asking, quiet = Regrouping(), Regrouping()
    asking.ask(0)
    asking.ask(3)  # a planned size wins over a replacement waiting
    asking.ask(0)
    parts = [[("regroup", f.agreement())] for f in (asking, quiet)]
    layout = Layout(parts[0])
    agreed = layout.unpack(combine([layout.pack(p) for p in parts]))["regroup"]
    assert agreed == RegroupFields(3)
    for f in (asking, quiet):
        with pytest.raises(Regroup) as e:
            f.apply_agreement(agreed)
        assert e.value.size == 3
    nothing = layout.unpack(combine([layout.pack([("regroup", f.agreement())]) for f in (asking, quiet)]))
    assert nothing["regroup"] == RegroupFields(-1)
    quiet.apply_agreement(nothing["regroup"])  # no regroup: nothing raised


def test_two_contributors_of_one_name_are_refused():
    with pytest.raises(ValueError, match="distinct names"):
        Layout([("a", A()), ("a", B())])
    one = StepFeature()
    one.name = "same"
    two = StepFeature()
    two.name = "same"
    with pytest.raises(ValueError, match="registered already"):
        FeatureSet([one, two])


def test_an_agreement_field_must_be_an_int():
    class Bad(msgspec.Struct):
        ratio: float = 0.0

    with pytest.raises(TypeError, match="Bad.ratio"):
        Layout([("bad", Bad())])
