"""glibc's malloc told to keep, for the next unit, the memory a worker frees after each one.

A worker and its helpers allocate megabytes per unit (token arrays, a unit's rows, its COPY stream) and
free them when it is written. glibc serves such blocks with mmap and hands them back on free, or trims
its heap, so the next unit's buffers are fresh pages again: about one page fault per row on a GPU
worker (docs/decisions/malloc-keep-freed.md).
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_FROM = 32 << 20  # blocks below this come from the heap: glibc's largest allowed on 64-bit
TRIM_FROM = 1 << 30  # free memory at the heap's top kept up to this


def keep_freed_memory() -> bool:
    """Have this process's glibc serve blocks under 32 MB from its heap and keep what is freed (up to
    1 GB) for reuse. False where the C library is not glibc (nothing changes there)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its own allocator's ways stand
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_FROM) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_FROM) == 1
