"""The cluster cost model (bench/cluster_model.py) against the published decode figures it prints
beside its predictions: every checked row within 10% (no overlap, as the model reports them), and
the Blackwell rows' prediction without the calibrated derate stays what it is, an upper bound."""
import pytest

from bench import cluster_model as cm

ROWS = [(sc, pub) for _, sc, pub in cm.CHECKS if pub is not None]


def tok_per_gpu(sc, eff):
    B, _, t = cm.operating_point(cm.ModelConfig(), cm.HARDWARE[sc.hw], sc, eff, 0.0)
    return B / t


@pytest.mark.parametrize("sc,published", ROWS, ids=[f"{sc.hw}-{sc.weights}" for sc, _ in ROWS])
def test_prediction_within_ten_percent_of_published(sc, published):
    assert 0.9 <= tok_per_gpu(sc, cm.Efficiency()) / published <= 1.1


def test_derate_only_touches_blackwell_and_is_needed_there():
    eff, undrated = cm.Efficiency(), cm.Efficiency(blackwell_derate=1.0)
    assert {sc.hw for sc, _ in ROWS} >= {"h800", "h100", "gb200"}
    for sc, published in ROWS:
        if cm.HARDWARE[sc.hw].blackwell:
            assert tok_per_gpu(sc, undrated) / published > 1.5  # Hopper fractions of peak: an upper bound
        else:
            assert tok_per_gpu(sc, undrated) == tok_per_gpu(sc, eff)
