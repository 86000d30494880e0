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

from embedfleet.config import build_config
from embedfleet.runtime.local import prepare
from embedfleet.runtime.worker import run_worker
from embedfleet.store.embedded import resolve_dsn
from embedfleet.store.ledger import Ledger, connect
from embedfleet.synth import write_amazon_reviews


def instant_forward(self, tok):
    """Stands in for Encoder._launch: unit vectors for every text, no device work."""
    import torch

    from embedfleet.encode import encoder as encoder_mod

    rng = np.random.default_rng(len(tok))
    v = rng.standard_normal((len(tok), self.dim)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return encoder_mod._Pending(torch.from_numpy(v), None)


class EmulatedDevice:
    """A GPU that embeds `tokens_per_s` tokens a second, one launch after another (no real work):
    a launch's vectors are ready when the device has worked through everything queued before it."""

    def __init__(self, tokens_per_s: float):
        self.rate, self.free_at = tokens_per_s, 0.0

    def forward(self, enc, tok):
        from embedfleet.encode import encoder as encoder_mod

        self.free_at = max(time.perf_counter(), self.free_at) + tok.num_tokens / self.rate
        pending = instant_forward(enc, tok)
        done_at = self.free_at

        class Done:
            @staticmethod
            def synchronize():
                time.sleep(max(0.0, done_at - time.perf_counter()))

        return encoder_mod._Pending(pending.host, Done())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--model", default=None)
    ap.add_argument("--db", default=None)
    ap.add_argument("--gpu-tokens-per-s", type=float, default=None,
                    help="emulate a device of this speed instead of an instant one (to see the claim throttle work)")
    a = ap.parse_args()
    # torch only here, not at the top: the worker's helpers re-import this script as their main module.
    from embedfleet.encode import encoder as encoder_mod

    if a.gpu_tokens_per_s:
        device = EmulatedDevice(a.gpu_tokens_per_s)
        encoder_mod.Encoder._launch = lambda self, tok: device.forward(self, tok)
    else:
        encoder_mod.Encoder._launch = instant_forward
    dsn = resolve_dsn(a.db)
    with tempfile.TemporaryDirectory() as tmp:
        src = write_amazon_reviews(Path(tmp) / "r.jsonl", a.n)
        job = f"cpu_ceiling_{int(time.time())}"
        cfg = build_config(dict(inputs=[str(src)], preset="amazon-reviews", model=a.model, table=job, job=job,
                                no_index=True, devices="cpu"))
        prepare(cfg, Ledger(connect(dsn)))
        t0, c0 = time.perf_counter(), time.process_time()
        stats = run_worker(job, dsn, "ceiling", "cpu")
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"{stats.rows:,} rows in {wall:.1f} s: {stats.rows / wall:,.0f} rows/s with an instant forward pass "
          f"({os.cpu_count()} cores; input wait {stats.wait_seconds:.1f} s); the worker process itself "
          f"(all its threads, not its helpers) used {cpu:.1f} CPU s = {cpu / max(stats.rows, 1) * 1e6:.1f} µs per row")


if __name__ == "__main__":
    main()
