"""The ledger: jobs, their chunks, and who holds which chunk.

The ledger is the single source of truth. A chunk is claimed with `FOR UPDATE SKIP LOCKED` and a
lease; every claim gets a fresh fencing token (`claim`), and a commit only counts if the chunk
still carries that token — a worker that lost its lease (paused, partitioned) cannot write twice.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

import orjson
import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from embedfleet.errors import DatabaseError, InputError, JobError
from embedfleet.pg.connect import Reconnect, lost
from embedfleet.pg.ddl import SCHEMA, quote_ident, role_and_database, schema_exists, table_exists, table_rows
from embedfleet.pg.ddl import drop_table as drop_table_
from embedfleet.platform.processes import alive, process_started
from embedfleet.settings import JobSpec

if TYPE_CHECKING:  # the ledger stays light: status and db never read input files
    from embedfleet.sources.changes import PlannedFile
    from embedfleet.sources.plan import ChunkSpec

log = logging.getLogger("embedfleet.ledger")

MAX_FAILURES = 3
FLEET_GAUGES = ("rows_s", "tokens_s", "gpu_util", "gpu_mem_used", "gpu_mem_total", "gpu_temp", "gpu_power")
STALE_SECONDS = 120  # a running job with no heartbeat for this long is reported as interrupted
ENDED_SECONDS = 5.0  # and one whose workers have all ended this long ago, with its launcher gone
# A worker that has beaten (every few seconds) but not for this long is gone (killed, its host or the database
# out of reach): shown "lost", not in the state of its last beat. One still loading its model has not beaten.
LOST_SECONDS = 30
_SHOWN_STATE = (f"CASE WHEN w.state NOT IN ('starting', 'finished', 'exited', 'failed') AND w.heartbeat < now() - "
                f"interval '{LOST_SECONDS} seconds' THEN 'lost' ELSE w.state END")
HOST = socket.gethostname()

LEDGER_VERSION = 8  # bump with each change below; ensure_ledger brings an older ledger up to it
# Every statement is idempotent: it creates a new ledger and brings an older one up to date.
LEDGER_DDL = """
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
-- version 2: when a worker started embedding a chunk (a crash counts against that one only),
-- and what each worker reports when it ends
ALTER TABLE embedfleet.chunks ADD COLUMN IF NOT EXISTS started timestamptz;
ALTER TABLE embedfleet.workers ADD COLUMN IF NOT EXISTS error text;
ALTER TABLE embedfleet.workers ADD COLUMN IF NOT EXISTS summary jsonb;
CREATE TABLE IF NOT EXISTS embedfleet.ledger_version (version integer NOT NULL);
-- version 3: the fleet view — each worker's rates and its GPU as NVML sees it, at its last heartbeat
ALTER TABLE embedfleet.workers ADD COLUMN IF NOT EXISTS rows_s real;
ALTER TABLE embedfleet.workers ADD COLUMN IF NOT EXISTS tokens_s real;
ALTER TABLE embedfleet.workers ADD COLUMN IF NOT EXISTS gpu_mem_used integer;
ALTER TABLE embedfleet.workers ADD COLUMN IF NOT EXISTS gpu_mem_total integer;
ALTER TABLE embedfleet.workers ADD COLUMN IF NOT EXISTS gpu_temp real;
ALTER TABLE embedfleet.workers ADD COLUMN IF NOT EXISTS gpu_power real;
-- version 4: the rows the target table held when the job was planned (what its upserts may rightly replace)
ALTER TABLE embedfleet.jobs ADD COLUMN IF NOT EXISTS rows_before bigint;
-- version 5: each input file as far as its job planned it (a rerun plans what was appended, refuses what
-- changed), and chunks that embed a file again in place of its earlier rows (--replace)
CREATE TABLE IF NOT EXISTS embedfleet.sources (
    job     text NOT NULL REFERENCES embedfleet.jobs ON DELETE CASCADE,
    source  text NOT NULL,
    kind    text NOT NULL,
    size    bigint NOT NULL,                -- bytes planned
    stamp   text,                           -- size and mtime (or a URL's key) when planned
    digest  text NOT NULL,                  -- of the bytes planned (sampled past 16 MiB)
    PRIMARY KEY (job, source)
);
ALTER TABLE embedfleet.chunks ADD COLUMN IF NOT EXISTS replace_to bigint;  -- the last line of earlier rows it replaces
-- version 6: the snapshot a --from-table job's planner exported (its workers read in it while it is held), and
-- sync: the job whose table follows a source through a queue, and when its queue was last drained
ALTER TABLE embedfleet.jobs ADD COLUMN IF NOT EXISTS snapshot text;
CREATE TABLE IF NOT EXISTS embedfleet.syncs (
    job        text PRIMARY KEY,                -- recorded before its backfill job is planned
    source     text NOT NULL,
    key        text NOT NULL,
    tag        text NOT NULL,                   -- names the queue, its trigger and channel in the source's database
    same_db    boolean NOT NULL,                -- the queue is in the target's database
    installed  timestamptz NOT NULL DEFAULT now(),
    synced_at  timestamptz                      -- when a worker last found the queue empty
);
-- version 7: the source server's start time a sync's (unlogged) queue was last known under
ALTER TABLE embedfleet.syncs ADD COLUMN IF NOT EXISTS source_started text;
-- version 8: the database a sync follows (its server's system identifier and its name): another is refused
ALTER TABLE embedfleet.syncs ADD COLUMN IF NOT EXISTS source_db text;
"""




def ledger_version(conn: psycopg.Connection) -> int:
    """0: no ledger; 1: a ledger from before versioning; else the version it records."""
    if not conn.execute("SELECT to_regclass('embedfleet.ledger_version') IS NOT NULL").fetchone()[0]:
        return 1 if conn.execute("SELECT to_regclass('embedfleet.jobs') IS NOT NULL").fetchone()[0] else 0
    row = conn.execute("SELECT max(version) FROM embedfleet.ledger_version").fetchone()
    return row[0] or 1


def ledger_exists(conn: psycopg.Connection) -> bool:
    """For the commands that only read (status, search, verify): they never create the ledger."""
    return ledger_version(conn) > 0


def ensure_ledger(conn: psycopg.Connection) -> None:
    """Create the ledger, or bring an older one up to date; an advisory lock keeps concurrent workers
    from racing on DDL. A current ledger needs no privilege beyond reading and writing its tables, and
    a schema an admin created for the role is used as it is (CREATE SCHEMA IF NOT EXISTS would still
    need CREATE on the database)."""
    if ledger_version(conn) >= LEDGER_VERSION:
        return
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('embedfleet.ledger'))")
        if ledger_version(conn) >= LEDGER_VERSION:
            return
        check_ledger_privileges(conn)
        if not schema_exists(conn, SCHEMA):
            conn.execute("CREATE SCHEMA embedfleet")
        conn.execute(LEDGER_DDL)
        conn.execute("DELETE FROM embedfleet.ledger_version")
        conn.execute("INSERT INTO embedfleet.ledger_version VALUES (%s)", [LEDGER_VERSION])


def check_ledger_privileges(conn: psycopg.Connection) -> None:
    """What creating or updating the ledger needs, as one line naming the GRANT that gives it."""
    role, db = role_and_database(conn)
    quote = lambda name: quote_ident(conn, name)  # noqa: E731
    if not schema_exists(conn, SCHEMA):
        if not conn.execute("SELECT has_database_privilege(current_database(), 'CREATE')").fetchone()[0]:
            raise DatabaseError(
                f"role {role} cannot create the ledger's schema {SCHEMA} (no CREATE on database {db}): "
                f"GRANT CREATE ON DATABASE {quote(db)} TO {quote(role)}; or have an admin run "
                f"CREATE SCHEMA {SCHEMA} AUTHORIZATION {quote(role)}")
        return
    if ledger_version(conn) < LEDGER_VERSION and not conn.execute(
            "SELECT has_schema_privilege(%s, 'CREATE') AND has_schema_privilege(%s, 'USAGE')",
            [SCHEMA, SCHEMA]).fetchone()[0]:
        raise DatabaseError(
            f"role {role} cannot create or update the ledger's tables in schema {SCHEMA} (no CREATE on it): "
            f"GRANT USAGE, CREATE ON SCHEMA {SCHEMA} TO {quote(role)}")




@dataclass
class Claim:
    job: str
    chunk: int
    source: str
    kind: str
    start: int
    end: int
    first_line: int
    last_line: int | None
    cursor_line: int
    token: uuid.UUID
    replace_to: int | None = None  # a --replace chunk: its last unit clears earlier rows up to this line


def _resilient(method):
    """Run a ledger call again on a new connection when the old one was lost mid-call. Every call is
    safe to repeat: reads, idempotent updates, and claims that recognise their own token."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        while True:
            try:
                return method(self, *args, **kwargs)
            except (psycopg.OperationalError, psycopg.InterfaceError) as e:
                if self._reconnect is None or not lost(self.conn, e):
                    raise
                self.conn = self._reconnect(e)

    return call


class Ledger:
    """The ledger's queries on one connection. Made with `Ledger.connect(dsn, patience)`, it rides through
    a database restart (reconnecting, then repeating the call); made on a connection, it does not."""

    def __init__(self, conn: psycopg.Connection, reconnect: Reconnect | None = None, host: str | None = None):
        self.conn, self._reconnect, self.host = conn, reconnect, host or HOST
        ensure_ledger(conn)

    @classmethod
    def connect(cls, dsn: str, patience: float = 0.0, setup=None, host: str | None = None) -> "Ledger":
        reconnect = Reconnect(dsn, patience, setup)
        return cls(reconnect.first(), reconnect, host)

    @property
    def dsn(self) -> str | None:
        """Where more connections to the same server come from (None: made on a connection)."""
        return self._reconnect.dsn if self._reconnect else None

    def close(self) -> None:
        self.conn.close()

    # ---- jobs -------------------------------------------------------------------------------

    def job(self, name: str) -> dict | None:
        with self.conn.cursor(row_factory=dict_row) as cur:
            return cur.execute("SELECT * FROM embedfleet.jobs WHERE job = %s", [name]).fetchone()

    def create_job(self, name: str, cfg: JobSpec, chunks: Iterable, meta_id: str | None,
                   planned: Iterable[PlannedFile] = ()) -> bool:
        """Insert the job, its plan and its files as planned in one transaction. Returns False if it already
        existed with the same fingerprint (a resume); raises if it exists with different settings."""
        with self.conn.transaction():
            self.conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"embedfleet.job.{name}"])
            existing = self.job(name)
            if existing is not None:
                if existing["fingerprint"] in _as_recorded_relative(cfg, existing["config"].get("model")):
                    # recorded with the model's folder relative (as given): now absolute, for workers run elsewhere
                    self.conn.execute("UPDATE embedfleet.jobs SET fingerprint = %s, config = jsonb_set(config, "
                                      "'{model}', to_jsonb(%s::text)) WHERE job = %s", [cfg.fingerprint(), cfg.model, name])
                    existing["fingerprint"] = cfg.fingerprint()
                if (error := _other_settings(name, existing, cfg)) is not None:
                    raise error
                planned_with = existing["config"].get("partitions")  # the layout its workers make the table with
                if cfg.partitions is not None and cfg.partitions != planned_with:
                    raise JobError(f"job {name!r} was planned {f'with --partitions {planned_with}' if planned_with else 'as one relation'}, "
                                   f"not --partitions {cfg.partitions}: rerun it without --partitions, or pass --job "
                                   "NEWNAME --table NEWTABLE")
                return False
            self.conn.execute(
                "INSERT INTO embedfleet.jobs (job, table_name, fingerprint, config, model, meta_id, rows_before) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s)",
                [name, cfg.table, cfg.fingerprint(), Jsonb(cfg.to_json()), cfg.model, meta_id,
                 table_rows(self.conn, cfg.table)],
            )
            self._add_chunks(name, 0, chunks)
            self._record_files(name, planned)
        return True

    def extend_job(self, name: str, chunks: list, planned: Iterable[PlannedFile], replaced: Iterable[str] = ()) -> int:
        """Add chunks to a planned job (parts appended to its files, new files, files embedded again in place
        of their chunks before), with the files as now planned, in one transaction. Returns chunks added."""
        with self.conn.transaction():
            self.conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"embedfleet.job.{name}"])
            for source in replaced:
                self.conn.execute("DELETE FROM embedfleet.chunks WHERE job = %s AND source = %s", [name, source])
                self.conn.execute("DELETE FROM embedfleet.rejects WHERE job = %s AND source = %s", [name, source])
            first = self.conn.execute("SELECT coalesce(max(chunk) + 1, 0) FROM embedfleet.chunks WHERE job = %s",
                                      [name]).fetchone()[0]
            self._add_chunks(name, first, chunks)
            self._record_files(name, planned)
            if chunks:
                self.conn.execute("UPDATE embedfleet.jobs SET state = 'planned', error = NULL, finished = NULL "
                                  "WHERE job = %s", [name])
        return len(chunks)

    def _add_chunks(self, name: str, first: int, chunks: Iterable) -> None:
        """(spec, last_line) or (spec, last_line, replace_to) each, numbered from `first`."""
        with self.conn.cursor() as cur:
            with cur.copy(
                "COPY embedfleet.chunks (job, chunk, source, kind, start_pos, end_pos, first_line, last_line, "
                "replace_to) FROM STDIN"
            ) as copy:
                for i, (spec, last_line, *replace_to) in enumerate(chunks, first):
                    copy.write_row((name, i, spec.source, spec.kind, spec.start, spec.end, spec.first_line,
                                    last_line, replace_to[0] if replace_to else None))

    def _record_files(self, name: str, planned: Iterable[PlannedFile]) -> None:
        with self.conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO embedfleet.sources (job, source, kind, size, stamp, digest) VALUES (%s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (job, source) DO UPDATE SET kind = EXCLUDED.kind, size = EXCLUDED.size, "
                "stamp = EXCLUDED.stamp, digest = EXCLUDED.digest",
                [(name, p.source, p.kind, p.size, p.stamp, p.digest) for p in planned])

    def planned_files(self, name: str) -> dict[str, PlannedFile]:
        """The job's files as planned. A job planned before files were recorded has them recorded now, as
        they are now (a byte span's end where its chunks say)."""
        rows = self.conn.execute("SELECT source, kind, size, stamp, digest FROM embedfleet.sources WHERE job = %s",
                                 [name]).fetchall()
        from embedfleet.sources import files
        from embedfleet.sources.changes import PlannedFile, digest

        if rows:
            return {r[0]: PlannedFile(*r) for r in rows}

        found = []
        for source, kind, end in self.conn.execute(
                "SELECT source, min(kind), max(end_pos) FILTER (WHERE end_pos >= 0 AND kind = 'jsonl') "
                "FROM embedfleet.chunks WHERE job = %s GROUP BY source", [name]).fetchall():
            try:
                size = end if end is not None else files.size(source)
                found.append(PlannedFile(source, kind, size, files.fingerprint(source) if end is None else None,
                                         digest(source, size)))
            except FileNotFoundError:
                continue
        with self.conn.transaction():
            # a whole stream's chunk read to the stream's end; from now on, to where it ended when recorded
            for p in found:
                self.conn.execute("UPDATE embedfleet.chunks SET end_pos = %s WHERE job = %s AND source = %s "
                                  "AND end_pos < 0", [p.size, name, p.source])
            self._record_files(name, found)
        return {p.source: p for p in found}

    def last_line_read(self, name: str, source: str) -> int:
        """The last line of `source` whose rows the job committed."""
        return self.conn.execute("SELECT coalesce(max(cursor_line), 0) FROM embedfleet.chunks WHERE job = %s "
                                 "AND source = %s", [name, source]).fetchone()[0]

    def last_chunks(self, name: str) -> dict[str, tuple[ChunkSpec, int | None]]:
        """Each file's last chunk, with its --limit cap."""
        from embedfleet.sources.plan import ChunkSpec

        return {r[0]: (ChunkSpec(*r[:5]), r[5]) for r in self.conn.execute(
            "SELECT DISTINCT ON (source) source, kind, start_pos, end_pos, first_line, last_line "
            "FROM embedfleet.chunks WHERE job = %s ORDER BY source, chunk DESC", [name]).fetchall()}

    def set_job_state(self, name: str, state: str, error: str | None = None) -> None:
        self.conn.execute(
            "UPDATE embedfleet.jobs SET state = %s, error = %s, "
            "started = CASE WHEN %s = 'running' THEN coalesce(started, now()) ELSE started END, "
            # a rerun of a finished job finds it finished: when it finished stays as it was
            "finished = CASE WHEN %s NOT IN ('done', 'failed') THEN NULL WHEN state = %s THEN coalesce(finished, now()) "
            "ELSE now() END WHERE job = %s",
            [state, error, state, state, state, name],
        )

    def check_settings(self, name: str, cfg: JobSpec) -> None:
        """Raise if job `name` exists with settings other than `cfg`'s: before anything is done for a rerun."""
        existing = self.job(name)
        if existing is not None and (error := _other_settings(name, existing, cfg)) is not None:
            raise error

    def record_sync(self, name: str, source: str, key: str, tag: str, same_db: bool, started: str,
                    source_db: str) -> None:
        """A sync job, with the source server's start time when its queue was installed (kept if recorded)."""
        self.conn.execute("INSERT INTO embedfleet.syncs (job, source, key, tag, same_db, source_started, source_db) "
                          "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (job) DO UPDATE SET source = EXCLUDED.source, "
                          "key = EXCLUDED.key, tag = EXCLUDED.tag, same_db = EXCLUDED.same_db, "
                          "source_started = coalesce(embedfleet.syncs.source_started, EXCLUDED.source_started), "
                          "source_db = EXCLUDED.source_db",
                          [name, source, key, tag, same_db, started, source_db])

    def source_restarted(self, name: str, started: str) -> bool:
        """Record the source server's start time for sync job `name`; whether it differs from the one recorded
        (a first record is no restart: the backfill read everything)."""
        row = self.conn.execute("UPDATE embedfleet.syncs s SET source_started = %s FROM (SELECT source_started "
                                "FROM embedfleet.syncs WHERE job = %s FOR UPDATE) old WHERE s.job = %s "
                                "RETURNING old.source_started", [started, name, name]).fetchone()
        return row is not None and row[0] is not None and row[0] != started

    def synced(self, name: str) -> None:
        self.conn.execute("UPDATE embedfleet.syncs SET synced_at = now() WHERE job = %s", [name])

    def sync_of(self, name: str) -> dict | None:
        with self.conn.cursor(row_factory=dict_row) as cur:
            return cur.execute("SELECT * FROM embedfleet.syncs WHERE job = %s", [name]).fetchone()

    def set_snapshot(self, name: str, snapshot: str | None) -> None:
        self.conn.execute("UPDATE embedfleet.jobs SET snapshot = %s WHERE job = %s", [snapshot, name])

    def restart_job(self, name: str) -> int:
        """Every chunk back to pending from its first line, counts and rejects cleared: the job's table is
        gone, so all of it is embedded again. Returns the chunks that had made progress."""
        with self.conn.transaction():
            n = self.conn.execute(
                "UPDATE embedfleet.chunks SET state = 'pending', cursor_line = 0, rows_written = 0, rows_seen = 0, "
                "rejected = 0, tokens = 0, failures = 0, claim = NULL, worker = NULL, started = NULL, error = NULL, "
                "finished = NULL WHERE job = %s", [name]).rowcount
            self.conn.execute("DELETE FROM embedfleet.rejects WHERE job = %s", [name])
            self.conn.execute("UPDATE embedfleet.jobs SET rows_before = 0, error = NULL WHERE job = %s", [name])
        return n

    def orphan_jobs(self, name: str) -> list[str]:
        """The other jobs that wrote job `name`'s table, whose rows went with it when it was dropped: each is set
        back to 'planned', every chunk pending (`restart_job`), with the reason, so its command embeds it again and
        neither `status` nor `verify` counts rows that are gone. Returns their names."""
        from embedfleet.pg.ddl import spellings

        table = self.conn.execute("SELECT table_name FROM embedfleet.jobs WHERE job = %s", [name]).fetchone()[0]
        others = [r[0] for r in self.conn.execute(
            "SELECT job FROM embedfleet.jobs j WHERE table_name = ANY(%s) AND job <> %s AND EXISTS (SELECT 1 FROM "
            "embedfleet.chunks c WHERE c.job = j.job AND (c.cursor_line > 0 OR c.state = 'done')) ORDER BY created",
            [spellings(self.conn, table), name])]
        for other in others:
            self.restart_job(other)
            self.conn.execute("UPDATE embedfleet.jobs SET state = 'planned', finished = NULL, error = %s WHERE job = %s",
                              [f"its table {table} was dropped: rerun this job's command to embed its inputs again",
                               other])
        return others

    def discard_failed_start(self, name: str, cfg: JobSpec) -> bool:
        """Remove job `name` if it failed before committing anything (a model that did not load, a device that
        did not start) and `cfg` has other settings: nothing of it to keep, so it is not in their way. Not a
        sync's job (its sync holds the name). Returns whether it was removed."""
        with self.conn.transaction():
            self.conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"embedfleet.job.{name}"])
            return self.conn.execute(
                "DELETE FROM embedfleet.jobs j WHERE job = %s AND state = 'failed' AND NOT fingerprint = ANY(%s) "
                "AND NOT EXISTS (SELECT 1 FROM embedfleet.chunks c WHERE c.job = j.job "
                "AND (c.cursor_line > 0 OR c.state = 'done')) "
                "AND (to_regclass('embedfleet.syncs') IS NULL OR NOT EXISTS (SELECT 1 FROM embedfleet.syncs s "
                "WHERE s.job = j.job))", [name, [cfg.fingerprint(), cfg.fingerprint(legacy=True)]]).rowcount > 0

    def made_progress(self, name: str) -> bool:
        """Whether any chunk of the job committed anything (rows, rejects, or its end)."""
        return self.conn.execute(
            "SELECT EXISTS (SELECT 1 FROM embedfleet.chunks WHERE job = %s AND (cursor_line > 0 OR state = 'done'))",
            [name]).fetchone()[0]

    def first_reject(self, name: str) -> tuple[str, int, str] | None:
        """(source, line, reason) of the job's first reject, in input order."""
        return self.conn.execute("SELECT source, line, reason FROM embedfleet.rejects WHERE job = %s "
                                 "ORDER BY source, line LIMIT 1", [name]).fetchone()

    def set_model(self, name: str, model: str, dim: int, digest: str | None = None) -> None:
        """The model a worker loaded for job `name`: its name, its vectors' width and `ModelSpec.digest` (kept in
        the job's config, which needs no new column: verify compares it across tables)."""
        self.conn.execute(
            "UPDATE embedfleet.jobs SET model = %s, dim = %s, config = CASE WHEN %s::text IS NULL THEN config "
            "ELSE config || jsonb_build_object('model_digest', %s::text) END WHERE job = %s",
            [model, dim, digest, digest, name])

    # ---- meta -------------------------------------------------------------------------------

    def meta_loaded(self, meta_id: str) -> bool:
        return self.conn.execute(
            "SELECT 1 FROM embedfleet.meta_loaded WHERE meta_id = %s", [meta_id]
        ).fetchone() is not None

    def load_meta(self, meta_id: str, source: str, rows: Iterable[tuple[str, dict]], skipped) -> int:
        """Load a meta file once (keyed by its content identity) with COPY; last duplicate key wins."""
        with self.conn.transaction():
            self.conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"embedfleet.meta.{meta_id}"])
            if self.meta_loaded(meta_id):
                return 0
            self.conn.execute(
                "CREATE TEMP TABLE IF NOT EXISTS _ef_meta (key text, data jsonb) ON COMMIT DROP"
            )
            n = 0
            with self.conn.cursor() as cur, cur.copy("COPY _ef_meta (key, data) FROM STDIN") as copy:
                for key, data in rows:
                    copy.write_row((key, Jsonb(data)))
                    n += 1
            self.conn.execute(
                "INSERT INTO embedfleet.meta (meta_id, key, data) "
                "SELECT DISTINCT ON (key) %s, key, data FROM _ef_meta ORDER BY key "
                "ON CONFLICT (meta_id, key) DO UPDATE SET data = EXCLUDED.data",
                [meta_id],
            )
            self.conn.execute(
                "INSERT INTO embedfleet.meta_loaded (meta_id, source, rows, skipped) VALUES (%s, %s, %s, %s)",
                [meta_id, source, n, skipped()],
            )
        return n

    def meta_lookup(self, meta_id: str, keys: set[str]) -> dict[str, dict]:
        if not keys:
            return {}
        rows = self.conn.execute(
            "SELECT key, data FROM embedfleet.meta WHERE meta_id = %s AND key = ANY(%s)", [meta_id, list(keys)]
        ).fetchall()
        return dict(rows)

    # ---- chunks -----------------------------------------------------------------------------

    def claim(self, job: str, worker: str, lease_seconds: float) -> Claim | None:
        """Take the next pending chunk, or one whose lease expired — unless this worker already holds its
        share of what is left: (pending + running) / live workers, rounded up. Claiming ahead keeps a
        worker's helpers and GPU busy, but with few chunks left it would leave the others idle (two CPU
        workers on a 4-chunk file ran one after the other). Live: registered and beating within a lease."""
        return self._claim(job, worker, lease_seconds, uuid.uuid4())

    @_resilient
    def _claim(self, job: str, worker: str, lease_seconds: float, token: uuid.UUID) -> Claim | None:
        # The token is made here, not by the server: repeated after a connection lost mid-claim, the call
        # finds the chunk its first try took (the claim committed, its answer was lost) instead of a second.
        row = self.conn.execute(
            """
            WITH prior AS (
                SELECT job, chunk FROM embedfleet.chunks WHERE job = %(job)s AND state = 'running' AND claim = %(token)s),
            held AS (
                SELECT count(*) AS n FROM embedfleet.chunks
                 WHERE job = %(job)s AND worker = %(worker)s AND state = 'running' AND lease_until >= now()),
            live AS (
                SELECT greatest(1, count(*)) AS n FROM embedfleet.workers
                 WHERE job = %(job)s AND state NOT IN ('finished', 'exited', 'failed')
                   AND heartbeat >= now() - make_interval(secs => %(lease)s)),
            left_ AS (  -- chunks not done, counted only as far as the rule needs
                SELECT count(*) AS n FROM (SELECT 1 FROM embedfleet.chunks
                 WHERE job = %(job)s AND state IN ('pending', 'running')
                 LIMIT (SELECT held.n * live.n + 1 FROM held, live)) s),
            taken AS (
                UPDATE embedfleet.chunks c
                   SET state = 'running', claim = %(token)s, worker = %(worker)s, host = %(host)s,
                       pid = %(pid)s, pid_started = %(pid_started)s, started = NULL,
                       lease_until = now() + make_interval(secs => %(lease)s), error = NULL
                  FROM (SELECT job, chunk FROM embedfleet.chunks
                         WHERE job = %(job)s
                           AND (state = 'pending' OR (state = 'running' AND lease_until < now()))
                           AND (SELECT left_.n > held.n * live.n FROM left_, held, live)
                           AND NOT EXISTS (SELECT 1 FROM prior)
                         ORDER BY chunk
                         LIMIT 1
                         FOR UPDATE SKIP LOCKED) next
                 WHERE c.job = next.job AND c.chunk = next.chunk
             RETURNING c.job, c.chunk)
            SELECT c.job, c.chunk, c.source, c.kind, c.start_pos, c.end_pos, c.first_line, c.last_line,
                   c.cursor_line, %(token)s::uuid, c.replace_to
              FROM embedfleet.chunks c JOIN (SELECT * FROM taken UNION ALL SELECT * FROM prior) t
                ON c.job = t.job AND c.chunk = t.chunk
            """,
            dict(job=job, worker=worker, host=self.host, pid=os.getpid(), token=token,
                 pid_started=process_started(os.getpid()), lease=lease_seconds),
        ).fetchone()
        return Claim(*row) if row else None

    def mark_started(self, claim: Claim) -> None:
        """This worker begins embedding the chunk: if it dies now, the failure counts against this one."""
        self.conn.execute(
            "UPDATE embedfleet.chunks SET started = now() WHERE job = %s AND chunk = %s AND claim = %s "
            "AND started IS NULL", [claim.job, claim.chunk, claim.token])

    def renew(self, job: str, worker: str, lease_seconds: float) -> None:
        self.conn.execute(
            "UPDATE embedfleet.chunks SET lease_until = now() + make_interval(secs => %s) "
            "WHERE job = %s AND worker = %s AND state = 'running'",
            [lease_seconds, job, worker],
        )

    def fail(self, claim: Claim, error: str) -> str:
        """Count a failure against a chunk: back to pending, or failed after MAX_FAILURES."""
        row = self.conn.execute(
            "UPDATE embedfleet.chunks SET failures = failures + 1, error = %s, claim = NULL, worker = NULL, "
            "started = NULL, state = CASE WHEN failures + 1 >= %s THEN 'failed' ELSE 'pending' END "
            "WHERE job = %s AND chunk = %s AND claim = %s RETURNING state",
            [error[:2000], MAX_FAILURES, claim.job, claim.chunk, claim.token],
        ).fetchone()
        return row[0] if row else "lost"

    def release_dead_local(self, job: str) -> int:
        """Chunks held by processes of this host that no longer exist go back to pending now,
        without waiting for their lease (the rerun after a kill -9)."""
        rows = self.conn.execute(
            "SELECT chunk, pid, pid_started FROM embedfleet.chunks WHERE job = %s AND state = 'running' AND host = %s",
            [job, self.host],
        ).fetchall()
        dead = [chunk for chunk, pid, started in rows if pid is None or not alive(pid, started)]
        if dead:
            self.conn.execute(
                "UPDATE embedfleet.chunks SET state = 'pending', claim = NULL, worker = NULL, started = NULL "
                "WHERE job = %s AND chunk = ANY(%s) AND state = 'running'",
                [job, dead],
            )
        return len(dead)

    def fail_dead_worker(self, job: str, pid: int, error: str) -> tuple[int | None, list[int]]:
        """A worker process died holding chunks. A failure counts only against the chunk it started
        embedding last (a chunk that kills every worker that embeds it ends up failed); the chunks it
        had only claimed ahead, or that wait in its writers, go back to pending without a mark.
        Returns (the chunk counted as failed or None, the chunks re-queued)."""
        rows = self.conn.execute(
            """
            WITH culprit AS (
                SELECT chunk FROM embedfleet.chunks
                 WHERE job = %(job)s AND host = %(host)s AND pid = %(pid)s AND state = 'running' AND started IS NOT NULL
                 ORDER BY started DESC, chunk DESC LIMIT 1)
            UPDATE embedfleet.chunks c
               SET failures = failures + (c.chunk IN (SELECT chunk FROM culprit))::int,
                   error = CASE WHEN c.chunk IN (SELECT chunk FROM culprit) THEN %(error)s ELSE c.error END,
                   state = CASE WHEN c.chunk IN (SELECT chunk FROM culprit) AND failures + 1 >= %(max)s
                                THEN 'failed' ELSE 'pending' END,
                   claim = NULL, worker = NULL, started = NULL
             WHERE job = %(job)s AND host = %(host)s AND pid = %(pid)s AND state = 'running'
         RETURNING chunk, chunk IN (SELECT chunk FROM culprit)
            """,
            dict(job=job, host=self.host, pid=pid, error=error, max=MAX_FAILURES),
        ).fetchall()
        culprit = next((chunk for chunk, counted in rows if counted), None)
        return culprit, sorted(chunk for chunk, counted in rows if not counted)

    def take_over(self, job: str, worker: str) -> tuple[int | None, list[int]]:
        """A worker starting under an id whose earlier process died (a restarted Ray actor, a relaunched
        slot) frees what that process held, as `fail_dead_worker` does: a failure only for the chunk it
        was embedding. Returns (that chunk or None, the chunks re-queued)."""
        rows = self.conn.execute(
            """
            WITH mine AS (
                SELECT chunk, started FROM embedfleet.chunks
                 WHERE job = %(job)s AND worker = %(worker)s AND state = 'running'
                   AND (host IS DISTINCT FROM %(host)s OR pid IS DISTINCT FROM %(pid)s)),
            culprit AS (SELECT chunk FROM mine WHERE started IS NOT NULL ORDER BY started DESC, chunk DESC LIMIT 1)
            UPDATE embedfleet.chunks c
               SET failures = failures + (c.chunk IN (SELECT chunk FROM culprit))::int,
                   error = CASE WHEN c.chunk IN (SELECT chunk FROM culprit)
                                THEN 'the worker embedding it died' ELSE c.error END,
                   state = CASE WHEN c.chunk IN (SELECT chunk FROM culprit) AND failures + 1 >= %(max)s
                                THEN 'failed' ELSE 'pending' END,
                   claim = NULL, worker = NULL, started = NULL
             WHERE job = %(job)s AND chunk IN (SELECT chunk FROM mine)
         RETURNING chunk, chunk IN (SELECT chunk FROM culprit)
            """,
            dict(job=job, worker=worker, host=self.host, pid=os.getpid(), max=MAX_FAILURES),
        ).fetchall()
        culprit = next((chunk for chunk, counted in rows if counted), None)
        return culprit, sorted(chunk for chunk, counted in rows if not counted)

    def release_workers(self, job: str, workers: list[str]) -> int:
        """Chunks held by these workers go back to pending now (their launcher stopped them: Ctrl-C);
        a commit they still try fails its fence."""
        return self.conn.execute(
            "UPDATE embedfleet.chunks SET state = 'pending', claim = NULL, worker = NULL, started = NULL "
            "WHERE job = %s AND state = 'running' AND worker = ANY(%s)", [job, workers]).rowcount

    def retry_failed(self, job: str) -> int:
        """A rerun gives failed chunks another round of attempts."""
        return self.conn.execute(
            "UPDATE embedfleet.chunks SET state = 'pending', failures = 0 WHERE job = %s AND state = 'failed'",
            [job],
        ).rowcount

    def counts(self, job: str) -> dict[str, int]:
        rows = self.conn.execute(
            "SELECT state, count(*) FROM embedfleet.chunks WHERE job = %s GROUP BY state", [job]
        ).fetchall()
        out = {"pending": 0, "running": 0, "done": 0, "failed": 0}
        out.update(dict(rows))
        return out

    def pending_bytes(self, job: str) -> int | None:
        """Input bytes of the chunks not done yet (pending or running); None when some are not plain
        JSONL byte ranges (compressed, Parquet, CSV: their size in text is not known here)."""
        known, unknown = self.conn.execute(
            "SELECT coalesce(sum(end_pos - start_pos) FILTER (WHERE kind = 'jsonl'), 0)::bigint, "
            "count(*) FILTER (WHERE kind <> 'jsonl') FROM embedfleet.chunks "
            "WHERE job = %s AND state IN ('pending', 'running')", [job]).fetchone()
        return None if unknown else int(known)

    def running_split(self, job: str, worker: str) -> tuple[int, int]:
        """Running chunks held by `worker` and by anyone else."""
        mine, others = self.conn.execute(
            "SELECT count(*) FILTER (WHERE worker = %s), count(*) FILTER (WHERE worker IS DISTINCT FROM %s) "
            "FROM embedfleet.chunks WHERE job = %s AND state = 'running'", [worker, worker, job],
        ).fetchone()
        return mine, others

    def failed_chunks(self, job: str) -> list[tuple[int, str, str]]:
        return self.conn.execute(
            "SELECT chunk, source, error FROM embedfleet.chunks WHERE job = %s AND state = 'failed' ORDER BY chunk",
            [job],
        ).fetchall()

    # ---- workers (for the progress display) --------------------------------------------------

    def worker_beat(self, job: str, worker: str, device: str, state: str, rows: int, tokens: int,
                    gauges: dict | None = None) -> None:
        """A worker's heartbeat row: what the fleet view shows. `gauges`: rows_s, tokens_s and the GPU's
        gpu_util, gpu_mem_used, gpu_mem_total (MiB), gpu_temp (°C), gpu_power (W), where known."""
        g = {k: None for k in FLEET_GAUGES} | (gauges or {})
        self.conn.execute(
            """
            INSERT INTO embedfleet.workers (job, worker, host, pid, device, state, rows, tokens, rows_s, tokens_s,
                                            gpu_util, gpu_mem_used, gpu_mem_total, gpu_temp, gpu_power)
            VALUES (%(job)s, %(worker)s, %(host)s, %(pid)s, %(device)s, %(state)s, %(rows)s, %(tokens)s, %(rows_s)s,
                    %(tokens_s)s, %(gpu_util)s, %(gpu_mem_used)s, %(gpu_mem_total)s, %(gpu_temp)s, %(gpu_power)s)
            ON CONFLICT (job, worker) DO UPDATE SET state = EXCLUDED.state, rows = EXCLUDED.rows,
                tokens = EXCLUDED.tokens, heartbeat = now(), host = EXCLUDED.host, pid = EXCLUDED.pid,
                device = EXCLUDED.device, rows_s = EXCLUDED.rows_s, tokens_s = EXCLUDED.tokens_s,
                gpu_util = EXCLUDED.gpu_util, gpu_mem_used = EXCLUDED.gpu_mem_used,
                gpu_mem_total = EXCLUDED.gpu_mem_total, gpu_temp = EXCLUDED.gpu_temp, gpu_power = EXCLUDED.gpu_power
            """,
            dict(job=job, worker=worker, host=self.host, pid=os.getpid(), device=device, state=state, rows=rows,
                 tokens=tokens, **{k: g[k] for k in FLEET_GAUGES}),
        )

    def register_workers(self, job: str, workers: list[tuple[str, str]]) -> None:
        """The launcher's workers, as (worker id, device), before they start: each counts as live from now,
        so the first to start does not claim the others' share of a small job."""
        with self.conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO embedfleet.workers (job, worker, host, device, state) VALUES (%s, %s, %s, %s, 'starting') "
                "ON CONFLICT (job, worker) DO UPDATE SET state = 'starting', heartbeat = now(), error = NULL, "
                "summary = NULL, host = EXCLUDED.host, device = EXCLUDED.device",
                [(job, worker, self.host, device) for worker, device in workers])

    def registered(self, job: str, worker: str, since: float = 0.0) -> bool:
        """Whether a launcher has registered `worker` for `job` at or after `since` (epoch seconds, the
        server's clock): what a worker started early waits for."""
        return self.conn.execute(
            "SELECT 1 FROM embedfleet.workers WHERE job = %s AND worker = %s AND state = 'starting' "
            "AND heartbeat >= to_timestamp(%s)", [job, worker, since]).fetchone() is not None

    def worker_ended(self, job: str, worker: str, state: str, error: str | None = None,
                     summary: dict | None = None) -> None:
        """A worker's last word: finished (with its summary), failed (with its error) or exited (seen dead)."""
        self.conn.execute(
            "UPDATE embedfleet.workers SET state = %s, error = coalesce(%s, error), "
            "summary = coalesce(%s, summary), heartbeat = now() WHERE job = %s AND worker = %s",
            [state, error, None if summary is None else Jsonb(summary), job, worker])

    def worker_errors(self, job: str) -> list[tuple[str, str]]:
        """(worker, error) of the workers that stopped on an error."""
        return self.conn.execute("SELECT worker, error FROM embedfleet.workers WHERE job = %s AND error IS NOT NULL "
                                 "ORDER BY worker", [job]).fetchall()

    def summaries(self, job: str) -> list[dict]:
        """What each worker of the job reported when it finished (rows, seconds, start-up steps, …)."""
        return [r[0] for r in self.conn.execute(
            "SELECT summary FROM embedfleet.workers WHERE job = %s AND summary IS NOT NULL ORDER BY worker", [job])]

    def progress(self, job: str) -> dict:
        with self.conn.cursor(row_factory=dict_row) as cur:
            totals = cur.execute(
                "SELECT count(*) AS chunks_total, count(*) FILTER (WHERE state = 'done') AS chunks_done, "
                "count(*) FILTER (WHERE state = 'failed') AS chunks_failed, "
                "coalesce(sum(rows_written), 0)::bigint AS rows_written, coalesce(sum(rows_seen), 0)::bigint AS rows_seen, "
                "coalesce(sum(rejected), 0)::bigint AS rejected, coalesce(sum(tokens), 0)::bigint AS tokens "
                "FROM embedfleet.chunks WHERE job = %s",
                [job],
            ).fetchone()
            workers = cur.execute(
                f"SELECT worker, host, pid, device, {_SHOWN_STATE} AS state, rows, tokens, rows_s, tokens_s, gpu_util, "
                "gpu_mem_used, gpu_mem_total, gpu_temp, gpu_power, heartbeat, error FROM embedfleet.workers w "
                "WHERE job = %s ORDER BY worker",
                [job],
            ).fetchall()
        totals["workers"] = workers
        return totals


