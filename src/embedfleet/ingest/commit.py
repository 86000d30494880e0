"""The commit stage: one transaction per unit — its rows (binary COPY, upsert on id), its rejects and its
chunk's cursor commit together, and only while the claim's fencing token still holds, so a crash at any moment
loses nothing and writes nothing twice.

`CommitStage` hands embedded units to a `Writer`, whose threads commit them on connections of their own so the
device never waits on the database, and records every failure that reaches it: the one owner of that.
`TableSink.commit_unit` is the whole transaction and can be called directly.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from embedfleet.errors import EmbedfleetError, first_line
from embedfleet.ingest.stages import Embedded, FailedClaims, Failure, Unit
from embedfleet.ledger import Ledger
from embedfleet.pg.connect import Reconnect, lost
from embedfleet.pg.copyin import assemble, vector_fields
from embedfleet.pg.ddl import table_sql

log = logging.getLogger("embedfleet.writer")


# Connections writing ($EMBEDFLEET_WRITERS) and units queued for each ($EMBEDFLEET_WRITER_DEPTH). Six keep up
# with a GPU on a small model (fewer fall behind, more contend for the WAL's eight insertion locks); eight units
# each ride out a slow flush instead of stalling the GPU (docs/decisions/writers-and-queue-depth.md).
def default_writers(device: str) -> tuple[int, int]:
    """(connections, units queued for each) for a worker embedding on `device`."""
    return (6, 8) if device.startswith("cuda") else (3, 2)


STALE_WINDOW = 1024  # passage ids a record written again is looked up for at a time


class LeaseLost(Exception):
    """Another worker holds the chunk now: this unit's transaction was rolled back."""


class _Committed(Exception):
    """This unit's commit had already gone through (its acknowledgement was lost with the connection)."""


