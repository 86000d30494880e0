"""Reading back what was stored: nearest-neighbour search and integrity checks.

`search_queries` is what `embedfleet search` runs (one query, or a file of them) and `Searcher` what
`embedfleet serve` keeps per table: the query's vector comes from `encode.query.QueryEncoder` (numpy on
the CPU for BERT-family models: no torch, no CUDA, no compile, no helper processes).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import numpy as np
import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from embedfleet.errors import DatabaseError, InputError, OptionError
from embedfleet.ledger import table_job
from embedfleet.pg.binary_code import query_code
from embedfleet.pg.ddl import embedding_info, index_key, index_of, table_sql
from embedfleet.pg.scan import user_filter, where_error

__all__ = ["Searcher", "query_encoder", "query_lines", "run_search", "search", "search_queries"]

QUERY_BATCH = 256  # queries embedded together in a --queries run


def query_encoder(conn: psycopg.Connection, table: str, model: str | None = None, device: str = "cpu",
                  settings=None, trust_remote_code: bool = False):
    """A QueryEncoder for `table`: its own model (unless `model` is given), --dim and --task."""
    from embedfleet.encode.query import QueryEncoder

    embedding_info(conn, table)  # fail fast on a missing table, before loading a model
    made = table_job(conn, table) or {}
    dim = int(made["requested_dim"]) if made.get("requested_dim") else None
    return QueryEncoder(model or made.get("requested"), device=device, dim=None if model else dim, settings=settings,
                        trust_remote_code=trust_remote_code, task=None if model else made.get("task"))


DEFAULT_STATEMENT_TIMEOUT = 5.0  # seconds a search may run: a filter can make the server work for ever
ITERATIVE_MIN = (0, 8)  # pgvector's iterative index scans: a filtered HNSW scan goes on until it has k rows
# A filter the planner expects to keep at most this many rows is searched exactly: measuring them all is cheap,
# and a graph walk from a far region finds such rows only where it happens to enter them.
EXACT_MATCHES = 20_000
# An iterative scan visits at most MAX_SCAN_TUPLES rows (pgvector's own default, set on each scan). A filter that
# drops more rows than that can leave every row the walk visits dropped, when the query lies among them, and the
# walk then hands back far rows that passed (docs/decisions/filtered-search.md). A table of at most EXACT_ROWS rows
# is then measured whole: no slower than such a walk. A larger one's walk is checked against a sample holding about
# SAMPLE_ROWS rows that pass: one nearer than the walk's kth shows the walk stopped among far rows.
MAX_SCAN_TUPLES, EXACT_ROWS, SAMPLE_ROWS = 20_000, 100_000, 20_000
WALK_ROWS = 40  # rows an iterative walk hands back, the nearest k of them kept: its order is only rough
EXACT_WORKERS = 8  # parallel workers an exact scan may take from the server's pool
MAX_K = 100_000_000  # a search's rows at most: far below what a statement's LIMIT (a bigint) overflows at
# A binary-quantized index ranks by Hamming distance: its nearest --rescore rows (default RESCORE × k, at least
# RESCORE_MIN) are taken, then ranked by their full vectors' cosine distance.
RESCORE, RESCORE_MIN = 10, 40
# Hamming distances are coarse (many rows tie), so a binary index's graph walk finds its true nearest candidates
# only when it walks several times as many (docs/decisions/binary-index.md).
RESCORE_EF = 4
# hnsw.ef_search unless asked: pgvector's default walks too little of a large graph for the recall users expect,
# and it never hands over more rows than ef_search, so a larger k gets at least k (docs/decisions/index-build.md)
EF_SEARCH = 200
EF_SEARCH_MAX = 1000  # pgvector's limit on hnsw.ef_search
RRF_K = 60  # reciprocal rank fusion's constant (a result's score: the sum over rankings of 1 / (RRF_K + rank))
INDEX_RECHECK_S = 5.0  # how often a searcher reads its table's index again
HYBRID_DEPTH = 50  # candidates each ranking gives a hybrid search (at least; 4 × k for a larger k)


class QueryTextError(InputError):
    """A query's own text cannot be searched (the others of a --queries file can)."""


