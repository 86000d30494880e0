"""The epoch order and the per-rank steps: pure functions, checked with numpy."""

from __future__ import annotations

import numpy as np
import pytest

from embedfleet.train.order import (
    default_window_rows,
    epoch_order,
    shard_bounds,
    step_bounds,
    step_sizes,
)


@pytest.mark.parametrize("n", [0, 1, 2, 255, 256, 257, 1000, 4099])
@pytest.mark.parametrize("window", [256, 512, None])
def test_order_is_a_permutation_fixed_by_seed_and_epoch(n, window):
    a = epoch_order(n, seed=3, epoch=5, block_rows=256, window_rows=window)
    assert a.dtype == np.int64 and np.array_equal(np.sort(a), np.arange(n))
    assert np.array_equal(a, epoch_order(n, seed=3, epoch=5, block_rows=256, window_rows=window))
    if n > 300:
        assert not np.array_equal(a, epoch_order(n, 3, 6, 256, window))
        assert not np.array_equal(a, epoch_order(n, 4, 5, 256, window))
        assert not np.array_equal(a, np.arange(n))
    assert np.array_equal(epoch_order(n, 3, 5, 256, window, shuffle=False), np.arange(n))


def test_each_window_holds_whole_blocks():
    n, block, window = 5000, 100, 700
    order = epoch_order(n, 0, 0, block, window)
    for w in range(0, n, window):
        rows = order[w:w + window]
        blocks = np.unique(rows // block)
        whole = np.concatenate([np.arange(b * block, min(n, (b + 1) * block)) for b in blocks])
        assert np.array_equal(np.sort(rows), whole)  # a window is a set of whole blocks
        assert not np.array_equal(rows, np.sort(rows))  # shuffled inside


def test_one_window_is_a_full_shuffle():
    # with every row in one window, a block is not kept together
    order = epoch_order(1000, 0, 0, 100, None)
    assert np.any(np.abs(np.diff(order[:100])) > 100)


def test_window_must_be_whole_blocks():
    with pytest.raises(ValueError):
        epoch_order(1000, 0, 0, 100, 150)
    assert default_window_rows(384) % 256 == 0 and default_window_rows(10**9) == 256


CASES = [(0, 4, 1), (0, 4, 3), (1, 4, 2), (3, 4, 4), (5, 2, 8), (10, 3, 2), (10, 3, 3), (17, 4, 3),
         (100, 7, 4), (4096, 64, 8), (1001, 1000, 1), (1001, 1, 7)]


@pytest.mark.parametrize("n,batch,world", CASES)
def test_every_row_once_and_equal_steps(n, batch, world):
    order = epoch_order(n, 1, 2, 256, None)
    seen, steps = [], set()
    for rank in range(world):
        starts, ends = step_bounds(n, batch, rank, world)
        steps.add(len(starts))
        assert np.all(ends - starts <= batch) and np.all(ends >= starts)
        seen.extend(order[a] for s, e in zip(starts, ends) for a in range(s, e))
    assert len(steps) == 1  # the same number of steps on every rank: no collective waits forever
    assert sorted(seen) == list(range(n))  # every row exactly once across ranks
    assert steps.pop() == -(-n // (batch * world))


@pytest.mark.parametrize("n,batch,world", CASES)
def test_a_step_is_the_same_rows_whatever_the_world_size(n, batch, world):
    # rank parts of step s, in rank order, are positions [s*B*W, (s+1)*B*W): one process with batch B*W
    # takes the same rows a step, so W processes make the same updates as one
    one_s, one_e = step_bounds(n, batch * world, 0, 1)
    parts = [step_bounds(n, batch, r, world) for r in range(world)]
    for s in range(len(one_s)):
        assert parts[0][0][s] == one_s[s] and parts[-1][1][s] == one_e[s]
        for r in range(world - 1):
            assert parts[r][1][s] == parts[r + 1][0][s]  # contiguous, in rank order


@pytest.mark.parametrize("n,batch,world", CASES)
def test_drop_last_gives_full_batches(n, batch, world):
    counts = set()
    for rank in range(world):
        starts, ends = step_bounds(n, batch, rank, world, drop_last=True)
        assert np.all(ends - starts == batch)
        counts.add(len(starts))
    assert counts == {n // (batch * world)}
    assert step_sizes(n, batch, world, drop_last=True).sum() == n // (batch * world) * batch * world


def test_rank_outside_world_and_bad_sizes():
    with pytest.raises(ValueError):
        step_bounds(10, 2, 2, 2)
    with pytest.raises(ValueError):
        step_sizes(10, 0, 1)


@pytest.mark.parametrize("n,world", [(0, 3), (2, 3), (10, 3), (11, 4)])
def test_shards_cover_without_padding(n, world):
    bounds = [shard_bounds(n, r, world) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(bounds[r][1] == bounds[r + 1][0] for r in range(world - 1))
    assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1


def test_the_order_is_the_same_on_any_device_and_spreads_every_row():
    import torch

    a = epoch_order(5000, 7, 1, 256, 1024)
    t = epoch_order(5000, 7, 1, 256, 1024, device="cpu")
    assert isinstance(t, torch.Tensor) and np.array_equal(t.numpy(), a)
    # block_rows 1: a plain shuffle; over 300 epochs each row's mean position is near the middle
    n, epochs = 100, 300
    total = np.zeros(n)
    for e in range(epochs):
        total[epoch_order(n, 0, e, 1, None)] += np.arange(n)
    assert np.all(np.abs(total / epochs - (n - 1) / 2) < 12)  # ~7 standard deviations


def test_the_host_and_the_device_code_make_the_same_order():
    import torch

    from embedfleet.train.order import _blocks_then_windows

    for n, block, window in ((300_001, 256, 65_536), (5_000, 100, 5_000), (2, 1, 2)):
        host = _blocks_then_windows(n, 3, 2, block, window, None)  # numpy, uint32 arithmetic
        torch_path = _blocks_then_windows(n, 3, 2, block, window, torch.device("cpu"))  # what runs on a GPU
        assert np.array_equal(host, torch_path.numpy())