class TableSink:
    """Everything needed to write one target table, prepared once per connection."""

    def __init__(self, conn: psycopg.Connection, table: str, columns: Sequence, vtype: str, job: str):
        self.conn, self.table, self.vtype, self.job = conn, table, vtype, job
        self.target = target = table_sql(conn, table)
        self.passages = any(c.name == "parent_id" for c in columns)  # rows are passages of a record's id
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
        # A map's coordinates (columns map made, by their comment) place the old vector: a row rewritten loses them.
        stale = [c for c in ("map_x", "map_y") if c not in names and conn.execute(
            "SELECT 1 FROM pg_attribute WHERE attrelid = %s::regclass AND attname = %s AND NOT attisdropped "
            "AND col_description(attrelid, attnum) LIKE 'embedfleet map:%%'", [target.as_string(conn), c]).fetchone()]
        updates = sql.SQL(", ").join(
            [sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(n)) for n in names if n != "id"]
            + [sql.SQL("{} = NULL").format(sql.Identifier(c)) for c in stale]
        )
        # xmax = 0 only for rows this statement inserted: that is how we count new ids exactly; and, for passages,
        # which records were there before (their rows past the new count go).
        self.upsert_sql = sql.SQL(
            "WITH up AS (INSERT INTO {t} ({c}) SELECT {c} FROM {s} ON CONFLICT (id) DO UPDATE SET {u} "
            "RETURNING (xmax = 0) AS inserted, {p} AS parent) SELECT count(*) FILTER (WHERE inserted), "
            "array_agg(DISTINCT parent) FILTER (WHERE NOT inserted AND parent IS NOT NULL) FROM up"
        ).format(t=target, c=ident, s=self.stage, u=updates,
                 p=sql.Identifier("parent_id") if self.passages else sql.SQL("NULL::text"))

    def _copy(self, target: sql.Composable, data: bytes) -> None:
        with self.conn.cursor() as cur, cur.copy(target) as copy:
            copy.write(data)

    def insert(self, data: bytes, n: int, direct: bool = True) -> tuple[int, list[str]]:
        """COPY straight into the table when every id is new (the common case: one pass, no
        staging); if any id exists already, roll that back and upsert through the stage table.
        `direct=False`: some ids are known to exist; upsert at once. Returns the ids newly inserted and, for
        passages, the records whose rows were there before."""
        if direct:
            try:
                with self.conn.transaction():  # a savepoint
                    self._copy(self.copy_direct_sql, data)
                return n, []
            except psycopg.errors.UniqueViolation:
                pass
        self._copy(self.copy_sql, data)
        inserted, rewritten = self.conn.execute(self.upsert_sql).fetchone()
        return inserted, rewritten or []

    def _drop_stale_passages(self, rewritten: list[str], counts: dict[str, int]) -> int:
        """Records written again lose their earlier passages past their new count: found by id
        (`<record id>#<n>`, the primary key), a window at a time until one finds none (a record's are contiguous).
        Returns the rows deleted."""
        parents = [p for p in rewritten if p in counts]
        start = total = 0
        while parents:
            deleted = self.conn.execute(sql.SQL(
                "DELETE FROM {} WHERE id = ANY(ARRAY(SELECT u.parent || '#' || g FROM unnest(%s::text[], %s::int[]) "
                "AS u(parent, n), generate_series(u.n + %s, u.n + %s) AS g))").format(self.target),
                [parents, [counts[p] for p in parents], start, start + STALE_WINDOW - 1]).rowcount
            if not deleted:
                break
            total += deleted
            start += STALE_WINDOW
        return total

    def commit_unit(self, item: Embedded) -> int:
        """One transaction: rows + rejects + chunk progress. Returns ids newly inserted."""
        conn, unit = self.conn, item.unit
        claim = unit.claim
        with conn.transaction():
            inserted = 0
            if claim.replace_to is not None and unit.id_prefix is not None:
                self._clear(unit)
            if unit.rows.n:
                data = assemble(unit.rows, vector_fields(item.vectors, self.vtype))
                inserted, rewritten = self.insert(data, unit.rows.n)
                if claim.replace_to is not None:  # a file embedded again: its rows are this chunk's own now
                    inserted = unit.rows.n
                if self.passages and unit.passages and rewritten:  # records written again: their rows past the
                    inserted -= self._drop_stale_passages(rewritten, unit.passages)  # new passages go, uncounted
            if unit.rejects:
                with conn.cursor() as cur:
                    cur.executemany(
                        "INSERT INTO embedfleet.rejects (job, source, line, reason, raw) VALUES (%s, %s, %s, %s, %s) "
                        "ON CONFLICT (job, source, line) DO UPDATE SET reason = EXCLUDED.reason, raw = EXCLUDED.raw",
                        [(self.job, r.source, r.line, r.reason, r.raw) for r in unit.rejects],
                    )
            # Only forward: a unit repeated after a lost connection whose commit had gone through finds
            # the chunk's cursor already at its line, and changes nothing.
            row = conn.execute(
                "UPDATE embedfleet.chunks SET cursor_line = %(cursor)s, rows_written = rows_written + %(inserted)s, "
                "rows_seen = rows_seen + %(seen)s, rejected = rejected + %(rejected)s, tokens = tokens + %(tokens)s, "
                "state = CASE WHEN %(last)s THEN 'done' ELSE state END, "
                "finished = CASE WHEN %(last)s THEN now() ELSE NULL END "
                "WHERE job = %(job)s AND chunk = %(chunk)s AND claim = %(token)s AND state = 'running' "
                "AND (cursor_line < %(cursor)s OR (%(last)s AND cursor_line = %(cursor)s)) RETURNING 1",
                dict(cursor=unit.cursor_line, inserted=inserted, seen=unit.seen, rejected=len(unit.rejects),
                     tokens=unit.tokens, last=unit.last, job=claim.job, chunk=claim.chunk, token=claim.token),
            ).fetchone()
            if row is None:
                held = conn.execute(
                    "SELECT cursor_line >= %s AND (state = 'done' OR NOT %s) FROM embedfleet.chunks "
                    "WHERE job = %s AND chunk = %s AND claim = %s", [unit.cursor_line, unit.last, claim.job,
                                                                     claim.chunk, claim.token]).fetchone()
                if held and held[0]:
                    raise _Committed
                raise LeaseLost(f"chunk {claim.chunk} was taken over by another worker; its unit was not written")
        return inserted

    def _clear(self, unit: Unit) -> None:
        """A --replace unit's lines lose their earlier rows (a line now blank, rejected or gone too): from the
        line after the chunk's cursor to the unit's, and at the chunk's end to `replace_to`."""
        claim = unit.claim
        row = self.conn.execute("SELECT cursor_line FROM embedfleet.chunks WHERE job = %s AND chunk = %s AND "
                                "claim = %s", [claim.job, claim.chunk, claim.token]).fetchone()
        if row is None:
            raise LeaseLost(f"chunk {claim.chunk} was taken over by another worker; its unit was not written")
        lo = max(row[0] + 1, claim.first_line)
        hi = max(unit.cursor_line, claim.replace_to) if unit.last else unit.cursor_line
        if hi >= lo:
            ids = sql.SQL("ARRAY(SELECT %s || g FROM generate_series(%s::bigint, %s::bigint) g)")
            self.conn.execute(sql.SQL("DELETE FROM {} WHERE {} = ANY(").format(
                self.target, sql.Identifier("parent_id" if self.passages else "id")) + ids + sql.SQL(")"),
                [unit.id_prefix, lo, hi])

    def commit_once(self, item: Embedded) -> int | None:
        """`commit_unit`, or None when the unit had been committed already (nothing written twice)."""
        try:
            return self.commit_unit(item)
        except _Committed:
            return None


