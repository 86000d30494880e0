"""PostgreSQL's own ingest ceiling: the rows/s a server commits from P GPU workers' writers, with no model.

    python bench/sink.py [--n 1000000] [--procs 1,2,4] [--threads 6] [--dim 384] [--vtype vector,halfvec]
                         [--shards 32] [--work DIR] [--db DSN] [--pg-set NAME=VALUE,…] [--out FILE]

For each P, P processes write one fresh table as P GPU workers do: each has a `Writer` of `--threads`
connections committing one transaction per unit (binary COPY, the chunk's progress in the ledger).
Their units — synthetic Amazon reviews (the amazon-reviews preset, 2 MB chunks) prepared by helper
processes, with random unit vectors — are all prepared before a barrier, so only the database is
timed. If P GPUs embed faster than the rate printed for P, PostgreSQL sets the ceiling there.
Prints rows/s, WAL and table bytes a row and checkpoints per P (the embedded server unless --db). `--pg-set`:
ALTER SYSTEM these settings and reload (those a reload applies: checkpoint, WAL writer, flush settings).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np
from psycopg import sql

import harness
from _cli import name_values
from embedfleet.settings import Settings, DEFAULT_CHUNK_BYTES, JobSpec
from embedfleet.encode.tokenize import tokenizer_spec
from embedfleet.ingest.stages import Task
from embedfleet.ingest.prepare import PrepareContext, UnitPool
from embedfleet.sources.plan import ChunkSpec, plan_chunks
from embedfleet.sources.presets import get_preset
from embedfleet.pg.embedded import alter_system, resolve_dsn
from embedfleet.ledger import Ledger
from embedfleet.pg.connect import Reconnect, connect
from embedfleet.pg.ddl import ensure_table, ensure_vector
from embedfleet.ingest.commit import TableSink, Writer
from embedfleet.ingest.stages import Unit
from embedfleet.synth import cached_review_shards


def _writer_process(dsn: str, job: str, share: int, threads: int, helpers: int, dim: int, vtype: str,
                    model: str | None, barrier, results) -> None:
    """One GPU worker's writing, without the GPU: claim `share` chunks, prepare them, then time the commits."""
    ledger = Ledger.connect(dsn)
    claims = [c for c in (ledger.claim(job, f"sink-{os.getpid()}", 3600) for _ in range(share)) if c is not None]
    pool = UnitPool(PrepareContext("amazon-reviews", None, None, None, tokenizer_spec(model)), helpers)
    futures = [pool.submit(Task(ChunkSpec(c.source, c.kind, c.start, c.end, c.first_line), c.cursor_line, c.last_line))
               for c in claims]
    rng = np.random.default_rng(os.getpid())
    units = []
    for claim, future in zip(claims, futures):
        p = pool.result(future)
        emb = rng.standard_normal((p.rows.n, dim), dtype=np.float32)
        emb /= np.linalg.norm(emb, axis=1, keepdims=True)
        units.append(Unit(claim, p.rows, p.seen, p.rejects, p.cursor_line, last=True, embeddings=emb))
    pool.close()
    columns = get_preset("amazon-reviews").columns
    writer = Writer(lambda conn: TableSink(conn, job, columns, vtype, job), Reconnect(dsn, 30.0), threads=threads)
    barrier.wait()
    t0 = time.time()
    for u in units:
        writer.submit(u)
    writer.close()
    t1 = time.time()
    failures = []
    while not writer.failures.empty():
        failures.append(repr(writer.failures.get().error))
    ledger.close()
    results.put({"rows": sum(u.rows.n for u in units), "start": t0, "end": t1, "failures": failures})


def _checkpoints(conn) -> int:
    row = conn.execute("SELECT num_timed + num_requested FROM pg_stat_checkpointer").fetchone()
    return int(row[0])