def no_fts(table: str) -> OptionError:
    """--hybrid on a table without a full-text index: the command that adds one."""
    return OptionError("hybrid", f"table {table!r} has no full-text index; `embedfleet index --table {table} --fts` "
                       "adds one (or ingest with --fts)")

class Searcher:
    """Top-k by cosine distance in one table, its columns and vector type read once, its index again every
    INDEX_RECHECK_S (a long-lived searcher, as serve's, follows `embedfleet index` replacing it).

    `scan` says how the last search found its rows: "index" (the HNSW index), "iterative" (the index, scanned
    on until k rows passed the filter), or "exact" (every row the filter keeps, measured)."""

    def __init__(self, conn: psycopg.Connection, table: str, statement_timeout: float = DEFAULT_STATEMENT_TIMEOUT,
                 rescore: int | None = None):
        from pgvector.psycopg import register_vector

        self.conn, self.table, self.statement_timeout = conn, table, statement_timeout
        if rescore is not None and rescore < 1:
            raise InputError(f"--rescore {rescore}: take at least one candidate")
        self.rescore = rescore  # a binary index's candidates (None: RESCORE × k, at least RESCORE_MIN)
        self.vtype, self.dim = embedding_info(conn, table)
        from embedfleet.pg.fts import FTS_COLUMN, fts_config

        self.columns = [r[0] for r in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped "
            "AND attname <> 'embedding' AND attname <> %s ORDER BY attnum",
            [table_sql(conn, table).as_string(conn), FTS_COLUMN],
        ).fetchall()]
        self.fts = fts_config(conn, table_sql(conn, table))  # the full-text column's configuration (None: none)
        self._read_index()
        version = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
        self.iterative = bool(version) and tuple(int(x) for x in version[0].split(".")[:2]) >= ITERATIVE_MIN
        self.scan: str | None = None
        register_vector(conn)  # the query goes over in pgvector's binary format; the SQL casts it for halfvec
        self._select = sql.SQL("SELECT {cols}, embedding <=> %(q)s::{vt} AS distance FROM {t} ").format(
            cols=sql.SQL(", ").join(map(sql.Identifier, self.columns)), vt=sql.SQL(self.vtype),
            t=table_sql(conn, table))
        self._order = sql.SQL(" ORDER BY embedding <=> %(q)s::{vt} LIMIT %(k)s").format(vt=sql.SQL(self.vtype))
        self._table = table_sql(conn, table)

    def _read_index(self) -> None:
        """The table's vector index: whether there is one, its kind (see pg.ddl.index_plan) and, for a binary one,
        the rows' code as the index holds it and the query's by the same expression."""
        found = index_of(self.conn, self.table)
        self._code = query_code(index_key(self.conn, self.table, found[0]), self.vtype) if (
            found and found[1] == "bit") else None
        self.index_kind = found[1] if found else None
        self.indexed = found is not None
        self._index_read_at = time.monotonic()

    def statements(self, filt: sql.Composable) -> tuple[sql.Composable, sql.Composable]:
        """(the statement an index scan runs, the exact one) for a filter: they differ where the index is on an
        expression of the vectors (halfvec, or binary-quantized with a rescore by the full vectors)."""
        exact = self._select + filt + self._order
        d = sql.Literal(self.dim)
        if self.index_kind == "halfvec":
            return self._select + filt + sql.SQL(" ORDER BY embedding::halfvec({d}) <=> %(q)s::halfvec({d}) "
                                                 "LIMIT %(k)s").format(d=d), exact
        if self.index_kind == "bit":
            inner = self._select + filt + sql.SQL(" ORDER BY ({}) <~> ({}) LIMIT %(n)s").format(*self._code)
            return sql.SQL("SELECT * FROM ({}) AS candidates ORDER BY distance LIMIT %(k)s").format(inner), exact
        return exact, exact

    def explain(self, query_vec: np.ndarray, k: int = 10, where: str | None = None) -> str:
        """The plan of the statement a search's index scan runs (sequential scans off: a small table's plan would
        not show whether the index can serve it)."""
        from pgvector import Vector

        stmt = self.statements(sql.SQL("WHERE ") + _searchable(where))[0]
        with self.conn.transaction(), self.conn.cursor() as cur:
            cur.execute("SET LOCAL enable_seqscan = off")
            rows = cur.execute(sql.SQL("EXPLAIN ") + stmt, self._params(Vector(query_vec.astype(np.float32)), k)).fetchall()
        return "\n".join(r[0] for r in rows)

    def _params(self, vec, k: int) -> dict:
        return {"q": vec, "k": k, "n": max(self.rescore or max(RESCORE * k, RESCORE_MIN), k)}

    def search(self, query_vec: np.ndarray, k: int = 10, where: str | None = None,
               ef_search: int | None = None, group_by_parent: bool = False, text: str | None = None,
               rrf_k: int = RRF_K) -> list[dict]:
        """`where` is the user's own SQL: it runs inside a READ ONLY transaction with a statement
        timeout, so it can filter but never write. Whenever k rows pass it, k rows come back.
        `group_by_parent`: the best passage of each of the k nearest records (a table ingested with --passages).
        `text`: a hybrid search, the vector ranking fused with the full-text ranking of `text` (see `hybrid`)."""
        if isinstance(query_vec, str):
            raise InputError("Searcher.search takes a query vector, not text: embed it first with the table's model "
                             "(Encoder(model).encode([text])[0]), or run `embedfleet search TEXT --table T`")
        _check_k(k)
        if group_by_parent and "parent_id" not in self.columns:
            raise OptionError("group-by-parent", f"table {self.table!r} has no passages (ingest it with --passages)")

        def ranked(n: int) -> list[dict]:
            if text is not None:
                return self.hybrid(query_vec, text, n, where, ef_search, rrf_k)
            return self._nearest(query_vec, n, where, ef_search)

        if not group_by_parent:
            return ranked(k)
        limit = 8 * k
        while True:  # the best passages, more of them until they hold k distinct records (or all there are)
            rows = ranked(limit)
            best: dict = {}
            for r in rows:
                best.setdefault(r["parent_id"], r)
            if len(best) >= k or len(rows) < limit:
                return list(best.values())[:k]
            limit *= 4

    @staticmethod
    def _measure_all(cur) -> None:
        """The statement after this one reads every row the filter keeps, with up to EXACT_WORKERS parallel workers
        of the server's pool beside it."""
        cur.execute("SET LOCAL enable_indexscan = off")
        cur.execute("SET LOCAL enable_seqscan = on")
        cur.execute("SELECT set_config('max_parallel_workers_per_gather', least(%s, "
                    "current_setting('max_parallel_workers')::int)::text, true)", [EXACT_WORKERS])

    def _nearer_in_sample(self, cur, filt: sql.Composable, params: dict, rows: list[dict], matching: float) -> bool:
        """Whether a sample holding about SAMPLE_ROWS of the rows that pass the filter (`matching`, the planner's
        estimate) has one that is not among the walk's rows and is nearer than the farthest of them: then the walk
        stopped among far rows. A walk that found rows far down the ranking is caught almost surely; one a few
        rows short of the exact top k may pass."""
        percent = min(100.0, 100.0 * SAMPLE_ROWS / max(matching, 1.0))
        self._arm_timeout(cur)
        stmt = (sql.SQL("SELECT 1 FROM {} TABLESAMPLE SYSTEM ({}) ").format(self._table, sql.Literal(round(percent, 6)))
                + filt + sql.SQL(" AND embedding <=> %(q)s::{} < %(kth)s AND id <> ALL(%(walked)s) LIMIT 1").format(
                    sql.SQL(self.vtype)))
        return cur.execute(stmt, {**params, "kth": max(r["distance"] for r in rows),
                                  "walked": [r["id"] for r in rows]}).fetchone() is not None

    def _matching(self, cur, filt: sql.Composable) -> float:
        """The planner's estimate of the rows a filter keeps (from the table's statistics; no row is read)."""
        plan = cur.execute(sql.SQL("EXPLAIN (FORMAT JSON) SELECT 1 FROM {} ").format(self._table) + filt, {}).fetchone()
        return float(next(iter(plan.values()))[0]["Plan"]["Plan Rows"])

    def hybrid(self, query_vec: np.ndarray, text: str, k: int = 10, where: str | None = None,
               ef_search: int | None = None, rrf_k: int = RRF_K) -> list[dict]:
        """The k best rows by reciprocal rank fusion of the vector ranking and the full-text ranking of `text`
        (`websearch_to_tsquery` over the stored tsvector, ts_rank_cd), each over its first HYBRID_DEPTH
        candidates (4 × k for a larger k). Each row has `distance`, `text_rank` (0: the text does not match it)
        and `score`."""
        from pgvector import Vector

        from embedfleet.pg.fts import FTS_COLUMN

        if self.fts is None:
            raise no_fts(self.table)
        if "\x00" in text:  # PostgreSQL's text cannot hold it
            raise QueryTextError("the query text holds a NUL character (\\x00), which PostgreSQL text cannot hold: "
                                 "remove it")
        _check_k(k)
        if rrf_k < 1:
            raise InputError(f"--rrf-k {rrf_k}: use a positive constant (60 is the usual one)")
        depth = max(HYBRID_DEPTH, 4 * k)
        by_vector = self._nearest(query_vec, depth, where, ef_search)
        scan = self.scan
        filt = sql.SQL(" AND ") + _searchable(where)
        stmt = sql.SQL(
            "SELECT {cols}, embedding <=> %(q)s::{vt} AS distance, ts_rank_cd({c}, query) AS text_rank FROM {t}, "
            "websearch_to_tsquery({cfg}::regconfig, %(text)s) AS query WHERE {c} @@ query{filt} "
            "ORDER BY text_rank DESC, id LIMIT %(k)s").format(
                cols=sql.SQL(", ").join(map(sql.Identifier, self.columns)), vt=sql.SQL(self.vtype),
                c=sql.Identifier(FTS_COLUMN), t=self._table, cfg=sql.Literal(self.fts), filt=filt)
        vec = Vector(query_vec.reshape(-1).astype(np.float32))
        with self._guarded(where) as cur:
            by_text = cur.execute(stmt, {"q": vec, "text": text, "k": depth}).fetchall()
            ranked_ids = {r["id"] for r in by_text}
            # a row the vectors found and the words match beyond the text ranking's depth: its own rank (RRF counts
            # it in the vector ranking only)
            beyond = [r["id"] for r in by_vector if r["id"] not in ranked_ids] if len(by_text) == depth else []
            text_ranks = {r["id"]: float(r["rank"]) for r in cur.execute(sql.SQL(
                "SELECT id, ts_rank_cd({c}, query) AS rank FROM {t}, websearch_to_tsquery({cfg}::regconfig, %(text)s) "
                "AS query WHERE id = ANY(%(ids)s) AND {c} @@ query").format(
                    c=sql.Identifier(FTS_COLUMN), t=self._table, cfg=sql.Literal(self.fts)),
                {"text": text, "ids": beyond}).fetchall()} if beyond else {}
        fused: dict = {}
        for rank, r in enumerate(by_vector, 1):
            fused[r["id"]] = dict(r, text_rank=text_ranks.get(r["id"], 0.0), score=1.0 / (rrf_k + rank))
        for rank, r in enumerate(by_text, 1):
            row = fused.setdefault(r["id"], dict(self._row(dict(r)), score=0.0))
            row["text_rank"] = float(r["text_rank"])
            row["score"] += 1.0 / (rrf_k + rank)
        self.scan = scan
        # equal scores (each first in one ranking): the row that matches the words first, then the nearer
        return sorted(fused.values(), key=lambda r: (-r["score"], -r["text_rank"], r["distance"]))[:k]

    def _arm_timeout(self, cur) -> None:
        cur.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(
            sql.Literal(f"{max(1, round(self.statement_timeout * 1000))}ms")))

    @contextmanager
    def _guarded(self, where: str | None):
        """A cursor (rows as dicts) in a READ ONLY transaction with the statement timeout, where the user's SQL's
        failures become one-line errors naming it."""
        conn = self.conn
        with conn.cursor(row_factory=dict_row) as cur:
            try:
                with conn.transaction():
                    cur.execute("SET TRANSACTION READ ONLY")
                    self._arm_timeout(cur)
                    yield cur
                    # rolled back, not committed: a session setting a filter slipped past the scan goes with it
                    raise psycopg.Rollback()
            except psycopg.errors.ReadOnlySqlTransaction as e:
                raise OptionError("where", f"it would write ({e.diag.message_primary}); it may only filter",
                                  where) from None
            except psycopg.errors.StatementTooComplex as e:  # a query of thousands of words, as a tsquery
                raise QueryTextError(f"the search is too complex for the server ({e.diag.message_primary}): "
                                     "shorten the query") from None
            except psycopg.errors.QueryCanceled as e:
                if "statement timeout" not in (e.diag.message_primary or ""):  # cancelled: not a timeout
                    raise DatabaseError(f"the search was cancelled on the server ({e.diag.message_primary})") from None
                detail = (f"stopped after the {self.statement_timeout:g} s statement timeout "
                          f"({e.diag.message_primary}); pass a larger --statement-timeout to wait longer")
                if where:  # a filter's cost is the user's to change
                    raise OptionError("where", detail, where) from None
                raise DatabaseError(f"the search: {detail}") from None
            except (psycopg.errors.SyntaxError, psycopg.errors.UndefinedColumn, psycopg.errors.UndefinedFunction,
                    psycopg.errors.UndefinedTable, psycopg.errors.DatatypeMismatch, psycopg.errors.DataError,
                    psycopg.errors.FeatureNotSupported, psycopg.errors.InsufficientPrivilege,
                    psycopg.errors.ProgrammingError) as e:
                if not where:
                    raise
                rest = next((c for c in ("record", "extra") if c in self.columns), None)
                hint = (f" (fields not given with --columns at ingest are in the jsonb column {rest}: "
                        f"{rest}->>'name')" if rest and isinstance(e, psycopg.errors.UndefinedColumn) else "")
                raise where_error(f"{e.diag.message_primary or e}{hint}", where) from None

    @staticmethod
    def _row(r: dict) -> dict:
        """A result: id, distance, content first, then the table's other columns."""
        d = {"id": r.pop("id"), "distance": float(r.pop("distance")), "content": r.pop("content")}
        r.pop("text_rank", None)
        d.update(r)
        return d

    def _nearest(self, query_vec: np.ndarray, k: int, where: str | None, ef_search: int | None) -> list[dict]:
        from pgvector import Vector

        if query_vec.shape[-1] != self.dim:
            raise DatabaseError(f"table {self.table!r} holds {self.dim}-dimensional vectors but the query has "
                                f"{query_vec.shape[-1]}: search with the model the table was built with (--model)")
        if time.monotonic() - self._index_read_at > INDEX_RECHECK_S:
            self._read_index()
        vec = Vector(query_vec.reshape(-1).astype(np.float32))
        filt = sql.SQL("WHERE ") + _searchable(where)
        by_index, exact = self.statements(filt)
        params = self._params(vec, k)
        with self._guarded(where) as cur:
            ef_search = max(ef_search or EF_SEARCH, k)
            if self.index_kind == "bit":  # the index must hand over every candidate the rescore takes, and better
                ef_search = max(ef_search, RESCORE_EF * params["n"])
            ef_search = min(ef_search, EF_SEARCH_MAX)  # beyond it, iterative scans and the exact fallback
            if self.indexed:
                cur.execute(sql.SQL("SET LOCAL hnsw.ef_search = {}").format(sql.Literal(int(ef_search))))
            scan = "exact" if not self.indexed else "index"
            matching = self._matching(cur, filt) if where and self.indexed else None
            plan = filtered_scan(matching, lambda: self._matching(cur, sql.SQL(""))) if matching is not None else "walk"
            if plan == "exact":  # few rows pass the filter, or the walk could stop before any: measure them all
                self._measure_all(cur)
                scan = "exact"
            elif where and self.indexed and self.iterative:
                # a filter drops most of the index's candidates: scan the graph on until k rows pass it; in relaxed
                # order, since strict order skips a row nearer than one already handed back (ranked again below)
                cur.execute("SET LOCAL hnsw.iterative_scan = relaxed_order")
                cur.execute(sql.SQL("SET LOCAL hnsw.max_scan_tuples = {}").format(sql.Literal(MAX_SCAN_TUPLES)))
                scan = "iterative"
            if scan != "exact":  # the index, as `scan` says: on a small table the planner would read every row
                cur.execute("SET LOCAL enable_seqscan = off")
            # a walk in relaxed order hands back rows roughly nearest first: the nearest k of WALK_ROWS it takes
            walk = max(k, WALK_ROWS) if scan == "iterative" else k
            rows = cur.execute(exact if scan == "exact" else by_index, {**params, "k": walk}).fetchall()
            if scan == "iterative" or (self.index_kind == "halfvec" and scan != "exact"):
                rows = sorted(rows, key=lambda r: r["distance"])[:k]  # (or ranked by halfvec distances)
            if scan != "exact" and (len(rows) < k or (
                    plan == "checked" and rows and self._nearer_in_sample(cur, filt, params, rows, matching))):
                # the index gave up before k rows passed (a filter, k past what it hands over, or a graph whose
                # walk cannot leave many equal vectors), or its walk stopped among far rows: measure every row kept
                self._measure_all(cur)
                self._arm_timeout(cur)  # each statement under its own timeout
                rows = cur.execute(exact, params).fetchall()
                scan = "exact"
        self.scan = scan
        return [self._row(r) for r in rows]


