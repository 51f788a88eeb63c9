"""Forecast of one layer's next window of expert load from its history (pure numpy).

Shape legend: W recorded windows (oldest first), E logical experts.

Each window becomes shares (busy and quiet windows weigh alike); the forecast is their
exponentially decayed mean, with the decay picked per layer by backtest: the one whose forecasts
would best have predicted the past windows (drift -> short memory, noise -> long memory). The
backtest also gives the layer's relative forecast error, which the packing hedges against.
"""
from __future__ import annotations

import numpy as np

# Candidate decays for the backtest: 0 trusts only the newest window, 1 weighs all windows alike.
DECAY_CHOICES = (0.0, 0.3, 0.5, 0.7, 0.85, 0.95, 1.0)
# Weight per window of age when averaging backtest errors: recent errors describe the next one best.
_ERROR_DECAY = 0.8


def _decayed_forecasts(shares_WE: np.ndarray, decay: float) -> np.ndarray:
    """(W+1, E): row j is the decayed mean of windows < j (row 0, with no history, is uniform)."""
    W, E = shares_WE.shape
    out = np.empty((W + 1, E))
    out[0] = 1.0 / E
    num, den = np.zeros(E), 0.0
    for j in range(W):
        num, den = decay * num + shares_WE[j], decay * den + 1.0
        out[j + 1] = num / den
    return out


def forecast(history_WE, decay: float | None = None) -> tuple[np.ndarray, float, float]:
    """Predict one layer's next window from its history.

    Args:
        history_WE: (W, E) token counts per window, oldest first.
        decay: weight of a window relative to the next newer one (1 = plain mean); None picks it
            by backtest among DECAY_CHOICES.
    Returns:
        mean_E: forecast tokens per expert, scaled to the decayed mean window total.
        rel_err: the forecast's typical relative error per expert, sqrt(sum resid^2 / sum share^2)
            over the backtest (0 with fewer than two windows). One number per layer, not per expert:
            a past burst on one expert does not predict the next burst's expert, so per-expert
            errors would only move replicas to where the last surprise was.
        decay: the decay used.
    """
    h = np.asarray(history_WE, dtype=np.float64)
    E = h.shape[1]
    totals = h.sum(axis=1)
    h, totals = h[totals > 0], totals[totals > 0]  # an idle window says nothing about shares
    if len(h) == 0:
        return np.ones(E), 0.0, 1.0 if decay is None else decay
    shares = h / totals[:, None]
    W = len(shares)
    if decay is None:
        # Backtest: the forecast from windows < j against window j, for every j >= 1.
        errors = [((_decayed_forecasts(shares, d)[1:W] - shares[1:]) ** 2).sum() for d in DECAY_CHOICES]
        decay = DECAY_CHOICES[int(np.argmin(errors))] if W > 1 else 1.0
    fc = _decayed_forecasts(shares, decay)
    age_w = decay ** np.arange(W)[::-1]
    scale = float((age_w * totals).sum() / age_w.sum())
    rel_err = 0.0
    if W > 1:
        err_w = _ERROR_DECAY ** np.arange(W - 1)[::-1][:, None]
        rel_err = float(np.sqrt((err_w * (fc[1:W] - shares[1:]) ** 2).sum()
                                / (err_w * shares[1:] ** 2).sum()))
    return fc[W] * scale, rel_err, float(decay)


def scenarios(history_WE, count: int, decay: float | None = None, seed: int = 0) -> np.ndarray:
    """(count, E) plausible next windows: the forecast times multiplicative errors drawn from the
    backtest (each expert its own draw from the pooled log-ratios of windows j >= 1 to the
    forecast made before them), renormalised to the forecast's total. A bootstrap of how wrong the
    forecast has been, for choosing placements that hold up to it. Deterministic (seeded RNG).
    With fewer than two windows there is nothing to draw from: count copies of the forecast."""
    h = np.asarray(history_WE, dtype=np.float64)
    mean, _, decay = forecast(h, decay)
    h = h[h.sum(axis=1) > 0]
    if len(h) < 2:
        return np.tile(mean, (count, 1))
    shares = h / h.sum(axis=1, keepdims=True)
    W, E = shares.shape
    eps = 0.2 / E  # a floor, so that near-idle experts' noise does not dominate the pool
    pool = np.log((shares[1:] + eps) / (_decayed_forecasts(shares, decay)[1:W] + eps)).ravel()
    f = mean / mean.sum()
    draws = np.random.default_rng(seed).integers(len(pool), size=(count, E))
    x = np.maximum((f + eps) * np.exp(pool[draws]) - eps, 0.0)
    return x / x.sum(axis=1, keepdims=True) * mean.sum()
