"""Texts to vectors: models, tokenizing, batching, packed forward passes, compiling, benchmarks."""

from __future__ import annotations

import os

__all__ = ["one_thread_math"]


def one_thread_math() -> None:
    """One BLAS thread for numpy in this process (unless the user set it): a query's matmuls are too
    small to share, and one shared between threads waits for whichever was descheduled (several times
    slower on a loaded machine: docs/decisions/query-encoder-numpy.md). Only numpy's
    OpenBLAS: a model that goes through torch keeps its threads. Takes effect only before numpy loads."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
