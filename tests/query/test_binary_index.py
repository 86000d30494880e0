"""`--index binary`: HNSW over the binary-quantized vectors, its candidates ranked by the full vectors. On a
clustered 50,000-row table: recall@10 against exact search at the default rescore, the index used (EXPLAIN),
`embedfleet index --index` switching between the two; and `ingest --index binary` end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

DIM, ROWS = 384, 50_000


def _clustered(rng, n, centres):
    x = centres[rng.integers(len(centres), size=n)] + 0.6 * rng.standard_normal((n, DIM)).astype(np.float32) / np.sqrt(DIM)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture
def clustered_table(conn):
    from pgvector.psycopg import register_vector

    conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    register_vector(conn)
    conn.execute(f"CREATE TABLE vecs (id text PRIMARY KEY, content text NOT NULL, embedding vector({DIM}))")
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((500, DIM)).astype(np.float32) / np.sqrt(DIM)
    with conn.cursor() as cur, cur.copy("COPY vecs FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types(["text", "text", "vector"])
        for i, v in enumerate(_clustered(rng, ROWS, centres)):
            copy.write_row((str(i), f"row {i}", v))
    conn.execute("ANALYZE vecs")
    return _clustered(rng, 30, centres)


def test_a_binary_index_finds_the_exact_top_10_and_is_used(cli, dsn, conn, clustered_table):
    from embedfleet.pg.ddl import index_of
    from embedfleet.query.search import Searcher

    p = cli("index", "--table", "vecs", "--index", "binary", "--db", dsn, "--json", check=True)
    doc = json.loads(p.stdout)
    assert doc["index_built"] is True and index_of(conn, "vecs") == (doc["index_name"], "bit")
    searcher = Searcher(conn, "vecs")
    assert doc["index_name"] in searcher.explain(clustered_table[0], 10)
    hits = 0
    for q in clustered_table:
        got = [r["id"] for r in searcher.search(q, 10)]
        assert searcher.scan == "index" and len(got) == 10
        with conn.transaction():
            conn.execute("SET LOCAL enable_indexscan = off")
            exact = [r[0] for r in conn.execute("SELECT id FROM vecs ORDER BY embedding <=> %s LIMIT 10", [q])]
        hits += len(set(got) & set(exact))
    recall = hits / (10 * len(clustered_table))
    assert recall >= 0.9, recall
    assert json.loads(cli("index", "--table", "vecs", "--index", "binary", "--db", dsn, "--json",
                          check=True).stdout)["index_built"] is False
    orphan = cli("index", "--table", "vecs", "--index", "binary", "--fts-config", "german", "--db", dsn)
    assert orphan.returncode != 0 and "--fts-config german configures --fts" in orphan.stderr  # not ignored
    back = json.loads(cli("index", "--table", "vecs", "--index", "hnsw", "--db", dsn, "--json", check=True).stdout)
    assert back["index_built"] and index_of(conn, "vecs")[1] == "direct"
    assert conn.execute("SELECT count(*) FROM pg_indexes WHERE tablename = 'vecs' AND indexdef ILIKE '%hnsw%'"
                        ).fetchone()[0] == 1  # the binary one went


def test_ingest_index_binary_end_to_end(cli, dsn, conn, tmp_path):
    from embedfleet.pg.ddl import index_of

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "text": f"review {i}: the charger and the cable"}) + "\n"
                           for i in range(40)))
    p = cli("ingest", src, "--db", dsn, "--devices", "cpu", "--id-field", "id", "--table", "docs", "--index", "binary",
            check=True)
    assert "index: HNSW on binary_quantize(embedding) at 8 levels a dimension, bit(2688)" in p.stderr
    assert index_of(conn, "docs")[1] == "bit"
    hits = json.loads(cli("search", "review 7: the charger and the cable", "--table", "docs", "--db", dsn, "--json",
                          "-k", "3", "--rescore", "20", check=True).stdout)
    assert hits["results"][0]["id"] == "d7" and hits["scan"] == "index"
    bad = cli("ingest", src, "--db", dsn, "--devices", "cpu", "--table", "other", "--index", "ivf")
    assert bad.returncode != 0 and "--index 'ivf': use hnsw or binary" in bad.stderr
