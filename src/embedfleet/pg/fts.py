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

__all__ = ["FTS_COLUMN", "DEFAULT_CONFIG", "add_fts", "fts_config"]

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


def add_fts(conn: psycopg.Connection, name: str, config: str = DEFAULT_CONFIG) -> bool:
    """Add the full-text column and its GIN index to table `name` (a rewrite of the table and its indexes, under its
    lock: a job adds it before its HNSW index). Returns
    False where it has them already (with the same configuration; another is refused in one line)."""
    if not conn.execute("SELECT 1 FROM pg_ts_config WHERE cfgname = %s", [config]).fetchone():
        known = [r[0] for r in conn.execute("SELECT cfgname FROM pg_ts_config ORDER BY 1")]
        raise InputError(f"--fts-config {config!r}: the server has no such text search configuration "
                         f"(it has {', '.join(known)})")
    from embedfleet.pg.ddl import table_sql, vector_index
    from embedfleet.pg.index_build import maintenance_settings, table_plan

    table = table_sql(conn, name)
    have = fts_config(conn, table)
    if have is not None:
        if have != config:
            raise InputError(f"table {table.as_string(conn)} has a full-text index with --fts-config {have!r}; drop "
                             f"its column {FTS_COLUMN} to build one with {config!r}")
        return False
    col = sql.Identifier(FTS_COLUMN)
    with conn.transaction():
        if vector_index(conn, name) is not None:  # the rewrite rebuilds it: with the memory and workers it was built with
            maintenance_settings(conn, table_plan(conn, name))
        conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN {} tsvector GENERATED ALWAYS AS "
                             "(to_tsvector({}::regconfig, coalesce(content, ''))) STORED").format(
            table, col, sql.Literal(config)))
        conn.execute(sql.SQL("CREATE INDEX ON {} USING gin ({})").format(table, col))
    return True
