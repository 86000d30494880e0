"""Checking what was stored: a table's rows against the ledger, its vectors' dimension and norms."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import NamedTuple

import psycopg
from psycopg import sql

from embedfleet.ledger import ledger_exists
from embedfleet.pg.ddl import embedding_info, spellings, table_sql

__all__ = ["verify", "verify_together"]

_END = datetime.max.replace(tzinfo=timezone.utc)  # an unfinished job's end


def verify(conn: psycopg.Connection, table: str, tol: float = 1e-3, max_ids: int = 100) -> dict:
    """Row count against the ledger, records written against rows stored (a record that replaced another's
    row of the same id was overwritten), dimension, unit norms, NaN and zero vectors.
    Returns a report with `ok` and, per problem, the offending ids (at most `max_ids` each)."""
    vtype, dim = embedding_info(conn, table)
    t = table_sql(conn, table)
    norm = sql.SQL("l2_norm(embedding)" if vtype == "halfvec" else "vector_norm(embedding)")
    rows = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(t)).fetchone()[0]
    names = spellings(conn, table)  # the jobs that wrote it, however they spelled it (`t`, `public.t`)
    per_job = [JobCounts(*r) for r in conn.execute(
        "SELECT j.rows_before, coalesce(sum(c.rows_written), 0)::bigint, coalesce(sum(c.rows_seen), 0)::bigint, "
        "j.created, coalesce(j.started, j.created), j.finished "
        "FROM embedfleet.jobs j LEFT JOIN embedfleet.chunks c ON c.job = j.job WHERE j.table_name = ANY(%s) "
        "GROUP BY j.job ORDER BY min(j.created)", [names])] if ledger_exists(conn) else []
    jobs = len(per_job)
    ledger_rows, records = sum(j.written for j in per_job), sum(j.seen for j in per_job)
    # rows its first job found (written before the ledger knew the table, or by a job since removed)
    rows_before_jobs = (per_job[0].before or 0) if per_job else 0
    overwritten = overwritten_records(per_job)
    # One scan computes every per-row check.
    bad = conn.execute(
        sql.SQL(
            "SELECT id, embedding IS NULL, vector_dims(embedding), {norm} "
            "FROM {t} WHERE embedding IS NULL OR vector_dims(embedding) <> %(dim)s "
            "OR NOT ({norm} BETWEEN 1 - %(tol)s AND 1 + %(tol)s)"
        ).format(norm=norm, t=t),
        {"dim": dim, "tol": tol},
    ).fetchall()
    problems: dict[str, list[str]] = {"null": [], "wrong_dimension": [], "nan": [], "zero": [], "not_unit_norm": []}
    for id_, is_null, dims, n in bad:
        if is_null:
            kind = "null"
        elif dims != dim:
            kind = "wrong_dimension"
        elif n is None or math.isnan(n):
            kind = "nan"
        elif n == 0:
            kind = "zero"
        else:
            kind = "not_unit_norm"
        problems[kind].append(id_)
    counts = {k: len(v) for k, v in problems.items()}
    sync = _sync_of(conn, names) if jobs else None
    # a synced table (or one synced until `sync --uninstall`) follows its source, not its backfill's count: the
    # ledger's rows say nothing of it
    followed = sync is not None or bool(jobs) and conn.execute(
        "SELECT bool_or(coalesce((config->>'followed')::bool, false)) FROM embedfleet.jobs WHERE table_name = ANY(%s)",
        [names]).fetchone()[0]
    count_ok = jobs == 0 or rows_before_jobs + ledger_rows == rows or followed  # (no job: nothing to compare)
    made = conn.execute(
        "SELECT coalesce(model, config->>'model'), config->>'prompt', config->>'passages', config->>'model_digest' "
        "FROM embedfleet.jobs WHERE table_name = ANY(%s) ORDER BY created DESC LIMIT 1", [names]).fetchone() \
        if jobs else None
    return {
        "table": table, "rows": rows, "ledger_rows": ledger_rows if jobs else None,
        "rows_before_jobs": rows_before_jobs if jobs else None,
        "count_matches_ledger": None if followed or not jobs else count_ok,
        "ledger_records": records if jobs else None, "sync": sync,
        "overwritten": overwritten, "dim": dim, "vector_type": vtype,
        "problems": counts, "offending_ids": {k: v[:max_ids] for k, v in problems.items() if v},
        "model": made[0] if made else None, "prompt": made[1] if made else None,
        "passages": made[2] if made else None, "model_digest": made[3] if made else None,
        "ok": count_ok and not overwritten and not any(counts.values()),
    }


class JobCounts(NamedTuple):
    before: int | None  # rows the table held when the job was planned (None: a ledger from before it was kept)
    written: int  # ids the job inserted
    seen: int  # records it wrote, inserted or not
    created: datetime
    started: datetime
    finished: datetime | None


def overwritten_records(jobs: list[JobCounts]) -> int:
    """Records that replaced the row of another record of their own job (duplicate ids in its inputs), over
    `jobs` in the order they were made. A job's record that inserted nothing replaced a row it could rightly
    replace: one the table held when it was planned, or one a job running beside it inserted meanwhile; only
    what goes past those counts. A ledger from before `before` was kept says so only for a table's first job."""
    total = 0
    for i, job in enumerate(jobs):
        before = job.before if job.before is not None else 0 if i == 0 else job.seen
        beside = sum(other.written for other in jobs if other is not job and overlapped(other, job))
        total += max(0, job.seen - job.written - before - beside)
    return total


def overlapped(a: JobCounts, b: JobCounts) -> bool:
    """Whether job `a` ran at some time between `b`'s planning and its end (either unfinished: to now)."""
    return a.started <= (b.finished or _END) and (a.finished or _END) >= b.created


def _sync_of(conn: psycopg.Connection, names: list[str]) -> dict | None:
    """The sync that keeps the table of these `names` (its source and what is queued), or None."""
    from embedfleet.ledger import sync_overview

    if conn.execute("SELECT to_regclass('embedfleet.syncs') IS NULL").fetchone()[0]:
        return None
    row = conn.execute("SELECT s.job FROM embedfleet.syncs s JOIN embedfleet.jobs j USING (job) "
                       "WHERE j.table_name = ANY(%s)", [names]).fetchone()
    return sync_overview(conn, row[0]) if row else None


def verify_together(conn: psycopg.Connection, tables: list[str]) -> dict:
    """Several tables meant to be searched against each other (documents, and questions embedded with the
    query prompt): each one's report, and whether they share a model and a dimension."""
    reports = [verify(conn, t) for t in tables]
    # one model: by what it computes where every job recorded it, else by its name (a ledger from before)
    by = "model_digest" if all(r["model_digest"] for r in reports) else "model"
    same = len({(r[by], r["dim"]) for r in reports}) == 1
    return {"tables": reports, "same_model": same, "ok": same and all(r["ok"] for r in reports)}
