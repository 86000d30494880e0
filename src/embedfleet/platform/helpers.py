"""Helper processes that start from this package alone, never from the caller's `__main__`.

multiprocessing's `spawn` (and `forkserver`) children run `spawn.prepare()`, which imports the
parent's main script or module again: a user's script with `import torch, sentence_transformers` at
its top made every tokenizer helper import both (6 s for two helpers on the 2-core VM, 79 s on a GPU
host), and a `__main__` from `python -c`, stdin or a notebook could not be re-imported at all. A
helper here is `python -c "from embedfleet.platform.helpers import _serve; ..."`: it imports this module,
takes the parent's `sys.path`, runs the initializer it is sent, then calls functions it is sent, one
at a time, over a pair of pipes (pickled, length-prefixed). Start-up costs what the initializer
imports and builds, whatever the caller's script holds.

A helper leaves when its pipe closes (the parent exited or was killed) or its parent changes.
A helper that dies breaks the pool, as a `ProcessPoolExecutor` does: its task and every later one
fail with `BrokenProcessPool`.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import Connection

__all__ = ["BrokenProcessPool", "HelperPool", "started_count"]

_STARTED = [0]  # helper processes this process has started (a test asks whether a command started any)
_STOP = object()


def started_count() -> int:
    """How many helper processes this process has started so far."""
    return _STARTED[0]


class _RemoteError(Exception):
    """An exception from a helper that could not travel as itself; carries its traceback text."""


class _Helper:
    """One process, its pipes and the parent-side thread that feeds it."""

    def __init__(self, index: int, name: str, init_blob: bytes, nice: int = 0):
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        code = (f"import os, sys; os.nice({nice}); sys.path.insert(0, {package_root!r}); "
                f"from embedfleet.platform.helpers import _serve; _serve({child_r}, {child_w})")
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(child_r, child_w),
                                         stdin=subprocess.DEVNULL, stdout=_stdout_target())
        finally:
            os.close(child_r)
            os.close(child_w)
        _STARTED[0] += 1
        self.index, self.name, self.init_blob = index, name, init_blob
        self.send = Connection(parent_w, readable=False)
        self.recv = Connection(parent_r, writable=False)

    def close_pipes(self) -> None:
        for c in (self.send, self.recv):
            try:
                c.close()
            except OSError:
                pass


def _stdout_target():
    """Helpers print to the parent's stderr: the parent's stdout may carry its one JSON document."""
    try:
        os.fstat(2)
        return 2
    except OSError:
        return subprocess.DEVNULL


class _State:
    """What the pool's threads share (not the pool itself, so an unreferenced pool can be finalized)."""

    def __init__(self, workers: int):
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.ready = [threading.Event() for _ in range(workers)]
        self.broken: BaseException | None = None
        self.lock = threading.Lock()

    def fail_all(self, err: BaseException) -> None:
        with self.lock:
            if self.broken is None:
                self.broken = err
        for e in self.ready:
            e.set()
        stops = 0
        while True:  # everything queued fails with it
            try:
                item = self.tasks.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                stops += 1
            elif item[0].set_running_or_notify_cancel():
                item[0].set_exception(err)
        for _ in range(stops):  # the other helpers' threads still need theirs
            self.tasks.put(_STOP)


def _feed(helper: _Helper, state: _State) -> None:
    """Parent side of one helper: send it where to import from and its initializer, wait for that to
    run, then send tasks and collect results. Once the pool is broken it fails each task it takes,
    until told to stop. (The sends are here, not in the pool's constructor: a pipe holds 64 kB, so
    there each helper's setup waited for its interpreter to start reading, one helper after another.)"""
    alive = True
    try:
        helper.send.send_bytes(pickle.dumps(list(sys.path)))
        helper.send.send_bytes(helper.init_blob)
        helper.init_blob = b""
        status, value = pickle.loads(helper.recv.recv_bytes())
        if status != "ready":
            raise value
    except BaseException as err:  # noqa: BLE001 - ends the pool; start() and every task report it
        state.fail_all(_broken(helper, err, "while starting"))
        alive = False
    else:
        state.ready[helper.index].set()
    while True:
        item = state.tasks.get()
        if item is _STOP:
            break
        future, blob = item
        if not future.set_running_or_notify_cancel():
            continue
        if not alive or state.broken is not None:
            future.set_exception(state.broken)
            continue
        try:
            helper.send.send_bytes(blob)
            reply = helper.recv.recv_bytes()
        except BaseException as err:  # noqa: BLE001 - the helper is gone: its task and the pool fail
            broken = _broken(helper, err, "while running a task")
            future.set_exception(broken)
            state.fail_all(broken)
            alive = False
            continue
        try:
            status, value = pickle.loads(reply)
        except Exception as err:  # noqa: BLE001 - a result this process cannot rebuild
            status, value = "error", RuntimeError(f"a helper's reply could not be read here: {err}")
        if status == "ok":
            future.set_result(value)
        else:
            future.set_exception(value)
    helper.close_pipes()


def _broken(helper: _Helper, err: BaseException, when: str) -> BaseException:
    if isinstance(err, (EOFError, OSError)):
        try:
            code = helper.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return BrokenProcessPool(f"{helper.name} helper process {helper.proc.pid} died {when} (exit code {code})")
    if isinstance(err, BrokenProcessPool):
        return err
    broken = BrokenProcessPool(f"{helper.name} helper failed {when}: {type(err).__name__}: {err}")
    broken.__cause__ = err
    return broken


