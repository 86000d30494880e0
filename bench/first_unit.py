"""A passage helper's first units against its next ones (issue 20: what the GPU waits for at a job's start).

    python bench/first_unit.py [--articles 2000] [--per-unit 15] [--units 8] [--passages 254:32]

Writes Wikipedia-length articles (`synth.write_articles`), builds one `Preparer` in this process as a helper
does, and times its calls on consecutive units of `--per-unit` articles: the first pays the word cache's and
the libraries' first use.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--articles", type=int, default=2000)
    ap.add_argument("--per-unit", type=int, default=15)
    ap.add_argument("--units", type=int, default=8)
    ap.add_argument("--passages", default="254:32")
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    from embedfleet.encode.passages import parse_passages
    from embedfleet.encode.tokenize import tokenizer_spec
    from embedfleet.runtime.units import Preparer, Task, UnitContext, settle_gc
    from embedfleet.sources import read_chunk
    from embedfleet.sources.plan import plan_chunks
    from embedfleet.synth import write_articles

    with tempfile.TemporaryDirectory() as tmp:
        path = write_articles(Path(tmp) / "articles.parquet", a.articles)
        spec = plan_chunks([str(path)], 1 << 40)[0]
        raws = list(read_chunk(spec))
    ctx = UnitContext("wikipedia", None, None, None, tokenizer_spec(a.model), passages=parse_passages(a.passages))
    t0 = time.perf_counter()
    prepare = Preparer(ctx)
    settle_gc()
    print(f"Preparer: {time.perf_counter() - t0:.3f} s")
    for k in range(a.units):
        unit = raws[k * a.per_unit:(k + 1) * a.per_unit]
        task = Task(spec, 0, None, raws=unit, cursor_line=unit[-1].line)
        t = time.perf_counter()
        out = prepare(task)
        dt = time.perf_counter() - t
        print(f"unit {k}: {len(unit)} articles -> {out.rows.n} passages in {dt * 1000:.1f} ms "
              f"({dt / out.rows.n * 1e6:.0f} µs a passage)")


if __name__ == "__main__":
    main()
