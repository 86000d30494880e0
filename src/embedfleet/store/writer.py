"""The sink: one transaction per unit of work — rows (binary COPY, upsert on id), rejects, and the
chunk's progress mark commit together, so a crash at any moment loses nothing and writes nothing twice.

`Writer` runs commits on background threads with their own connections so the GPU never waits on
the database; `TableSink.commit_unit` is the whole transaction and can be called directly.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import psycopg
from psycopg import sql
from psycopg.adapt import Dumper
from psycopg.pq import Format
from psycopg.types.json import set_json_dumps

from embedfleet.records import Record, Reject
from embedfleet.store.ledger import Claim

# psycopg's COPY type names for our column types.
_COPY_TYPES = {
    "text": "text", "real": "float4", "double precision": "float8", "integer": "int4", "bigint": "int8",
    "boolean": "bool", "timestamptz": "timestamptz", "jsonb": "jsonb",
}


def _orjson_dumps(obj) -> bytes:
    import orjson

    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)


set_json_dumps(_orjson_dumps)


class LeaseLost(Exception):
    """Another worker holds the chunk now: this unit's transaction was rolled back."""


class _PackedVector(bytes):
    """A vector already in pgvector's binary wire format (built for the whole batch with numpy)."""


def _register_packed(conn: psycopg.Connection, vtype: str) -> None:
    from pgvector.psycopg import register_vector
    from psycopg.types import TypeInfo

    register_vector(conn)
    oid = TypeInfo.fetch(conn, vtype).oid

    class PackedDumper(Dumper):
        format = Format.BINARY

        def dump(self, obj):
            return obj

    PackedDumper.oid = oid
    conn.adapters.register_dumper(_PackedVector, PackedDumper)


def pack_vectors(emb: np.ndarray, vtype: str) -> list[_PackedVector]:
    """pgvector binary format: uint16 dim, uint16 0, then big-endian float32 (vector) or float16 (halfvec)."""
    n, dim = emb.shape
    header = np.array([dim, 0], dtype=">u2").tobytes()
    body = np.ascontiguousarray(emb, dtype=">f2" if vtype == "halfvec" else ">f4")
    row_bytes = body.strides[0]
    buf = body.tobytes()
    return [_PackedVector(header + buf[i * row_bytes : (i + 1) * row_bytes]) for i in range(n)]


@dataclass
class Unit:
    """A slice of a chunk's records, embedded together and committed in one transaction."""

    claim: Claim
    records: list[Record]
    rejects: list[Reject]
    cursor_line: int  # every line up to here has been read into this unit or an earlier one
    last: bool  # the chunk's final unit: commit marks the chunk done
    tokens: int = 0
    tok: object = None  # the encoder's Tokenized batch
    embeddings: np.ndarray | None = None