for _name, _method in list(vars(Ledger).items()):  # every query method; _claim is wrapped above
    if callable(_method) and not _name.startswith("_") and _name not in ("connect", "close", "claim"):
        setattr(Ledger, _name, _resilient(_method))


def _other_settings(name: str, existing: dict, cfg: JobSpec) -> JobError | None:
    """The error for running job `name` (recorded as `existing`) with `cfg`'s other settings; None if the same."""
    if existing["fingerprint"] in (cfg.fingerprint(), cfg.fingerprint(legacy=True),
                                   *_as_recorded_relative(cfg, existing["config"].get("model"))):
        return None
    return JobError(f"job {name!r} already exists with other settings ({_differences(existing['config'], cfg)}); "
                    "pass --job NEWNAME to start a new one")


def _differences(recorded: dict, cfg: JobSpec) -> str:
    """What a job's recorded settings and `cfg` differ in, as flags: `--limit 7 then, 10 now`."""
    from embedfleet.settings import FLAG_FIELDS

    flags = {field: flag for flag, field in FLAG_FIELDS.items()}
    shown = []
    for key in JobSpec._IDENTITY:
        then, now = recorded.get(key), getattr(cfg, key)
        now = list(now) if isinstance(now, tuple) else now
        if then != now:
            shown.append(f"--{flags.get(key, key).replace('_', '-')} {then if then is not None else 'not given'} then, "
                         f"{now if now is not None else 'not given'} now")
    return "; ".join(shown[:3]) or "model, table, template or fields differ"


