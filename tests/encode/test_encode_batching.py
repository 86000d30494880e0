"""Pure batching, packing and OOM backoff: numpy and a fake forward, no model."""

import numpy as np
import pytest
import torch

from embedfleet.encode.batching import cumulative, length_order, plan_batches
from embedfleet.encode.budget import (
    MAX_BATCH_TOKENS,
    TokenBudget,
    max_batch_tokens,
    probe_batch_tokens,
    run_with_backoff,
)
from embedfleet.encode.packed.attention import token_layout
from embedfleet.encode.tokenize import pack_sorted


def test_plan_batches_respects_budget_and_covers_all():
    lengths = np.array([9, 7, 7, 5, 3, 3, 2, 1])
    batches = plan_batches(lengths, 12)
    assert batches[0][0] == 0 and batches[-1][1] == len(lengths)
    assert all(a[1] == b[0] for a, b in zip(batches, batches[1:]))
    assert all(lengths[s:e].sum() <= 12 for s, e in batches)
    assert batches == [(0, 1), (1, 2), (2, 4), (4, 8)]


def test_oversize_item_runs_alone():
    assert plan_batches(np.array([50, 4, 4]), 10) == [(0, 1), (1, 3)]


def test_length_order_longest_first_and_stable():
    assert length_order(np.array([2, 5, 2, 5])).tolist() == [1, 3, 0, 2]


def test_positions_segments_offsets():
    lengths = np.array([3, 1, 2])
    assert cumulative(lengths).tolist() == [0, 3, 4, 6]
    cu, seg, pos = token_layout(torch.tensor(lengths, dtype=torch.int32), 6)
    assert cu.tolist() == [0, 3, 4, 6] and cu.dtype == seg.dtype == pos.dtype == torch.int32
    assert pos.tolist() == [0, 1, 2, 0, 0, 1]
    assert seg.tolist() == [0, 0, 0, 1, 2, 2]


def test_pack_sorted_round_trip():
    seqs = [[1, 2], [3, 4, 5, 6], [7], [8, 9, 10]]
    tok = pack_sorted(np.array(sum(seqs, []), dtype=np.int32), np.array([len(s) for s in seqs], dtype=np.int32))
    assert tok.lengths.tolist() == [4, 3, 2, 1] and tok.num_tokens == 10
    cu = cumulative(tok.lengths)
    unpacked = [tok.ids[cu[i] : cu[i + 1]].tolist() for i in range(len(seqs))]
    assert [unpacked[tok.inverse[j]] for j in range(len(seqs))] == seqs
    assert [seqs[tok.order[i]] for i in range(len(seqs))] == unpacked


def test_oom_halves_budget_and_retries_same_items():
    lengths = np.full(40, 10)
    done, calls = [], []

    def step(s, e):  # a forward that runs out of memory above 64 tokens
        calls.append((s, e))
        if lengths[s:e].sum() > 64:
            raise torch.OutOfMemoryError("fake")
        done.extend(range(s, e))

    budget = TokenBudget(400, floor=10)
    run_with_backoff(cumulative(lengths), budget, step)
    assert done == list(range(40))  # every item exactly once, in order
    assert budget.tokens == 50 and calls[0] == (0, 40)


def test_oom_at_floor_raises():
    def step(s, e):
        raise torch.OutOfMemoryError("fake")

    budget = TokenBudget(64, floor=16)
    with pytest.raises(torch.OutOfMemoryError):
        run_with_backoff(cumulative(np.full(4, 8)), budget, step)
    assert budget.tokens == 16


def test_small_models_get_bigger_batches():
    """Launch-bound small models (MiniLM: hidden 384) may batch a whole 2 MB unit (up to 2^20 tokens,
    16× what matmul-bound ones get); GPU memory still caps it (probe_batch_tokens)."""
    assert max_batch_tokens(384) == 16 * MAX_BATCH_TOKENS == 1 << 20
    assert max_batch_tokens(1024) == max_batch_tokens(768) == MAX_BATCH_TOKENS
    assert probe_batch_tokens(torch.device("cpu"), 1000, 512, 384) == 4096  # the CPU budget is its own



def test_flash_attention_is_torchs_op_called_directly_and_only_with_the_arguments_it_takes():
    import sys

    from embedfleet.encode.packed.attention import (
        _FLASH_ARGS,
        _flash_op,
        takes_flash_args,
    )

    # this torch registers the op (CPU builds too): found without importing torch._dynamo
    dynamo_before = "torch._dynamo" in sys.modules
    assert _flash_op() is not None
    assert ("torch._dynamo" in sys.modules) == dynamo_before
    assert takes_flash_args(_FLASH_ARGS + ["scale", "window_size_left"])
    assert not takes_flash_args(_FLASH_ARGS + ["window_size_left"])  # no scale
    assert not takes_flash_args(["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "is_causal",
                                 "dropout_p", "return_debug_mask", "scale"])  # reordered: refused
