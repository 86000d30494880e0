"""The bulk read's chunked COPY (many rows a message) against a real PostgreSQL: the same rows, in the
same order, as a plain SELECT by ctid — across ranges, with pages left empty by deletes, a --where,
text labels and halfvec, blocks put in place inline or on a thread of their own — and a one-line error
for a vector of another dimension or from the put."""

from __future__ import annotations

import time

import numpy as np
import pytest

from embedfleet.errors import DatabaseError
from embedfleet.pg.ddl import heap_pages
from embedfleet.train import read as readmod
from embedfleet.train.read import TableRead, describe

DIM = 8


def _table(conn, name: str, vtype: str = "vector", rows: int = 3000):
    conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    conn.execute(f"CREATE TABLE {name} (id text, embedding {vtype}({DIM}), genre text, pad text, p int, n int)")
    # wide rows (pad) spread them over many heap pages; ids carry multi-byte characters
    conn.execute(
        f"INSERT INTO {name} SELECT 'é-' || i || repeat('x', i % 7), "
        f"(SELECT array_agg(((i * 31 + j) % 97)::real / 97) FROM generate_series(1, {DIM}) j)::{vtype}({DIM}), "
        f"(ARRAY['a', 'b', 'c'])[1 + i % 3], repeat('p', 700), 0, 0 FROM generate_series(1, {rows}) i")
    conn.execute(f"DELETE FROM {name} WHERE (ctid::text::point)[0]::int % 5 = 2")  # whole pages left empty


def _plain(conn, name: str, where: str = "true") -> list[tuple]:
    return conn.execute(f"SELECT id, embedding::real[], genre FROM {name} WHERE embedding IS NOT NULL AND genre "
                        f"IS NOT NULL AND ({where}) ORDER BY ctid").fetchall()


@pytest.mark.parametrize("vtype", ["vector", "halfvec"])
def test_chunks_give_the_rows_of_a_plain_select_in_order(dsn, conn, monkeypatch, vtype):
    monkeypatch.setattr(readmod, "CHUNK_BYTES", 20_000)  # chunks of a few pages: many, some of them empty
    monkeypatch.setattr(readmod, "BLOCK_ROWS", 97)  # many blocks a range: the put's buffers taken in turn
    _table(conn, "c", vtype)
    # columns named p and n, and a --where on them: nothing in the chunk's query may take their place
    for where, connections, chunked, ahead in (
            (None, 1, True, True), (None, 1, True, False), (None, 3, True, True),
            ("genre <> 'b' AND p = 0 AND n = 0", 2, True, True),
            ("genre <> 'b'", 2, False, True), (None, 1, False, False)):  # False: a message a row
        source = describe(conn, "c", "genre", where, "classify")
        with TableRead(dsn, source, connections=connections) as r:
            assert 1 < r.chunk_pages < 10 and r.ahead == (connections == 1)
            r.chunked, r.ahead = chunked, ahead
            plan = r.plan(parts=connections)
            got = np.zeros((plan.n, DIM), np.float32)

            def put(o, v, got=got):
                if o % 5 == 0:
                    time.sleep(0.002)  # a slow put: a buffer the read reused too early would show
                got[o:o + len(v)] = v

            cols = r.read(plan, put)
        want = _plain(conn, "c", where or "true")
        assert len(plan.ranges) == connections and plan.n == len(want) > 1000
        assert list(cols.ids) == [w[0] for w in want]
        assert np.array_equal(got, np.array([w[1] for w in want], np.float32))
        assert [plan.classes[i] for i in cols.labels.tolist()] == [w[2] for w in want]
        assert np.all(np.diff(cols.tids.astype(np.int64)) > 0)  # ctid order across the ranges


@pytest.mark.parametrize("chunked", [True, False])
def test_an_error_of_the_put_on_its_thread_is_the_reads_error(dsn, conn, monkeypatch, chunked):
    monkeypatch.setattr(readmod, "BLOCK_ROWS", 50)
    monkeypatch.setattr(readmod, "CHUNK_BYTES", 20_000)
    _table(conn, "e", rows=800)
    source = describe(conn, "e", "genre", None, "classify")
    seen = []

    def put(o, v):
        seen.append(o)
        if len(seen) == 3:
            raise DatabaseError("the destination is full")

    with TableRead(dsn, source) as r:
        assert r.ahead  # one connection: the put runs on its own thread
        r.chunked = chunked
        plan = r.plan()
        with pytest.raises(DatabaseError, match="^the destination is full$"):
            r.read(plan, put)
    assert len(seen) == 3  # no block put after the failed one
    assert conn.execute("SELECT count(*) FROM e").fetchone()[0] > 0  # the server is fine


