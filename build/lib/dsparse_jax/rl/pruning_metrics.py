"""Metrics of rollout pruning (docs/pruning.md): the quality head's AUC and calibration on
completed rows, and the fraction of groups whose rewards vary (a GRPO group with one
reward value has zero advantages and gives no gradient). numpy, on the host."""

from __future__ import annotations

import numpy as np


def weighted_auc(scores_N, labels_N, weights_N=None) -> float:
    """P(score of a positive > score of a negative), pairs weighted by w_i w_j, ties 1/2;
    nan without both classes."""
    s, y = np.asarray(scores_N, np.float64), np.asarray(labels_N) > 0.5
    w = np.ones_like(s) if weights_N is None else np.asarray(weights_N, np.float64)
    if not y.any() or y.all():
        return float("nan")
    sp, wp, sn, wn = s[y], w[y], s[~y], w[~y]
    order = np.argsort(sn)
    sn, wn = sn[order], wn[order]
    cum = np.concatenate([[0.0], np.cumsum(wn)])
    below = cum[np.searchsorted(sn, sp, side="left")]
    equal = cum[np.searchsorted(sn, sp, side="right")] - below
    return float(np.sum(wp * (below + 0.5 * equal)) / (wp.sum() * wn.sum()))


def calibration(scores_N, labels_N, weights_N=None, bins: int = 10) -> dict:
    """Expected calibration error over equal-width bins, and the mean prediction vs the
    mean label (weighted)."""
    s, y = np.asarray(scores_N, np.float64), np.asarray(labels_N, np.float64)
    w = np.ones_like(s) if weights_N is None else np.asarray(weights_N, np.float64)
    total = max(w.sum(), 1e-12)
    idx = np.minimum((s * bins).astype(int), bins - 1)
    ece = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            wb = w[m].sum()
            ece += wb / total * abs(np.sum(w[m] * s[m]) / wb - np.sum(w[m] * y[m]) / wb)
    return {
        "ece": float(ece),
        "mean_pred": float(np.sum(w * s) / total),
        "mean_label": float(np.sum(w * y) / total),
    }


def groups_mixed(rewards_PxG) -> float:
    """The fraction of groups (rows) whose rewards are not all equal."""
    r = np.asarray(rewards_PxG)
    if r.size == 0:
        return float("nan")
    return float(np.mean(r.max(axis=1) > r.min(axis=1)))
