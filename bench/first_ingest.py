"""The README's first commands as a user meets them: on a new, empty EMBEDFLEET_HOME each time, `embedfleet
ingest` of the example reviews (it makes the embedded server), then `embedfleet search` on that table, each a
new process timed from its start to its exit.

    python bench/first_ingest.py [--runs 3] [--warmup 1] [--model DIR] [--out FILE]

The warm-up runs (timed, left out) take the machine's own first start: a fresh host's first torch import, its
disk's first writes. Each run's home is new, so its bytecode and compile caches are cold too, as a new user's.
One JSON document on stdout (the environment stamp first): min, median and max of the ingest and of the
search after it, and the pg_wal a new server made; each run on stderr as it ends.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import harness

REVIEWS = [str(harness.ROOT / "examples/Cell_Phones_and_Accessories.jsonl"), "--meta",
           str(harness.ROOT / "examples/meta_Cell_Phones_and_Accessories.jsonl"), "--preset", "amazon-reviews", "--quiet"]
SEARCH = ["battery dies after a week", "--table", "Cell_Phones_and_Accessories", "--where", "rating <= 2"]


def _mb(path: Path) -> float | None:
    return round(sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20, 1) if path.exists() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="runs left out first (default 1)")
    ap.add_argument("--model", default=None, help="model directory for the ingest (default: the bundled MiniLM)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one command may take")
    ap.add_argument("--out", default=None, help="also write the JSON document here")
    a = ap.parse_args()
    model = ["--model", a.model] if a.model else []
    runs = []
    for r in range(a.warmup + a.runs):
        with harness.FreshHome() as env:
            ingest = harness.fresh(["embedfleet", "ingest", *REVIEWS, *model], env, a.timeout)
            search = harness.fresh(["embedfleet", "search", *SEARCH], env, a.timeout)
            wal = _mb(Path(env["EMBEDFLEET_HOME"]) / "pgdata" / "pg_wal")
        runs.append({"ingest_s": round(ingest, 3), "search_s": round(search, 3), "pg_wal_mb": wal})
        print(f"[first_ingest] {'warm-up' if r < a.warmup else 'run'}: {runs[-1]}", file=sys.stderr, flush=True)
    timed, left_out = runs[a.warmup:], runs[:a.warmup]
    doc = {"model": a.model or "bundled all-MiniLM-L6-v2", "warmup": left_out,
           "ingest": harness.summary([x["ingest_s"] for x in timed]),
           "search": harness.summary([x["search_s"] for x in timed]),
           "pg_wal_mb": [x["pg_wal_mb"] for x in timed]}
    print(harness.record(doc, a.out))


if __name__ == "__main__":
    main()