@pytest.mark.parametrize("chunked", [True, False])
def test_a_vector_of_another_dimension_is_a_one_line_error(dsn, conn, chunked):
    conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    conn.execute("CREATE TABLE mixed (id text, embedding vector, rating real)")
    conn.execute("INSERT INTO mixed SELECT 'r' || i, '[1,2,3]', 1 FROM generate_series(1, 50) i")
    conn.execute("INSERT INTO mixed VALUES ('odd', '[1,2,3,4]', 1)")
    source = describe(conn, "mixed", "rating", None, "regress")
    with TableRead(dsn, source) as r:
        r.chunked = chunked  # both paths say the same, whichever this host's cores choose
        plan = r.plan()
        with pytest.raises(DatabaseError, match=r"table 'mixed': vec: a value of 20 bytes where 16 were expected "
                                                r"\(a vector of another dimension\?\)") as e:
            r.read(plan, lambda o, v: None)
    assert "\n" not in str(e.value)


def test_a_chunk_spans_about_the_same_bytes_whatever_the_rows_a_page():
    from embedfleet.train.read import Source, chunk_pages

    inline = Source(table="t", column="embedding", vtype="vector", dim=384, id_column="id")
    assert 50 <= chunk_pages(inline, None) <= 80  # ~5 rows of 1.6 kB a page: ~64 pages
    assert chunk_pages(inline, 5.0) == chunk_pages(inline, None)
    wide = Source(table="t", column="e", vtype="vector", dim=1024, id_column="id")
    assert chunk_pages(wide, 150.0) == 1  # vectors out of line: many rows a page


def test_a_whole_tables_counts_may_use_the_servers_parallel_workers_and_agree(dsn, conn, monkeypatch):
    """The plan's counts do not depend on order, so the server may share their scan among its
    parallel workers; the read itself never does (its order is the dataset's)."""
    import time

    from psycopg.conninfo import make_conninfo

    _table(conn, "par")
    conn.execute("UPDATE par SET genre = NULL WHERE length(id) % 4 = 0")
    source = describe(conn, "par", "genre", None, "classify")
    # a table this small would not be worth parallel workers to the planner: make them free
    cheap = make_conninfo(dsn, options="-c parallel_setup_cost=0 -c parallel_tuple_cost=0 "
                                       "-c min_parallel_table_scan_size=0")

    def launched() -> int:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        return conn.execute("SELECT parallel_workers_launched FROM pg_stat_database "
                            "WHERE datname = current_database()").fetchone()[0]

    plans, used, rows = {}, {}, {}
    for workers in (0, 4):
        monkeypatch.setattr(readmod, "PRECOUNT_WORKERS", workers)
        before = launched()
        with TableRead(cheap, source) as r:
            plans[workers] = plan = r.plan()
            for c in r.conns:  # the read that follows stays serial: its order is the dataset's
                assert c.execute("SHOW max_parallel_workers_per_gather").fetchone()[0] == "0"
            r.conns[0].execute("SELECT pg_stat_force_next_flush()")  # the leader's counts, at its next idle
            got = np.zeros((plan.n, DIM), np.float32)
            rows[workers] = (r.read(plan, lambda o, v, got=got: got.__setitem__(slice(o, o + len(v)), v)), got)
        deadline = time.monotonic() + 5
        while workers and launched() == before and time.monotonic() < deadline:
            time.sleep(0.05)  # a closed backend's statistics reach the view moments later
        used[workers] = launched() - before
    serial, parallel = plans[0], plans[4]
    assert (parallel.counts, parallel.classes, parallel.skipped_null_label) == \
           (serial.counts, serial.classes, serial.skipped_null_label)
    assert serial.skipped_null_label > 500 and serial.classes == ["a", "b", "c"]
    assert used[0] == 0 and used[4] > 0  # the count went parallel when allowed
    (cols0, x0), (cols4, x4) = rows[0], rows[4]
    assert list(cols0.ids) == list(cols4.ids) and np.array_equal(x0, x4)  # the read itself: the same order


def test_pgvector_installed_outside_the_search_path_reads(dsn, conn):
    """Supabase and others install extensions in a schema of their own: the read names the vector's send
    function by the schema the catalog gives, not by the search path."""
    conn.execute("CREATE SCHEMA extensions")
    conn.execute("CREATE EXTENSION vector SCHEMA extensions")
    conn.execute("CREATE TABLE elsewhere (id text, embedding extensions.vector, rating real)")  # no dimension
    conn.execute("INSERT INTO elsewhere SELECT 'r' || i, ('[' || i || ',2,3]')::extensions.vector, i % 2 "
                 "FROM generate_series(1, 40) i")
    assert conn.execute("SELECT to_regproc('vector_send')").fetchone()[0] is None  # not on the search path
    source = describe(conn, "elsewhere", "rating", None, "classify")
    assert source.send == ("extensions", "vector_send") and source.dim == 3
    got = []
    with TableRead(dsn, source) as r:
        plan = r.plan()
        r.read(plan, lambda o, v: got.append(v.astype(np.float32)))
    assert np.concatenate(got)[:, 0].tolist() == list(range(1, 41))


