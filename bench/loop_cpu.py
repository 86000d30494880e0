"""One worker's GPU loop by itself: how fast could it go if input and database were free?

    python bench/loop_cpu.py [--n 200000] [--rows N] [--model DIR] [--batch-tokens 65536,262144] [--profile]

Synthetic reviews (the ingest benchmark's corpus) are tokenized up front into units of one chunk
each (2 MB of input, as the pipeline makes them); then the loop of `run_worker` — queue unit k+1 on
the device, then read unit k's vectors — runs over all of them with no helpers, no writer and no
database. Reported per token-budget ceiling: rows/s, the loop thread's CPU µs per row, the GPU's
busy share (NVML). --rows: only the first chunks of the corpus, up to about N rows. With --profile, the loop's top functions by own time (cProfile) for the first.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import harness
from ingest import GpuSampler  # bench/ingest.py


def units_of(n: int, rows: int, model: str | None, work: str):
    from embedfleet.settings import DEFAULT_CHUNK_BYTES
    from embedfleet.encode.encoder import Encoder
    from embedfleet.sources.records import to_records
    from embedfleet.sources import read_chunk
    from embedfleet.sources.plan import plan_chunks
    from embedfleet.sources.presets import get_preset
    from embedfleet.synth import cached_reviews

    data = cached_reviews(work, n)
    preset = get_preset("amazon-reviews")
    units = []
    with Encoder(model, device="cpu") as enc:  # only its tokenizer (a pool of processes)
        for spec in plan_chunks([str(data)], DEFAULT_CHUNK_BYTES):
            units.append(enc.tokenize([r.content for r in to_records(list(read_chunk(spec)), preset)[0]]))
            if sum(map(len, units)) >= rows:
                break
    return units


def run_loop(enc, units) -> None:
    pending = None
    for tok in units:
        handle = enc.embed_async(tok)
        if pending is not None:
            pending.result()
        pending = handle
    pending.result()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch-tokens", default="65536,262144")
    ap.add_argument("--work", default="/tmp/efbench")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from embedfleet.encode.encoder import Encoder
    from embedfleet.ingest.prepare import settle_gc

    units = units_of(a.n, a.rows or a.n, a.model, a.work)
    rows, tokens = sum(len(u) for u in units), sum(u.num_tokens for u in units)
    results = []
    for i, bt in enumerate(int(x) for x in a.batch_tokens.split(",")):
        enc = Encoder(a.model, batch_tokens=bt, tokenizer_workers=0)
        enc.warmup()
        run_loop(enc, units[:4])
        settle_gc()
        sampler = GpuSampler([0])
        sampler.start()
        t0, c0 = time.perf_counter(), time.thread_time()
        run_loop(enc, units)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        r = {"batch_tokens": bt, "rows": rows, "tokens_per_row": round(tokens / rows, 1), "units": len(units),
             "rows_per_s": round(rows / wall), "loop_cpu_us_per_row": round(cpu / rows * 1e6, 2),
             "gpu_util_pct": sampler.stop()[0], "device": enc.device}
        if a.profile and i == 0:
            prof = cProfile.Profile()
            prof.enable()
            run_loop(enc, units)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            r["profile"] = text.getvalue()
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "profile"}), flush=True)
        if "profile" in r:
            print(r["profile"], flush=True)
        enc.close()
    if a.out:  # the runs under "results", beside the environment stamp
        harness.record(results, a.out)


if __name__ == "__main__":
    main()
