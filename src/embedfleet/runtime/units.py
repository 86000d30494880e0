"""Preparing units of work in helper processes, so the worker process only feeds the GPU.

A unit is the slice of a chunk that is embedded and committed together. Making one — parse JSON,
template, sanitize and coerce every record, tokenize the texts, encode the COPY rows — is Python
work per row, and inside the worker it shares one GIL with the kernel-launching loop and the
writers: that capped a worker near 11k rows/s (bench/NOTES.md). Here a pool of processes does it
and sends back only bulk data: packed token ids, one block of COPY-ready rows (the embedding is
appended by the writer), the rejects and a few counts. Shipping Python records instead would cost
the worker as much to unpickle as to build.

Helpers hand their arrays back through a file in /dev/shm (memory), not the pool's pipe: reading a
few MB from a pipe takes the GIL back after every 64 kB, and with the worker's other threads busy
each of those waits up to a switch interval: a 4.4 MB unit took ~335 ms with one busy thread in the
parent (8 ms with none); through /dev/shm, with the worker's 0.5 ms switch interval, 6 ms
(`bench/gil_convoy.py`, 2-core VM).

A plain JSONL chunk (a byte range) is read by the helper itself. A stream must be read in order from
one place, so the worker reads it: a compressed JSONL file (.gz/.zst) goes to the helpers as blocks of
whole lines of about `chunk_bytes` (the worker only decompresses and counts lines), CSV and Parquet as
groups of parsed records; each commits with the stream's cursor.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import psutil

from embedfleet.config import settings
from embedfleet.encode.passages import Splitter, expand
from embedfleet.encode.tokenize import Tokenized, TokenizerSpec, default_workers
from embedfleet.helper_pool import HelperPool
from embedfleet.records import Reject, to_records
from embedfleet.runtime.heap import keep_freed_memory
from embedfleet.sources import RawRecord, read_chunk
from embedfleet.sources.jsonl import block_lines, block_records, stream_blocks
from embedfleet.sources.plan import ChunkSpec, id_name
from embedfleet.sources.presets import job_preset, table_columns
from embedfleet.store.copyrows import COPY_TYPES, EncodedRows, RowEncoder


@dataclass(frozen=True)
class UnitContext:
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


@dataclass
class Task:
    spec: ChunkSpec
    after_line: int  # resume cursor: lines up to here are done
    last_line: int | None  # --limit: no line after this one
    raws: list[RawRecord] | None = None  # CSV/Parquet records read by the worker
    block: bytes | None = None  # whole lines of a compressed JSONL file, from line `first_line` on
    first_line: int = 1
    cursor_line: int = 0  # with raws or block: every line up to here is in this task or an earlier one
    last: bool = True  # the chunk's final unit: its commit marks the chunk done
    # No raws and no block: the helper reads the plain-JSONL byte range `spec` itself.


@dataclass
class Prepared:
    rows: EncodedRows  # one per distinct id, the last occurrence winning (as a later upsert would)
    tok: Tokenized  # their texts' token ids, in row order
    seen: int  # records before merging duplicate ids
    rejects: list[Reject]
    cursor_line: int
    busy_s: float = 0.0  # the helper's wall time on this unit (to tell idle helpers from slow ones)
    cpu_s: float = 0.0  # and its CPU time (below busy_s when the helper shared its core)


@dataclass
class Spooled:
    """A Prepared whose arrays wait in a file (`path`) for the worker to read in one call."""

    path: str
    layout: list[tuple[str, int]]  # (numpy dtype, count) of each array, in file order
    rest: Prepared  # everything else, with rows and tok left out (None)


def spool(p: Prepared, directory: str) -> Spooled:
    arrays = [np.frombuffer(p.rows.blob, dtype=np.uint8), p.rows.offsets, p.tok.ids, p.tok.lengths, p.tok.order,
              p.tok.inverse]
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
    blob, offsets, ids, lengths, order, inverse = arrays
    return dataclasses.replace(s.rest, rows=EncodedRows(blob, offsets), tok=Tokenized(ids, lengths, order, inverse))


class Preparer:
    """Turns tasks into prepared units; one per process (or one inline when there is no pool)."""

    def __init__(self, ctx: UnitContext):
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

    def _source_name(self, source: str) -> str:
        return os.path.basename(source) if self.ctx.id_root is None else id_name(source, self.ctx.id_root)

    def _meta_lookup(self, keys: set[str]) -> dict[str, dict]:
        if self._ledger is None:
            from embedfleet.store.ledger import Ledger

            self._ledger = Ledger.connect(self.ctx.dsn, self.ctx.db_patience)
        return self._ledger.meta_lookup(self.ctx.meta_id, keys)

    @staticmethod
    def _read(task: Task) -> tuple[list[RawRecord], int]:
        """The task's records (none past --limit) and the cursor to commit with them."""
        if task.raws is not None:
            return task.raws, task.cursor_line
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
        ctx = self.ctx
        raws, cursor = self._read(task)
        records, rejects = to_records(
            raws, self.preset, template=ctx.template, text_field=ctx.text_field, id_field=ctx.id_field,
            meta_lookup=self._meta_lookup if ctx.meta_id else None, source_name=self._source_name,
        )
        if self.splitter is not None:
            records = expand(records, self.splitter)
        kept = [records[i] for i in {r.id: i for i, r in enumerate(records)}.values()]
        names = self._column_names
        rows = self.encoder.encode([(r.id, r.content, *map(r.values.get, names)) for r in kept])
        tok = self.tokenizer.tokenize([r.content for r in kept], ctx.tokenizer.prefix)
        return Prepared(rows, tok, len(records), rejects, cursor)

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.conn.close()


_HELPER: tuple[Preparer, str] | None = None


def settle_gc() -> None:
    """Call once start-up is done. What is alive then (modules, tokenizer, model) stays alive: freeze
    it out of the cyclic collector's scans, and collect less often. Per-row work makes millions of
    short-lived objects that reference counting frees; the collector's passes over them (and over the
    tokenizer's word cache) cost a helper 10-20% of its time (2-core VM: ~56 → ~48 µs per review)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def _helper_init(ctx: UnitContext, spool_dir: str) -> None:
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

    def __init__(self, ctx: UnitContext, workers: int | None = None):
        self.workers = helper_count() if workers is None else workers
        self._inline = Preparer(ctx) if self.workers == 0 else None
        self._pool = self._spool_dir = None
        if self.workers:  # processes of our own: they never import the caller's __main__ (helper_pool.py)
            self._spool_dir = _spool_dir()
            # Settings.helper_nice: the database's backends and the GPU's loop come first on a short host.
            self._pool = HelperPool(self.workers, _helper_init, (ctx, self._spool_dir), name="units",
                                    nice=settings().helper_nice)

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


# Each of a GPU worker's first stream tasks is this much larger than the one before, from FIRST_TASK_BYTES up
# to a full unit: helpers start together, so growth above 1 + (a helper's speed over the GPU's) leaves the
# GPU waiting for each next unit; doubling did (bench/ramp_sim.py, bench/NOTES.md run 77).
RAMP = 1.05
FIRST_TASK_BYTES = 64 << 10


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
        for first, block in stream_blocks(spec, after_line, sizes):
            if last_line is not None and first > last_line:
                return
            end = first + block_lines(block) - 1
            yield Task(spec, after_line, last_line, block=block, first_line=first,
                       cursor_line=end if last_line is None else min(end, last_line), last=False)
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
