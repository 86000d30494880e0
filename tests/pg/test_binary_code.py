"""The binary index's code (pg.binary_code), computed by a real server: the Hamming distance between two codes
is the L1 distance between the vectors' levels; a narrow vector gets thresholds up to about CODE_BITS bits, a
wide one keeps the sign alone; the thresholds are the sample's quantiles; the query's code is the index's
expression with the query in place of the column, and the planner uses the index for it (a halfvec table too)."""

from __future__ import annotations

import numpy as np
import pytest
from psycopg import sql

from embedfleet.pg.binary_code import code_bits, code_expression, quantiles, query_code, thresholds


def test_thresholds_follow_the_width():
    assert [thresholds(d) for d in (384, 768, 1024, 2000, 2688, 4000, 4096, 16000)] == [7, 4, 3, 2, 1, 1, 1, 1]
    assert code_bits(384) == 2688 and code_bits(4096) == 4096


def test_quantiles_split_each_dimension_evenly():
    rng = np.random.default_rng(0)
    sample = rng.standard_normal((20_000, 3)).astype(np.float32) * np.array([1, 10, 0.1], np.float32) + [0, 5, -1]
    q = quantiles(sample, 3)
    assert q.shape == (3, 3)
    for t, share in zip(q, (0.25, 0.5, 0.75)):
        assert np.allclose((sample < t).mean(axis=0), share, atol=0.01)
    assert not quantiles(sample, 1).any() and not quantiles(sample[:0], 3).any()  # the sign, where nothing to read


def test_hamming_distance_is_the_l1_distance_between_levels(conn):
    conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    rng = np.random.default_rng(1)
    dim = 16
    levels = np.sort(rng.standard_normal((4, dim)).astype(np.float32), axis=0)
    a, b = rng.standard_normal((2, dim)).astype(np.float32)
    code = code_expression(sql.SQL("v"), levels, dim, "vector")
    got = conn.execute(sql.SQL("SELECT ({c}) <~> ({d}), length(({c})::text) FROM (SELECT %s::vector AS v) x, "
                               "(SELECT %s::vector AS w) y").format(
        c=code, d=code_expression(sql.SQL("w"), levels, dim, "vector")), [str(a.tolist()), str(b.tolist())]).fetchone()
    level = lambda x: (x[None, :] > levels).sum(axis=0)  # noqa: E731
    assert got == (float(np.abs(level(a) - level(b)).sum()), 4 * dim)
    plain = code_expression(sql.Identifier("embedding"), None, 8, "vector").as_string(conn)
    assert plain == 'binary_quantize("embedding")::bit(8)'


@pytest.mark.parametrize("vtype", ["vector", "halfvec"])
def test_the_query_code_is_the_index_expression_and_uses_the_index(conn, vtype):
    from embedfleet.pg.ddl import index_key, index_of
    from embedfleet.pg.index_build import build_index
    from embedfleet.query.search import Searcher

    conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3000, 64)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    conn.execute(f"CREATE TABLE t (id text PRIMARY KEY, content text, embedding {vtype}(64))")
    with conn.cursor() as cur, cur.copy("COPY t (id, content, embedding) FROM STDIN") as copy:
        for i, v in enumerate(x):
            copy.write_row((str(i), f"row {i}", "[" + ",".join(map(str, v.tolist())) + "]"))
    conn.execute("ANALYZE t")
    build_index(conn, "t", "binary")
    name, kind = index_of(conn, "t")
    key = index_key(conn, "t", name)
    assert kind == "bit" and key.count("binary_quantize") == thresholds(64) == 7 and "bit(448)" in key
    rows, query = query_code(key, vtype)
    assert rows.as_string(conn) == key and "%(q)s::" + vtype in query.as_string(conn) and "embedding" not in query.as_string(conn)
    searcher = Searcher(conn, "t")
    assert name in searcher.explain(x[5], 10)
    got = searcher.search(x[5], 10)
    assert searcher.scan == "index" and got[0]["id"] == "5" and len(got) == 10
    # the index replaced under a long-lived searcher (serve's): its next search after the recheck uses the new one
    from embedfleet.pg.index_build import rebuild_index
    from embedfleet.query import search

    rebuild_index(conn, "t", "hnsw")
    searcher._index_read_at -= search.INDEX_RECHECK_S
    assert searcher.search(x[5], 10)[0]["id"] == "5" and searcher.index_kind == "direct" and searcher.scan == "index"
