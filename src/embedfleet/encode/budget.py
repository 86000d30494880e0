"""The token budget: sized from free GPU memory at start, halved on out-of-memory.

An OOM never ends the run: the budget halves and the same items are retried, down to one
sequence per batch. The cache is emptied only on that rare path, never per batch.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from embedfleet.encode.batching import next_batch_end

log = logging.getLogger(__name__)

MAX_BATCH_TOKENS = 65536  # past this matmuls are no faster, only latency and memory grow
# A small model's batch is launch-bound, not matmul-bound: bigger batches free the loop's CPU for the
# worker's helpers and PostgreSQL (docs/decisions/token-budget-and-batching.md).
# Up to 2^20 tokens, a whole unit (a 2 MB chunk: ~300-550k tokens of reviews) is one forward pass:
# fewer launches, and each launch gives the GIL back and must win it again from the writer threads.
SMALL_MODEL_BATCH_TOKENS, SMALL_MODEL_HIDDEN = 1 << 20, 512
CPU_BATCH_TOKENS = 4096


def activation_bytes_per_token(hidden: int, intermediate: int, dtype: torch.dtype) -> int:
    """Peak live activations per token in inference (no autograd): the residual stream, a few
    hidden-sized temporaries, the fused QKV and the MLP's up projection, times a safety factor."""
    size = torch.finfo(dtype).bits // 8
    return 2 * size * (8 * hidden + 3 * intermediate)


def max_batch_tokens(hidden: int) -> int:
    """The most tokens worth putting in one batch for a model of this width."""
    return SMALL_MODEL_BATCH_TOKENS if hidden <= SMALL_MODEL_HIDDEN else MAX_BATCH_TOKENS


def probe_batch_tokens(device: torch.device, per_token: int, max_seq_length: int, hidden: int,
                       share: float = 0.5) -> int:
    if device.type != "cuda":
        return max(CPU_BATCH_TOKENS, max_seq_length)
    free, _ = torch.cuda.mem_get_info(device)
    tokens = int(free * share) // per_token // 256 * 256
    return int(min(max_batch_tokens(hidden), max(tokens, max_seq_length)))


class TokenBudget:
    def __init__(self, tokens: int, floor: int):
        self.tokens, self.floor = max(int(tokens), int(floor)), int(floor)

    def halve(self) -> bool:
        """Halve after an OOM; False once a single longest sequence no longer fits."""
        if self.tokens <= self.floor:
            return False
        self.tokens = max(self.floor, self.tokens // 2)
        log.warning("out of GPU memory: token budget halved to %d", self.tokens)
        return True


def run_with_backoff(cu: np.ndarray, budget: TokenBudget, step: Callable[[int, int], None],
                     on_oom: Callable[[], None] | None = None) -> None:
    """Call step(start, end) over items [0, n) in token-budget batches, retrying on OOM."""
    start, n = 0, len(cu) - 1
    while start < n:
        end = next_batch_end(cu, start, budget.tokens)
        try:
            step(start, end)
        except torch.OutOfMemoryError:
            if on_oom is not None:
                on_oom()
            if not budget.halve():
                raise
            continue
        start = end
