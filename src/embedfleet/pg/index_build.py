"""Building a table's HNSW index as fast as its server allows: maintenance_work_mem sized to the graph, a
parallel worker a core, and a partitioned table's partitions built side by side (docs/decisions/index-build.md).

pgvector builds the graph in memory while it fits in maintenance_work_mem and inserts the rest one page at a
time, many times slower; PostgreSQL gives a build workers by the table's size, not by the cores, unless the
table's `parallel_workers` says otherwise."""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import psycopg
from psycopg import sql

from embedfleet.pg.binary_code import code_bits, is_current, thresholds_of
from embedfleet.pg.ddl import (_index_expression, embedding_info, free_connections, heaps, index_key, index_plan,
                               indexes_of, table_sql)

__all__ = ["BuildPlan", "build_index", "build_plan", "create_index", "graph_mb", "maintenance_settings",
           "rebuild_index", "table_plan"]

HNSW_M = 16  # pgvector's default m: 2·m neighbours at the graph's bottom layer
# An element of pgvector's in-memory graph beside its value: header, heap tids, lock, neighbour lists of
# 16-byte entries (2·m below, m on the few upper layers).
ELEMENT_BYTES = 160 + 2 * HNSW_M * 16 + HNSW_M * 16 // (HNSW_M - 1)
HEADROOM = 1.25  # the estimate's margin: a graph one byte over maintenance_work_mem finishes page by page
MIN_MEMORY_MB = 64
REMOTE_MEMORY_MB = 8192  # the most one build asks of a server whose memory this process cannot see
MAX_SIDE_BY_SIDE = 4  # partitions built at once: enough to overlap each build's single-threaded write-out


class BuildPlan(NamedTuple):
    memory_mb: int  # maintenance_work_mem of each build
    workers: int  # parallel maintenance workers of each build (its leader works too)
    side_by_side: int  # builds at once: 1 for a table, up to MAX_SIDE_BY_SIDE for a partitioned one


def value_bytes(kind: str, dim: int, vtype: str) -> int:
    """Bytes of one indexed value as the graph holds it."""
    if kind == "bit":
        return 8 + (code_bits(dim) + 7) // 8
    return 8 + dim * (2 if kind == "halfvec" or vtype == "halfvec" else 4)


def graph_mb(rows: float, kind: str, dim: int, vtype: str) -> int:
    """maintenance_work_mem (MB) that holds the graph of `rows` elements, with HEADROOM."""
    return max(MIN_MEMORY_MB, math.ceil(rows * (ELEMENT_BYTES + value_bytes(kind, dim, vtype)) * HEADROOM / 2**20))


