"""Which rows a rank visits, step by step: pure functions of (rows, seed, epoch, rank, world size).

Glossary:
    order     a permutation of the dataset's row indices for one epoch, the same on every rank, every
              tier, every device and every run: positions sorted by a bijective 32-bit integer hash
              salted from (seed, epoch). Integer arithmetic and a sort give the same values on any
              CPU or GPU (a seeded CUDA generator's output differs between GPU models), and on a GPU
              10M rows take milliseconds where numpy's shuffle took ~0.2 s of the host an epoch.
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
import torch

__all__ = ["epoch_order", "step_bounds", "step_sizes", "shard_bounds", "default_window_rows",
           "BLOCK_ROWS", "WINDOW_BYTES"]

BLOCK_ROWS = 256
# One window of float32 vectors in host memory: the streaming tier holds two at a time.
WINDOW_BYTES = 1 << 30


def default_window_rows(dim: int, block_rows: int = BLOCK_ROWS) -> int:
    """Rows of a window: about WINDOW_BYTES of float32 vectors, a whole number of blocks."""
    return max(block_rows, WINDOW_BYTES // (4 * max(1, dim)) // block_rows * block_rows)


M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """(x * c) mod 2^32 for 0 ≤ x < 2^32 held in int64 (numpy or torch), in two halves: no product
    overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def _mix32(x):
    """A bijection of 32-bit values with good avalanche (lowbias32, from Chris Wellons' hash prospector)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _salts(seed: int, epoch: int, stream: int) -> tuple[int, int]:
    a, b = np.random.SeedSequence([int(seed), int(epoch), int(stream)]).generate_state(2)
    return int(a), int(b)


def _shuffled(n: int, salts: tuple[int, int], device: torch.device | None):
    """A permutation of range(n) (n ≤ 2^32): positions sorted by a salted bijective hash (no ties, so
    any sort gives the same order): numpy on the host, torch on a device."""
    i = np.arange(n, dtype=np.int64) if device is None else torch.arange(n, dtype=torch.int64, device=device)
    keys = _mix32(_mix32(i ^ salts[0]) ^ salts[1])
    return np.argsort(keys) if device is None else torch.argsort(keys, stable=True)


def epoch_order(n: int, seed: int, epoch: int, block_rows: int = BLOCK_ROWS, window_rows: int | None = None,
                shuffle: bool = True, device=None):
    """The epoch's permutation of range(n): blocks in random order, rows shuffled within each window of
    `window_rows` positions. `shuffle=False`: range(n). A numpy int64 array computed on the host; with
    `device`, a torch int64 tensor computed there — the same values wherever it is computed."""
    dev = None if device is None or torch.device(device).type == "cpu" else torch.device(device)
    if not shuffle or n <= 1:
        order = np.arange(n, dtype=np.int64)
    else:
        if block_rows < 1 or (window_rows is not None and (window_rows < block_rows or window_rows % block_rows)):
            raise ValueError(f"window_rows ({window_rows}) must be a positive multiple of block_rows ({block_rows})")
        if n > 1 << 32:
            raise ValueError(f"{n} rows: an order covers at most 2^32")
        order = _blocks_then_windows(n, seed, epoch, block_rows, window_rows or n, dev)
    if device is None or isinstance(order, torch.Tensor):
        return order
    return torch.from_numpy(order).to(device)


def _blocks_then_windows(n: int, seed: int, epoch: int, block_rows: int, window_rows: int, dev):
    """Blocks of `block_rows` rows in a shuffled order, then each window of positions shuffled."""
    xp_arange = (lambda k: np.arange(k, dtype=np.int64)) if dev is None else \
        (lambda k: torch.arange(k, dtype=torch.int64, device=dev))
    blocks = _shuffled(-(-n // block_rows), _salts(seed, epoch, 0), dev)
    starts = blocks * block_rows
    lengths = (np.minimum if dev is None else torch.clamp_max)(n - starts, block_rows)
    placed = lengths.cumsum(0) - lengths  # where each block's first row lands in the order
    shift = np.repeat(placed - starts, lengths) if dev is None else \
        torch.repeat_interleave(placed - starts, lengths, output_size=n)
    order = xp_arange(n) - shift
    salts = _salts(seed, epoch, 1)
    for w in range(0, n, window_rows):
        k = min(window_rows, n - w)
        order[w:w + k] = order[w:w + k][_shuffled(k, (salts[0] ^ (w & M32), salts[1]), dev)]
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
