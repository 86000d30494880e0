"""The prepare stage: tasks made into units on helper processes, so the worker process only feeds the device.

Making a unit — parse JSON, template, sanitize and coerce every record, tokenize the texts, encode the COPY
rows — is Python work per row; inside the worker it would share one GIL with the loop that launches kernels
and with the writers. A pool of helpers does it and sends back only bulk data: packed token ids, one block of
COPY-ready rows (the embedding is appended at commit), the rejects and a few counts. Their arrays come back
through a file in /dev/shm, not the pool's pipe, which would take the GIL back every 64 kB
(docs/decisions/helpers-and-spool.md).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import numpy as np
import psutil

from embedfleet.encode.passages import Splitter, expand
from embedfleet.encode.tokenize import Tokenized, TokenizerSpec, default_workers
from embedfleet.ingest.flow import Throttle
from embedfleet.ingest.stages import IDLE, Failure, Task, Unit
from embedfleet.ledger import Claim
from embedfleet.pg.copyin import COPY_TYPES, EncodedRows, RowEncoder
from embedfleet.platform.heap import keep_freed_memory
from embedfleet.platform.helpers import HelperPool
from embedfleet.sources import RawRecord, read_chunk
from embedfleet.sources.jsonl import block_records
from embedfleet.sources.plan import id_name
from embedfleet.sources.presets import job_preset, table_columns
from embedfleet.sources.records import Reject, to_records

__all__ = ["PrepareContext", "PrepareStage", "PrepareStats", "Prepared", "Preparer", "UnitPool", "helper_count",
           "settle_gc", "spool", "unspool"]


@dataclass(frozen=True)
class PrepareContext:
    """Everything a helper needs to prepare any unit of one job; sent once per process."""

    preset: str
    template: str | None
    text_field: str | None
    id_field: str | None
    tokenizer: TokenizerSpec
    dsn: str | None = None  # for the meta join: each helper opens its own connection when first needed
    meta_id: str | None = None
    db_patience: float = 0.0  # how long that connection keeps reconnecting to a database that went away
    passages: tuple[int, int] | None = None  # (tokens, overlap): each record as its passages
    id_root: str | None = None  # default ids name files below this (`sources.plan.id_root`); None: by base name
    columns: tuple[str, ...] | None = None  # --columns: record fields promoted into typed columns
    source_dsn: str | None = None  # --from-table: where the source is (each helper reads its spans itself)
    snapshot: str | None = None  # the snapshot the job's planner holds, to read the source in
    where: str | None = None  # which of the source's rows
    source_table: str | None = None  # --from-table: the source's qualified name (a chunk may read one partition)


@dataclass
class Prepared:
    rows: EncodedRows  # one per distinct id, the last occurrence winning (as a later upsert would)
    tok: Tokenized  # their texts' token ids, in row order
    seen: int  # records before merging duplicate ids
    rejects: list[Reject]
    cursor_line: int
    busy_s: float = 0.0  # the helper's wall time on this unit (to tell idle helpers from slow ones)
    cpu_s: float = 0.0  # and its CPU time (below busy_s when the helper shared its core)
    passages: dict[str, int] | None = None  # --passages: each record's id and its passages' count


@dataclass
class Spooled:
    """A Prepared whose arrays wait in a file (`path`) for the worker to read in one call."""

    path: str
    layout: list[tuple[str, int]]  # (numpy dtype, count) of each array, in file order
    rest: Prepared  # everything else, with rows and tok left out (None)


def spool(p: Prepared, directory: str) -> Spooled:
    arrays = [np.frombuffer(p.rows.blob, dtype=np.uint8), p.rows.offsets, p.tok.ids, p.tok.lengths, p.tok.order,
              p.tok.inverse, np.array([p.tok.prompt_tokens], np.int64)]
    fd, path = tempfile.mkstemp(dir=directory, suffix=".unit")
    try:
        with os.fdopen(fd, "wb") as f:
            for a in arrays:
                f.write(np.ascontiguousarray(a).data)
    except OSError:
        os.unlink(path)
        raise
    return Spooled(path, [(a.dtype.str, a.size) for a in arrays], dataclasses.replace(p, rows=None, tok=None))


def unspool(s: Spooled) -> Prepared:
    with open(s.path, "rb") as f:
        data = f.read()
    os.unlink(s.path)
    arrays, pos = [], 0
    for dtype, count in s.layout:
        a = np.frombuffer(data, dtype=dtype, count=count, offset=pos)
        arrays.append(a)
        pos += a.nbytes
    blob, offsets, ids, lengths, order, inverse, prompt_tokens = arrays
    return dataclasses.replace(s.rest, rows=EncodedRows(blob, offsets),
                               tok=Tokenized(ids, lengths, order, inverse, int(prompt_tokens[0])))


def source_name(ctx: PrepareContext, source: str) -> str:
    """How a default id names `source`."""
    return os.path.basename(source) if ctx.id_root is None else id_name(source, ctx.id_root)


def line_ids(ctx: PrepareContext, source: str) -> str | None:
    """The prefix of `source`'s default ids ("NAME:" and the line), or None where ids come from the records."""
    preset = job_preset(ctx.preset, ctx.columns)
    if ctx.id_field or preset.id_field or preset.id_fields:
        return None
    return f"{source_name(ctx, source)}:"


