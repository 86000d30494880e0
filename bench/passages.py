"""Passages against whole documents: Wikipedia-length articles ingested twice, with `--passages` and
without, on the same corpus, model and GPU (the embedded PostgreSQL, --no-index).

    python bench/passages.py [--n 50000] [--passages 256:32] [--model DIR] [--devices cuda] [--skip-whole]

Writes `--n` articles (median ~700 words, `synth.write_articles`, Wikipedia's Parquet layout), then for
each run reads the worker's summary from `ingest --json`: rows and tokens over the loop's time, and the
seconds the GPU loop waited for its input (the helpers, which do the splitting). One JSON document.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import orjson

import harness
from _cli import loop_span, run_json
from embedfleet.settings import Settings
from embedfleet.pg.embedded import resolve_dsn
from embedfleet.synth import write_articles


def ingest(src: Path, dsn: str, table: str, extra: list[str], model: str | None, devices: str) -> dict:
    args = ["ingest", src, "--preset", "wikipedia", "--db", dsn, "--table", table, "--devices", devices,
            "--no-index", "--json", "--quiet", *extra] + (["--model", model] if model else [])
    _, wall, doc = run_json(args)
    w = doc["workers"]
    _, loop = loop_span(w)
    rows, tokens = sum(x["rows"] for x in w), sum(x["tokens"] for x in w)
    return {"rows": rows, "tokens": tokens, "wall_s": round(wall, 2), "loop_s": round(loop, 2),
            "rows_per_s": round(rows / loop, 1), "tokens_per_s": round(tokens / loop, 1),
            "input_wait_s": round(max(x["input_wait_s"] for x in w), 3),
            "gpu_waited_share": round(max(x["input_wait_s"] for x in w) / loop, 4),
            "first_wait_s": max(x.get("first_wait_s", 0) for x in w), "sink_wait_s": max(x["sink_wait_s"] for x in w),
            "input_wait_by_tenth_s": w[0].get("input_wait_by_tenth_s"),
            "claims_ahead": [w[0]["claims_ahead_mean"], w[0]["claims_ahead_end"]],
            "helpers": w[0]["helpers"], "startup": w[0]["startup"],
            # where the input's time went: the helpers' CPU a row, and the worker's records thread
            "helper_cpu_us_per_row": round(1e6 * sum(x.get("helper_cpu_s", 0) for x in w) / max(1, rows), 1),
            "helper_busy_s": sum(x.get("helper_busy_s", 0) for x in w),
            "records_thread_s": {k: max(x.get(k, 0) for x in w) for k in ("read_s", "collect_s", "records_blocked_s")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50000)
    ap.add_argument("--passages", default="256:32")
    ap.add_argument("--model", default=None)
    ap.add_argument("--devices", default="auto")
    ap.add_argument("--work", default=None)
    ap.add_argument("--skip-whole", action="store_true", help="only the run with passages")
    a = ap.parse_args()
    dsn = resolve_dsn(None, Settings.from_env())
    if a.work:
        Path(a.work).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=a.work) as tmp:
        t0 = time.time()
        src = write_articles(Path(tmp) / "articles.parquet", a.n)
        written = time.time() - t0
        stamp = int(time.time())
        whole = None if a.skip_whole else ingest(src, dsn, f"articles_{stamp}", [], a.model, a.devices)
        parts = ingest(src, dsn, f"passages_{stamp}", ["--passages", a.passages], a.model, a.devices)
    print(orjson.dumps(harness.stamp({"articles": a.n, "corpus_written_s": round(written, 1), "passages": a.passages,
                                      "cores": os.cpu_count(), "whole_documents": whole, "with_passages": parts}, dsn),
                       option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
