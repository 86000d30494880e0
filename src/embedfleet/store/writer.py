"""The sink: one transaction per unit of work — rows (binary COPY, upsert on id), rejects, and the
chunk's progress mark commit together, so a crash at any moment loses nothing and writes nothing twice.

`Writer` runs commits on background threads with their own connections so the GPU never waits on
the database; `TableSink.commit_unit` is the whole transaction and can be called directly.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import psycopg
from psycopg import sql

from embedfleet.records import Reject
from embedfleet.store.copyrows import EncodedRows, assemble, vector_fields
from embedfleet.store.ledger import Claim
from embedfleet.store.schema import table_sql

log = logging.getLogger("embedfleet.writer")


# Connections writing ($EMBEDFLEET_WRITERS) and units queued for each ($EMBEDFLEET_WRITER_DEPTH). A
# GPU worker on a small model fills ~100k rows/s: three connections were 85% busy with PostgreSQL's
# CPU and WAL work a row (two GPUs 0.54x the one-GPU rate; six: 0.82x, bench/NOTES.md runs 39-40).
# More slack (12 x 4, 6 x 8) kept the GPU loops from waiting on the server (<= 0.015 s a run, against
# 0.01-1.6 s), yet two GPUs gave 0.74-0.89x the one-GPU rate against 0.80-0.93x with 6 x 2: the loops
# waited longer for input instead, and twelve connections contended for PostgreSQL's WAL insertion
# locks (bench/NOTES.md runs 50-52). So 6 x 2 stays.
def default_writers(device: str) -> tuple[int, int]:
    """(connections, units queued for each) for a worker embedding on `device`."""
    return (6, 2) if device.startswith("cuda") else (3, 2)


class LeaseLost(Exception):
    """Another worker holds the chunk now: this unit's transaction was rolled back."""


@dataclass
class Unit:
    """A slice of a chunk's records, embedded together and committed in one transaction."""

    claim: Claim
    rows: EncodedRows  # COPY-ready rows, one per distinct id, without their embeddings
    seen: int  # records read, before merging duplicate ids
    rejects: list[Reject]
    cursor_line: int  # every line up to here has been read into this unit or an earlier one
    last: bool  # the chunk's final unit: commit marks the chunk done
    tokens: int = 0
    tok: object = None  # the encoder's Tokenized batch, in row order
    embeddings: np.ndarray | None = None  # [rows.n, dim], in row order


class TableSink:
    """Everything needed to write one target table, prepared once per connection."""

    def __init__(self, conn: psycopg.Connection, table: str, columns: Sequence, vtype: str, job: str):
        self.conn, self.table, self.vtype, self.job = conn, table, vtype, job
        target = table_sql(conn, table)
        # The embedding goes last: rows come encoded without it (copyrows.assemble appends it).
        names = ["id", "content"] + [c.name for c in columns] + ["embedding"]
        ident = sql.SQL(", ").join(map(sql.Identifier, names))
        self.stage = sql.Identifier("_ef_stage")  # a temp table: private to this connection, which writes one table
        conn.execute(
            sql.SQL("CREATE TEMP TABLE IF NOT EXISTS {} (LIKE {}) ON COMMIT DELETE ROWS").format(
                self.stage, target
            )
        )
        self.copy_sql = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(self.stage, ident)
        self.copy_direct_sql = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(target, ident)
        # Safe: a crash loses at most the last moments of commits, rows and ledger mark together.
        conn.execute("SET synchronous_commit = off")
        updates = sql.SQL(", ").join(
            sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(n)) for n in names if n != "id"
        )
        # xmax = 0 only for rows this statement inserted: that is how we count new ids exactly.
        self.upsert_sql = sql.SQL(
            "WITH up AS (INSERT INTO {t} ({c}) SELECT {c} FROM {s} ON CONFLICT (id) DO UPDATE SET {u} "
            "RETURNING (xmax = 0) AS inserted) SELECT count(*) FILTER (WHERE inserted) FROM up"
        ).format(t=target, c=ident, s=self.stage, u=updates)

    def _copy(self, target: sql.Composable, data: bytes) -> None:
        with self.conn.cursor() as cur, cur.copy(target) as copy:
            copy.write(data)

    def _insert(self, data: bytes, n: int) -> int:
        """COPY straight into the table when every id is new (the common case: one pass, no
        staging); if any id exists already, roll that back and upsert through the stage table."""
        try:
            with self.conn.transaction():  # a savepoint
                self._copy(self.copy_direct_sql, data)
            return n
        except psycopg.errors.UniqueViolation:
            pass
        self._copy(self.copy_sql, data)
        return self.conn.execute(self.upsert_sql).fetchone()[0]

    def commit_unit(self, unit: Unit) -> int:
        """One transaction: rows + rejects + chunk progress. Returns ids newly inserted."""
        conn, claim = self.conn, unit.claim
        with conn.transaction():
            inserted = 0
            if unit.rows.n:
                data = assemble(unit.rows, vector_fields(unit.embeddings, self.vtype))
                inserted = self._insert(data, unit.rows.n)
            if unit.rejects:
                with conn.cursor() as cur:
                    cur.executemany(
                        "INSERT INTO embedfleet.rejects (job, source, line, reason, raw) VALUES (%s, %s, %s, %s, %s) "
                        "ON CONFLICT (job, source, line) DO UPDATE SET reason = EXCLUDED.reason, raw = EXCLUDED.raw",
                        [(self.job, r.source, r.line, r.reason, r.raw) for r in unit.rejects],
                    )
            row = conn.execute(
                "UPDATE embedfleet.chunks SET cursor_line = %s, rows_written = rows_written + %s, "
                "rows_seen = rows_seen + %s, rejected = rejected + %s, tokens = tokens + %s, "
                "state = CASE WHEN %s THEN 'done' ELSE state END, "
                "finished = CASE WHEN %s THEN now() ELSE NULL END "
                "WHERE job = %s AND chunk = %s AND claim = %s AND state = 'running' RETURNING 1",
                [unit.cursor_line, inserted, unit.seen, len(unit.rejects), unit.tokens,
                 unit.last, unit.last, claim.job, claim.chunk, claim.token],
            ).fetchone()
            if row is None:
                raise LeaseLost(f"chunk {claim.chunk} was taken over by another worker; its unit was not written")
        return inserted