class Preparer:
    """Turns tasks into prepared units; one per process (or one inline when there is no pool)."""

    def __init__(self, ctx: PrepareContext):
        self.ctx = ctx
        self.preset = job_preset(ctx.preset, ctx.columns)
        self.tokenizer = ctx.tokenizer.build()
        self.tokenizer.build_word_path()  # in the helper's start-up, not in the job's first unit
        columns = table_columns(ctx.preset, ctx.passages is not None, ctx.columns)
        self.encoder = RowEncoder(["text", "text"] + [COPY_TYPES[c.pgtype] for c in columns])
        self._column_names = tuple(c.name for c in columns)  # each row's values, in column order
        self.splitter = (Splitter(ctx.tokenizer.tokenizer_json, *ctx.passages, words=self.tokenizer.word_tokens_many)
                         if ctx.passages else None)
        self._ledger = None
        self._tables = None

    def _source_name(self, source: str) -> str:
        return source_name(self.ctx, source)

    def _meta_lookup(self, keys: set[str]) -> dict[str, dict]:
        if self._ledger is None:
            from embedfleet.ledger import Ledger

            self._ledger = Ledger.connect(self.ctx.dsn, self.ctx.db_patience)
        return self._ledger.meta_lookup(self.ctx.meta_id, keys)

    def _read(self, task: Task) -> tuple[list[RawRecord], int]:
        """The task's records (none past --limit) and the cursor to commit with them."""
        if task.raws is not None:
            return task.raws, task.cursor_line
        if task.spec.kind == "table":  # a page span of a source table, read on this process's connection
            if self._tables is None:
                from embedfleet.sources.table import TableReader

                self._tables = TableReader(self.ctx.source_dsn, self.ctx.source_table, self.ctx.id_field,
                                           self.ctx.snapshot, self.ctx.where, self.ctx.columns)
            raws = list(self._tables.read(task.spec, task.after_line))
            return raws, max((r.line for r in raws), default=task.after_line)
        if task.block is not None:
            source = block_records(task.spec.source, task.first_line, task.block, task.after_line)
        else:
            source = read_chunk(task.spec, after_line=task.after_line)
        raws = []
        for raw in source:
            if task.last_line is not None and raw.line > task.last_line:
                break
            raws.append(raw)
        if task.block is not None:  # the block's last line, blank or not, came with the task
            return raws, task.cursor_line
        return raws, raws[-1].line if raws else task.after_line

    def __call__(self, task: Task) -> Prepared:
        raws, cursor = self._read(task)
        records, rejects = self.records(raws)
        if task.spec.kind == "table":
            rejects = self._tables.name_rejects(raws, rejects)
        return self.prepare(records, rejects, cursor)

    def records(self, raws: list[RawRecord]) -> tuple[list, list[Reject]]:
        """Raw records as the job's records (passages, with --passages) and rejects."""
        ctx = self.ctx
        records, rejects = to_records(
            raws, self.preset, template=ctx.template, text_field=ctx.text_field, id_field=ctx.id_field,
            meta_lookup=self._meta_lookup if ctx.meta_id else None, source_name=self._source_name,
        )
        if self.splitter is not None:
            records = expand(records, self.splitter)
        return records, rejects

    def prepare(self, records: list, rejects: list[Reject], cursor: int) -> Prepared:
        """Records as COPY-ready rows (one per id, the last winning) and their texts' tokens."""
        ctx = self.ctx
        kept = [records[i] for i in {r.id: i for i, r in enumerate(records)}.values()]
        names = self._column_names
        rows = self.encoder.encode([(r.id, r.content, *map(r.values.get, names)) for r in kept])
        tok = self.tokenizer.tokenize([r.content for r in kept], ctx.tokenizer.prefix)
        counts = None
        if self.splitter is not None:  # a record's passages are numbered from 0, in order: the last one's n + 1
            counts = {r.values["parent_id"]: r.values["passage"] + 1 for r in kept}
        return Prepared(rows, tok, len(records), rejects, cursor, passages=counts)

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.conn.close()
        if self._tables is not None:
            self._tables.close()