def run(dsn: str, paths: list[Path], procs: int, threads: int, dim: int, vtype: str, model: str | None) -> dict:
    """One load of every chunk of `paths` into a fresh table by `procs` writer processes."""
    conn = connect(dsn)
    ensure_vector(conn)
    ledger = Ledger(conn)
    job = f"sink_{procs}p_{int(time.time() * 1000) % 10**9}"
    chunks = plan_chunks([str(p) for p in paths], DEFAULT_CHUNK_BYTES)
    cfg = JobSpec(inputs=[str(p) for p in paths], table=job, job=job, preset="amazon-reviews")
    ledger.create_job(job, cfg, [(c, None) for c in chunks], None)
    ensure_table(conn, job, get_preset("amazon-reviews").columns, dim, vtype)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(procs + 1), ctx.Queue()
    helpers = max(1, min(8, (os.cpu_count() or 2) // procs // 2))
    share = math.ceil(len(chunks) / procs)
    workers = [ctx.Process(target=_writer_process, args=(dsn, job, share, threads, helpers, dim, vtype, model,
                                                         barrier, results)) for _ in range(procs)]
    for w in workers:
        w.start()
    barrier.wait()  # every process has its units ready
    lsn0 = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]
    ckpt0 = _checkpoints(conn)
    done = [results.get() for _ in workers]
    for w in workers:
        w.join()
    wal = float(conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)", [lsn0]).fetchone()[0])
    rows = sum(d["rows"] for d in done)
    span = max(d["end"] for d in done) - min(d["start"] for d in done)
    out = {"procs": procs, "threads": threads, "rows": rows, "seconds": round(span, 3),
           "rows_per_s": round(rows / span, 1), "wal_bytes_per_row": round(wal / rows, 1),
           "wal_mb_per_s": round(wal / span / 1e6, 1), "checkpoints": _checkpoints(conn) - ckpt0,
           "per_process_rows_per_s": [round(d["rows"] / (d["end"] - d["start"]), 1) for d in done],
           "failures": [f for d in done for f in d["failures"]][:3]}
    out["table_bytes_per_row"] = round(conn.execute("SELECT pg_total_relation_size(%s::regclass)", [job]).fetchone()[0] / rows, 1)
    conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(job)))  # the next load starts from an empty table, as a job does
    conn.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200_000, help="reviews in all (each P loads all of them)")
    ap.add_argument("--procs", default="1,2", help="writer processes (GPU workers) per load")
    ap.add_argument("--threads", type=int, default=6, help="writer connections per process (a GPU worker's)")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--vtype", default="vector", help="column types to compare: vector, halfvec (--dtype half)")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--model", default=None, help="tokenizer's model directory (default: the bundled MiniLM)")
    ap.add_argument("--work", default="/tmp/efbench")
    ap.add_argument("--db", default=None)
    ap.add_argument("--pg-set", default=None, metavar="NAME=VALUE,…")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dsn = resolve_dsn(a.db, Settings.from_env())
    if a.pg_set:
        with connect(dsn) as conn:
            alter_system(conn, name_values(a.pg_set.split(",")), reload=True)
        os.environ["EMBEDFLEET_PG_TUNE"] = "0"  # the writers' processes leave them (the tuning would set its own back)
    paths = cached_review_shards(Path(a.work), a.n, a.shards)
    results = []
    for vtype, procs in ((v, int(p)) for v in a.vtype.split(",") for p in a.procs.split(",")):
        r = {"vtype": vtype, **run(dsn, paths, procs, a.threads, a.dim, vtype, a.model)}
        results.append(r)
        print(f"{vtype}, {procs} process(es) x {a.threads} connections: {r['rows_per_s']:,.0f} rows/s "
              f"({r['rows']:,} rows in {r['seconds']} s), {r['wal_bytes_per_row']:,.0f} WAL bytes a row, "
              f"{r['table_bytes_per_row']:,.0f} table bytes a row, {r['wal_mb_per_s']} MB/s of WAL, "
              f"{r['checkpoints']} checkpoint(s)", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(harness.stamp({"n": a.n, "dim": a.dim, "pg_set": a.pg_set, "results": results}, dsn),
                                          indent=2))


if __name__ == "__main__":
    main()
