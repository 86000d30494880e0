"""A table made as hash partitions (`ingest --partitions`): made, checked and finished on a real server."""

from __future__ import annotations

import psycopg
import pytest

from embedfleet.errors import DatabaseError, InputError
from embedfleet.pg.ddl import (
    check_partitions,
    ensure_table,
    ensure_vector,
    finish_table,
    partition_count,
)


def _loaded(conn, table: str, partitions: int | None, rows: int = 3000) -> None:
    ensure_vector(conn)
    ensure_table(conn, table, [], 8, "vector", partitions)
    conn.execute(f"INSERT INTO {table} (id, content, embedding) SELECT 'r' || g, 'text ' || g, "
                 "array_fill(g::real, ARRAY[8])::vector FROM generate_series(1, %s) g", [rows])


def _stats(conn, name: str, inherited: bool = False) -> int:
    return conn.execute("SELECT count(*) FROM pg_stats WHERE tablename = %s AND inherited = %s",
                        [name, inherited]).fetchone()[0]


def test_a_partitioned_tables_partitions_are_analyzed_side_by_side_then_the_whole(dsn, conn, monkeypatch):
    _loaded(conn, "pt", 3)
    opened, connect = [], psycopg.connect
    monkeypatch.setattr(psycopg, "connect", lambda *a, **kw: opened.append(a) or connect(*a, **kw))
    timings = {}
    assert finish_table(conn, "pt", index=False, timings=timings, dsn=dsn) is None
    side_by_side = conn.info.server_version >= 180000  # ANALYZE ONLY: the whole without its partitions again
    assert len(opened) == (3 if side_by_side else 0) and timings["analyze_s"] >= 0
    for i in range(3):
        options, tuples = conn.execute("SELECT reloptions, reltuples FROM pg_class WHERE oid = %s::regclass",
                                       [f"pt_p{i}"]).fetchone()
        assert options == ["toast_tuple_target=8160"] and tuples > 0 and _stats(conn, f"pt_p{i}") > 0
    assert _stats(conn, "pt", inherited=True) > 0 and partition_count(conn, "pt") == 3
    assert conn.execute("SELECT sum(reltuples) FROM pg_class WHERE relname LIKE 'pt_p_'").fetchone()[0] == 3000


def test_without_a_dsn_or_partitions_one_analyze_on_the_connection(dsn, conn, monkeypatch):
    _loaded(conn, "pq", 2)
    _loaded(conn, "plain", None)
    opened, connect = [], psycopg.connect
    monkeypatch.setattr(psycopg, "connect", lambda *a, **kw: opened.append(a) or connect(*a, **kw))
    finish_table(conn, "pq", index=False)
    finish_table(conn, "plain", index=False, dsn=dsn)
    assert opened == []
    assert _stats(conn, "pq_p0") > 0 and _stats(conn, "pq", inherited=True) > 0 and _stats(conn, "plain") > 0
    assert conn.execute("SELECT reloptions FROM pg_class WHERE oid = 'plain'::regclass").fetchone()[0] == [
        "toast_tuple_target=8160"]


def test_hash_partitions_take_every_id_and_a_name_past_63_bytes_is_refused_first(conn):
    _loaded(conn, "spread", 4, rows=400)
    counts = [conn.execute(f"SELECT count(*) FROM spread_p{i}").fetchone()[0] for i in range(4)]
    assert sum(counts) == 400 and min(counts) > 40
    check_partitions(conn, "spread", 4)  # exists with as many: resumed into
    check_partitions(conn, "spread", None)
    with pytest.raises(InputError, match="63-byte limit"):
        check_partitions(conn, "y" * 61, 10)  # its last partition, y…_p9, would take 64 bytes
    check_partitions(conn, "y" * 60, 10)
    # an unqualified table's partitions go to the first schema of the search path: a name elsewhere is no clash
    conn.execute("CREATE SCHEMA side")
    conn.execute("CREATE TABLE side.lone_p0 (x int)")
    conn.execute("SET search_path = public, side")
    check_partitions(conn, "lone", 2)
    conn.execute("CREATE TABLE public.lone_p1 (x int)")
    with pytest.raises(DatabaseError, match="table 'public.lone_p1' already exists"):
        check_partitions(conn, "lone", 2)


def test_where_partitions_cannot_be_sampled_side_by_side_the_whole_is_analyzed_on_the_connection(
        dsn, conn, monkeypatch):
    """Before PostgreSQL 18 (no ANALYZE ONLY), with no connection to spare, or when the server refuses one."""
    from embedfleet.pg import ddl as schema

    opened, connect = [], psycopg.connect
    monkeypatch.setattr(psycopg, "connect", lambda *a, **kw: opened.append(a) or connect(*a, **kw))
    for table, patch in (("old", "version"), ("busy", "connections"), ("refused", "refused")):
        _loaded(conn, table, 3, rows=600)
        with monkeypatch.context() as m:
            if patch == "version":
                m.setattr(type(conn.info), "server_version", property(lambda self: 170000))
            elif patch == "connections":
                m.setattr(schema, "free_connections", lambda c: 2)  # one to spare: not side by side
            else:
                def refuse(*a, **kw):
                    raise psycopg.OperationalError("sorry, too many clients already")

                m.setattr(psycopg, "connect", refuse)
            finish_table(conn, table, index=False, dsn=dsn)
        assert opened == [], patch
        assert all(_stats(conn, f"{table}_p{i}") > 0 for i in range(3)) and _stats(conn, table, inherited=True) > 0
        assert conn.execute("SELECT count(*) FROM pg_class WHERE relname LIKE %s AND "
                            "'autovacuum_enabled=off' = ANY(reloptions)", [f"{table}_p_"]).fetchone()[0] == 0
