"""Reading back what was stored: nearest-neighbour search and integrity checks.

`search_queries` is what `embedfleet search` runs (one query, or a file of them) and `Searcher` what
`embedfleet serve` keeps per table: the query's vector comes from `encode.query.QueryEncoder` (numpy on
the CPU for BERT-family models: no torch, no CUDA, no compile, no helper processes).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator

import numpy as np
import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from embedfleet.errors import DatabaseError, InputError
from embedfleet.store.schema import embedding_info, ledger_exists, table_sql, vector_index

__all__ = ["Searcher", "query_encoder", "query_lines", "run_search", "search", "search_queries", "table_model",
           "verify", "verify_together"]

QUERY_BATCH = 256  # queries embedded together in a --queries run


def table_model(conn: psycopg.Connection, table: str) -> str | None:
    """The model as the user named it for the newest job that wrote `table` (None: the default),
    so a query is embedded by the same model resolution as the documents were."""
    return _table_job(conn, table)[0]


def _table_job(conn: psycopg.Connection, table: str) -> tuple[str | None, int | None]:
    """(model, --dim) of the newest job that wrote `table`."""
    if not ledger_exists(conn):
        return None, None
    row = conn.execute(
        "SELECT config->>'model', config->>'dim' FROM embedfleet.jobs WHERE table_name = %s "
        "ORDER BY created DESC LIMIT 1",
        [table],
    ).fetchone()
    if not row:
        return None, None
    return row[0], int(row[1]) if row[1] else None


def query_encoder(conn: psycopg.Connection, table: str, model: str | None = None, device: str = "cpu"):
    """A QueryEncoder for `table`: its own model (unless `model` is given) and --dim."""
    from embedfleet.encode.query import QueryEncoder

    embedding_info(conn, table)  # fail fast on a missing table, before loading a model
    job_model, dim = _table_job(conn, table)
    return QueryEncoder(model or job_model, device=device, dim=None if model else dim)


DEFAULT_STATEMENT_TIMEOUT = 5.0  # seconds a search may run: a filter can make the server work for ever
ITERATIVE_MIN = (0, 8)  # pgvector's iterative index scans: a filtered HNSW scan goes on until it has k rows


class Searcher:
    """Top-k by cosine distance in one table, its columns, vector type and index read once.

    `scan` says how the last search found its rows: "index" (the HNSW index), "iterative" (the index, scanned
    on until k rows passed the filter), or "exact" (every row the filter keeps, measured)."""

    def __init__(self, conn: psycopg.Connection, table: str, statement_timeout: float = DEFAULT_STATEMENT_TIMEOUT):
        from pgvector.psycopg import register_vector

        self.conn, self.table, self.statement_timeout = conn, table, statement_timeout
        self.vtype, self.dim = embedding_info(conn, table)
        self.columns = [r[0] for r in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped "
            "AND attname <> 'embedding' ORDER BY attnum",
            [table_sql(conn, table).as_string(conn)],
        ).fetchall()]
        self.indexed = vector_index(conn, table) is not None
        version = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
        self.iterative = bool(version) and tuple(int(x) for x in version[0].split(".")[:2]) >= ITERATIVE_MIN
        self.scan: str | None = None
        register_vector(conn)  # the query goes over in pgvector's binary format; the SQL casts it for halfvec
        self._select = sql.SQL("SELECT {cols}, embedding <=> %(q)s::{vt} AS distance FROM {t} ").format(
            cols=sql.SQL(", ").join(map(sql.Identifier, self.columns)), vt=sql.SQL(self.vtype),
            t=table_sql(conn, table))
        self._order = sql.SQL(" ORDER BY embedding <=> %(q)s::{vt} LIMIT %(k)s").format(vt=sql.SQL(self.vtype))

    def search(self, query_vec: np.ndarray, k: int = 10, where: str | None = None,
               ef_search: int | None = None, group_by_parent: bool = False) -> list[dict]:
        """`where` is the user's own SQL: it runs inside a READ ONLY transaction with a statement
        timeout, so it can filter but never write. Whenever k rows pass it, k rows come back.
        `group_by_parent`: the best passage of each of the k nearest records (a table ingested with --passages)."""
        if not group_by_parent:
            return self._nearest(query_vec, k, where, ef_search)
        if "parent_id" not in self.columns:
            raise InputError(f"--group-by-parent: table {self.table!r} has no passages (ingest it with --passages)")
        limit = 8 * k
        while True:  # the nearest passages, more of them until they hold k distinct records (or all there are)
            rows = self._nearest(query_vec, limit, where, max(ef_search or 0, limit) if limit > 40 else ef_search)
            best: dict = {}
            for r in rows:
                best.setdefault(r["parent_id"], r)
            if len(best) >= k or len(rows) < limit:
                return list(best.values())[:k]
            limit *= 4

    def _nearest(self, query_vec: np.ndarray, k: int, where: str | None, ef_search: int | None) -> list[dict]:
        from pgvector import Vector

        if query_vec.shape[-1] != self.dim:
            raise DatabaseError(f"table {self.table!r} holds {self.dim}-dimensional vectors but the query has "
                                f"{query_vec.shape[-1]}: search with the model the table was built with (--model)")
        if k < 1:
            raise InputError(f"-k {k}: ask for at least one result")
        vec = Vector(query_vec.reshape(-1).astype(np.float32))
        # The user's SQL goes in as written: its % are escaped so that psycopg, which reads the statement for its
        # own placeholders, gives them back to the server unchanged ("title ilike '%cable%'").
        filt = sql.SQL("WHERE ({})").format(sql.SQL(where.replace("%", "%%"))) if where else sql.SQL("")
        stmt = self._select + filt + self._order
        conn = self.conn
        with conn.cursor(row_factory=dict_row) as cur:
            try:
                with conn.transaction():
                    cur.execute("SET TRANSACTION READ ONLY")
                    cur.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(
                        sql.Literal(f"{max(1, round(self.statement_timeout * 1000))}ms")))
                    if ef_search:
                        cur.execute(sql.SQL("SET LOCAL hnsw.ef_search = {}").format(sql.Literal(int(ef_search))))
                    scan = "exact" if not self.indexed else "index"
                    if where and self.indexed and self.iterative:
                        # a filter drops most of the index's candidates: scan the graph on until k rows pass it
                        cur.execute("SET LOCAL hnsw.iterative_scan = strict_order")
                        scan = "iterative"
                    rows = cur.execute(stmt, {"q": vec, "k": k}).fetchall()
                    if where and self.indexed and len(rows) < k:
                        # the index gave up before k rows passed (a rare filter): measure every row it keeps
                        cur.execute("SET LOCAL enable_indexscan = off")
                        rows = cur.execute(stmt, {"q": vec, "k": k}).fetchall()
                        scan = "exact"
            except psycopg.errors.ReadOnlySqlTransaction as e:
                raise InputError(f"--where {where!r} would write ({e.diag.message_primary}): it may only filter") from None
            except psycopg.errors.QueryCanceled as e:
                error = InputError if where else DatabaseError  # a filter's cost is the user's to change
                what = f"--where {where!r}" if where else "the search"
                raise error(f"{what}: stopped after the {self.statement_timeout:g} s statement timeout "
                            f"({e.diag.message_primary}); pass a larger --statement-timeout to wait longer") from None
            except (psycopg.errors.SyntaxError, psycopg.errors.UndefinedColumn, psycopg.errors.UndefinedFunction,
                    psycopg.errors.UndefinedTable, psycopg.errors.DatatypeMismatch, psycopg.errors.DataError,
                    psycopg.errors.FeatureNotSupported, psycopg.errors.InsufficientPrivilege,
                    psycopg.errors.ProgrammingError) as e:
                if not where:
                    raise
                raise InputError(f"--where {where!r}: {e.diag.message_primary or e}") from None
        self.scan = scan
        out = []
        for r in rows:
            d = {"id": r.pop("id"), "distance": float(r.pop("distance")), "content": r.pop("content")}
            d.update(r)
            out.append(d)
        return out


def search(conn: psycopg.Connection, table: str, query_vec: np.ndarray, k: int = 10,
           where: str | None = None, ef_search: int | None = None, group_by_parent: bool = False) -> list[dict]:
    """Top-k by cosine distance (see `Searcher.search`)."""
    return Searcher(conn, table).search(query_vec, k, where, ef_search, group_by_parent)


def search_queries(conn: psycopg.Connection, table: str, queries: Iterable[str], k: int = 10,
                   where: str | None = None, model: str | None = None, device: str = "cpu",
                   group_by_parent: bool = False, statement_timeout: float = DEFAULT_STATEMENT_TIMEOUT,
                   ) -> Iterator[tuple[str, list[dict], str]]:
    """(query, its top-k, how they were found) for each query, in order: the model loaded once, queries
    embedded QUERY_BATCH at a time (the same vectors as one at a time)."""
    encoder = query_encoder(conn, table, model, device)
    try:
        searcher = Searcher(conn, table, statement_timeout)

        def each(batch: list[str]) -> Iterator[tuple[str, list[dict], str]]:
            for text, vec in zip(batch, encoder.encode(batch)):
                results = searcher.search(vec, k, where, None, group_by_parent)
                yield text, results, searcher.scan

        batch: list[str] = []
        for q in queries:
            batch.append(q)
            if len(batch) == QUERY_BATCH:
                yield from each(batch)
                batch = []
        if batch:
            yield from each(batch)
    finally:
        encoder.close()


def run_search(dsn: str, table: str, queries: Iterable[str], k: int = 10, where: str | None = None,
               model: str | None = None, device: str = "cpu", group_by_parent: bool = False,
               statement_timeout: float = DEFAULT_STATEMENT_TIMEOUT) -> Iterator[tuple[str, list[dict], str]]:
    """`embedfleet search`: (query, its top-k, the scan) for each query, on one connection."""
    from embedfleet.store.ledger import connect

    with connect(dsn) as conn:
        yield from search_queries(conn, table, queries, k=k, where=where, model=model, device=device,
                                  group_by_parent=group_by_parent, statement_timeout=statement_timeout)


def query_lines(path: str) -> Iterator[str]:
    """The queries of a --queries file ('-': stdin), one a line, blank lines skipped; read as they go."""
    if path != "-" and not os.path.isfile(path):
        raise InputError(f"--queries {path}: no such file")
    return _lines(path)


def _lines(path: str) -> Iterator[str]:
    import sys

    f = sys.stdin if path == "-" else open(path, encoding="utf-8", errors="replace")
    try:
        for line in f:
            line = line.rstrip("\r\n")
            if line.strip():
                yield line
    finally:
        if f is not sys.stdin:
            f.close()


def verify(conn: psycopg.Connection, table: str, tol: float = 1e-3, max_ids: int = 100) -> dict:
    """Row count against the ledger, records written against rows stored (a record that replaced another's
    row of the same id was overwritten), dimension, unit norms, NaN and zero vectors.
    Returns a report with `ok` and, per problem, the offending ids (at most `max_ids` each)."""
    vtype, dim = embedding_info(conn, table)
    t = table_sql(conn, table)
    norm = sql.SQL("l2_norm(embedding)" if vtype == "halfvec" else "vector_norm(embedding)")
    rows = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(t)).fetchone()[0]
    per_job = conn.execute(
        "SELECT j.rows_before, coalesce(sum(c.rows_written), 0), coalesce(sum(c.rows_seen), 0) "
        "FROM embedfleet.jobs j LEFT JOIN embedfleet.chunks c ON c.job = j.job WHERE j.table_name = %s "
        "GROUP BY j.job ORDER BY min(j.created)", [table]).fetchall() if ledger_exists(conn) else []
    jobs = len(per_job)
    ledger_rows, records = sum(int(w) for _, w, _ in per_job), sum(int(r) for _, _, r in per_job)
    # A job's records that did not insert their id replaced a row: one the table held before the job (a later
    # job rewriting rows), else one of the job's own records (an overwrite). A ledger from before rows_before
    # was kept says so only for a table's first job.
    overwritten = sum(max(0, int(seen) - int(written) - (before if before is not None else 0 if i == 0 else seen))
                      for i, (before, written, seen) in enumerate(per_job))
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
    made = conn.execute(
        "SELECT coalesce(model, config->>'model'), config->>'prompt', config->>'passages' FROM embedfleet.jobs "
        "WHERE table_name = %s ORDER BY created DESC LIMIT 1", [table]).fetchone() if jobs else None
    return {
        "table": table, "rows": rows, "ledger_rows": int(ledger_rows) if jobs else None,
        "count_matches_ledger": count_ok, "ledger_records": int(records) if jobs else None,
        "overwritten": overwritten, "dim": dim, "vector_type": vtype,
        "problems": counts, "offending_ids": {k: v[:max_ids] for k, v in problems.items() if v},
        "model": made[0] if made else None, "prompt": made[1] if made else None,
        "passages": made[2] if made else None,
        "ok": count_ok and not overwritten and not any(counts.values()),
    }


def verify_together(conn: psycopg.Connection, tables: list[str]) -> dict:
    """Several tables meant to be searched against each other (documents, and questions embedded with the
    query prompt): each one's report, and whether they share a model and a dimension."""
    reports = [verify(conn, t) for t in tables]
    same = len({(r["model"], r["dim"]) for r in reports}) == 1
    return {"tables": reports, "same_model": same, "ok": same and all(r["ok"] for r in reports)}
