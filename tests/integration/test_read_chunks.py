"""The bulk read's chunked COPY (many rows a message) against a real PostgreSQL: the same rows, in the
same order, as a plain SELECT by ctid — across ranges, with pages left empty by deletes, a --where,
text labels and halfvec, blocks put in place inline or on a thread of their own — and a one-line error
for a vector of another dimension or from the put."""

from __future__ import annotations

import time

import numpy as np
import pytest

from embedfleet.errors import DatabaseError
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