class Writer:
    """Commits units on `threads` background threads, each with its own connection, so the server
    inserts in parallel. A unit goes to the thread with the fewest units queued or committing, except
    that a chunk's later units follow its first: they commit in order, so a chunk's cursor never
    moves backwards. (Fixed turns, chunk number modulo threads, made every unit wait whenever one
    commit was slow — a checkpoint, a WAL flush — while the other threads sat idle.) `submit` blocks
    only when the chosen thread has `depth` units waiting: the back-pressure that keeps memory bounded.

    A unit that cannot be written becomes a `Failure` in `failures`, for the commit stage to record.
    A lost connection is not a failure: the thread connects again (`reconnect`, with backoff) and
    commits the same unit; only a database gone past its patience stops the worker (`fatal`)."""

    def __init__(self, sink: Callable[[psycopg.Connection], TableSink], reconnect: Reconnect,
                 on_done: Callable[[Unit, int], None] | None = None, depth: int = 2, threads: int = 3, spare: int = 0):
        self._on_done, self._reconnect = on_done, reconnect
        sink_factory = self._sink = lambda conn=None: sink(conn or reconnect.first())
        self.failures: queue.SimpleQueue[Failure] = queue.SimpleQueue()
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

    def submit(self, item: Embedded) -> None:
        if self.fatal is not None:
            raise self.fatal
        self._queues[self._route(item.unit)].put(item)

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

    def _commit(self, sink: TableSink, item: Embedded) -> tuple[TableSink, int | None]:
        """(the sink to go on with, rows inserted — None if the unit had been committed already)."""
        while True:
            try:
                return sink, sink.commit_once(item)
            except (psycopg.OperationalError, psycopg.InterfaceError) as e:
                if not lost(sink.conn, e):
                    raise
                sink = self._sink(self._reconnect(e))  # waits (with backoff) until the server answers, or raises

    def _run(self, i: int, sink: TableSink) -> None:
        q = self._queues[i]
        while (item := q.get()) is not None:
            unit = item.unit
            t0, n = time.perf_counter(), None
            try:
                sink, n = self._commit(sink, item)
            except Exception as e:
                if isinstance(e, EmbedfleetError) or (isinstance(e, psycopg.OperationalError) and lost(sink.conn, e)):
                    self.fatal = e  # the database is gone for good: stop the worker
                self.failures.put(Failure(unit.claim, e))
                continue
            finally:
                self._seconds[i] += time.perf_counter() - t0
                self._cpu[i] = time.thread_time()
                with self._lock:
                    self._load[i] -= 1
                    if n is None:  # the chunk's claim is gone (a failure): forget its thread, as its
                        self._chunk_thread.pop(unit.claim.token, None)  # later units, if any, fail too
            if self._on_done:
                self._on_done(unit, n or 0)


@dataclass
class CommitStats:
    rows: int = 0  # rows committed (distinct ids of each unit)
    tokens: int = 0
    sink_wait_seconds: float = 0.0  # time the loop waited for the writer (back-pressure)
    sink_waits: list = field(default_factory=list)  # (seconds into the loop, seconds): those >= 1 ms


class CommitStage:
    """Embedded units handed to the writer, and every Failure recorded in the ledger, once per claim (the rest
    of a failed chunk's units are dropped upstream; the chunk is retried from its last commit). `since()` is
    when the loop started (the stats' clock). The last stage: it yields each item once handed on or recorded,
    and the worker drains it."""

    def __init__(self, writer: Writer, ledger: Ledger, failed: FailedClaims, worker: str,
                 since: Callable[[], float] = lambda: 0.0):
        self.writer, self.ledger, self.failed, self.worker, self.since = writer, ledger, failed, worker, since
        self.stats = CommitStats()
        self._done_lock = threading.Lock()  # the writer's threads report concurrently

    def __call__(self, items: Iterator[Embedded | Failure]) -> Iterator[Embedded | Failure]:
        stats = self.stats
        for item in items:
            self.record_failures()
            if isinstance(item, Failure):
                self.fail(item)
                yield item
                continue
            t0 = time.perf_counter()
            self.writer.submit(item)
            waited = time.perf_counter() - t0
            stats.sink_wait_seconds += waited
            if waited >= 1e-3:
                stats.sink_waits.append((t0 - self.since(), waited))
            yield item

    def done(self, unit: Unit, inserted: int) -> None:
        """The writer's report of a committed unit (from its threads)."""
        with self._done_lock:
            self.stats.rows += unit.rows.n
            self.stats.tokens += unit.tokens

    def record_failures(self) -> None:
        """Every failure the writer reported so far (from the loop's thread, or the claims thread while idle)."""
        while True:
            try:
                failure = self.writer.failures.get_nowait()
            except queue.Empty:
                return
            self.fail(failure)

    def fail(self, failure: Failure) -> None:
        """Count a failure against its chunk, once per claim (later units of that chunk fail too)."""
        claim, err = failure.claim, failure.error
        if not self.failed.add(claim):
            return
        state = self.ledger.fail(claim, f"{type(err).__name__}: {err}")
        log.error("worker %s: chunk %d (%s) failed, now %s: %s", self.worker, claim.chunk, claim.source, state,
                  first_line(err))  # the server's DETAIL and CONTEXT lines are kept in the ledger's error
