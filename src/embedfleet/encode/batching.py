"""Length-sorted, token-budget batching: pure functions over arrays of lengths.

Packed sequences cost what their real tokens cost, so a batch is bounded by a token budget, not
an item count. Sorting by length keeps each batch's attention work even (and its longest
sequence close to the others), and putting the longest first makes the first batch the
heaviest, so an out-of-memory shows up at once rather than at the end of a long run.
"""

from __future__ import annotations

import numpy as np


def length_order(lengths: np.ndarray) -> np.ndarray:
    """Indices that sort `lengths` longest first (stable, so ties keep input order)."""
    return np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")


def next_batch_end(cu: np.ndarray, start: int, budget: int) -> int:
    """End (exclusive) of the batch starting at item `start`: as many items as fit in `budget`
    tokens, and always at least one. `cu` are cumulative offsets (len n+1)."""
    n = len(cu) - 1
    if start >= n:
        return start
    end = int(np.searchsorted(cu, cu[start] + budget, side="right")) - 1
    return min(max(end, start + 1), n)


def plan_batches(lengths: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Split items (already in the order to run them) into consecutive token-budget batches."""
    if budget < 1:
        raise ValueError("budget must be at least one token")
    cu = cumulative(lengths)
    out, start = [], 0
    while start < len(lengths):
        end = next_batch_end(cu, start, budget)
        out.append((start, end))
        start = end
    return out


def cumulative(lengths: np.ndarray) -> np.ndarray:
    """Offsets of each sequence in the packed buffer: [0, l0, l0+l1, ...] (int64, len n+1)."""
    cu = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    return cu