class HelperPool:
    """`workers` helper processes, each set up once by `initializer(*initargs)` (called there).

    The processes start at once, in the background; `start()` waits until every one has run its
    initializer. `submit(fn, *args)` runs `fn(*args)` in whichever helper is free (fn and args must
    pickle by reference to an importable module, not to `__main__`). `nice` lowers the helpers' CPU
    priority by that much below the caller's.
    """

    def __init__(self, workers: int, initializer: Callable, initargs: tuple = (), name: str = "embedfleet",
                 nice: int = 0):
        if workers < 1:
            raise ValueError("a helper pool needs at least one process")
        self.workers = workers
        self._state = state = _State(workers)
        init_blob = pickle.dumps((initializer, tuple(initargs)), protocol=pickle.HIGHEST_PROTOCOL)
        self._helpers: list[_Helper] = []
        self._threads: list[threading.Thread] = []
        try:
            for i in range(workers):
                helper = _Helper(i, name, init_blob, nice)
                self._helpers.append(helper)
                t = threading.Thread(target=_feed, args=(helper, state), name=f"{name}-helper-{i}", daemon=True)
                t.start()
                self._threads.append(t)
        except BaseException:
            _shutdown(state, self._helpers, self._threads, wait=False)
            raise
        self._finalizer = weakref.finalize(self, _shutdown, state, self._helpers, self._threads, False)

    @property
    def pids(self) -> list[int]:
        return [h.proc.pid for h in self._helpers]

    def start(self, timeout: float | None = None) -> float:
        """Wait until every helper has run its initializer; returns the seconds waited. Raises
        `BrokenProcessPool` if one failed or died."""
        t0 = time.perf_counter()
        deadline = None if timeout is None else t0 + timeout
        for e in self._state.ready:
            if not e.wait(None if deadline is None else max(0.0, deadline - time.perf_counter())):
                raise TimeoutError(f"helper processes not ready after {timeout} s")
        if self._state.broken is not None:
            raise self._state.broken
        return time.perf_counter() - t0

    def ready(self) -> bool:
        """True once every helper has started (without waiting)."""
        return self._state.broken is None and all(e.is_set() for e in self._state.ready)

    @property
    def broken(self) -> BaseException | None:
        """Why the pool cannot run tasks any more (a helper failed or died), else None."""
        return self._state.broken

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        if self._state.broken is not None:
            future.set_exception(self._state.broken)
            return future
        if not self._finalizer.alive:
            raise RuntimeError("submit on a closed helper pool")
        self._state.tasks.put((future, pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)))
        return future

    def map(self, fn: Callable, iterable: Iterable) -> list:
        """fn over every item, in the helpers, results in order."""
        return [f.result() for f in [self.submit(fn, x) for x in iterable]]

    def close(self, wait: bool = True) -> None:
        """Cancel tasks not yet started, let running ones finish (`wait`), and end the processes."""
        if self._finalizer.detach() is not None:
            _shutdown(self._state, self._helpers, self._threads, wait)


def _shutdown(state: _State, helpers: list[_Helper], threads: list[threading.Thread], wait: bool) -> None:
    while True:  # cancel what has not started
        try:
            item = state.tasks.get_nowait()
        except queue.Empty:
            break
        if item is not _STOP:
            item[0].cancel()
    for _ in threads:
        state.tasks.put(_STOP)
    if wait:  # running tasks finish; each thread then closes its helper's pipes, and the helper leaves
        for t in threads:
            t.join()
    else:  # a helper sees EOF on its pipe and leaves (its thread may be waiting on it: not joined)
        for h in helpers:
            try:
                h.send.close()
            except OSError:
                pass
    for h in helpers:
        try:
            h.proc.wait(timeout=10 if wait else 1)
        except subprocess.TimeoutExpired:
            h.proc.kill()
            h.proc.wait()


# --- the helper's side ---------------------------------------------------------------------------


def _serve(read_fd: int, write_fd: int) -> None:
    """Run in a helper: set up from the parent's first messages, then answer tasks until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes the pipe
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    try:
        sys.path[:] = pickle.loads(inbox.recv_bytes())
        init, args = pickle.loads(inbox.recv_bytes())
        init(*args)
    except EOFError:
        return
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which fails the pool
        _reply(outbox, "error", err)
        return
    _reply(outbox, "ready", os.getpid())
    while True:
        try:
            blob = inbox.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            fn, args = pickle.loads(blob)
            status, value = "ok", fn(*args)
        except Exception as err:  # noqa: BLE001 - the task's error travels to its future
            status, value = "error", err
        try:
            _reply(outbox, status, value)
        except OSError:  # the parent is gone
            return


def _reply(outbox: Connection, status: str, value) -> None:
    try:
        blob = pickle.dumps((status, value), protocol=pickle.HIGHEST_PROTOCOL)
        if status == "error":
            pickle.loads(blob)  # an exception whose class cannot be rebuilt from its args fails here, not there
    except Exception as err:  # noqa: BLE001 - an exception (or result) that does not travel
        text = "".join(traceback.format_exception(value)) if isinstance(value, BaseException) else repr(err)
        blob = pickle.dumps(("error", _RemoteError(text.strip())))
    outbox.send_bytes(blob)


def _exit_with_parent(parent: int) -> None:
    """A parent killed with -9 while another process holds a copy of this helper's pipe (a fork of
    the parent) would leave it waiting forever: leave once the parent is gone."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)
