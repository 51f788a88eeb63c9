"""EngineStats: named parts per concern, combined over ranks by name; the flat names of the
one-struct era still read the same figures."""
from __future__ import annotations

import msgspec

from moe_serve.metrics import EngineMetrics
from moe_serve.protocol import (EngineStats, EplbStats, KVTransferStats, SchedulerStats, SpecDecodeStats,
                                SpeedOfLightStats, _FLAT_NAMES, combine_rank_stats)


def rank(i: int) -> EngineStats:
    return EngineStats(SchedulerStats(1 + i, 2, 0.25 * (i + 1), 0.0, 3, 10 * i, 20, 5 + i, 100, 40 + i, 7),
                       SpecDecodeStats(2, 6, 3 + i, [2, 1 + i]), KVTransferStats(1, 1000 * i, 0, 0.5, i, 1),
                       EplbStats(4 + i, 0.9, 1.5), SpeedOfLightStats(0.5 + 0.1 * i, 30.0, 1e9))


def test_combined_over_ranks_by_name():
    c = combine_rank_stats([rank(0), rank(1)])
    assert c.scheduler == SchedulerStats(3, 4, 0.375, 81 / 200, 6, 10, 40, 6, 200, 81, 14)
    assert c.spec_decode == SpecDecodeStats(4, 12, 7, [4, 3])
    assert c.kv_transfer == KVTransferStats(2, 1000, 0, 1.0, 1, 2)
    assert c.eplb == rank(0).eplb  # the same on every rank: rank 0's
    assert c.speed_of_light == SpeedOfLightStats()  # per rank only


def test_flat_names_read_their_part():
    s = rank(1)
    assert len(_FLAT_NAMES) == 27  # every field of the one-struct era
    for flat, (part, field) in _FLAT_NAMES.items():
        assert getattr(s, flat) == getattr(getattr(s, part), field), flat
    assert s.kv_sent_bytes == 1000 and s.decode_sol_fraction == 0.6 and s.spec_accepted_per_pos == [2, 2]


def test_travels_between_processes_and_renders_per_rank():
    ranks = [msgspec.msgpack.decode(msgspec.msgpack.encode(rank(i)), type=EngineStats) for i in range(2)]
    text = EngineMetrics().render("m", combine_rank_stats(ranks), ranks)
    assert 'moe_serve:decode_speed_of_light_fraction{model_name="m",rank="1"} 0.6' in text
    assert 'moe_serve:kv_transfer_sent_bytes_total{model_name="m",rank="1"} 1000' in text
    assert 'moe_serve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 3' in text
    assert 'moe_serve:eplb_rebalances_total{model_name="m"} 4' in text