def _as_recorded_relative(cfg: JobSpec, recorded: str | None) -> tuple[str, ...]:
    """`cfg`'s fingerprints with its model as a job recorded it before model folders were made absolute: the
    relative folder that names the same one from here (none where it does not)."""
    from pathlib import Path

    if not recorded or not cfg.model or Path(recorded).is_absolute() or not Path(recorded).is_dir() \
            or str(Path(recorded).resolve()) != cfg.model:
        return ()
    old = cfg.replace(model=recorded)
    return old.fingerprint(), old.fingerprint(legacy=True)


def jobs_overview(conn: psycopg.Connection, job: str | None = None, source_db: str | None = None,
                  count_rows: Callable[[psycopg.Connection, str], int] = table_rows, host: str = HOST) -> list[dict]:
    """What `embedfleet status` prints: one dict per job (contract fields first). Reads only: a role with
    SELECT on the ledger is enough, and a database without a ledger has no jobs. `count_rows`: a sync job's
    rows, counted in its table (`status --watch` counts less often than it redraws)."""
    if not ledger_exists(conn):
        return []
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            f"""
            SELECT j.job, j.table_name AS "table", j.state, j.model, j.dim, j.error,
                   coalesce((j.config->>'followed')::bool, false) AS followed,
                   (SELECT count(*) FROM embedfleet.rejects r WHERE r.job = j.job) AS rejects_kept,
                   count(c.chunk) AS chunks_total,
                   count(c.chunk) FILTER (WHERE c.state = 'done') AS chunks_done,
                   count(c.chunk) FILTER (WHERE c.state = 'failed') AS chunks_failed,
                   coalesce(sum(c.rows_written), 0) AS rows_written,
                   coalesce(sum(c.rejected), 0) AS rejected,
                   j.started, j.finished,
                   extract(epoch FROM now() - coalesce(
                       (SELECT max(heartbeat) FROM embedfleet.workers w WHERE w.job = j.job), j.started)) AS idle_s,
                   (SELECT count(*) FROM embedfleet.workers w WHERE w.job = j.job
                       AND {_SHOWN_STATE} NOT IN ('finished', 'exited', 'failed', 'lost')) AS live_workers,
                   (SELECT coalesce(jsonb_agg(jsonb_build_object('chunk', f.chunk, 'source', f.source,
                                                                 'error', f.error) ORDER BY f.chunk), '[]')
                      FROM embedfleet.chunks f WHERE f.job = j.job AND f.state = 'failed') AS failures,
                   -- every column a worker row has (older ledgers have fewer: to_jsonb takes what is there)
                   (SELECT coalesce(jsonb_agg((to_jsonb(w) - 'job' - 'summary')
                                              || jsonb_build_object('beat_age_s', extract(epoch FROM now() - w.heartbeat),
                                                                    'state', {_SHOWN_STATE})
                                              ORDER BY w.worker), '[]')
                      FROM embedfleet.workers w WHERE w.job = j.job) AS workers
              FROM embedfleet.jobs j LEFT JOIN embedfleet.chunks c ON c.job = j.job
             WHERE %(job)s::text IS NULL OR j.job = %(job)s
             GROUP BY j.job ORDER BY j.created
            """,
            {"job": job},
        ).fetchall()
    out = []
    for r in rows:
        state = r["state"]
        idle = float(r["idle_s"]) if r["idle_s"] is not None else 0.0
        gone = _gone_here(r["workers"], host)
        for w in r["workers"]:
            if w.get("worker") in gone:
                w["state"] = "lost"
        live = r["live_workers"] - len(gone)
        if state == "running" and (idle > STALE_SECONDS or (live == 0 and idle > ENDED_SECONDS)):
            state = "interrupted"  # no worker beats, or every one has ended: rerun the same command to resume
        out.append({
            "job": r["job"], "table": r["table"], "state": state,
            "chunks_total": int(r["chunks_total"]), "chunks_done": int(r["chunks_done"]),
            "rows_written": int(r["rows_written"]), "rejected": int(r["rejected"]),
            "started": r["started"].isoformat() if r["started"] else None,
            "finished": r["finished"].isoformat() if r["finished"] else None,
            "chunks_failed": int(r["chunks_failed"]), "model": r["model"], "dim": r["dim"], "error": r["error"],
            "failures": r["failures"], "workers": r["workers"],
            # a finished job whose table was dropped since (by hand, or by another job's --drop-table)
            "table_exists": table_exists(conn, r["table"]),
        })
        sync = sync_overview(conn, r["job"], source_db)
        if sync is not None or r["followed"]:  # followed, or followed until a `sync --uninstall`
            out[-1].update(sync or {})
            # a followed table's rows are the source's now, not what its backfill wrote; its rejects are those
            # kept now (a drain clears a row's once it can write it), not the backfill's count
            out[-1]["backfill_rows"] = out[-1]["rows_written"]
            out[-1]["rejected"] = int(r["rejects_kept"])
            if out[-1]["table_exists"]:
                out[-1]["rows_written"] = count_rows(conn, r["table"])
    return out