class Writer:
    """Commits units on `threads` background threads, each with its own connection, so the server
    inserts in parallel. A unit goes to the thread with the fewest units queued or committing, except
    that a chunk's later units follow its first: they commit in order, so a chunk's cursor never
    moves backwards. (Fixed turns, chunk number modulo threads, made every unit wait whenever one
    commit was slow — a checkpoint, a WAL flush — while the other threads sat idle.) `submit` blocks
    only when the chosen thread has `depth` units waiting: the back-pressure that keeps memory bounded."""

    def __init__(self, sink_factory: Callable[[], TableSink], on_error: Callable[[Unit, BaseException], None],
                 on_done: Callable[[Unit, int], None] | None = None, depth: int = 2, threads: int = 3,
                 spare: int = 0):
        self._on_error, self._on_done = on_error, on_done
        # Connect here, one after another: a server that runs out of connections part way (other
        # clients, another host's workers) leaves this worker fewer writers, not dead — and `spare`
        # connections given back for those the caller opens later. Not even one is the caller's error.
        sinks = [sink_factory()]
        while len(sinks) < threads:
            try:
                sinks.append(sink_factory())
            except Exception as e:
                while spare and len(sinks) > 1:
                    sinks.pop().conn.close()
                    spare -= 1
                log.warning("writing on %d connections, not %d: %s", len(sinks), threads, e)
                break
        threads = len(sinks)
        self._queues = [queue.Queue(maxsize=depth) for _ in range(threads)]
        self._seconds = [0.0] * threads
        self._cpu = [0.0] * threads
        self._load = [0] * threads  # units queued or committing, per thread
        self._chunk_thread: dict = {}  # claim token → thread, while that chunk has units still to come
        self._lock = threading.Lock()
        self.fatal: BaseException | None = None
        self._threads = [threading.Thread(target=self._run, args=(i, sink), name=f"embedfleet-writer-{i}", daemon=True)
                         for i, sink in enumerate(sinks)]
        for t in self._threads:
            t.start()

    @property
    def connections(self) -> int:
        return len(self._threads)

    @property
    def db_seconds(self) -> float:
        """Wall time the busiest writer thread spent committing."""
        return max(self._seconds)

    @property
    def cpu_seconds(self) -> float:
        """CPU time of all writer threads (complete once `close` has returned)."""
        return sum(self._cpu)

    def submit(self, unit: Unit) -> None:
        if self.fatal is not None:
            raise self.fatal
        self._queues[self._route(unit)].put(unit)

    def _route(self, unit: Unit) -> int:
        with self._lock:
            token = unit.claim.token
            i = self._chunk_thread.pop(token, None)
            if i is None:
                i = min(range(len(self._load)), key=self._load.__getitem__)
            if not unit.last:
                self._chunk_thread[token] = i
            self._load[i] += 1
            return i

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()
        if self.fatal is not None:
            raise self.fatal

    def _run(self, i: int, sink: TableSink) -> None:
        q = self._queues[i]
        while (unit := q.get()) is not None:
            t0, n = time.perf_counter(), None
            try:
                n = sink.commit_unit(unit)
            except psycopg.OperationalError as e:  # the connection itself is gone: stop the worker
                self.fatal = e
                self._on_error(unit, e)
                continue
            except Exception as e:
                self._on_error(unit, e)
                continue
            finally:
                self._seconds[i] += time.perf_counter() - t0
                self._cpu[i] = time.thread_time()
                with self._lock:
                    self._load[i] -= 1
                    if n is None:  # the chunk's claim is gone (on_error): forget its thread, as its
                        self._chunk_thread.pop(unit.claim.token, None)  # later units, if any, fail too
            if self._on_done:
                self._on_done(unit, n)
