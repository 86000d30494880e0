"""Sink rate: how many rows/s the writer commits into PostgreSQL, without any model.

    python bench/sink.py [--n 60000] [--unit 6000] [--threads 1,3] [--dim 384] [--vtype vector,halfvec] [--db DSN]

Synthetic Amazon reviews are prepared as a worker's helpers do (reader, `to_records` with the
amazon-reviews preset's 24 typed columns, COPY encoding), get random unit vectors, and are committed by `Writer` exactly as a worker does
(one transaction per unit: binary COPY, rejects, chunk progress). Prints rows/s per thread count and
column type (`halfvec` is `--dtype half`), with the WAL and table bytes each row cost.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from embedfleet.config import JobConfig
from embedfleet.encode.tokenize import tokenizer_spec
from embedfleet.runtime.units import Preparer, Task, UnitContext
from embedfleet.sources.plan import plan_chunks
from embedfleet.sources.presets import get_preset
from embedfleet.store.embedded import resolve_dsn
from embedfleet.store.ledger import Ledger, connect
from embedfleet.store.schema import ensure_table, ensure_vector
from embedfleet.store.writer import TableSink, Unit, Writer
from embedfleet.synth import write_amazon_reviews


def run(dsn: str, src: Path, unit_bytes: int, threads: int, dim: int, vtype: str) -> tuple[float, float, float]:
    """rows/s, WAL bytes a row, table bytes a row (with its index) of one load into a fresh table."""
    conn = connect(dsn)
    ensure_vector(conn)
    ledger = Ledger(conn)
    name = f"sink_{threads}t_{int(time.time() * 1000) % 10**9}"
    preset = get_preset("amazon-reviews")
    cfg = JobConfig(inputs=[str(src)], table=name, job=name, preset="amazon-reviews", chunk_bytes=unit_bytes)
    chunks = plan_chunks([str(src)], unit_bytes)
    ledger.create_job(name, cfg, [(c, None) for c in chunks], None)
    ensure_table(conn, name, preset.columns, dim, vtype)
    rng = np.random.default_rng(0)
    units = []
    prepare = Preparer(UnitContext("amazon-reviews", None, None, None, tokenizer_spec()))
    for spec in chunks:  # prepare everything first: only the sink is timed
        claim = ledger.claim(name, "bench", 600)
        p = prepare(Task(spec, 0, None))
        emb = rng.standard_normal((p.rows.n, dim)).astype(np.float32)
        emb /= np.linalg.norm(emb, axis=1, keepdims=True)
        units.append(Unit(claim, p.rows, p.seen, p.rejects, p.cursor_line, last=True, embeddings=emb))
    errors = []
    writer = Writer(lambda: TableSink(connect(dsn), name, preset.columns, vtype, name),
                    on_error=lambda u, e: errors.append(e), threads=threads)
    lsn0 = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]
    t0 = time.perf_counter()
    for u in units:
        writer.submit(u)
    writer.close()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    rows = sum(u.rows.n for u in units)
    wal = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)", [lsn0]).fetchone()[0]
    size = conn.execute("SELECT pg_total_relation_size(%s::regclass)", [name]).fetchone()[0]
    conn.close()
    return rows / dt, float(wal) / rows, size / rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=60_000)
    ap.add_argument("--unit", type=int, default=2 << 20, help="bytes of input per unit (chunk)")
    ap.add_argument("--threads", default="1,3")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--vtype", default="vector", help="column types to compare: vector, halfvec (--dtype half)")
    ap.add_argument("--db", default=None)
    a = ap.parse_args()
    dsn = resolve_dsn(a.db)
    with tempfile.TemporaryDirectory() as tmp:
        src = write_amazon_reviews(Path(tmp) / "r.jsonl", a.n)
        for vtype in a.vtype.split(","):
            for t in a.threads.split(","):
                rate, wal, size = run(dsn, src, a.unit, int(t), a.dim, vtype)
                print(f"{vtype}, {t} writer thread(s): {rate:,.0f} rows/s, {wal:,.0f} WAL bytes and {size:,.0f} "
                      f"table bytes a row (n={a.n}, dim={a.dim})", flush=True)


if __name__ == "__main__":
    main()