def sync_overview(conn: psycopg.Connection, job: str, source_db: str | None = None) -> dict | None:
    """A sync job's `source`, `pending` (keys queued), `lag_s` (age of the oldest) and `synced_at` (when a worker
    last found its queue empty); None for other jobs. The queue is read where the ledger is, or at `source_db`;
    elsewhere pending and lag_s are None."""
    if conn.execute("SELECT to_regclass('embedfleet.syncs') IS NULL").fetchone()[0]:
        return None
    row = conn.execute("SELECT source, key, tag, same_db, synced_at, source_started FROM embedfleet.syncs "
                       "WHERE job = %s", [job]).fetchone()
    if row is None:
        return None
    from embedfleet.pg import queue

    source, key, tag, same_db, synced_at, started = row
    q, n, age, restarted, missing = queue.Queue(source, key, tag), None, None, False, False

    def look(src: psycopg.Connection) -> tuple[int | None, float | None, bool, bool]:
        # A server started since sync last looked may have emptied the (unlogged) queue: its count means nothing
        # until the next sync queues every key again. A queue dropped by hand counts nothing either.
        if started is not None and queue.server_started(src) != started:
            return None, None, True, False
        if not src.execute("SELECT to_regclass(%s) IS NOT NULL", [q.table_name]).fetchone()[0]:
            return None, None, False, True
        return (*queue.pending(src, q), False, False)

    try:
        if same_db:
            n, age, restarted, missing = look(conn)
        elif source_db:
            with psycopg.connect(source_db, autocommit=True) as src:
                n, age, restarted, missing = look(src)
    except psycopg.Error:  # the source's server cannot be reached now: status still answers
        pass
    return {"source": source, "pending": n, "lag_s": None if age is None else round(age, 3),
            "synced_at": synced_at.isoformat() if synced_at else None, "restarted": restarted,
            "queue_missing": missing}


