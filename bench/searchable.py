"""Time to searchable: from `embedfleet ingest`'s start to a table that `search` answers from its index, the
embedding and the index build apart, then the index's recall@10 against exact search on held-out queries.

    python bench/searchable.py --n 1000000 --model DIR [--devices cuda] [--queries 100] [--ef 40,64,100,200]
                               [--binary] [--fts] [--keep] [--partitions P] [--table T] [--work DIR] [--db DSN] [--out FILE]

Runs the real CLI once (default index, no --no-index) on --n synthetic reviews (long-tailed lengths) and reads
its `--json` summary: `embed_s` is the command's start to the job's finish step (embedding and writing every
row), `index_s` the HNSW build inside that step, `searchable_s` the command's wall time. Then --queries reviews
of another seed are embedded with the same model and searched through `Searcher` at the defaults and at each
--ef (hnsw.ef_search), each against the exact top 10 (no index; parallel scans); p50 of a search's time.
`--binary`: the index rebuilt as `--index binary` (its build, size, recall and p50 at the default rescore), then
as HNSW again where `--keep` keeps the table (a second build's time). One JSON document on stdout and --out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import psycopg

import harness


def say(*parts) -> None:
    print("[searchable]", *parts, file=sys.stderr, flush=True)


def recall_and_p50(conn, table: str, queries: np.ndarray, exact: list[set], **kw) -> dict:
    from embedfleet.query.search import Searcher

    searcher = Searcher(conn, table, **({"rescore": kw.pop("rescore")} if "rescore" in kw else {}))
    hits, times = [], []
    for q, truth in zip(queries, exact):
        t0 = time.perf_counter()
        rows = searcher.search(q, 10, **kw)
        times.append(time.perf_counter() - t0)
        hits.append(len({r["id"] for r in rows} & truth) / 10)
    return {"recall_at_10": round(float(np.mean(hits)), 4), "p50_ms": round(statistics.median(times) * 1e3, 2),
            "scan": searcher.scan}


def exact_top10(conn, table: str, queries: np.ndarray) -> list[set]:
    from pgvector import Vector

    out = []
    with conn.transaction():
        conn.execute("SET LOCAL enable_indexscan = off")
        conn.execute("SET LOCAL max_parallel_workers_per_gather = 8")
        for q in queries:
            out.append({r[0] for r in conn.execute(
                f"SELECT id FROM {table} ORDER BY embedding <=> %s LIMIT 10", [Vector(q)]).fetchall()})
    return out


def index_size(conn, table: str) -> int:
    from embedfleet.pg.ddl import index_of

    name = index_of(conn, table)[0]
    return int(conn.execute("SELECT coalesce((SELECT sum(pg_relation_size(inhrelid)) FROM pg_inherits WHERE inhparent = "
                        "%s::regclass), 0) + pg_relation_size(%s::regclass)", [name, name]).fetchone()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--model", required=True)
    ap.add_argument("--devices", default="cuda")
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--ef", default="40,64,100,200")
    ap.add_argument("--binary", action="store_true")
    ap.add_argument("--fts", action="store_true", help="ingest --fts: the full-text index too (its seconds apart)")
    ap.add_argument("--partitions", type=int, default=0, help="ingest --partitions P (their indexes built side by side)")
    ap.add_argument("--keep", action="store_true", help="leave the table (with its HNSW index) for serve_latency.py")
    ap.add_argument("--table", default=f"bench_searchable_{int(time.time())}")
    ap.add_argument("--work", default="/tmp/efsearchable")
    ap.add_argument("--db", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from pgvector.psycopg import register_vector

    from embedfleet import Encoder
    from embedfleet.pg.embedded import resolve_dsn
    from embedfleet.pg.index_build import rebuild_index
    from embedfleet.settings import Settings
    from embedfleet.synth import cached_reviews, review_texts

    dsn = resolve_dsn(a.db, Settings.from_env())
    Path(a.work).mkdir(parents=True, exist_ok=True)
    data = cached_reviews(a.work, a.n)
    doc: dict = {"environment": harness.environment(dsn), "n": a.n, "queries": a.queries, "partitions": a.partitions}
    shm = shutil.disk_usage("/dev/shm") if os.path.exists("/dev/shm") else None
    with psycopg.connect(dsn, autocommit=True) as conn:
        doc["server"] = {name: conn.execute(f"SHOW {name}").fetchone()[0] for name in (
            "max_worker_processes", "max_parallel_workers", "maintenance_work_mem", "shared_buffers")}
    doc["server"]["dev_shm_free_gb"] = round(shm.free / 2**30, 1) if shm else None
    cmd = [sys.executable, "-m", "embedfleet.cli", "ingest", str(data), "--preset", "amazon-reviews", "--table", a.table,
           "--model", a.model, "--devices", *a.devices.split(), "--json", "--quiet",
           *(["--partitions", str(a.partitions)] if a.partitions else []), *(["--fts"] if a.fts else [])]
    say("ingest", " ".join(cmd[3:]))
    t0_wall, t0 = time.time(), time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"ingest failed: {p.stderr[-3000:]}")
    summary = orjson.loads(p.stdout)
    fin = summary["finalize"]
    doc["ingest"] = {"searchable_s": round(wall, 2), "embed_s": round(fin["started_at"] - t0_wall, 2),
                     "finalize": fin, "rows": summary["rows_written"],
                     "index_over_embed": round(fin.get("index_s", 0) / max(fin["started_at"] - t0_wall, 1e-9), 3)}
    say("ingest", doc["ingest"])
    texts = review_texts(a.queries, seed=4242)
    queries = np.asarray(Encoder(a.model, device=a.devices.split()[0]).encode(texts), dtype=np.float32)
    with psycopg.connect(dsn, autocommit=True) as conn:
        register_vector(conn)
        t0 = time.perf_counter()
        exact = exact_top10(conn, a.table, queries)
        doc["exact_s"] = round(time.perf_counter() - t0, 2)
        doc["hnsw"] = {"size_bytes": index_size(conn, a.table),
                       "default": recall_and_p50(conn, a.table, queries, exact),
                       **{f"ef_{ef}": recall_and_p50(conn, a.table, queries, exact, ef_search=int(ef))
                          for ef in a.ef.split(",")}}
        say("hnsw", doc["hnsw"])
        if a.binary:
            t0 = time.perf_counter()
            rebuild_index(conn, a.table, "binary", dsn)
            doc["binary"] = {"build_s": round(time.perf_counter() - t0, 2), "size_bytes": index_size(conn, a.table),
                             "default": recall_and_p50(conn, a.table, queries, exact),
                             **{f"rescore_{r}": recall_and_p50(conn, a.table, queries, exact, rescore=r)
                                for r in (200, 400)}}
            say("binary", doc["binary"])
            if a.keep:
                t0 = time.perf_counter()
                rebuild_index(conn, a.table, "hnsw", dsn)
                doc["hnsw"]["rebuild_s"] = round(time.perf_counter() - t0, 2)
                say("hnsw again", doc["hnsw"]["rebuild_s"])
        if not a.keep:
            conn.execute(f"DROP TABLE {a.table}")
    out = orjson.dumps(doc, option=orjson.OPT_INDENT_2)
    if a.out:
        Path(a.out).write_bytes(out)
    sys.stdout.write(out.decode() + "\n")


if __name__ == "__main__":
    main()
