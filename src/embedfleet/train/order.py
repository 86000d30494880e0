"""Which rows a rank visits, step by step: pure functions of (rows, seed, epoch, rank, world size).

Glossary:
    order     a permutation of the dataset's row indices for one epoch, the same on every rank, every
              tier and every run (numpy's PCG64 seeded from (seed, epoch), on the CPU: a seeded CUDA
              generator's output differs between GPU models).
    block     `block_rows` consecutive rows of the dataset (its last one may be short).
    window    `window_rows` consecutive positions of the order: a set of whole blocks, shuffled
              row by row. The streaming tier holds one window (and the next) in memory, so the
              order is a block shuffle at the window level and a full shuffle inside a window; a
              dataset that fits in one window gets a uniform permutation.
    step      one global batch: `batch_size * world_size` consecutive positions of the order,
              split into `world_size` near-equal contiguous parts, one per rank. Every rank takes
              the same number of steps, and the ranks together see every row exactly once an epoch
              (drop_last=False); a part may be empty when a step has fewer rows than ranks.
"""

from __future__ import annotations

import numpy as np

__all__ = ["epoch_order", "step_bounds", "step_sizes", "shard_bounds", "default_window_rows",
           "BLOCK_ROWS", "WINDOW_BYTES"]

BLOCK_ROWS = 256
# One window of float32 vectors in host memory: the streaming tier holds two at a time.
WINDOW_BYTES = 1 << 30


def default_window_rows(dim: int, block_rows: int = BLOCK_ROWS) -> int:
    """Rows of a window: about WINDOW_BYTES of float32 vectors, a whole number of blocks."""
    return max(block_rows, WINDOW_BYTES // (4 * max(1, dim)) // block_rows * block_rows)


def _rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch)])))


def epoch_order(n: int, seed: int, epoch: int, block_rows: int = BLOCK_ROWS,
                window_rows: int | None = None, shuffle: bool = True) -> np.ndarray:
    """The epoch's permutation of range(n) (int64): blocks in random order, rows shuffled within
    each window of `window_rows` positions. `shuffle=False`: range(n)."""
    if not shuffle or n <= 1:
        return np.arange(n, dtype=np.int64)
    if block_rows < 1 or (window_rows is not None and (window_rows < block_rows or window_rows % block_rows)):
        raise ValueError(f"window_rows ({window_rows}) must be a positive multiple of block_rows ({block_rows})")
    window_rows = window_rows or n
    rng = _rng(seed, epoch)
    blocks = rng.permutation(-(-n // block_rows)).astype(np.int64)
    starts = blocks * block_rows
    lengths = np.minimum(block_rows, n - starts)
    placed = np.cumsum(lengths) - lengths  # where each block's first row lands in the order
    order = np.arange(n, dtype=np.int64) - np.repeat(placed - starts, lengths)
    for w in range(0, n, window_rows):
        rng.shuffle(order[w:w + window_rows])
    return order


def step_sizes(n: int, batch_size: int, world_size: int = 1, drop_last: bool = False) -> np.ndarray:
    """Rows in each global step (all ranks together)."""
    if batch_size < 1 or world_size < 1:
        raise ValueError("batch_size and world_size must be at least 1")
    g = batch_size * world_size
    steps = n // g if drop_last else -(-n // g)
    sizes = np.full(steps, g, dtype=np.int64)
    if steps and not drop_last:
        sizes[-1] = n - g * (steps - 1)
    return sizes


def step_bounds(n: int, batch_size: int, rank: int = 0, world_size: int = 1,
                drop_last: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends): positions in the epoch's order of this rank's rows at each step.
    `batch_size` is per rank; a step spans batch_size * world_size positions."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    sizes = step_sizes(n, batch_size, world_size, drop_last)
    first = np.arange(len(sizes), dtype=np.int64) * batch_size * world_size
    return first + sizes * rank // world_size, first + sizes * (rank + 1) // world_size


def shard_bounds(n: int, rank: int = 0, world_size: int = 1) -> tuple[int, int]:
    """A contiguous, near-equal share of n rows for `rank` (validation: no padding, no overlap)."""
    return n * rank // world_size, n * (rank + 1) // world_size