def build_plan(rows: list[float], kind: str, dim: int, vtype: str, cores: int, memory_mb: int) -> BuildPlan:
    """How to build the index of heaps holding `rows` each (one heap: a table; several: its partitions), on a
    server of `cores` cores that can give the builds `memory_mb` in all. Each build's graph fits its memory where
    the budget allows; side by side only as many as the budget holds; the cores shared among them."""
    each = graph_mb(max(rows, default=0), kind, dim, vtype)
    side_by_side = max(1, min(len(rows), MAX_SIDE_BY_SIDE, max(2, cores // 2) if cores > 1 else 1, memory_mb // each))
    return BuildPlan(min(each, memory_mb), max(0, cores // side_by_side - 1), side_by_side)


def _local(conn: psycopg.Connection) -> bool:
    host = conn.info.host or ""
    return host.startswith("/") or host in ("localhost", "127.0.0.1", "::1", "")


def server_resources(conn: psycopg.Connection) -> tuple[int, int]:
    """(cores, MB of memory) a build may use: this machine's where the server runs on it, less what the server
    lets parallel work have (max_parallel_workers)."""
    allowed = int(conn.execute("SELECT current_setting('max_parallel_workers')").fetchone()[0]) + 1
    if not _local(conn):
        return allowed, REMOTE_MEMORY_MB
    from embedfleet.pg.embedded import memory_bytes

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return min(cores, allowed), memory_bytes() // 2 >> 20


def _rows(conn: psycopg.Connection, oid: int) -> float:
    """The heap's rows as its statistics say (ANALYZE has run), else as its pages suggest."""
    reltuples, pages = conn.execute("SELECT reltuples, pg_relation_size(oid) / current_setting('block_size')::int "
                                    "FROM pg_class WHERE oid = %s", [oid]).fetchone()
    return reltuples if reltuples and reltuples > 0 else pages * 4.0


def maintenance_settings(conn: psycopg.Connection, plan: BuildPlan) -> None:
    """The plan's memory and workers for the index builds of the transaction `conn` is in."""
    conn.execute(sql.SQL("SET LOCAL maintenance_work_mem = {}").format(sql.Literal(f"{plan.memory_mb}MB")))
    conn.execute(sql.SQL("SET LOCAL max_parallel_maintenance_workers = {}").format(sql.Literal(plan.workers)))


def table_plan(conn: psycopg.Connection, table: str, index: str = "hnsw", side_by_side: int | None = None) -> BuildPlan:
    """The plan for building `table`'s vector index on this server; `side_by_side`: at most so many builds at once
    (1: one after another, as CREATE INDEX on a partitioned table makes them, each with all the workers)."""
    vtype, dim = embedding_info(conn, table)
    kind, _ = index_plan(dim, vtype, index)
    rows = [_rows(conn, oid) for oid, _ in heaps(conn, table)]
    if side_by_side is not None and side_by_side < len(rows):  # the largest `side_by_side` set the memory
        rows = sorted(rows, reverse=True)[:max(1, side_by_side)]
    return build_plan(rows, kind, dim, vtype, *server_resources(conn))


def create_index(conn: psycopg.Connection, heap: sql.Composable, using: sql.Composable, plan: BuildPlan) -> None:
    """CREATE INDEX on `heap` USING `using` ("hnsw (…)", "gin (…)") in a transaction of its own, with the plan's
    memory and workers. The table's `parallel_workers` (what PostgreSQL gives a build otherwise follows its size)
    is set for the build and put back before the commit; a failed parallel build (a container's small /dev/shm)
    is done again serially."""
    (options, partitioned) = conn.execute("SELECT coalesce(reloptions, '{}'), relkind = 'p' FROM pg_class "
                                          "WHERE oid = %s::regclass", [heap.as_string(conn)]).fetchone()
    own = next((o.split("=", 1)[1] for o in options if o.startswith("parallel_workers=")), None)
    set_workers = sql.SQL("ALTER TABLE {} SET (parallel_workers = {})")
    back = (sql.SQL("ALTER TABLE {} RESET (parallel_workers)").format(heap) if own is None else
            set_workers.format(heap, sql.Literal(int(own))))
    for workers in ((plan.workers, 0) if plan.workers else (0,)):
        try:
            with conn.transaction():
                maintenance_settings(conn, plan._replace(workers=workers))
                if workers and not partitioned:  # a partitioned table has no storage: its partitions' builds count
                    conn.execute(set_workers.format(heap, sql.Literal(workers)))
                conn.execute(sql.SQL("CREATE INDEX ON {} USING {}").format(heap, using))
                if workers and not partitioned:
                    conn.execute(back)
            return
        except (psycopg.errors.OutOfMemory, psycopg.errors.DiskFull):
            if not workers:
                raise


def build_index(conn: psycopg.Connection, table: str, index: str = "hnsw", dsn: str | None = None) -> BuildPlan:
    """The table's HNSW index (`index`: "hnsw" or "binary", see index_plan), built on `conn`. A partitioned
    table's partitions are indexed side by side on connections of their own where `dsn` is given (a partition
    that has its index keeps it: a build cut short resumes), then the table's index is made, which adopts them.
    Returns the plan it followed."""
    vtype, dim = embedding_info(conn, table)
    kind, _ = index_plan(dim, vtype, index)
    ident = table_sql(conn, table)
    (partitioned,) = conn.execute("SELECT relkind = 'p' FROM pg_class WHERE oid = %s::regclass",
                                  [ident.as_string(conn)]).fetchone()
    codes = _partition_codes(conn, table) if kind == "bit" and partitioned else []
    # a build cut short left partitions indexed with its thresholds: the rest take the same, so the table adopts all
    key = next((k for _, _, k, attached in codes if not attached and is_current(k, dim)), None)
    if key is not None:
        using = sql.SQL("hnsw (({}) bit_hamming_ops)").format(sql.SQL(key))
    else:  # one set of thresholds for every partition
        levels = thresholds_of(conn, ident, dim) if kind == "bit" else None
        using = sql.SQL("hnsw ({})").format(_index_expression(kind, dim, vtype, levels))
    # side by side on connections of their own: a few, and one left for anyone else
    spare = max(1, free_connections(conn) - 1) if partitioned and dsn is not None else 1
    plan = table_plan(conn, table, index, spare)
    if plan.side_by_side > 1:
        if kind == "bit":
            done = {leaf for leaf, _, k, _ in codes if k == key}
            todo = [name for _, name in heaps(conn, table) if name not in done]
        else:
            todo = [name for oid, name in heaps(conn, table) if kind not in {k for _, k in indexes_of(conn, oid)}]
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:  # idle in it meanwhile: not timed out
            conn.execute("SET LOCAL idle_in_transaction_session_timeout = 0")

        def one(leaf: str) -> None:
            with psycopg.connect(dsn, autocommit=True) as c:
                create_index(c, sql.SQL(leaf), using, plan)

        try:
            with ThreadPoolExecutor(plan.side_by_side) as pool:
                list(pool.map(one, todo))
        except psycopg.OperationalError:  # the server refused a connection: the table's CREATE INDEX builds the rest
            plan = table_plan(conn, table, index, 1)
    create_index(conn, ident, using, plan)  # a partitioned table's: adopts each partition's matching index
    for _, name, _, attached in (_partition_codes(conn, table) if codes else []):
        if not attached:  # another code's, left by a build cut short: the table's index has its own now
            conn.execute(sql.SQL("DROP INDEX {}").format(sql.SQL(name)))
    return plan


def _partition_codes(conn: psycopg.Connection, table: str) -> list[tuple[str, str, str, bool]]:
    """(partition, its index, the index's key, whether a partitioned index adopted it) of each binary index on
    `table`'s partitions; names as SQL reads them."""
    return conn.execute(
        "SELECT i.indrelid::regclass::text, i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid, 1, true), "
        "EXISTS (SELECT 1 FROM pg_inherits h WHERE h.inhrelid = i.indexrelid) FROM pg_index i "
        "JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am am ON am.oid = c.relam "
        "WHERE i.indrelid = ANY(%s::oid[]) AND am.amname = 'hnsw' AND i.indisvalid "
        "AND pg_get_indexdef(i.indexrelid) ~ 'bit_hamming_ops' ORDER BY 1, 2",
        [[oid for oid, _ in heaps(conn, table)]]).fetchall()


def rebuild_index(conn: psycopg.Connection, table: str, index: str, dsn: str | None = None) -> tuple[str, bool]:
    """The table's vector index made `index` ("hnsw" or "binary"): built unless the table has one of that kind
    (also after a rebuild cut short before its drop), then those of other kinds dropped. Returns (its name,
    whether it was built)."""
    vtype, dim = embedding_info(conn, table)
    kind, _ = index_plan(dim, vtype, index)
    have = indexes_of(conn, table)
    # a binary index coded otherwise (an earlier version's, one bit a dimension) is rebuilt like another kind
    stale = {n for n, k in have if k == "bit" and not is_current(index_key(conn, table, n), dim)}
    built = kind not in {k for n, k in have if n not in stale}
    if built:  # the old one serves searches until the new one is there
        build_index(conn, table, index, dsn)
    for other, k in have:
        if k != kind or other in stale:
            conn.execute(sql.SQL("DROP INDEX {}").format(_in_schema(conn, table, other)))
    return next(n for n, k in indexes_of(conn, table) if k == kind), built


def _in_schema(conn: psycopg.Connection, table: str, index: str) -> sql.Composable:
    """The index `index` of `table`, named in the table's schema."""
    schema = conn.execute("SELECT relnamespace::regnamespace::text FROM pg_class WHERE oid = %s::regclass",
                          [table_sql(conn, table).as_string(conn)]).fetchone()[0]
    return sql.SQL("{}.{}").format(sql.SQL(schema), sql.Identifier(index))
