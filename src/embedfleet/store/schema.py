"""DDL: the ledger (schema `embedfleet`) and the target tables. Identifiers always go through
psycopg's `sql.Identifier`; names we cannot use are refused with a clear message."""

from __future__ import annotations

import os
from typing import Sequence

import psycopg
from psycopg import sql

from embedfleet.errors import DatabaseError, InputError

SCHEMA = "embedfleet"

LEDGER_DDL = """
CREATE SCHEMA IF NOT EXISTS embedfleet;
CREATE TABLE IF NOT EXISTS embedfleet.jobs (
    job          text PRIMARY KEY,
    table_name   text NOT NULL,
    fingerprint  text NOT NULL,
    config       jsonb NOT NULL,
    model        text,
    dim          integer,
    state        text NOT NULL DEFAULT 'planned',   -- planned | running | done | failed
    meta_id      text,
    created      timestamptz NOT NULL DEFAULT now(),
    started      timestamptz,
    finished     timestamptz,
    error        text
);
CREATE TABLE IF NOT EXISTS embedfleet.chunks (
    job          text NOT NULL REFERENCES embedfleet.jobs ON DELETE CASCADE,
    chunk        integer NOT NULL,
    source       text NOT NULL,
    kind         text NOT NULL,
    start_pos    bigint NOT NULL,
    end_pos      bigint NOT NULL,
    first_line   bigint NOT NULL,
    last_line    bigint,                -- inclusive cap from --limit; NULL: to the chunk's end
    state        text NOT NULL DEFAULT 'pending',   -- pending | running | done | failed
    cursor_line  bigint NOT NULL DEFAULT 0,         -- lines <= cursor_line are committed
    failures     integer NOT NULL DEFAULT 0,
    claim        uuid,                  -- fencing token of the current holder
    worker       text,
    host         text,
    pid          integer,
    pid_started  double precision,      -- process start time: a reused pid is not our worker
    lease_until  timestamptz,
    rows_written bigint NOT NULL DEFAULT 0,         -- ids newly inserted by this chunk
    rows_seen    bigint NOT NULL DEFAULT 0,         -- records embedded (duplicates included)
    rejected     integer NOT NULL DEFAULT 0,
    tokens       bigint NOT NULL DEFAULT 0,
    error        text,
    finished     timestamptz,
    PRIMARY KEY (job, chunk)
);
CREATE INDEX IF NOT EXISTS chunks_claimable ON embedfleet.chunks (job, state, chunk);
CREATE TABLE IF NOT EXISTS embedfleet.rejects (
    job     text NOT NULL REFERENCES embedfleet.jobs ON DELETE CASCADE,
    source  text NOT NULL,
    line    bigint NOT NULL,
    reason  text NOT NULL,
    raw     text,
    created timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, source, line)
);
CREATE TABLE IF NOT EXISTS embedfleet.workers (
    job        text NOT NULL REFERENCES embedfleet.jobs ON DELETE CASCADE,
    worker     text NOT NULL,
    host       text,
    pid        integer,
    device     text,
    state      text,
    rows       bigint NOT NULL DEFAULT 0,
    tokens     bigint NOT NULL DEFAULT 0,
    gpu_util   real,
    started    timestamptz NOT NULL DEFAULT now(),
    heartbeat  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, worker)
);
CREATE TABLE IF NOT EXISTS embedfleet.meta (
    meta_id text NOT NULL,
    key     text NOT NULL,
    data    jsonb NOT NULL,
    PRIMARY KEY (meta_id, key)
);
CREATE TABLE IF NOT EXISTS embedfleet.meta_loaded (
    meta_id text PRIMARY KEY,
    source  text NOT NULL,
    rows    bigint NOT NULL,
    skipped bigint NOT NULL,
    loaded  timestamptz NOT NULL DEFAULT now()
);
"""


def check_identifier(name: str, what: str = "table") -> str:
    """PostgreSQL identifiers: 1–63 bytes, no NUL. Anything else is quoted, never spliced."""
    if not name or not name.strip():
        raise InputError(f"--{what} name is empty")
    if "\x00" in name:
        raise InputError(f"--{what} {name!r}: NUL characters cannot appear in a name")
    if len(name.encode()) > 63:
        raise InputError(f"--{what} {name!r}: longer than PostgreSQL's 63-byte limit; pass a shorter --{what}")
    if name.lower().startswith("pg_"):
        raise InputError(f"--{what} {name!r}: names starting with pg_ are reserved by PostgreSQL")
    return name


