"""Leaving a process whose work is written, without the interpreter's teardown."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import NoReturn

__all__ = ["NOT_REGISTERED", "die_with_parent", "exit_now"]

# A worker started early that gave up waiting to be registered (its launcher gone, or it never came).
NOT_REGISTERED = 3


def exit_now(code: int) -> NoReturn:
    """Exit at once with `code`, logs and stdio flushed first: no atexit handlers, no exit-time
    destructors (torch's CUDA context, Inductor's compile workers, a gloo group's)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def die_with_parent(parent: int) -> None:
    """End this process when `parent` (the launcher that started it) dies, however it dies: Linux sends it
    SIGTERM then (prctl's parent-death signal); elsewhere a thread watches. A parent already gone: exit now."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    else:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="embedfleet-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # it died before the signal was asked for
        exit_now(NOT_REGISTERED)