def _gone_here(workers: list[dict], host: str = HOST) -> set[str]:
    """The workers of this host (`host`: Settings.host_id), not ended by their own word, whose process is gone
    (a `kill -9`): no longer counted as running, without waiting for their heartbeats to age."""
    return {w["worker"] for w in workers if w.get("host") == host and w.get("pid")
            and w.get("state") not in ("finished", "exited", "failed", "lost") and not alive(int(w["pid"]))}


def remove_job(conn: psycopg.Connection, job: str, drop_table: bool = False, host: str = HOST) -> dict:
    """`embedfleet jobs rm`: the job and all the ledger holds of it, in one transaction; its table too with
    `drop_table`. A job whose workers still beat is refused: it would be planned again under them."""
    if not ledger_exists(conn):
        raise InputError(f"no job named {job!r}; `embedfleet status` lists them")
    with conn.transaction():
        row = conn.execute("SELECT table_name FROM embedfleet.jobs WHERE job = %s FOR UPDATE", [job]).fetchone()
        if row is None:  # a name the user gave that is none, as `status --job` says it (exit 2)
            raise InputError(f"no job named {job!r}; `embedfleet status` lists them")
        recent = [{"worker": w, "host": h, "pid": p, "state": st} for w, h, p, st in conn.execute(
            "SELECT worker, host, pid, state FROM embedfleet.workers WHERE job = %s AND state NOT IN ('finished', "
            "'exited', 'failed') AND heartbeat >= now() - make_interval(secs => %s)", [job, STALE_SECONDS / 4])]
        beating = len(recent) - len(_gone_here(recent, host))
        if beating:
            raise JobError(f"job {job!r} is running ({beating} worker{'' if beating == 1 else 's'} beat within the "
                           f"last {STALE_SECONDS // 4} s): "
                           "stop it first (Ctrl-C its `embedfleet ingest`), then remove it")
        sync = conn.execute("SELECT source FROM embedfleet.syncs WHERE job = %s", [job]).fetchone()
        if sync is not None:
            raise JobError(f"job {job!r} syncs {sync[0]}: its trigger would keep queueing changes; remove it with "
                           f"`embedfleet sync --from-table {sync[0]} --job {job} --uninstall` (the table stays)")
        if drop_table:  # the table is not this job's alone to drop
            from embedfleet.pg.ddl import spellings

            others = [j for (j,) in conn.execute(
                "SELECT job FROM embedfleet.jobs WHERE table_name = ANY(%s) AND job <> %s ORDER BY job",
                [spellings(conn, row[0]), job])]
            if others:
                raise JobError(f"table {row[0]!r} also holds the rows of job{'s' if len(others) > 1 else ''} "
                               f"{', '.join(map(repr, others))}: remove {'them' if len(others) > 1 else 'it'} first "
                               "to drop the table, or leave out --drop-table to keep it")
        chunks, rejects = conn.execute(
            "SELECT (SELECT count(*) FROM embedfleet.chunks WHERE job = %s), "
            "(SELECT count(*) FROM embedfleet.rejects WHERE job = %s)", [job, job]).fetchone()
        conn.execute("DELETE FROM embedfleet.jobs WHERE job = %s", [job])  # chunks, rejects, workers cascade
        dropped = drop_table and table_exists(conn, row[0])
        if dropped:
            drop_table_(conn, row[0])
    return {"job": job, "table": row[0], "chunks": chunks, "rejects": rejects, "table_dropped": dropped}