def _check_k(k: int) -> None:
    if not 1 <= k <= MAX_K:
        raise InputError(f"-k {k}: ask for at least one result" if k < 1 else
                         f"-k {k:,}: a search returns at most {MAX_K:,} rows; `embedfleet export` reads a whole table")


def filtered_scan(matching: float, rows) -> str:
    """How a filtered search finds its rows: "exact" (every row the filter keeps, measured: few pass it, or the
    walk could stop before any in a table small enough to measure), "walk" (the index's walk), or "checked" (the
    walk, which could stop short, checked against a sample). `matching`: the rows the planner expects to pass;
    `rows()`: the table's rows (asked only where it matters)."""
    if matching <= EXACT_MATCHES:
        return "exact"
    total = rows()
    if total - matching <= MAX_SCAN_TUPLES:
        return "walk"
    return "exact" if total <= EXACT_ROWS else "checked"


def _searchable(where: str | None) -> sql.Composable:
    """The rows a search ranks: those with a vector (a row written without one has no distance), that --where keeps."""
    has = sql.SQL("embedding IS NOT NULL")
    return sql.SQL("{} AND {}").format(has, user_filter(where, placeholders=True)) if where else has


def search(conn: psycopg.Connection, table: str, query_vec: np.ndarray, k: int = 10,
           where: str | None = None, ef_search: int | None = None, group_by_parent: bool = False) -> list[dict]:
    """Top-k by cosine distance (see `Searcher.search`)."""
    return Searcher(conn, table).search(query_vec, k, where, ef_search, group_by_parent)


