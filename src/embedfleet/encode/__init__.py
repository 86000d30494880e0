"""Texts to vectors: models, tokenizing, batching, packed forward passes, compiling, benchmarks."""

from __future__ import annotations

import os

__all__ = ["one_thread_math"]


def one_thread_math() -> None:
    """One BLAS / OpenMP thread in this process (unless the user set the variables): a query's matmuls
    are too small to share, and one shared between threads waits for whichever was descheduled (one
    MiniLM query on the loaded 2-core VM: p50 10-18 ms with one thread, 75-234 ms with two). Takes
    effect only before numpy or torch has loaded its math library."""
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")
