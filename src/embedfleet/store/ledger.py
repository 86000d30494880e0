"""The ledger: jobs, their chunks, and who holds which chunk.

The ledger is the single source of truth. A chunk is claimed with `FOR UPDATE SKIP LOCKED` and a
lease; every claim gets a fresh fencing token (`claim`), and a commit only counts if the chunk
still carries that token — a worker that lost its lease (paused, partitioned) cannot write twice.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Iterable

import psutil
import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from embedfleet.config import JobConfig
from embedfleet.errors import JobError
from embedfleet.store.schema import ensure_ledger, ledger_exists

MAX_FAILURES = 3
STALE_SECONDS = 120  # a running job with no heartbeat for this long is reported as interrupted
HOST = socket.gethostname()


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


def connect(dsn: str, **kw) -> psycopg.Connection:
    from embedfleet.errors import DatabaseError

    try:
        return psycopg.connect(dsn, autocommit=True, **kw)
    except psycopg.OperationalError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DatabaseError(f"cannot connect to the database ({first}); check --db / EMBEDFLEET_DB") from None


def process_started(pid: int) -> float | None:
    """Start time of a live process, None if it is gone (a zombie is gone: it only awaits reaping)."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


class Ledger:
    def __init__(self, conn: psycopg.Connection):
        self.conn = conn
        ensure_ledger(conn)

    # ---- jobs -------------------------------------------------------------------------------

    def job(self, name: str) -> dict | None:
        with self.conn.cursor(row_factory=dict_row) as cur:
            return cur.execute("SELECT * FROM embedfleet.jobs WHERE job = %s", [name]).fetchone()

    def create_job(self, name: str, cfg: JobConfig, chunks: Iterable, meta_id: str | None) -> bool:
        """Insert the job and its plan in one transaction. Returns False if it already existed
        with the same fingerprint (a resume); raises if it exists with different settings."""
        with self.conn.transaction():
            self.conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"embedfleet.job.{name}"])
            existing = self.job(name)
            if existing is not None:
                if existing["fingerprint"] != cfg.fingerprint():
                    raise JobError(
                        f"job {name!r} already exists with other settings (inputs, model, table or template "
                        f"differ); pass --job NEWNAME to start a new one"
                    )
                return False
            self.conn.execute(
                "INSERT INTO embedfleet.jobs (job, table_name, fingerprint, config, model, meta_id) "
                "VALUES (%s, %s, %s, %s, %s, %s)",
                [name, cfg.table, cfg.fingerprint(), Jsonb(cfg.to_json()), cfg.model, meta_id],
            )
            with self.conn.cursor() as cur:
                with cur.copy(
                    "COPY embedfleet.chunks (job, chunk, source, kind, start_pos, end_pos, first_line, last_line) "
                    "FROM STDIN"
                ) as copy:
                    for i, (spec, last_line) in enumerate(chunks):
                        copy.write_row(
                            (name, i, spec.source, spec.kind, spec.start, spec.end, spec.first_line, last_line)
                        )
        return True

    def set_job_state(self, name: str, state: str, error: str | None = None) -> None:
        self.conn.execute(
            "UPDATE embedfleet.jobs SET state = %s, error = %s, "
            "started = CASE WHEN %s = 'running' THEN coalesce(started, now()) ELSE started END, "
            "finished = CASE WHEN %s IN ('done', 'failed') THEN now() ELSE NULL END WHERE job = %s",
            [state, error, state, state, name],
        )

    def set_model(self, name: str, model: str, dim: int) -> None:
        self.conn.execute(
            "UPDATE embedfleet.jobs SET model = %s, dim = %s WHERE job = %s", [model, dim, name]
        )

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
        row = self.conn.execute(
            """
            WITH held AS (
                SELECT count(*) AS n FROM embedfleet.chunks
                 WHERE job = %(job)s AND worker = %(worker)s AND state = 'running' AND lease_until >= now()),
            live AS (
                SELECT greatest(1, count(*)) AS n FROM embedfleet.workers
                 WHERE job = %(job)s AND state NOT IN ('finished', 'exited', 'failed')
                   AND heartbeat >= now() - make_interval(secs => %(lease)s)),
            left_ AS (  -- chunks not done, counted only as far as the rule needs
                SELECT count(*) AS n FROM (SELECT 1 FROM embedfleet.chunks
                 WHERE job = %(job)s AND state IN ('pending', 'running')
                 LIMIT (SELECT held.n * live.n + 1 FROM held, live)) s)
            UPDATE embedfleet.chunks c
               SET state = 'running', claim = gen_random_uuid(), worker = %(worker)s, host = %(host)s,
                   pid = %(pid)s, pid_started = %(pid_started)s, started = NULL,
                   lease_until = now() + make_interval(secs => %(lease)s), error = NULL
              FROM (SELECT job, chunk FROM embedfleet.chunks
                     WHERE job = %(job)s
                       AND (state = 'pending' OR (state = 'running' AND lease_until < now()))
                       AND (SELECT left_.n > held.n * live.n FROM left_, held, live)
                     ORDER BY chunk
                     LIMIT 1
                     FOR UPDATE SKIP LOCKED) next
             WHERE c.job = next.job AND c.chunk = next.chunk
         RETURNING c.job, c.chunk, c.source, c.kind, c.start_pos, c.end_pos, c.first_line, c.last_line,
                   c.cursor_line, c.claim
            """,
            dict(job=job, worker=worker, host=HOST, pid=os.getpid(),
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
            [job, HOST],
        ).fetchall()
        dead = [chunk for chunk, pid, started in rows if pid is None or not _alive(pid, started)]
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
            dict(job=job, host=HOST, pid=pid, error=error, max=MAX_FAILURES),
        ).fetchall()
        culprit = next((chunk for chunk, counted in rows if counted), None)
        return culprit, sorted(chunk for chunk, counted in rows if not counted)

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
                    gpu_util: float | None) -> None:
        self.conn.execute(
            """
            INSERT INTO embedfleet.workers (job, worker, host, pid, device, state, rows, tokens, gpu_util)
            VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)
            ON CONFLICT (job, worker) DO UPDATE SET state = EXCLUDED.state, rows = EXCLUDED.rows,
                tokens = EXCLUDED.tokens, gpu_util = EXCLUDED.gpu_util, heartbeat = now(),
                host = EXCLUDED.host, pid = EXCLUDED.pid, device = EXCLUDED.device
            """,
            [job, worker, HOST, os.getpid(), device, state, rows, tokens, gpu_util],
        )

    def register_workers(self, job: str, workers: list[tuple[str, str]]) -> None:
        """The launcher's workers, as (worker id, device), before they start: each counts as live from now,
        so the first to start does not claim the others' share of a small job."""
        with self.conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO embedfleet.workers (job, worker, host, device, state) VALUES (%s, %s, %s, %s, 'starting') "
                "ON CONFLICT (job, worker) DO UPDATE SET state = 'starting', heartbeat = now(), error = NULL, "
                "summary = NULL, host = EXCLUDED.host, device = EXCLUDED.device",
                [(job, worker, HOST, device) for worker, device in workers])

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
                "SELECT worker, host, pid, device, state, rows, tokens, gpu_util, heartbeat FROM embedfleet.workers "
                "WHERE job = %s ORDER BY worker",
                [job],
            ).fetchall()
        totals["workers"] = workers
        return totals


