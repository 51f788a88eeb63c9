"""Synthetic expert load for tests and benchmarks of the placement tuner (numpy only).

Every layer: Zipf-like skew over a random expert order (exponent drawn from `skew`) plus a bias
per expert group, then per scenario
  zipf    the same profile every window, a little noise;
  drift   a random walk of every expert's log-popularity (hot experts change);
  shift   a gradual move to a second, unrelated profile (a new traffic mix);
  bursty  mild drift, and experts turning 4-8x hotter for 2-5 windows now and then;
  spiky   the same, but spikes last one window: nothing in the past predicts the judged one.
"""
from __future__ import annotations

import numpy as np

SCENARIOS = ("zipf", "drift", "shift", "bursty", "spiky")


def synthetic_load(scenario: str, seed: int, windows: int, layers: int, experts: int, groups: int | None,
                   copies: int, skew: tuple[float, float] = (0.6, 1.0)) -> np.ndarray:
    """(W, L, E) int64 token counts: `copies` routed token copies per layer per window."""
    rng = np.random.default_rng(seed)
    g = groups or 8
    out = np.zeros((windows, layers, experts), dtype=np.int64)

    def profile():
        lp = -rng.uniform(*skew) * np.log(rng.permutation(experts) + 1.0)
        return lp + np.repeat(rng.normal(0, 0.3, g), experts // g)

    for l in range(layers):
        logp, target = profile(), profile()
        boost, until = np.zeros(experts), np.zeros(experts, dtype=np.int64)
        for w in range(windows):
            if scenario == "zipf":
                lp = logp + rng.normal(0, 0.05, experts)
            elif scenario == "drift":
                logp = logp + rng.normal(0, 0.25, experts)
                lp = logp
            elif scenario == "shift":
                a = w / (windows - 1)
                lp = np.logaddexp(np.log1p(-a + 1e-12) + logp, np.log(a + 1e-12) + target)
            else:
                logp = logp + rng.normal(0, 0.1, experts)
                boost[until <= w] = 0.0
                if rng.random() < 0.5:
                    e = rng.integers(experts)
                    boost[e] = np.log(rng.uniform(4.0, 8.0))
                    until[e] = w + (1 if scenario == "spiky" else rng.integers(2, 6))
                lp = logp + boost
            p = np.exp(lp - lp.max())
            out[w, l] = rng.multinomial(copies, p / p.sum())
    return out
