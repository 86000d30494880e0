"""The one place processes are started, watched, stopped and asked whether they are alive: workers (the local
launcher), training ranks, helpers, export's parts.

A child started here dies with the process that started it (the parent-death signal on Linux, a watching
thread elsewhere): a launcher killed with -9 leaves no worker writing on.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import NoReturn

import psutil

__all__ = ["NOT_REGISTERED", "alive", "die_with_parent", "exit_now", "first_failure", "process_started", "spawn",
           "stop"]

# A worker started early that gave up waiting to be registered (its launcher gone, or it never came).
NOT_REGISTERED = 3


def spawn(cmd: Sequence[str], env: dict | None = None, **popen) -> subprocess.Popen:
    """Start `cmd` with no stdin (a child never reads the user's terminal)."""
    return subprocess.Popen(list(cmd), env=env, stdin=subprocess.DEVNULL, **popen)


def stop(procs: Sequence[subprocess.Popen | None], wait: bool = True, grace: float = 10.0) -> None:
    """SIGTERM each running process; with `wait`, wait for each, killed after `grace` seconds."""
    procs = [p for p in procs if p is not None]
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs if wait else []:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def first_failure(procs: Sequence[subprocess.Popen], poll: float = 0.2) -> int:
    """Wait until every process has exited or one has failed; the first non-zero exit code (0: none failed).
    The caller stops the rest (`stop`)."""
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed:
            return failed[0]
        time.sleep(poll)
    return next((p.returncode for p in procs if p.returncode), 0)


def process_started(pid: int) -> float | None:
    """Start time of a live process, None if it is gone (a zombie is gone: it only awaits reaping)."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def alive(pid: int, started: float | None = None) -> bool:
    """Whether process `pid` lives, and is the one that started at `started` (a reused pid is not)."""
    now_started = process_started(pid)
    if now_started is None:
        return False
    return started is None or abs(now_started - started) < 1.0


def exit_now(code: int) -> NoReturn:
    """Exit at once with `code`, logs and stdio flushed first: no atexit handlers, no exit-time destructors
    (torch's CUDA context, Inductor's compile workers, a gloo group's)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def die_with_parent(parent: int) -> None:
    """End this process when `parent` (the process that started it) dies, however it dies: Linux sends it
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