def search_queries(conn: psycopg.Connection, table: str, queries: Iterable[str], k: int = 10,
                   where: str | None = None, model: str | None = None, device: str = "cpu",
                   group_by_parent: bool = False, statement_timeout: float = DEFAULT_STATEMENT_TIMEOUT,
                   settings=None, trust_remote_code: bool = False, hybrid: bool = False,
                   rrf_k: int | None = None, rescore: int | None = None, rerank: str | None = None,
                   rerank_depth: int | None = None) -> Iterator[tuple[str, list[dict], str, str | None]]:
    """(query, its top-k, how they were found, why it could not be searched or None) for each query, in order (a
    query whose own text cannot be searched does not stop the others): the model loaded once, queries
    embedded QUERY_BATCH at a time (the same vectors as one at a time). `hybrid`: each query's text also
    ranked by the table's full-text index, the two rankings fused (Searcher.hybrid) with `rrf_k` (None: RRF_K).
    `rerank`: a cross-encoder that reorders the first `rerank_depth` rows (query/rerank.py). A knob given
    without what it tunes is refused, not ignored."""
    from embedfleet.query.rerank import RERANK_DEPTH

    if rrf_k is not None and not hybrid:
        raise InputError(f"--rrf-k {rrf_k} tunes --hybrid's fusion: add --hybrid, or leave --rrf-k out")
    if rerank_depth is not None and not rerank:
        raise InputError(f"--rerank-depth {rerank_depth} is how many rows --rerank MODEL scores: add --rerank, "
                         "or leave --rerank-depth out")
    depth = max(RERANK_DEPTH, k) if rerank_depth is None else rerank_depth  # the default: never fewer than k
    if rerank and depth < k:
        raise InputError(f"--rerank-depth {depth}: rerank at least the k = {k} rows asked for")
    searcher = Searcher(conn, table, statement_timeout, rescore)  # a missing table fails here, before any model
    if rescore is not None and searcher.index_kind != "bit":
        raise InputError(f"--rescore {rescore} applies to a binary-quantized index, and table {table!r} has "
                         f"{'an index on the full vectors' if searcher.indexed else 'no index'}: its search ranks "
                         f"by the full vectors already (`embedfleet index --table {table} --index binary` makes one)")
    if hybrid and searcher.fts is None:  # said before a model is loaded
        raise no_fts(table)
    encoder = query_encoder(conn, table, model, device, settings, trust_remote_code)
    reranker = None
    try:
        if rerank:
            from embedfleet.query.rerank import Reranker

            reranker = Reranker(rerank, device=device, trust_remote_code=trust_remote_code)

        def each(batch: list[str]) -> Iterator[tuple[str, list[dict], str, str | None]]:
            for text, vec in zip(batch, encoder.encode(batch)):
                try:
                    results = searcher.search(vec, depth if reranker else k, where, None, group_by_parent,
                                              text if hybrid else None, RRF_K if rrf_k is None else rrf_k)
                except QueryTextError as e:
                    yield text, [], searcher.scan, str(e)
                    continue
                if reranker is not None:
                    results = reranker.rerank(text, results, k)
                yield text, results, searcher.scan, None

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
               statement_timeout: float = DEFAULT_STATEMENT_TIMEOUT, settings=None,
               trust_remote_code: bool = False, hybrid: bool = False,
               rrf_k: int | None = None, rescore: int | None = None, rerank: str | None = None,
               rerank_depth: int | None = None) -> Iterator[tuple[str, list[dict], str, str | None]]:
    """`embedfleet search`: (query, its top-k, the scan, an error of its own or None) for each query, on one
    connection."""
    from embedfleet.pg.connect import connect

    with connect(dsn) as conn:
        yield from search_queries(conn, table, queries, k=k, where=where, model=model, device=device,
                                  group_by_parent=group_by_parent, statement_timeout=statement_timeout,
                                  settings=settings, trust_remote_code=trust_remote_code, hybrid=hybrid,
                                  rrf_k=rrf_k, rescore=rescore, rerank=rerank, rerank_depth=rerank_depth)


def query_lines(path: str) -> Iterator[str]:
    """The queries of a --queries file ('-': stdin), one a line, blank lines skipped; read as they go."""
    if path != "-" and not os.path.isfile(path):
        raise InputError(f"--queries {path}: {'a directory, not a file' if os.path.isdir(path) else 'no such file'}")
    return _nonempty(path, _lines(path))


def _nonempty(path: str, lines: Iterator[str]) -> Iterator[str]:
    """The lines, or one line saying there were none (an empty file printed nothing and exited 0)."""
    first = next(lines, None)
    if first is None:
        raise InputError(f"--queries {path}: no queries in it (one a line)")
    yield first
    yield from lines


def _lines(path: str) -> Iterator[str]:
    import io
    import sys

    # bytes that are not UTF-8 become U+FFFD, from a file or stdin alike (whose own decoding may keep them as
    # lone surrogates, which nothing downstream can encode)
    f = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace") if path == "-" else \
        open(path, encoding="utf-8", errors="replace")
    try:
        for line in f:
            line = line.rstrip("\r\n")
            if line.strip():
                yield line
    finally:
        if path == "-":
            f.detach()  # stdin stays open
        else:
            f.close()
