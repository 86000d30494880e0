"""The claim stage: chunks claimed from the ledger, as the tasks their units are made from.

A plain JSONL chunk (a byte span) is one task: the helper reads it. A stream (CSV, Parquet, compressed JSONL)
must be read in order from one place, so it is read here: a compressed file as blocks of whole lines of about
`unit_bytes` (only decompressed and counted), CSV and Parquet as groups of parsed records; each becomes a task
committed with the stream's cursor, so a crash resumes from the last commit.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from embedfleet.ingest.stages import IDLE, Failure, Task
from embedfleet.ledger import Ledger
from embedfleet.sources import RawRecord, read_chunk
from embedfleet.sources.base import DamagedStream
from embedfleet.sources.jsonl import block_lines, stream_blocks
from embedfleet.sources.plan import ChunkSpec

__all__ = ["ClaimStage", "ClaimStats", "FIRST_TASK_BYTES", "RAMP", "stream_tasks", "task_sizes"]

# A GPU worker's first stream tasks grow from FIRST_TASK_BYTES by RAMP each, up to a full unit: helpers start
# together, so growth above 1 + (a helper's speed over the GPU's) leaves the GPU waiting for each next unit.
RAMP = 1.05
FIRST_TASK_BYTES = 64 << 10


@dataclass
class ClaimStats:
    claim_seconds: float = 0.0  # claiming chunks from the ledger (a query each)
    tail_started: float = 0.0  # perf_counter when nothing was left to claim and only others' chunks ran


class ClaimStage:
    """Tasks of the chunks this worker claims, until no chunk of the job is left; `IDLE` whenever nothing can be
    claimed right now (what is in flight is finished first: those chunks count as running too); a Failure for
    a stream that cannot be read. It keeps looking while chunks still run elsewhere: one of ours may fail and
    come back (`idle()` records our writer's failures while nothing flows), and a dead worker's come back
    when its lease expires. `ramp`: a worker's first stream tasks
    start small and grow (`task_sizes`), so a GPU, far quicker than a helper, starts sooner."""

    def __init__(self, ledger: Ledger, job: str, worker: str, lease: float, unit_bytes: int, ramp: bool = True,
                 idle: Callable[[], None] = lambda: None):
        self.ledger, self.job, self.worker, self.lease, self.unit_bytes = ledger, job, worker, lease, unit_bytes
        self.ramp, self.idle = ramp, idle
        self.stats = ClaimStats()

    def __call__(self, items: Iterator = iter(())) -> Iterator[Task | Failure | None]:
        stats, unit_bytes = self.stats, self.unit_bytes
        sizes = task_sizes(unit_bytes, FIRST_TASK_BYTES if self.ramp else None)
        while True:
            t0 = time.perf_counter()
            claim = self.ledger.claim(self.job, self.worker, self.lease)
            stats.claim_seconds += time.perf_counter() - t0
            if claim is None:
                mine, others = self.ledger.running_split(self.job, self.worker)
                if mine == 0 and others and not stats.tail_started:
                    stats.tail_started = time.perf_counter()  # ours all committed: the job's tail, others' last chunks
                if mine + others == 0:
                    return
                if mine:  # a unit of ours may have failed in the writer after the last item reached the commit
                    self.idle()  # stage, which records failures only as items pass: recorded now, retried or failed
                yield IDLE
                # Ours are only waiting for our writer, and this wait is the job's tail: look again soon.
                time.sleep(0.02 if others == 0 else min(0.25, self.lease / 4))
                continue
            stats.tail_started = 0.0  # a chunk came back and is ours now: not the tail after all
            spec = ChunkSpec(claim.source, claim.kind, claim.start, claim.end, claim.first_line)
            if claim.kind in ("jsonl", "table"):  # a byte or page span: one unit, read by the helper
                sizes = itertools.repeat(unit_bytes)  # full units have gone out: no ramp after them
                yield Task(spec, claim.cursor_line, claim.last_line, claim=claim)
                continue
            try:  # a stream: read here in order, committed every unit_bytes so a crash resumes from there
                for task in stream_tasks(spec, claim.cursor_line, claim.last_line, sizes):
                    task.claim = claim
                    yield task
            except Exception as e:  # unreadable file, decompression error…: the chunk fails, the job goes on
                yield Failure(claim, e)


def task_sizes(chunk_bytes: int, first_bytes: int | None = FIRST_TASK_BYTES, growth: float = RAMP) -> Iterator[int]:
    """Sizes of a worker's stream tasks: from `first_bytes`, each next `growth` times the last, up to
    `chunk_bytes`, then `chunk_bytes` on (None: `chunk_bytes` from the start)."""
    size = float(min(chunk_bytes, first_bytes or chunk_bytes))
    while size < chunk_bytes:
        yield int(size)
        size *= growth
    yield from itertools.repeat(chunk_bytes)


def stream_tasks(spec: ChunkSpec, after_line: int, last_line: int | None,
                 sizes: int | Iterator[int]) -> Iterator[Task]:
    """A stream chunk as tasks of about `sizes` bytes of input each (or each the next size of an iterator,
    which a worker shares across its chunks: `task_sizes`), read in order here; the last one is marked
    so. A chunk with nothing left still yields one (empty) task, to mark it done."""
    sizes = itertools.repeat(sizes) if isinstance(sizes, int) else sizes
    pending: Task | None = None  # one task of look-ahead, to know which one is the last
    for task in _stream_pieces(spec, after_line, last_line, sizes):
        if pending is not None:
            yield pending
        pending = task
    if pending is None:
        pending = Task(spec, after_line, last_line, raws=[], cursor_line=after_line)
    pending.last = True
    yield pending


def _stream_pieces(spec: ChunkSpec, after_line: int, last_line: int | None, sizes: Iterator[int]) -> Iterator[Task]:
    if spec.kind == "stream":  # compressed JSONL: here only decompress and count lines; helpers parse
        try:
            for first, block in stream_blocks(spec, after_line, sizes):
                if last_line is not None and first > last_line:
                    return
                end = first + block_lines(block) - 1
                yield Task(spec, after_line, last_line, block=block, first_line=first,
                           cursor_line=end if last_line is None else min(end, last_line), last=False)
        except DamagedStream as e:  # the lines before the damage land, the damage is a reject
            line = e.reject.line
            if line > after_line and (last_line is None or line <= last_line):
                yield Task(spec, after_line, last_line, raws=[e.reject], cursor_line=line, last=False)
        return
    group: list[RawRecord] = []  # CSV, Parquet: records read here
    size, cursor, limit = 0, after_line, next(sizes)
    for raw in read_chunk(spec, after_line=after_line):
        if last_line is not None and raw.line > last_line:
            break
        group.append(raw)
        size += len(raw.raw) + 1
        cursor = raw.line
        if size >= limit:
            yield Task(spec, after_line, last_line, raws=group, cursor_line=cursor, last=False)
            group, size, limit = [], 0, next(sizes)
    if group:
        yield Task(spec, after_line, last_line, raws=group, cursor_line=cursor, last=False)
