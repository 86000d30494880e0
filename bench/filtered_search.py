"""Filtered searches whose filter drops the query's region: recall@10 against the exact top 10 among the rows that
pass, the latency, and how `Searcher` found them (`scan`: index, iterative or exact).

    python bench/filtered_search.py [--rows 62000] [--queries 20] [--model DIR] [--device auto] [--db DSN] [--out FILE]

Corpus: two topics of texts the project did not tune for, embedded by the model (the bundled all-MiniLM-L6-v2 by
default): topic 'A', synthetic English reviews (`synth.review_texts`), and topic 'B', non-ASCII texts
with long tails (`synth.world_texts`), about 2:1, each row a random rating 1–5; the table's default HNSW index.
Queries: held-out texts of the other topic (`topic = 'B'` is asked with queries from A, `topic = 'A'` with queries
from B) and of both (`rating <= 3`). A returned row as near as the exact tenth counts as found (ties). One JSON
document on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import psycopg

import harness


def say(*parts) -> None:
    print("[filtered_search]", *parts, file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=62_000)
    ap.add_argument("--queries", type=int, default=20)
    ap.add_argument("--model", default=None, help="the embedding model (default: the bundled MiniLM)")
    ap.add_argument("--device", default="auto", help="where the corpus is embedded (default: a GPU where there is one)")
    ap.add_argument("--db", default=None, help="a DSN (default: the embedded server under EMBEDFLEET_HOME)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from pgvector.psycopg import register_vector

    from embedfleet import Encoder, synth
    from embedfleet.pg.ddl import finish_table
    from embedfleet.pg.embedded import resolve_dsn
    from embedfleet.query.search import Searcher
    from embedfleet.settings import Settings

    n_b = args.rows // 3
    texts = {"A": synth.review_texts(args.rows - n_b + args.queries, seed=11),
             "B": synth.world_texts(n_b + args.queries, seed=12)}
    encoder = Encoder(args.model, device=args.device)
    t0 = time.perf_counter()
    vecs = {t: encoder.encode(x) for t, x in texts.items()}
    say(f"embedded {sum(map(len, texts.values())):,} texts in {time.perf_counter() - t0:.1f} s")
    held = {t: v[-args.queries:] for t, v in vecs.items()}
    rng = np.random.default_rng(0)
    dsn = resolve_dsn(args.db, Settings.from_env())
    doc: dict = {"environment": harness.environment(dsn), "rows": args.rows, "queries": args.queries,
                 "model": args.model or "all-MiniLM-L6-v2", "filters": []}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        register_vector(conn)
        conn.execute("DROP TABLE IF EXISTS bench_filtered")
        conn.execute(f"CREATE TABLE bench_filtered (id text PRIMARY KEY, content text, topic text, rating int, "
                     f"embedding vector({encoder.dim}))")
        with conn.cursor() as cur, cur.copy("COPY bench_filtered FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(["text", "text", "text", "int4", "vector"])
            for t in texts:
                for i, (text, v) in enumerate(zip(texts[t][:-args.queries], vecs[t][:-args.queries])):
                    copy.write_row((f"{t}{i}", text, t, int(rng.integers(1, 6)), v))
        t0 = time.perf_counter()
        finish_table(conn, "bench_filtered", True, dsn=dsn)  # the default index, as an ingest's end builds it
        say(f"index built in {time.perf_counter() - t0:.1f} s")
        searcher = Searcher(conn, "bench_filtered")
        cases = [("topic = 'B'", held["A"]), ("topic = 'A'", held["B"]),
                 ("rating <= 3", np.concatenate([held["A"][: args.queries // 2], held["B"][: args.queries // 2]]))]
        out = doc["filters"]
        for where, queries in cases:
            recalls, seconds, scans = [], [], []
            for q in queries:
                t0 = time.perf_counter()
                rows = searcher.search(q, 10, where=where)
                seconds.append(time.perf_counter() - t0)
                scans.append(searcher.scan)
                with conn.transaction():  # the exact top 10: no index
                    conn.execute("SET LOCAL enable_indexscan = off")
                    exact = [r[0] for r in conn.execute(
                        f"SELECT embedding <=> %s FROM bench_filtered WHERE {where} ORDER BY 1 LIMIT 10", [q]).fetchall()]
                recalls.append(sum(r["distance"] <= exact[-1] + 1e-6 for r in rows[:10]) / len(exact))
            passing = conn.execute(f"SELECT count(*) FROM bench_filtered WHERE {where}").fetchone()[0]
            out.append({"where": where, "rows_passing": passing, "recall_at_10": round(statistics.mean(recalls), 4),
                        "p50_ms": round(1e3 * statistics.median(seconds), 2),
                        "p99_ms": round(1e3 * float(np.percentile(seconds, 99)), 2),
                        "scans": {s: scans.count(s) for s in sorted(set(scans))}})
            say(out[-1])
        conn.execute("DROP TABLE bench_filtered")
    print(harness.record(doc, args.out))


if __name__ == "__main__":
    main()
