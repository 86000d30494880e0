"""A table's full-text index for hybrid search: a stored tsvector of `content` and its GIN index.

The column (`content_tsv`, GENERATED ALWAYS AS to_tsvector(CONFIG, content) STORED) keeps itself current for rows
written later (reruns, sync); its generation expression records the text search configuration, which searches
read back (`fts_config`), so a query is parsed the way the rows were.
"""

from __future__ import annotations

import re

import psycopg
from psycopg import sql

from embedfleet.errors import InputError

__all__ = ["FTS_COLUMN", "DEFAULT_CONFIG", "add_fts", "check_fts_config", "fts_config"]

FTS_COLUMN = "content_tsv"
DEFAULT_CONFIG = "simple"


def fts_config(conn: psycopg.Connection, table: sql.Composable) -> str | None:
    """The text search configuration of `table`'s full-text column, or None where it has none."""
    row = conn.execute(
        "SELECT pg_get_expr(d.adbin, d.adrelid) FROM pg_attribute a JOIN pg_attrdef d ON d.adrelid = a.attrelid "
        "AND d.adnum = a.attnum WHERE a.attrelid = %s::regclass AND a.attname = %s AND NOT a.attisdropped",
        [table.as_string(conn), FTS_COLUMN]).fetchone()
    if row is None:
        return None
    found = re.search(r"'([^']+)'::regconfig", row[0])
    return found.group(1) if found else DEFAULT_CONFIG


def check_fts_config(conn: psycopg.Connection, name: str, config: str) -> None:
    """One line where table `name` has a full-text column in another configuration than `config` (before a job
    writes anything: its finish could not build the index it asks for)."""
    from embedfleet.pg.ddl import table_sql

    table = table_sql(conn, name)
    _check_same(conn, table, fts_config(conn, table), config)


def _check_same(conn: psycopg.Connection, table: sql.Composable, have: str | None, config: str) -> None:
    if have is not None and have != config:
        raise InputError(f"table {table.as_string(conn)} has a full-text index with --fts-config {have!r}; drop "
                         f"its column {FTS_COLUMN} to build one with {config!r}, or leave --fts-config out to keep it")


def fts_column(config: str) -> sql.Composable:
    """The full-text column's definition: `content`'s tsvector in `config`, kept by the server as rows change."""
    return sql.SQL("{} tsvector GENERATED ALWAYS AS (to_tsvector({}::regconfig, coalesce(content, ''))) STORED").format(
        sql.Identifier(FTS_COLUMN), sql.Literal(config))


def _gin_indexed(conn: psycopg.Connection, table: sql.Composable) -> bool:
    return conn.execute(
        "SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am am ON am.oid = c.relam "
        "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s::regclass "
        "AND am.amname = 'gin' AND a.attname = %s", [table.as_string(conn), FTS_COLUMN]).fetchone() is not None


def add_fts(conn: psycopg.Connection, name: str, config: str | None = None) -> tuple[bool, str]:
    """Give table `name` the full-text column and its GIN index, with the memory and workers of an HNSW build. A
    table made with the column (`ingest --fts`) only needs the index; adding the column rewrites the table and its
    indexes under its lock. `config` None: the table's recorded configuration, else DEFAULT_CONFIG. Returns
    (whether anything was added: not where it has both already, with the same configuration; another is refused
    in one line), the configuration)."""
    from embedfleet.pg.ddl import table_sql
    from embedfleet.pg.index_build import create_index, maintenance_settings, table_plan

    if config is not None and not conn.execute("SELECT 1 FROM pg_ts_config WHERE cfgname = %s", [config]).fetchone():
        known = [r[0] for r in conn.execute("SELECT cfgname FROM pg_ts_config ORDER BY 1")]
        raise InputError(f"--fts-config {config!r}: the server has no such text search configuration "
                         f"(it has {', '.join(known)})")
    table = table_sql(conn, name)
    with conn.transaction():  # under the lock of a job's finish: two finishing together build one index
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"embedfleet.finish.{table.as_string(conn)}"])
        have = fts_config(conn, table)
        config = config or have or DEFAULT_CONFIG
        _check_same(conn, table, have, config)
        if have is not None and _gin_indexed(conn, table):
            return False, config
        plan = table_plan(conn, name, side_by_side=1)
        if have is None:
            maintenance_settings(conn, plan)  # the rewrite rebuilds the table's indexes
            conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN {}").format(table, fts_column(config)))
        create_index(conn, table, sql.SQL("gin ({})").format(sql.Identifier(FTS_COLUMN)), plan)
    return True, config
