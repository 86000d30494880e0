"""Leaving a process whose work is written, without the interpreter's teardown."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

__all__ = ["NOT_REGISTERED", "exit_now"]

# A worker started early that gave up waiting to be registered (its launcher gone, or it never came).
NOT_REGISTERED = 3


def exit_now(code: int) -> NoReturn:
    """Exit at once with `code`, logs and stdio flushed first: no atexit handlers, no exit-time
    destructors (torch's CUDA context, Inductor's compile workers, a gloo group's)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
