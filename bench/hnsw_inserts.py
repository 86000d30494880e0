"""How fast a live HNSW index takes new rows: what bounds a sync drain, whose every changed row is an insert
into the target's index.

    python bench/hnsw_inserts.py [--rows 100000] [--dim 384] [--efc 64,32] [--conns 1,8] [--batch 256]
                                 [--seconds 10] [--db DSN] [--out FILE]

A table of --rows clustered unit vectors (as bench/wide_index.py makes them) gets an HNSW index (m 16, each
--efc as ef_construction; `none`: no index, the heap's and the key's cost alone). Then --conns connections, each
on a thread of its own, COPY batches of --batch new rows (binary COPY, the payloads made before the clock starts)
in a transaction each, for --seconds: rows/s over all of them. One JSON document on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np
import psycopg

import harness
from wide_index import clustered


LANE_MAX_ROWS_S = 4000  # payloads are made for lanes no faster than this (a live HNSW index takes far fewer)


def say(*parts) -> None:
    print("[hnsw_inserts]", *parts, file=sys.stderr, flush=True)


HEADER, TRAILER = b"PGCOPY\n\xff\r\n\0" + bytes(8), b"\xff\xff"


def binary_rows(first: int, vectors: np.ndarray) -> bytes:
    """Rows (id, content '', embedding) in COPY's binary format, ids of 12 digits: one numpy record a row."""
    n, dim = vectors.shape
    rec = np.zeros(n, np.dtype([("fields", ">i2"), ("id_len", ">i4"), ("id", "S12"), ("content_len", ">i4"),
                                ("vec_len", ">i4"), ("dim", ">i2"), ("unused", ">i2"), ("vec", ">f4", (dim,))]))
    rec["fields"], rec["id_len"], rec["vec_len"], rec["dim"] = 3, 12, 4 + 4 * dim, dim
    rec["id"] = np.char.zfill(np.arange(first, first + n).astype("U12"), 12).astype("S12")
    rec["vec"] = vectors
    return HEADER + rec.tobytes() + TRAILER


def payloads(n_batches: int, batch: int, first: int, dim: int, rng, centres) -> list[bytes]:
    return [binary_rows(first + b * batch, clustered(batch, dim, rng, centres)) for b in range(n_batches)]


def insert_rate(dsn: str, table: str, conns: int, batches: list[list[bytes]], seconds: float, dim: int) -> dict:
    done, row_bytes = [0] * conns, 2 + 4 + 12 + 4 + 4 + 4 + 4 * dim
    start = threading.Barrier(conns + 1)

    def lane(i: int) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SET synchronous_commit = off")  # as sync's lanes write
            start.wait()
            t_end = time.perf_counter() + seconds
            for data in batches[i]:
                if time.perf_counter() >= t_end:
                    break
                with conn.transaction(), conn.cursor() as cur, cur.copy(
                        f"COPY {table} (id, content, embedding) FROM STDIN (FORMAT BINARY)") as copy:
                    copy.write(data)
                done[i] += (len(data) - len(HEADER) - len(TRAILER)) // row_bytes

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(conns)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"conns": conns, "rows": sum(done), "seconds": round(wall, 2), "rows_s": round(sum(done) / wall)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--efc", default="64,32", help="ef_construction of each index tried ('none': no index)")
    ap.add_argument("--conns", default="1,8")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--db", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from embedfleet.pg.embedded import resolve_dsn
    from embedfleet.settings import Settings

    dsn = resolve_dsn(a.db, Settings.from_env())
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((1000, a.dim)).astype(np.float32) / np.sqrt(a.dim)
    conns = [int(c) for c in a.conns.split(",")]
    most = max(conns)
    per_lane = int(LANE_MAX_ROWS_S * a.seconds / a.batch) + 1  # the clock ends a lane before they run out
    say(f"making {most} x {per_lane} batches of {a.batch} rows")
    batches = [payloads(per_lane, a.batch, 10**9 + i * 10**7, a.dim, rng, centres) for i in range(most)]
    base = binary_rows(0, clustered(a.rows, a.dim, rng, centres))
    doc: dict = {"environment": harness.environment(dsn), "rows": a.rows, "dim": a.dim, "batch": a.batch,
                 "seconds": a.seconds, "runs": []}
    table = "bench_hnsw_inserts"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        for efc in a.efc.split(","):
            for n in conns:
                conn.execute(f"DROP TABLE IF EXISTS {table}")
                conn.execute(f"CREATE TABLE {table} (id text PRIMARY KEY, content text, embedding vector({a.dim}))")
                with conn.cursor() as cur, cur.copy(f"COPY {table} (id, content, embedding) FROM STDIN "
                                                    "(FORMAT BINARY)") as copy:
                    copy.write(base)
                t0 = time.perf_counter()
                if efc != "none":  # the graph in memory, as embedfleet builds it (pg/index_build.py)
                    conn.execute("SET maintenance_work_mem = '4GB'")
                    conn.execute(f"CREATE INDEX ON {table} USING hnsw (embedding vector_cosine_ops) "
                                 f"WITH (m = 16, ef_construction = {int(efc)})")
                build_s = time.perf_counter() - t0
                conn.execute(f"VACUUM ANALYZE {table}")
                run = {"ef_construction": efc, "build_s": round(build_s, 2),
                       **insert_rate(dsn, table, n, batches, a.seconds, a.dim)}
                doc["runs"].append(run)
                say(run)
        conn.execute(f"DROP TABLE IF EXISTS {table}")
    print(harness.record(doc, a.out))


if __name__ == "__main__":
    main()
