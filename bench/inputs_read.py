"""What reading an input through an fsspec URL costs against its local path: planning (one pass that
finds newline-aligned chunk boundaries) and reading every chunk (`read_chunk`: ranged read + JSON
parse), and the bytes alone (`read_range`, no parsing). One process, the file in the page cache, no
GPU, no database. Rates are over the process's CPU time (single-threaded work; on a shared machine
wall time swings with the neighbours' load), wall-time rates in the last column.

    python bench/inputs_read.py [--n 360000] [--chunk-bytes 262144,2097152] [--rounds 3] [--schemes path,file]

`--n 360000` synthetic reviews make ~200 MB of JSONL. Schemes: `path` (builtin open), `file` (file://
through fsspec's LocalFileSystem). Each round runs the schemes in alternating order.
"""

from __future__ import annotations

import argparse
import statistics
import time

from embedfleet.sources import plan_chunks, read_chunk
from embedfleet.sources.files import read_range
from embedfleet.sources.files import size as size_of
from embedfleet.synth import cached_reviews


def _source(path: str, scheme: str) -> str:
    return path if scheme == "path" else f"{scheme}://{path}"


def _measure(source: str, chunk_bytes: int) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    chunks = plan_chunks([source], chunk_bytes)
    t1, c1 = time.perf_counter(), time.process_time()
    rows = sum(1 for c in chunks for _ in read_chunk(c))
    t2, c2 = time.perf_counter(), time.process_time()
    size = sum(len(b) for c in chunks for b in read_range(c.source, c.start, c.end))
    t3, c3 = time.perf_counter(), time.process_time()
    return {"chunks": len(chunks), "rows": rows, "bytes": size, "plan_s": c1 - c0, "read_s": c2 - c1,
            "bytes_s": c3 - c2, "wall": (t1 - t0, t2 - t1, t3 - t2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=360_000)
    ap.add_argument("--work", default="/tmp/efbench")
    ap.add_argument("--chunk-bytes", default=f"{256 << 10},{2 << 20}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--schemes", default="path,file")
    a = ap.parse_args()
    path = str(cached_reviews(a.work, a.n).resolve())
    schemes = a.schemes.split(",")
    with open(path, "rb") as f:  # into the page cache before the first timed run
        size = sum(len(b) for b in iter(lambda: f.read(16 << 20), b""))
    print(f"{path}: {size / 1e6:.1f} MB, {a.n:,} reviews")
    if any(s != "path" for s in schemes):
        t0 = time.perf_counter()
        size_of(_source(path, next(s for s in schemes if s != "path")))  # imports fsspec, builds the filesystem
        print(f"first URL call (fsspec import, filesystem instance): {(time.perf_counter() - t0) * 1e3:.0f} ms")
    results: dict[tuple[int, str], list[dict]] = {}
    for chunk_bytes in map(int, a.chunk_bytes.split(",")):
        for r in range(a.rounds):
            for scheme in schemes if r % 2 == 0 else schemes[::-1]:
                results.setdefault((chunk_bytes, scheme), []).append(_measure(_source(path, scheme), chunk_bytes))
    print("chunk bytes | scheme | chunks | plan MB/s | read_chunk rows/s | bytes only MB/s | the same, wall time "
          "(medians of the rounds; CPU-time rates of each round in brackets)")
    for (chunk_bytes, scheme), runs in results.items():
        assert len({(m["chunks"], m["rows"], m["bytes"]) for m in runs}) == 1
        plan = [size / 1e6 / m["plan_s"] for m in runs]
        read = [m["rows"] / m["read_s"] for m in runs]
        raw = [m["bytes"] / 1e6 / m["bytes_s"] for m in runs]
        wall = [statistics.median(q / m["wall"][i] for m in runs) for i, q in enumerate((size / 1e6, runs[0]["rows"], size / 1e6))]
        print(f"{chunk_bytes:>11,} | {scheme:>6} | {runs[0]['chunks']:>6,} | {statistics.median(plan):>9,.0f} | "
              f"{statistics.median(read):>17,.0f} | {statistics.median(raw):>15,.0f} | "
              f"{wall[0]:,.0f} / {wall[1]:,.0f} / {wall[2]:,.0f}  "
              f"[{' '.join(f'{p:,.0f}' for p in plan)}; {' '.join(f'{x:,.0f}' for x in read)}; "
              f"{' '.join(f'{x:,.0f}' for x in raw)}]")
    for scheme in schemes:  # the fixed cost of one chunk's read: open, seek, read 4 bytes, close
        source, calls = _source(path, scheme), 3000
        list(read_range(source, 1000, 1004))
        c0 = time.process_time()
        for _ in range(calls):
            list(read_range(source, 1000, 1004))
        print(f"{scheme}: {(time.process_time() - c0) / calls * 1e6:.1f} µs (CPU) to open and read a 4-byte range")


if __name__ == "__main__":
    main()
