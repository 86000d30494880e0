"""How fast a worker's helper processes prepare units (read, template, tokenize, COPY-encode).

    python bench/prep_cpu.py [--n 200000] [--helpers 1,4,8,16] [--model DIR]

No GPU and no database: every chunk of a synthetic Amazon-review file (amazon-reviews preset, 2 MB
chunks) goes through `UnitPool` with N helpers, and the rows/s it sustains is the most one worker
can feed its GPU on this machine. One helper's time per row is also split by stage.
"""

from __future__ import annotations

import argparse
import os
import time

from embedfleet.config import DEFAULT_CHUNK_BYTES
from embedfleet.encode.tokenize import tokenizer_spec
from embedfleet.records import to_records
from embedfleet.runtime.units import Preparer, Task, UnitContext, UnitPool
from embedfleet.sources import read_chunk
from embedfleet.sources.plan import plan_chunks
from embedfleet.synth import cached_reviews


def stage_split(ctx: UnitContext, task: Task) -> dict:
    """Microseconds per row of each step, in this process, tokenizer single-threaded as in a helper."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    p = Preparer(ctx)
    p(task)  # warm
    t0 = time.perf_counter()
    raws = list(read_chunk(task.spec))
    t1 = time.perf_counter()
    records, _ = to_records(raws, p.preset)
    t2 = time.perf_counter()
    p.encoder.encode([(r.id, r.content, *(r.values.get(c.name) for c in p.preset.columns)) for r in records])
    t3 = time.perf_counter()
    tok = p.tokenizer.tokenize([r.content for r in records])
    t4 = time.perf_counter()
    n = len(records)
    return {"rows": n, "tokens_per_row": round(tok.num_tokens / n, 1), "read_us": round((t1 - t0) / n * 1e6, 1),
            "records_us": round((t2 - t1) / n * 1e6, 1), "copy_encode_us": round((t3 - t2) / n * 1e6, 1),
            "tokenize_us": round((t4 - t3) / n * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--helpers", default="1,4,8,16")
    ap.add_argument("--model", default=None)
    ap.add_argument("--work", default="/tmp/efbench")
    a = ap.parse_args()
    data = cached_reviews(a.work, a.n)
    ctx = UnitContext("amazon-reviews", None, None, None, tokenizer_spec(a.model))  # no torch, no weights
    tasks = [Task(spec, 0, None) for spec in plan_chunks([str(data)], DEFAULT_CHUNK_BYTES)]
    print(f"cores: {len(os.sched_getaffinity(0))}; one helper, per row: {stage_split(ctx, tasks[0])}", flush=True)
    for h in map(int, a.helpers.split(",")):
        pool = UnitPool(ctx, h)
        pool.start()
        t0 = time.perf_counter()
        rows = sum(pool.result(f).rows.n for f in [pool.submit(t) for t in tasks])
        dt = time.perf_counter() - t0
        pool.close()
        print(f"{h:3d} helpers: {rows / dt:9,.0f} rows/s ({rows:,} rows in {dt:.2f} s)", flush=True)


if __name__ == "__main__":
    main()
