"""Plumbing between a worker's stages: a generator run ahead on a thread, and how far ahead the prepare stage
keeps units in preparation. No embedfleet types here: both are tested on their own."""

from __future__ import annotations

import math
import queue
import threading
import time
from typing import Iterator

__all__ = ["Prefetch", "Throttle", "by_tenth"]


class Throttle:
    """How many tasks the records thread keeps in preparation. It starts with every helper busy, as
    many prepared units waiting for the GPU, and two more queued (a helper that finishes starts on
    the next at once). Units are taken in claim order, so finished
    ones wait behind a slower one; with room for only a couple of them, helpers sat idle while the
    GPU loop was busy and the loop waited while they caught up (docs/decisions/helpers-and-spool.md). Only when the GPU is the bottleneck — its loop has spent under 5% of
    the last second or so waiting for input — and prepared units queue up for it (the next one is
    waiting and the one after it is ready too) does the limit drop by one, down to two: claiming
    more chunks then would only leave other workers idle at the end of the job. Each time the GPU
    loop had to wait raises it by one. When the helpers are the bottleneck (small models) the limit
    stays up even though units sometimes arrive in bursts: shrinking then would idle helpers. Nor does
    it drop below what the GPU uses up while one unit is prepared (Little's law: a unit's preparation
    time over the GPU's time a unit, plus one): units slower to prepare than to embed (passages of long
    documents) left the GPU waiting with two in preparation (docs/decisions/first-units-ramp.md)."""

    GPU_BOUND = 0.05  # recent share of the loop's time spent waiting for input, below which the GPU is the bottleneck
    MEMORY_S = 1.0  # how far back "recent" reaches (seconds)

    def __init__(self, helpers: int, most: int | None = None):
        self.most, self.least = (most or 2 * helpers + 2, 2) if helpers else (0, 0)
        self.limit = self.most
        self.waiting = 1.0  # moving average of the loop's share of time waiting for input
        self.prep_s = 0.0  # moving averages: a helper's seconds preparing a unit, the GPU loop's seconds a unit
        self.use_s = 0.0
        self._sum = self._n = 0

    def prepared(self, seconds: float) -> None:
        """A helper took `seconds` to prepare a unit."""
        self.prep_s = seconds if not self.prep_s else 0.8 * self.prep_s + 0.2 * seconds

    @property
    def floor(self) -> int:
        """The fewest tasks in preparation that keep a busy GPU fed: the units it uses up while one is
        prepared, plus one."""
        if not (self.prep_s and self.use_s):
            return self.least
        return min(self.most, max(self.least, math.ceil(self.prep_s / self.use_s) + 1))

    def feedback(self, waited: bool, backlog: int = 0, wait_s: float = 0.0, cycle_s: float = 0.0,
                 embedded: bool = True) -> None:
        """`waited`: the GPU loop found no unit ready; `backlog`: units ready when it looked;
        `wait_s` of `cycle_s`: how long it waited, out of the time since its previous unit; `embedded`:
        whether the rest of that time went to embedding a unit (the GPU's time a unit, for `floor`)."""
        if cycle_s > 0:  # averaged over time (about the last second), so a burst of quick units barely moves it
            keep = math.exp(-cycle_s / self.MEMORY_S)
            self.waiting = keep * self.waiting + (1 - keep) * min(1.0, wait_s / cycle_s)
        if cycle_s > 0 and embedded:  # a failure or a skipped unit is no measure of the GPU's time a unit
            use = max(0.0, cycle_s - wait_s)
            self.use_s = use if not self.use_s else 0.8 * self.use_s + 0.2 * use
        if waited:
            self.limit = min(self.most, self.limit + 1)
        elif backlog >= 2 and self.waiting < self.GPU_BOUND:
            self.limit -= 1
        self.limit = max(self.limit, self.floor)
        self._sum, self._n = self._sum + self.limit, self._n + 1

    @property
    def mean(self) -> float:
        return self._sum / self._n if self._n else float(self.limit)


def by_tenth(events: list[tuple[float, float]], span: float, parts: int = 10) -> list[float]:
    """The sum of the values in each of `parts` equal stretches of `span` seconds, from (start, value)
    pairs (an event across a boundary counts where it started): whether a loop waits at its start, its
    end or throughout; how its rate ramps."""
    out = [0.0] * parts
    for start, value in events:
        out[min(parts - 1, max(0, int(start / span * parts))) if span > 0 else 0] += value
    return [round(v, 3) for v in out]


class Prefetch:
    """Runs a generator on a thread, `depth` items ahead. Exceptions re-raise in the consumer."""

    _END = object()

    def __init__(self, gen: Iterator, depth: int = 2, name: str = "embedfleet-prefetch"):
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._putting = 0
        self.cpu_s = 0.0  # the thread's CPU time, once it has finished
        self.blocked_s = 0.0  # time it waited for room: its items were ready before the consumer was
        self._thread = threading.Thread(target=self._run, args=(gen,), name=name, daemon=True)
        self._thread.start()

    def _run(self, gen):
        try:
            for item in gen:
                self._put(item)
            self.cpu_s = time.thread_time()
            self._q.put(self._END)
        except BaseException as e:
            self._q.put(e)

    def ready(self) -> bool:
        """Whether the next item is already waiting (taking it will not block)."""
        return not self._q.empty()

    def backlog(self) -> int:
        """Items ready: those queued, plus the one the producer holds while it waits for room."""
        return self._q.qsize() + self._putting

    def _put(self, item) -> None:
        self._putting = 1
        t0 = time.perf_counter()
        try:
            self._q.put(item)
        finally:
            self._putting = 0
            self.blocked_s += time.perf_counter() - t0

    def __iter__(self):
        while (item := self._q.get()) is not self._END:
            if isinstance(item, BaseException):
                raise item
            yield item