def _alive(pid: int, started: float | None) -> bool:
    now_started = process_started(pid)
    if now_started is None:
        return False
    return started is None or abs(now_started - started) < 1.0


def jobs_overview(conn: psycopg.Connection, job: str | None = None) -> list[dict]:
    """What `embedfleet status` prints: one dict per job (contract fields first). Reads only: a role with
    SELECT on the ledger is enough, and a database without a ledger has no jobs."""
    if not ledger_exists(conn):
        return []
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            """
            SELECT j.job, j.table_name AS "table", j.state, j.model, j.dim, j.error,
                   count(c.chunk) AS chunks_total,
                   count(c.chunk) FILTER (WHERE c.state = 'done') AS chunks_done,
                   count(c.chunk) FILTER (WHERE c.state = 'failed') AS chunks_failed,
                   coalesce(sum(c.rows_written), 0) AS rows_written,
                   coalesce(sum(c.rejected), 0) AS rejected,
                   j.started, j.finished,
                   extract(epoch FROM now() - coalesce(
                       (SELECT max(heartbeat) FROM embedfleet.workers w WHERE w.job = j.job), j.started)) AS idle_s,
                   (SELECT coalesce(jsonb_agg(jsonb_build_object('chunk', f.chunk, 'source', f.source,
                                                                 'error', f.error) ORDER BY f.chunk), '[]')
                      FROM embedfleet.chunks f WHERE f.job = j.job AND f.state = 'failed') AS failures
              FROM embedfleet.jobs j LEFT JOIN embedfleet.chunks c ON c.job = j.job
             WHERE %(job)s::text IS NULL OR j.job = %(job)s
             GROUP BY j.job ORDER BY j.created
            """,
            {"job": job},
        ).fetchall()
    out = []
    for r in rows:
        state = r["state"]
        if state == "running" and r["idle_s"] is not None and float(r["idle_s"]) > STALE_SECONDS:
            state = "interrupted"  # no worker has beaten for a while: rerun the same command to resume
        out.append({
            "job": r["job"], "table": r["table"], "state": state,
            "chunks_total": int(r["chunks_total"]), "chunks_done": int(r["chunks_done"]),
            "rows_written": int(r["rows_written"]), "rejected": int(r["rejected"]),
            "started": r["started"].isoformat() if r["started"] else None,
            "finished": r["finished"].isoformat() if r["finished"] else None,
            "chunks_failed": int(r["chunks_failed"]), "model": r["model"], "dim": r["dim"], "error": r["error"],
            "failures": r["failures"],
        })
    return out
