"""Reading back what was stored: nearest-neighbour search and integrity checks."""

from __future__ import annotations

import math

import numpy as np
import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from embedfleet.errors import DatabaseError, InputError
from embedfleet.store.schema import embedding_info, ledger_exists, table_sql


def table_model(conn: psycopg.Connection, table: str) -> str | None:
    """The model as the user named it for the newest job that wrote `table` (None: the default),
    so a query is embedded by the same model resolution as the documents were."""
    if not ledger_exists(conn):
        return None
    row = conn.execute(
        "SELECT config->>'model' FROM embedfleet.jobs WHERE table_name = %s ORDER BY created DESC LIMIT 1",
        [table],
    ).fetchone()
    return row[0] if row else None


def search(conn: psycopg.Connection, table: str, query_vec: np.ndarray, k: int = 10,
           where: str | None = None, ef_search: int | None = None) -> list[dict]:
    """Top-k by cosine distance. `where` is the user's own SQL: it runs inside a READ ONLY
    transaction with a statement timeout, so it can filter but never write."""
    vtype, dim = embedding_info(conn, table)
    if query_vec.shape[-1] != dim:
        raise DatabaseError(f"table {table!r} holds {dim}-dimensional vectors but the query has "
                            f"{query_vec.shape[-1]}: search with the model the table was built with (--model)")
    cols = [r[0] for r in conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped "
        "AND attname <> 'embedding' ORDER BY attnum",
        [table_sql(conn, table).as_string(conn)],
    ).fetchall()]
    from pgvector import Vector
    from pgvector.psycopg import register_vector

    register_vector(conn)  # the query goes over in pgvector's binary format; the SQL casts it for halfvec
    vec = Vector(query_vec.reshape(-1).astype(np.float32))
    stmt = sql.SQL(
        "SELECT {cols}, embedding <=> %(q)s::{vt} AS distance FROM {t} {where} "
        "ORDER BY embedding <=> %(q)s::{vt} LIMIT %(k)s"
    ).format(
        cols=sql.SQL(", ").join(map(sql.Identifier, cols)),
        vt=sql.SQL(vtype),
        t=table_sql(conn, table),
        where=sql.SQL("WHERE ({})").format(sql.SQL(where)) if where else sql.SQL(""),
    )
    with conn.cursor(row_factory=dict_row) as cur:
        try:
            with conn.transaction():
                cur.execute("SET TRANSACTION READ ONLY")
                cur.execute("SET LOCAL statement_timeout = '60s'")
                if ef_search:
                    cur.execute(sql.SQL("SET LOCAL hnsw.ef_search = {}").format(sql.Literal(int(ef_search))))
                rows = cur.execute(stmt, {"q": vec, "k": k}).fetchall()
        except (psycopg.errors.SyntaxError, psycopg.errors.UndefinedColumn, psycopg.errors.UndefinedFunction,
                psycopg.errors.ReadOnlySqlTransaction, psycopg.errors.DatatypeMismatch,
                psycopg.errors.InvalidTextRepresentation) as e:
            raise InputError(f"--where {where!r}: {e.diag.message_primary}") from None
    out = []
    for r in rows:
        d = {"id": r.pop("id"), "distance": float(r.pop("distance")), "content": r.pop("content")}
        d.update(r)
        out.append(d)
    return out


def verify(conn: psycopg.Connection, table: str, tol: float = 1e-3, max_ids: int = 100) -> dict:
    """Row count against the ledger, dimension, unit norms, NaN and zero vectors.
    Returns a report with `ok` and, per problem, the offending ids (at most `max_ids` each)."""
    vtype, dim = embedding_info(conn, table)
    t = table_sql(conn, table)
    norm = sql.SQL("l2_norm(embedding)" if vtype == "halfvec" else "vector_norm(embedding)")
    rows = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(t)).fetchone()[0]
    ledger_rows, jobs = conn.execute(
        "SELECT coalesce(sum(c.rows_written), 0), count(DISTINCT j.job) FROM embedfleet.jobs j "
        "LEFT JOIN embedfleet.chunks c ON c.job = j.job WHERE j.table_name = %s",
        [table],
    ).fetchone() if ledger_exists(conn) else (0, 0)
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
    count_ok = jobs == 0 or int(ledger_rows) == rows
    return {
        "table": table, "rows": rows, "ledger_rows": int(ledger_rows) if jobs else None,
        "count_matches_ledger": count_ok, "dim": dim, "vector_type": vtype,
        "problems": counts, "offending_ids": {k: v[:max_ids] for k, v in problems.items() if v},
        "ok": count_ok and not any(counts.values()),
    }