def ensure_ledger(conn: psycopg.Connection) -> None:
    """Create the ledger once; an advisory lock keeps concurrent workers from racing on DDL."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('embedfleet.ledger'))")
        exists = conn.execute("SELECT to_regclass('embedfleet.meta_loaded') IS NOT NULL").fetchone()[0]
        if not exists:
            conn.execute(LEDGER_DDL)


def ensure_vector(conn: psycopg.Connection) -> tuple[int, ...]:
    """Make sure pgvector is installed; return its version as a tuple."""
    row = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
    if row is None:
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(hashtext('embedfleet.vector'))")
                conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        except psycopg.Error as e:
            raise DatabaseError(
                f"pgvector is not available on this server ({e.diag.message_primary}); "
                "install it (https://github.com/pgvector/pgvector) or run without --db for the embedded server"
            ) from None
        row = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
    return tuple(int(x) for x in row[0].split(".")[:3] if x.isdigit())


def vector_type(conn: psycopg.Connection, dtype: str) -> str:
    version = ensure_vector(conn)
    if dtype == "half":
        if version < (0, 7):
            raise DatabaseError(
                f"--dtype half needs pgvector ≥ 0.7 for halfvec; this server has {'.'.join(map(str, version))}"
            )
        return "halfvec"
    return "vector"


def free_connections(conn: psycopg.Connection) -> int:
    """Connections the server can still accept from an ordinary role: max_connections, less those
    reserved (for superusers, and since PostgreSQL 16 for pg_use_reserved_connections) and those open."""
    return conn.execute(
        "SELECT current_setting('max_connections')::int - current_setting('superuser_reserved_connections')::int"
        " - coalesce(current_setting('reserved_connections', true)::int, 0)"
        " - (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')::int"
    ).fetchone()[0]


def table_exists(conn: psycopg.Connection, table: str) -> bool:
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", [sql.Identifier(table).as_string(conn)]).fetchone()[0]


def ensure_table(conn: psycopg.Connection, table: str, columns: Sequence, dim: int, vtype: str) -> None:
    """Create the target table if needed; refuse one whose embedding has another dimension or type."""
    check_identifier(table)
    ident = sql.Identifier(table)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"embedfleet.table.{table}"])
        if table_exists(conn, table):
            row = conn.execute(
                "SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
                "WHERE attrelid = %s::regclass AND attname = 'embedding' AND NOT attisdropped",
                [ident.as_string(conn)],
            ).fetchone()
            want = f"{vtype}({dim})"
            if row is None or row[0] != want:
                have = row[0] if row else "no embedding column"
                raise DatabaseError(
                    f"table {table!r} already exists with {have}, not {want}; pass another --table"
                )
            return
        cols = [
            sql.SQL("id text PRIMARY KEY"),
            sql.SQL("content text NOT NULL"),
            sql.SQL("embedding {}({})").format(sql.SQL(vtype), sql.Literal(dim)),
        ] + [sql.SQL("{} {}").format(sql.Identifier(c.name), sql.SQL(c.pgtype)) for c in columns]
        # A review row with a 384-float vector passes the default 2 kB TOAST threshold, and the vector,
        # its largest value, is the one moved out of line: every insert would also write the TOAST
        # table and its index, and every read fetch the vector back. Toasting only rows that do not fit
        # a page keeps vectors inline: the sink writes ~1.6x faster (bench/NOTES.md, runs 22-28).
        # No autovacuum while the job loads it (`settle_table` turns it back on): PostgreSQL would
        # vacuum the table again and again as rows arrive, and with data checksums (on by default
        # since PostgreSQL 18) marking a page visited logs a full copy of it, if it is the page's
        # first change since a checkpoint, into the WAL the writers share. PostgreSQL's own advice
        # for bulk loads: no autovacuum during, ANALYZE after.
        conn.execute(sql.SQL("CREATE TABLE {} ({}) WITH (toast_tuple_target = 8160, autovacuum_enabled = off)").format(
            ident, sql.SQL(", ").join(cols)))


def settle_table(conn: psycopg.Connection, table: str) -> None:
    """Once a job has loaded `table`: autovacuum back to the server's setting, and statistics for
    the planner (ANALYZE reads a fixed-size sample of rows, not the whole table)."""
    ident = sql.Identifier(table)
    options = conn.execute("SELECT reloptions FROM pg_class WHERE oid = %s::regclass",
                           [ident.as_string(conn)]).fetchone()[0] or []
    if "autovacuum_enabled=off" in options:  # set by ensure_table: a table someone else made is left alone
        with conn.transaction():
            conn.execute(sql.SQL("ALTER TABLE {} RESET (autovacuum_enabled)").format(ident))
    conn.execute(sql.SQL("ANALYZE {}").format(ident))


def embedding_info(conn: psycopg.Connection, table: str) -> tuple[str, int]:
    """(vector type, dimension) of a table's embedding column; DatabaseError if it has none."""
    if not table_exists(conn, table):
        raise DatabaseError(f"table {table!r} does not exist; `embedfleet status` lists the jobs and their tables")
    row = conn.execute(
        "SELECT t.typname, a.atttypmod FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
        "WHERE a.attrelid = %s::regclass AND a.attname = 'embedding' AND NOT a.attisdropped",
        [sql.Identifier(table).as_string(conn)],
    ).fetchone()
    if row is None:
        raise DatabaseError(f"table {table!r} has no embedding column")
    return row[0], row[1]


def build_index(conn: psycopg.Connection, table: str, vtype: str) -> None:
    """HNSW (cosine) with a generous maintenance_work_mem and parallel maintenance workers."""
    name = sql.Identifier(f"{table[:40]}_embedding_hnsw")
    ops = sql.SQL("halfvec_cosine_ops" if vtype == "halfvec" else "vector_cosine_ops")
    stmt = sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} USING hnsw (embedding {})").format(
        name, sql.Identifier(table), ops
    )
    workers = max(0, min(7, (os.cpu_count() or 2) - 1))
    try:
        with conn.transaction():
            conn.execute("SET LOCAL maintenance_work_mem = '1GB'")
            conn.execute(sql.SQL("SET LOCAL max_parallel_maintenance_workers = {}").format(sql.Literal(workers)))
            conn.execute(stmt)
    except (psycopg.errors.OutOfMemory, psycopg.errors.DiskFull):
        # A small /dev/shm (containers) cannot hold a parallel build's shared memory: build serially.
        with conn.transaction():
            conn.execute("SET LOCAL max_parallel_maintenance_workers = 0")
            conn.execute(stmt)