_HELPER: tuple[Preparer, str] | None = None


def settle_gc() -> None:
    """Call once start-up is done. What is alive then (modules, tokenizer, model) stays alive: freeze
    it out of the cyclic collector's scans, and collect less often. Per-row work makes millions of
    short-lived objects that reference counting frees; the collector's passes over them (and over the
    tokenizer's word cache) cost a helper a good share of its time (docs/decisions/helpers-and-spool.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def _helper_init(ctx: PrepareContext, spool_dir: str) -> None:
    # One helper per core already: tokenizer threads inside each would oversubscribe the CPU.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    keep_freed_memory()  # as its worker: a unit's arrays reuse the last one's pages
    global _HELPER
    _HELPER = (Preparer(ctx), spool_dir)
    settle_gc()


def _helper_prepare(task: Task) -> Spooled | Prepared:
    prepare, spool_dir = _HELPER
    t0, c0 = time.perf_counter(), time.process_time()
    prepared = prepare(task)
    prepared.busy_s, prepared.cpu_s = time.perf_counter() - t0, time.process_time() - c0
    try:
        return spool(prepared, spool_dir)
    except OSError:  # /dev/shm full (containers often get 64 MB): the pipe is slower, but works
        return prepared


def helper_count(cores: int | None = None) -> int:
    """Half of `cores` (this worker's share of the machine; default: all of it) up to 8, and none under
    4 cores: the tokenizer pool's rule. Settings.helpers, where set, overrides it."""
    return default_workers(cores)


class UnitPool:
    """Prepares tasks on `workers` helper processes, or inline on the caller's thread with 0."""

    def __init__(self, ctx: PrepareContext, workers: int | None = None, nice: int = 0):
        self.ctx = ctx
        self.workers = helper_count() if workers is None else workers
        self._inline = Preparer(ctx) if self.workers == 0 else None
        self._pool = self._spool_dir = None
        if self.workers:  # processes of our own: they never import the caller's __main__ (helper_pool.py)
            self._spool_dir = _spool_dir()
            # `nice`: the database's backends and the GPU's loop may come first on a short host.
            self._pool = HelperPool(self.workers, _helper_init, (ctx, self._spool_dir), name="units",
                                    nice=nice)

    def start(self) -> None:
        """Start every helper now (each imports and loads the tokenizer), not on the first units."""
        if self._pool is not None:
            self._pool.start()

    def start_in_background(self) -> Future:
        """`start` on a thread, so the caller can load its model meanwhile (both take seconds);
        the future's result is how long the helpers took."""
        done: Future = Future()

        def run() -> None:
            t0 = time.perf_counter()
            try:
                self.start()
            except BaseException as e:  # noqa: BLE001 - re-raised by whoever waits for the future
                done.set_exception(e)
            else:
                done.set_result(time.perf_counter() - t0)

        # A daemon thread, not an executor's: those are joined at exit, so a worker failing during its
        # model load would wait for the helpers to finish starting before it could exit.
        threading.Thread(target=run, name="embedfleet-helpers-start", daemon=True).start()
        return done

    def submit(self, task: Task) -> Future:
        """A future whose result is a Spooled (read it with `unspool`) or, inline, the Prepared."""
        if self._pool is not None:
            return self._pool.submit(_helper_prepare, task)
        fut: Future = Future()
        try:
            fut.set_result(self._inline(task))
        except Exception as e:
            fut.set_exception(e)
        return fut

    @staticmethod
    def result(future: Future) -> Prepared:
        out = future.result()
        return unspool(out) if isinstance(out, Spooled) else out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            shutil.rmtree(self._spool_dir, ignore_errors=True)
        if self._inline is not None:
            self._inline.close()


def _spool_dir() -> str:
    """A fresh directory in memory (/dev/shm) for this worker's units in flight; those left behind by
    killed workers (their pid is gone) are removed first."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    for old in os.listdir(base):
        pid = old.removeprefix("embedfleet-units-").split("-")[0]
        if old.startswith("embedfleet-units-") and pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(os.path.join(base, old), ignore_errors=True)
    return tempfile.mkdtemp(dir=base, prefix=f"embedfleet-units-{os.getpid()}-")


@dataclass
class PrepareStats:
    busy_seconds: float = 0.0  # this stage's time to produce each unit: waiting for claims, collecting, reading
    collect_seconds: float = 0.0  # waiting for the oldest unit in preparation, reading it back
    helper_seconds: float = 0.0  # helpers' wall time preparing units (over helpers × wall: how busy they were)
    helper_cpu_seconds: float = 0.0  # and their CPU time (below helper_seconds when helpers share cores)


class PrepareStage:
    """Units (or Failures) in claim order, prepared up to `throttle.limit` tasks ahead on the pool's helpers.
    `started(claim)` as a chunk's first unit goes out. A prepared unit goes out at once while the device loop
    is `hungry()` (has nothing queued), else once the window is full: otherwise a job's first unit would wait
    for a window's worth of tasks read from a stream (docs/decisions/first-units-ramp.md)."""

    def __init__(self, pool: UnitPool, throttle: Throttle, started: Callable[[Claim], None],
                 hungry: Callable[[], bool] = lambda: False):
        self.pool, self.throttle, self.started, self.hungry = pool, throttle, started, hungry
        self.stats = PrepareStats()

    def __call__(self, tasks: Iterator[Task | Failure | None]) -> Iterator[Unit | Failure]:
        units = self._units(tasks)
        while True:  # the time each unit took to come out: this stage's busy time (the records thread's)
            t0 = time.perf_counter()
            item = next(units, None)
            self.stats.busy_seconds += time.perf_counter() - t0
            if item is None:
                return
            yield item

    def _units(self, tasks: Iterator[Task | Failure | None]) -> Iterator[Unit | Failure]:
        pool, throttle, stats = self.pool, self.throttle, self.stats
        window: deque = deque()  # (task, future), oldest first
        begun: set = set()  # claim tokens whose chunk has gone to the device

        def collect() -> Iterator:
            task, future = window.popleft()
            claim = task.claim
            t0 = time.perf_counter()
            try:
                p = pool.result(future)
            except BrokenProcessPool as e:  # a helper died on this chunk (killed, out of memory): the culprit
                yield Failure(claim, e)
                raise
            except Exception as e:  # a bad file in a helper: the chunk fails, the job goes on
                yield Failure(claim, e)
                return
            finally:
                stats.collect_seconds += time.perf_counter() - t0
            stats.helper_seconds += p.busy_s
            stats.helper_cpu_seconds += p.cpu_s
            throttle.prepared(p.busy_s)
            if claim.token not in begun:
                begun.add(claim.token)
                self.started(claim)
            yield Unit(claim, p.rows, p.seen, p.rejects, p.cursor_line, task.last, p.tok.num_tokens, p.tok,
                       id_prefix=None if claim.replace_to is None else line_ids(pool.ctx, claim.source),
                       passages=p.passages)

        for item in tasks:
            if isinstance(item, Failure):
                yield item
                continue
            if item is IDLE:
                while window:
                    yield from collect()
                continue
            window.append((item, pool.submit(item)))
            while window and (len(window) > throttle.limit or (window[0][1].done() and self.hungry())):
                yield from collect()
        while window:
            yield from collect()
