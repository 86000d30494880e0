"""Validation metrics from sums that ranks can add up (no padding, no per-row gathering):
a confusion matrix for classification, error sums for regression. Pure numpy."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["classify_metrics", "regress_metrics"]


def classify_metrics(confusion: np.ndarray) -> dict:
    """Accuracy, macro-F1 (over classes that occur or are predicted) and the confusion matrix
    (rows: true class, columns: predicted) from its counts."""
    c = np.asarray(confusion, np.int64)
    total = int(c.sum())
    tp = np.diag(c).astype(np.float64)
    true, pred = c.sum(1).astype(np.float64), c.sum(0).astype(np.float64)
    present = (true + pred) > 0
    f1 = np.divide(2 * tp, true + pred, out=np.zeros_like(tp), where=present)
    return {
        "accuracy": float(tp.sum() / total) if total else None,
        "macro_f1": float(f1[present].mean()) if present.any() else None,
        "confusion": c.tolist(),
        "rows": total,
    }


def regress_metrics(abs_sum: float, sq_sum: float, rows: int) -> dict:
    return {
        "mae": abs_sum / rows if rows else None,
        "rmse": math.sqrt(sq_sum / rows) if rows else None,
        "rows": int(rows),
    }
