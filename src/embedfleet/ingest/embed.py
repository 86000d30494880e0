"""The embed stage: units through the device, the next one queued before the last one's vectors are read.

It runs on the worker's main thread, the loop that feeds the device. Its input comes from a `Prefetch`
thread; whenever nothing is ready there, the unit in flight is finished at once rather than held (holding it
could also stall the prepare stage, which waits for a chunk's units to go out). Every wait for input is timed:
the throttle that sizes the prepare stage's window learns from it whether the device is the bottleneck.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from embedfleet.ingest.flow import Throttle
from embedfleet.ingest.stages import Embedded, FailedClaims, Failure, Unit

__all__ = ["EmbedStage", "EmbedStats", "compile_pays", "COMPILE_MIN_BYTES", "SMALL_COMPILE_MIN_BYTES"]

# Below this much input left, a big model's compile costs more than eager steps lose.
COMPILE_MIN_BYTES = 32 << 20
# A small model's loop is bound by its host, not by the glue the compile fuses: its compile pays only for
# very long jobs (docs/decisions/compile-thresholds.md).
SMALL_COMPILE_MIN_BYTES = 1 << 30


def compile_pays(pending_bytes: int | None, small: bool = False) -> bool | None:
    """Whether a worker compiles (`Encoder.warmup`'s `compile`), given the job's input bytes left (None:
    not known, e.g. Parquet) and whether its model is small (`Encoder.small`): True, at once; for a
    big model's short job None, the encoder's own rule (once it has seen enough work); for a small
    model's, False: never. With an unknown size a big model compiles and a small one does not."""
    if pending_bytes is None:
        return not small
    if pending_bytes >= (SMALL_COMPILE_MIN_BYTES if small else COMPILE_MIN_BYTES):
        return True
    return False if small else None


@dataclass
class EmbedStats:
    embed_seconds: float = 0.0  # queuing forward passes and reading results
    launch_seconds: float = 0.0  # the queuing part of it (the rest waits for the device)
    wait_seconds: float = 0.0  # waiting for the prepare stage
    waits: list = field(default_factory=list)  # (seconds into the loop, seconds): the first wait, then those >= 1 ms
    done: list = field(default_factory=list)  # (seconds into the loop, rows): each unit's result read
    loop_start: float = 0.0  # perf_counter at the loop's start
    loop_seconds: float = 0.0
    last_wait: tuple[float, float] = (0.0, 0.0)  # (perf_counter, seconds) of the loop's last wait: its end
    state: str = "starting"


class EmbedStage:
    """Embedded units (or Failures) from units: `encoder.embed_async` queues a unit on the device, and its
    result is read after the next unit is queued. `ready()` says whether the next input is already waiting
    (the Prefetch's), `backlog()` how many are; a unit of a failed claim is dropped."""

    def __init__(self, encoder, throttle: Throttle, failed: FailedClaims, ready: Callable[[], bool],
                 backlog: Callable[[], int]):
        self.encoder, self.throttle, self.failed = encoder, throttle, failed
        self.ready, self.backlog = ready, backlog
        self.stats = EmbedStats()

    def __call__(self, units: Iterator[Unit | Failure]) -> Iterator[Embedded | Failure]:
        stats, throttle = self.stats, self.throttle
        units = iter(units)
        pending = None  # (unit, handle) queued on the device whose result is not read yet
        t_cycle = t_loop = stats.loop_start = time.perf_counter()
        embedded = False  # whether the last cycle embedded a unit (the throttle's measure of the device's time)
        while True:
            if pending is not None and not self.ready():
                yield self._finish(*pending)  # nothing to overlap with: finish it now
                pending = None
            stats.state = "waiting for input"
            ready, backlog = self.ready(), self.backlog()
            t0 = time.perf_counter()
            item = next(units, None)
            waited = time.perf_counter() - t0
            stats.wait_seconds += waited
            if waited >= 1e-3 or not stats.waits:
                stats.waits.append((t0 - t_loop, waited))
            throttle.feedback(not ready, backlog, waited, time.perf_counter() - t_cycle, embedded)
            t_cycle, embedded = time.perf_counter(), False
            if item is None:
                stats.loop_seconds = t_cycle - t_loop
                stats.last_wait = (t_cycle, waited)
                break
            if isinstance(item, Failure):
                yield item
                continue
            if item.claim in self.failed:
                continue  # the rest of a chunk that failed; it is retried from its last commit
            embedded = True
            stats.state = f"chunk {item.claim.chunk}"
            t0 = time.perf_counter()
            try:
                handle = self.encoder.embed_async(item.tok) if item.rows.n else None
            except Exception as e:
                yield Failure(item.claim, e)
                continue
            finally:
                launched = time.perf_counter() - t0
                stats.launch_seconds += launched
                stats.embed_seconds += launched
            if pending is not None:
                yield self._finish(*pending)
            pending = (item, handle)
        if pending is not None:
            yield self._finish(*pending)

    def _finish(self, unit: Unit, handle) -> Embedded | Failure:
        """A unit's vectors (waiting for the device if needed)."""
        t0 = time.perf_counter()
        try:
            vectors = handle.result() if handle is not None else None
        except Exception as e:
            return Failure(unit.claim, e)
        finally:
            self.stats.embed_seconds += time.perf_counter() - t0
        self.stats.done.append((time.perf_counter() - self.stats.loop_start, unit.rows.n))
        unit.tok = None  # free the token arrays before the unit waits in the writer queue
        return Embedded(unit, vectors)