def job_rejects(conn: psycopg.Connection, job: str, limit: int | None = None) -> tuple[list[dict], int]:
    """The records job `job` could not make rows of, in input order: source, line, reason, and the raw record's
    first characters; and how many there are (a sync's are those of rows it cannot write now). Reads only."""
    if not ledger_exists(conn):
        return [], 0
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute("SELECT source, line, reason, raw FROM embedfleet.rejects WHERE job = %s "
                           "ORDER BY source, line LIMIT %s", [job, limit]).fetchall()
    key = conn.execute("SELECT config->>'id_field' FROM embedfleet.jobs WHERE job = %s AND config->>'source_table' "
                       "IS NOT NULL", [job]).fetchone()
    if key is not None:  # a table's rows are named by their keys (`line` keeps a hash of one that is no integer)
        for r in rows:
            try:
                r["key"] = orjson.loads(r["raw"]).get(key[0])
            except (orjson.JSONDecodeError, AttributeError):  # cut to its first characters
                r["key"] = None
    return rows, conn.execute("SELECT count(*) FROM embedfleet.rejects WHERE job = %s", [job]).fetchone()[0]


def table_job(conn: psycopg.Connection, table: str) -> dict | None:
    """What made `table`: the newest job that wrote it (job, model, dim, the model and --dim as requested,
    prompt, template, preset, task), from the ledger; None with no ledger or no such job (a table written by
    something else). Read by search (the query's model) and train (the head's record)."""
    from embedfleet.pg.ddl import spellings

    if not ledger_exists(conn):
        return None
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(
            "SELECT job, model, dim, config->>'model' AS requested, config->>'dim' AS requested_dim, "
            "config->>'prompt' AS prompt, config->>'text_template' AS text_template, config->>'preset' AS preset, "
            "config->>'task' AS task "
            "FROM embedfleet.jobs WHERE table_name = ANY(%s) ORDER BY created DESC LIMIT 1",
            [spellings(conn, table)]).fetchone()
    return dict(row) if row else None