class TableSink:
    """Everything needed to write one target table, prepared once per connection."""

    def __init__(self, conn: psycopg.Connection, table: str, columns: Sequence, vtype: str, job: str):
        self.conn, self.table, self.columns, self.vtype, self.job = conn, table, list(columns), vtype, job
        _register_packed(conn, vtype)
        names = ["id", "content", "embedding"] + [c.name for c in self.columns]
        self.copy_types = ["text", "text", vtype] + [_COPY_TYPES[c.pgtype] for c in self.columns]
        ident = sql.SQL(", ").join(map(sql.Identifier, names))
        self.stage = sql.Identifier("_ef_stage")  # a temp table: private to this connection, which writes one table
        conn.execute(
            sql.SQL("CREATE TEMP TABLE IF NOT EXISTS {} (LIKE {}) ON COMMIT DELETE ROWS").format(
                self.stage, sql.Identifier(table)
            )
        )
        self.copy_sql = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(self.stage, ident)
        self.copy_direct_sql = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(sql.Identifier(table), ident)
        # Safe: a crash loses at most the last moments of commits, rows and ledger mark together.
        conn.execute("SET synchronous_commit = off")
        updates = sql.SQL(", ").join(
            sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(n)) for n in names if n != "id"
        )
        # xmax = 0 only for rows this statement inserted: that is how we count new ids exactly.
        self.upsert_sql = sql.SQL(
            "WITH up AS (INSERT INTO {t} ({c}) SELECT {c} FROM {s} ON CONFLICT (id) DO UPDATE SET {u} "
            "RETURNING (xmax = 0) AS inserted) SELECT count(*) FILTER (WHERE inserted) FROM up"
        ).format(t=sql.Identifier(table), c=ident, s=self.stage, u=updates)

    def _copy(self, target: sql.Composable, rows: list) -> None:
        with self.conn.cursor() as cur, cur.copy(target) as copy:
            copy.set_types(self.copy_types)
            for row in rows:
                copy.write_row(row)

    def _insert(self, rows: list) -> int:
        """COPY straight into the table when every id is new (the common case: one pass, no
        staging); if any id exists already, roll that back and upsert through the stage table."""
        try:
            with self.conn.transaction():  # a savepoint
                self._copy(self.copy_direct_sql, rows)
            return len(rows)
        except psycopg.errors.UniqueViolation:
            pass
        self._copy(self.copy_sql, rows)
        return self.conn.execute(self.upsert_sql).fetchone()[0]

    def commit_unit(self, unit: Unit) -> int:
        """One transaction: rows + rejects + chunk progress. Returns ids newly inserted."""
        records, emb = unit.records, unit.embeddings
        # Same id twice in one unit: the last occurrence wins (as a later upsert would).
        keep = list({r.id: i for i, r in enumerate(records)}.values())
        conn, claim = self.conn, unit.claim
        with conn.transaction():
            inserted = 0
            if keep:
                rows = [[records[i].id, records[i].content, vec, *(records[i].values.get(c.name) for c in self.columns)]
                        for vec, i in zip(pack_vectors(emb[keep], self.vtype), keep)]
                inserted = self._insert(rows)
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
                [unit.cursor_line, inserted, len(records), len(unit.rejects), unit.tokens,
                 unit.last, unit.last, claim.job, claim.chunk, claim.token],
            ).fetchone()
            if row is None:
                raise LeaseLost(f"chunk {claim.chunk} was taken over by another worker; its unit was not written")
        return inserted


class Writer:
    """Commits units on `threads` background threads, each with its own connection, so the server
    inserts in parallel. A chunk's units always go to the same thread: they commit in order, so a
    chunk's cursor never moves backwards. `submit` blocks only when a thread has `depth` units
    waiting — the back-pressure that keeps memory bounded."""

    def __init__(self, sink_factory: Callable[[], TableSink], on_error: Callable[[Unit, BaseException], None],
                 on_done: Callable[[Unit, int], None] | None = None, depth: int = 2, threads: int = 3):
        self._factory, self._on_error, self._on_done = sink_factory, on_error, on_done
        self._queues = [queue.Queue(maxsize=depth) for _ in range(threads)]
        self._seconds = [0.0] * threads
        self.fatal: BaseException | None = None
        self._threads = [threading.Thread(target=self._run, args=(i,), name=f"embedfleet-writer-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    @property
    def db_seconds(self) -> float:
        """Wall time the busiest writer thread spent committing."""
        return max(self._seconds)

    def submit(self, unit: Unit) -> None:
        if self.fatal is not None:
            raise self.fatal
        self._queues[unit.claim.chunk % len(self._queues)].put(unit)

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()
        if self.fatal is not None:
            raise self.fatal

    def _run(self, i: int) -> None:
        q = self._queues[i]
        try:
            sink = self._factory()
        except BaseException as e:  # cannot even connect: every submit will see this
            self.fatal = e
            while q.get() is not None:
                pass
            return
        while (unit := q.get()) is not None:
            t0 = time.perf_counter()
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
            if self._on_done:
                self._on_done(unit, n)