def test_a_partitioned_tables_ranges_split_its_rows_and_give_each_once(dsn, conn, monkeypatch):
    """Hash partitions share a ctid's page numbers: the ranges split the largest partition's pages (the parent
    has none), each reading those pages of every partition, in chunks of a few pages, every row once."""
    monkeypatch.setattr(readmod, "CHUNK_BYTES", 20_000)
    _table(conn, "flat")
    conn.execute("CREATE TABLE pc (LIKE flat) PARTITION BY HASH (id)")
    for i in range(4):
        conn.execute(f"CREATE TABLE pc_{i} PARTITION OF pc FOR VALUES WITH (MODULUS 4, REMAINDER {i})")
    conn.execute("INSERT INTO pc SELECT * FROM flat")
    conn.execute("ANALYZE pc")
    source = describe(conn, "pc", "genre", None, "classify")
    with TableRead(dsn, source, connections=3) as r:
        assert 1 < r.chunk_pages < 10
        plan = r.plan(parts=3)
        got = np.zeros((plan.n, DIM), np.float32)
        cols = r.read(plan, lambda o, v: got.__setitem__(slice(o, o + len(v)), v))
        # the stream tier's windows: rows of every partition in any order, found by their tids, back in that order
        assert len(np.unique(cols.tids >> readmod.HEAP_SHIFT)) == 4 and len(np.unique(cols.tids)) == plan.n
        pick = np.random.default_rng(5).permutation(plan.n)[:plan.n // 2]
        again = np.zeros((len(pick), DIM), np.float32)
        r.read_vectors(cols.tids[pick], lambda o, v: again.__setitem__(slice(o, o + len(v)), v), chunk=500)
        assert np.array_equal(again, got[pick])
    want = {w[0]: w for w in _plain(conn, "pc")}
    assert len(plan.ranges) == 3 and min(plan.counts) > plan.n / 6 and plan.n == len(want) > 1000
    assert sorted(cols.ids) == sorted(want)
    assert np.array_equal(got, np.array([want[i][1] for i in cols.ids], np.float32))
    # the page space: the largest partition's pages, all of their rows over them; a partition is one heap
    sizes = conn.execute("SELECT pg_relation_size(relid) / 8192, reltuples, relpages FROM pg_partition_tree('pc') "
                         "JOIN pg_class c ON c.oid = relid WHERE isleaf ORDER BY relid::regclass::text").fetchall()
    pages, per_page = heap_pages(conn, "pc")
    assert pages == max(p for p, _, _ in sizes) and per_page == pytest.approx(
        sum(t for _, t, _ in sizes) / max(r for _, _, r in sizes))
    assert heap_pages(conn, "pc_0") == (sizes[0][0], pytest.approx(sizes[0][1] / sizes[0][2]))
    # with no id column the ids are the row's place, which needs its partition's name to be one row's
    conn.execute("CREATE TABLE pn (LIKE flat) PARTITION BY LIST (genre)")
    for g in "abc":
        conn.execute(f"CREATE TABLE pn_{g} PARTITION OF pn FOR VALUES IN ('{g}')")
    conn.execute("INSERT INTO pn SELECT * FROM flat")
    conn.execute("ALTER TABLE pn DROP COLUMN id")
    with TableRead(dsn, describe(conn, "pn", "genre", None, "classify"), connections=2) as r:
        ids = r.read(r.plan(parts=2), None).ids
    assert len(set(ids)) == len(ids) == len(want)


def test_a_parent_by_inheritance_reads_its_childrens_rows_once(dsn, conn, monkeypatch):
    monkeypatch.setattr(readmod, "CHUNK_BYTES", 20_000)
    _table(conn, "ih", rows=1500)
    conn.execute("CREATE TABLE ih_child () INHERITS (ih)")
    conn.execute("INSERT INTO ih_child SELECT 'c' || id, embedding, genre, pad, p, n FROM ih")
    conn.execute("ANALYZE ih")
    conn.execute("ANALYZE ih_child")
    source = describe(conn, "ih", "genre", None, "classify")
    assert source.several_heaps and not describe(conn, "ih_child").several_heaps
    with TableRead(dsn, source, connections=3) as r:
        plan = r.plan(parts=3)
        cols = r.read(plan, None)
    want = [w[0] for w in _plain(conn, "ih")]
    assert len(plan.ranges) == 3 and min(plan.counts) > 0 and sorted(cols.ids) == sorted(want)
    assert len(want) == 2 * conn.execute("SELECT count(*) FROM ONLY ih").fetchone()[0] > 2000
