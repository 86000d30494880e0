"""How fast a worker's helper processes prepare units (read, template, tokenize, COPY-encode).

    python bench/prep_cpu.py [--n 200000] [--helpers 1,4,8,16] [--model DIR]
                             [--articles N --passages 254:32]

No GPU and no database: every chunk of a synthetic Amazon-review file (amazon-reviews preset, 2 MB
chunks) goes through `UnitPool` with N helpers, and the rows/s it sustains is the most one worker
can feed its GPU on this machine. One helper's time per row is also split by stage. `--articles N`:
N Wikipedia-length articles (median ~700 words, the wikipedia preset, JSON lines) instead, cut into
passages with `--passages`; rows are then passage rows.
"""

from __future__ import annotations

import argparse
import os
import time

from pathlib import Path

import orjson

from embedfleet.settings import DEFAULT_CHUNK_BYTES
from embedfleet.encode.passages import parse_passages
from embedfleet.encode.tokenize import tokenizer_spec
from embedfleet.sources.records import to_records
from embedfleet.ingest.prepare import Preparer, PrepareContext, UnitPool
from embedfleet.ingest.stages import Task
from embedfleet.sources import read_chunk
from embedfleet.sources.plan import plan_chunks
from embedfleet.synth import cached_reviews, long_tail_texts


def stage_split(ctx: PrepareContext, task: Task) -> dict:
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
    ap.add_argument("--articles", type=int, default=0, help="Wikipedia-length articles instead of reviews")
    ap.add_argument("--passages", default=None, help="TOKENS[:OVERLAP], with --articles")
    a = ap.parse_args()
    if a.articles:
        data = Path(a.work) / f"articles-{a.articles}.jsonl"
        if not data.exists():
            data.parent.mkdir(parents=True, exist_ok=True)
            texts = long_tail_texts(a.articles, seed=1, median_words=700)
            data.write_bytes(b"".join(orjson.dumps({"id": str(i), "title": t[:40], "text": t}) + b"\n"
                                      for i, t in enumerate(texts)))
        ctx = PrepareContext("wikipedia", None, None, None, tokenizer_spec(a.model), passages=parse_passages(a.passages))
    else:
        data = cached_reviews(a.work, a.n)
        ctx = PrepareContext("amazon-reviews", None, None, None, tokenizer_spec(a.model))  # no torch, no weights
    tasks = [Task(spec, 0, None) for spec in plan_chunks([str(data)], DEFAULT_CHUNK_BYTES)]
    split = "(articles: not split by stage)" if a.articles else stage_split(ctx, tasks[0])
    print(f"cores: {len(os.sched_getaffinity(0))}; one helper, per row: {split}", flush=True)
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
