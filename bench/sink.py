"""Sink rate: how many rows/s the writer commits into PostgreSQL, without any model.

    python bench/sink.py [--n 60000] [--unit 6000] [--threads 1,3] [--dim 384] [--db DSN]

Synthetic Amazon reviews are prepared as a worker's helpers do (reader, `to_records` with the
amazon-reviews preset's 24 typed columns, COPY encoding), get random unit vectors, and are committed by `Writer` exactly as a worker does
(one transaction per unit: binary COPY, rejects, chunk progress). Prints rows/s per thread count.
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


def run(dsn: str, src: Path, unit_bytes: int, threads: int, dim: int) -> float:
    conn = connect(dsn)
    ensure_vector(conn)
    ledger = Ledger(conn)
    name = f"sink_{threads}t_{int(time.time() * 1000) % 10**9}"
    preset = get_preset("amazon-reviews")
    cfg = JobConfig(inputs=[str(src)], table=name, job=name, preset="amazon-reviews", chunk_bytes=unit_bytes)
    chunks = plan_chunks([str(src)], unit_bytes)
    ledger.create_job(name, cfg, [(c, None) for c in chunks], None)
    ensure_table(conn, name, preset.columns, dim, "vector")
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
    writer = Writer(lambda: TableSink(connect(dsn), name, preset.columns, "vector", name),
                    on_error=lambda u, e: errors.append(e), threads=threads)
    t0 = time.perf_counter()
    for u in units:
        writer.submit(u)
    writer.close()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return sum(u.rows.n for u in units) / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=60_000)
    ap.add_argument("--unit", type=int, default=2 << 20, help="bytes of input per unit (chunk)")
    ap.add_argument("--threads", default="1,3")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--db", default=None)
    a = ap.parse_args()
    dsn = resolve_dsn(a.db)
    with tempfile.TemporaryDirectory() as tmp:
        src = write_amazon_reviews(Path(tmp) / "r.jsonl", a.n)
        for t in a.threads.split(","):
            print(f"{t} writer thread(s): {run(dsn, src, a.unit, int(t), a.dim):,.0f} rows/s "
                  f"(n={a.n}, dim={a.dim})")


if __name__ == "__main__":
    main()
