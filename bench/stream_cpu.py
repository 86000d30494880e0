"""Worker-side cost of a compressed input: what the worker process itself does per review for a
.jsonl.gz (decompress, cut into tasks, pickle them for the helpers). No GPU, no database.

    python bench/stream_cpu.py [--n 100000]
"""

from __future__ import annotations

import argparse
import gzip
import pickle
import time

from embedfleet.settings import DEFAULT_CHUNK_BYTES
from embedfleet.ingest.claim import stream_tasks
from embedfleet.sources.plan import ChunkSpec
from embedfleet.synth import cached_reviews


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--work", default="/tmp/efbench")
    a = ap.parse_args()
    plain = cached_reviews(a.work, a.n)
    gz = plain.with_suffix(".jsonl.gz")
    if not gz.exists():
        gz.write_bytes(gzip.compress(plain.read_bytes(), 6))
    spec = ChunkSpec(str(gz), "stream", 0, 0, 1)
    t0 = time.perf_counter()
    tasks = list(stream_tasks(spec, 0, None, DEFAULT_CHUNK_BYTES))
    t1 = time.perf_counter()
    sent = sum(len(pickle.dumps(t, protocol=5)) for t in tasks)
    t2 = time.perf_counter()
    print(f"{a.n:,} reviews, {len(tasks)} tasks: cutting {(t1 - t0) / a.n * 1e6:.2f} µs/review, "
          f"pickling {(t2 - t1) / a.n * 1e6:.2f} µs/review, {sent / a.n:,.0f} bytes/review sent")


if __name__ == "__main__":
    main()
