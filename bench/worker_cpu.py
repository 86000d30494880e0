"""The worker's CPU ceiling: the real pipeline with an infinitely fast GPU.

    python bench/worker_cpu.py [--n 50000] [--model DIR] [--gpu-tokens-per-s R]

Ledger claims, reading, templating (amazon-reviews preset, meta-less), the tokenizer (pool or
in-process, as on the real machine), the writer's COPY transactions — everything a worker does —
with the forward pass replaced by random unit vectors that are ready at once. The rows/s it prints is
the most one worker process can feed a GPU on this machine; if a model embeds faster than that on
the GPU (MiniLM does), the worker, not the GPU, sets the pace. No GPU needed, so it can be iterated on
anywhere.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from embedfleet.settings import Settings, build_job
from embedfleet.ingest.job import check_job, plan_job
from embedfleet.ingest.worker import Worker
from embedfleet.pg.embedded import resolve_dsn
from embedfleet.ledger import Ledger
from embedfleet.synth import write_amazon_reviews


class _Ready:
    def __init__(self, vectors, done_at=0.0):
        self.vectors, self.done_at = vectors, done_at

    def result(self):
        time.sleep(max(0.0, self.done_at - time.perf_counter()))
        return self.vectors


class EmulatedEncoder:
    """Unit vectors for every text at no cost (`tokens_per_s` None), or a device that embeds
    `tokens_per_s` tokens a second, one launch after another: a launch's vectors are ready when the
    device has worked through everything queued before it. Injected into the real Worker."""

    name, device = "emulated", "cuda"

    def __init__(self, dim: int = 384, tokens_per_s: float | None = None):
        self.dim, self.rate, self.free_at = dim, tokens_per_s, 0.0

    def embed_async(self, tok):
        rng = np.random.default_rng(len(tok))
        v = rng.standard_normal((len(tok), self.dim)).astype(np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        if not self.rate:
            return _Ready(v)
        self.free_at = max(time.perf_counter(), self.free_at) + tok.num_tokens / self.rate
        return _Ready(v, self.free_at)

    def warmup(self, wait=True, compile=True):
        pass

    def close(self):
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--model", default=None)
    ap.add_argument("--db", default=None)
    ap.add_argument("--gpu-tokens-per-s", type=float, default=None,
                    help="emulate a device of this speed instead of an instant one (to see the claim throttle work)")
    a = ap.parse_args()
    encoder = EmulatedEncoder(tokens_per_s=a.gpu_tokens_per_s)
    dsn = resolve_dsn(a.db, Settings.from_env())
    with tempfile.TemporaryDirectory() as tmp:
        src = write_amazon_reviews(Path(tmp) / "r.jsonl", a.n)
        job = f"cpu_ceiling_{int(time.time())}"
        cfg = build_job(dict(inputs=[str(src)], preset="amazon-reviews", model=a.model, table=job, job=job,
                                no_index=True, devices="cpu"))
        ledger = Ledger.connect(dsn)
        plan_job(check_job(cfg, ledger.conn, Settings.from_env()), ledger, "cuda")
        t0, c0 = time.perf_counter(), time.process_time()
        summary = Worker(job, dsn, "ceiling", "cpu", Settings.from_env(), encoder=lambda cfg, device, s: encoder).run()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rows = summary["rows"]
    print(f"{rows:,} rows in {wall:.1f} s: {rows / wall:,.0f} rows/s with an instant forward pass "
          f"({os.cpu_count()} cores; input wait {summary['input_wait_s']:.1f} s); the worker process itself "
          f"(all its threads, not its helpers) used {cpu:.1f} CPU s = {cpu / max(rows, 1) * 1e6:.1f} µs per row")


if __name__ == "__main__":
    main()