def job_named(conn: psycopg.Connection, name: str) -> str:
    """The job a user names: by its name, else by its table's name however spelled (`t` for job `public.t`)."""
    if not ledger_exists(conn) or conn.execute("SELECT 1 FROM embedfleet.jobs WHERE job = %s", [name]).fetchone():
        return name
    known = job_for_table(conn, name)
    return known[0] if known else name


def syncs_into(conn: psycopg.Connection, table: str) -> list[str]:
    """The sync jobs whose target is `table`, however it was spelled."""
    from embedfleet.pg.ddl import spellings

    if not ledger_exists(conn):
        return []
    return [j for (j,) in conn.execute("SELECT s.job FROM embedfleet.syncs s JOIN embedfleet.jobs j USING (job) "
                                       "WHERE j.table_name = ANY(%s) ORDER BY s.job", [spellings(conn, table)])]


def job_for_table(conn: psycopg.Connection, table: str) -> tuple[str, str] | None:
    """(job, its table as recorded) of the job named for `table` however it was spelled (`t` or `public.t`), so
    one table is one job; None where there is none."""
    from embedfleet.pg.ddl import spellings

    if not ledger_exists(conn):
        return None
    names = spellings(conn, table)
    return conn.execute("SELECT job, table_name FROM embedfleet.jobs WHERE job = ANY(%s) "
                        "ORDER BY array_position(%s, job) LIMIT 1", [names, names]).fetchone()
