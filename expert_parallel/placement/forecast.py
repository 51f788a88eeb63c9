"""Forecast of one layer's next window of expert load from its history (pure numpy).

Shape legend: W recorded windows (oldest first), E logical experts.

Each window becomes shares (busy and quiet windows weigh alike); the forecast is their
exponentially decayed mean (a window that saw fewer steps than the others, the last one of a
recording stopped between boundaries, weighs by its share of a full window's steps), with the decay picked per layer by backtest: the one whose forecasts
would best have predicted the past windows (drift -> short memory, noise -> long memory). The
backtest also gives the layer's relative forecast error, which the packing hedges against.
"""
from __future__ import annotations

import numpy as np

# Candidate decays for the backtest: 0 trusts only the newest window, 1 weighs all windows alike.
DECAY_CHOICES = (0.0, 0.3, 0.5, 0.7, 0.85, 0.95, 1.0)
# Weight per window of age when averaging backtest errors: recent errors describe the next one best.
_ERROR_DECAY = 0.8


def _decayed_forecasts(shares_WE: np.ndarray, decay: float, weights_W: np.ndarray | None = None) -> np.ndarray:
    """(W+1, E): row j is the decayed mean of windows < j, each also weighted by weights_W (row 0,
    with no history, is uniform)."""
    W, E = shares_WE.shape
    w = np.ones(W) if weights_W is None else weights_W
    out = np.empty((W + 1, E))
    out[0] = 1.0 / E
    num, den = np.zeros(E), 0.0
    for j in range(W):
        num, den = decay * num + w[j] * shares_WE[j], decay * den + w[j]
        out[j + 1] = num / den
    return out


def _weights(weights_W, W: int) -> np.ndarray:
    """Per-window weights in (0, 1]: a window's steps over a full window's (1 for all when None)."""
    if weights_W is None:
        return np.ones(W)
    w = np.asarray(weights_W, dtype=np.float64)
    if w.shape != (W,) or not ((w > 0) & (w <= 1)).all():
        raise ValueError(f"window weights must be {W} numbers in (0, 1], got {weights_W!r}")
    return w


def forecast(history_WE, decay: float | None = None, weights_W=None) -> tuple[np.ndarray, float, float]:
    """Predict one layer's next window from its history.

    Args:
        history_WE: (W, E) token counts per window, oldest first.
        decay: weight of a window relative to the next newer one (1 = plain mean); None picks it
            by backtest among DECAY_CHOICES.
        weights_W: (W,) each window's steps over a full window's (None: every window is full). A
            partial window's shares weigh that much, and its total counts as the full window's
            it would have been at its rate.
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
    w = _weights(weights_W, len(h))
    totals = h.sum(axis=1)
    busy = totals > 0  # an idle window says nothing about shares
    h, totals, w = h[busy], totals[busy], w[busy]
    if len(h) == 0:
        return np.ones(E), 0.0, 1.0 if decay is None else decay
    shares = h / totals[:, None]
    W = len(shares)
    if decay is None:
        # Backtest: the forecast from windows < j against window j, for every j >= 1.
        errors = [(w[1:, None] * (_decayed_forecasts(shares, d, w)[1:W] - shares[1:]) ** 2).sum()
                  for d in DECAY_CHOICES]
        decay = DECAY_CHOICES[int(np.argmin(errors))] if W > 1 else 1.0
    fc = _decayed_forecasts(shares, decay, w)
    age_w = decay ** np.arange(W)[::-1] * w
    scale = float((age_w * totals / w).sum() / age_w.sum())
    rel_err = 0.0
    if W > 1:
        err_w = _ERROR_DECAY ** np.arange(W - 1)[::-1][:, None]
        rel_err = float(np.sqrt((err_w * (fc[1:W] - shares[1:]) ** 2).sum()
                                / (err_w * shares[1:] ** 2).sum()))
    return fc[W] * scale, rel_err, float(decay)


def scenarios(history_WE, count: int, decay: float | None = None, seed: int = 0, weights_W=None) -> np.ndarray:
    """(count, E) plausible next windows: the forecast times multiplicative errors drawn from the
    backtest (each expert its own draw from the pooled log-ratios of windows j >= 1 to the
    forecast made before them), renormalised to the forecast's total. A bootstrap of how wrong the
    forecast has been, for choosing placements that hold up to it. Deterministic (seeded RNG).
    With fewer than two windows there is nothing to draw from: count copies of the forecast."""
    h = np.asarray(history_WE, dtype=np.float64)
    mean, _, decay = forecast(h, decay, weights_W)
    w = _weights(weights_W, len(h))[h.sum(axis=1) > 0]
    h = h[h.sum(axis=1) > 0]
    if len(h) < 2:
        return np.tile(mean, (count, 1))
    shares = h / h.sum(axis=1, keepdims=True)
    W, E = shares.shape
    eps = 0.2 / E  # a floor, so that near-idle experts' noise does not dominate the pool
    pool = np.log((shares[1:] + eps) / (_decayed_forecasts(shares, decay, w)[1:W] + eps)).ravel()
    f = mean / mean.sum()
    draws = np.random.default_rng(seed).integers(len(pool), size=(count, E))
    x = np.maximum((f + eps) * np.exp(pool[draws]) - eps, 0.0)
    return x / x.sum(axis=1, keepdims=True) * mean.sum()
