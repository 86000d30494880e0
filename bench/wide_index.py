"""Recall@10 of the index each vector width gets (pg.ddl.index_plan) against exact search, through `Searcher`:
direct HNSW up to 2,000 dimensions, HNSW on embedding::halfvec(D) to 4,000, a binary-quantized HNSW rescored by
the full vectors above.

    python bench/wide_index.py [--rows 100000] [--dims 384,2560,4096] [--index hnsw,binary] [--queries 100]
                               [--db DSN] [--out FILE]

Vectors: --rows unit vectors around 1,000 random centres (a clustered corpus, as embeddings are), float32 in a
`vector(D)` column; queries: other points around the same centres. Recall@10: the share of the exact top 10 (the
exact statement, no index) that the indexed search returns, over --queries queries, at the defaults
(ef_search 40; a binary index's rescore takes 10 × k candidates, at least 40). `--index`: the kinds asked for each
width (`binary`: HNSW over the binary-quantized vectors whatever the width). Also the index's build seconds
and size. One JSON document on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import psycopg
from psycopg import sql

import harness


def say(*parts) -> None:
    print("[wide_index]", *parts, file=sys.stderr, flush=True)


def clustered(n: int, dim: int, rng: np.random.Generator, centres: np.ndarray) -> np.ndarray:
    x = centres[rng.integers(len(centres), size=n)] + 0.6 * rng.standard_normal((n, dim)).astype(np.float32) / np.sqrt(dim)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dims", default="384,2560,4096")
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--index", default="hnsw", help="hnsw, binary or both (hnsw,binary) for each width")
    ap.add_argument("--db", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from pgvector.psycopg import register_vector

    from embedfleet.pg.ddl import finish_table
    from embedfleet.pg.index_build import rebuild_index
    from embedfleet.pg.embedded import resolve_dsn
    from embedfleet.settings import Settings

    dsn = resolve_dsn(a.db, Settings.from_env())
    doc: dict = {"environment": harness.environment(dsn), "rows": a.rows, "queries": a.queries, "widths": []}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        for dim in [int(d) for d in a.dims.split(",")]:
            rng = np.random.default_rng(dim)
            centres = rng.standard_normal((1000, dim)).astype(np.float32) / np.sqrt(dim)
            table = f"bench_wide_{dim}"
            conn.execute(f"DROP TABLE IF EXISTS {table}")
            conn.execute(f"CREATE TABLE {table} (id text PRIMARY KEY, content text, embedding vector({dim}))")
            t0 = time.perf_counter()
            register_vector(conn)
            with conn.cursor() as cur, cur.copy(f"COPY {table} (id, content, embedding) FROM STDIN "
                                                "(FORMAT BINARY)") as copy:
                copy.set_types(["text", "text", "vector"])
                for start in range(0, a.rows, 10_000):
                    block = clustered(min(10_000, a.rows - start), dim, rng, centres)
                    for i, v in enumerate(block):
                        copy.write_row((str(start + i), "", v))
            load_s = time.perf_counter() - t0
            finish_table(conn, table, False, dsn=dsn)
            queries = clustered(a.queries, dim, rng, centres)
            for asked in a.index.split(","):
                t0 = time.perf_counter()
                rebuild_index(conn, table, asked)
                row = measure(conn, table, dim, asked, queries, time.perf_counter() - t0, load_s)
                doc["widths"].append(row)
                say(row)
            conn.execute(f"DROP TABLE {table}")
    print(harness.record(doc, a.out))


def measure(conn, table: str, dim: int, asked: str, queries: np.ndarray, build_s: float, load_s: float) -> dict:
    """The table's index: its size, recall@10 against the exact statement, and the time of a search."""
    from embedfleet.pg.ddl import index_of, index_plan
    from embedfleet.query.search import Searcher

    name, kind = index_of(conn, table)
    size = conn.execute("SELECT pg_relation_size(%s::regclass)", [name]).fetchone()[0]
    searcher = Searcher(conn, table, statement_timeout=600)
    exact = sql.SQL("SELECT id FROM {} ORDER BY embedding <=> %s LIMIT 10").format(sql.Identifier(table))
    hits, times = 0, []
    for q in queries:
        t1 = time.perf_counter()
        got = {r["id"] for r in searcher.search(q, 10)}
        times.append(time.perf_counter() - t1)
        assert searcher.scan == "index"
        with conn.transaction():
            conn.execute("SET LOCAL enable_indexscan = off")
            hits += len(got & {r[0] for r in conn.execute(exact, [q]).fetchall()})
    return {"dim": dim, "asked": asked, "index": kind, "plan": index_plan(dim, "vector", asked)[1],
            "load_s": round(load_s, 1), "build_s": round(build_s, 1), "index_mb": round(size / 2**20, 1),
            "recall_at_10": round(hits / (10 * len(queries)), 4),
            "search_ms_mean": round(1000 * float(np.mean(times)), 2),
            "search_ms_p50": round(1000 * float(np.median(times)), 2)}


if __name__ == "__main__":
    main()
