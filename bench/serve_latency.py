"""Latency of `embedfleet serve`: one query at a time over HTTP, as an application would send them.

    python bench/serve_latency.py --table T [--device cpu,cuda] [--n 200] [--port 8765] [--db DSN]

For each device: starts `embedfleet serve --table T --device D` (its start-up timed until /health
answers), sends 20 warm-up queries, then `--n` distinct queries one after another, and reports p50, p90
and p99 of the wall time of each request (the client's view: HTTP, embedding, the HNSW search). One
JSON document on stdout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import orjson

import harness
from embedfleet.synth import world_texts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read()


def one_device(table: str, device: str, n: int, port: int, db: str | None) -> dict:
    cmd = [sys.executable, "-m", "embedfleet.cli", "serve", "--table", table, "--device", device, "--port", str(port)]
    if db:
        cmd += ["--db", db]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                _get(base + "/health")
                break
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit(f"serve exited: {proc.stderr.read()[-2000:]}")
                time.sleep(0.05)
        start_s = time.perf_counter() - t0
        queries = [" ".join(t.split()[:12]) for t in world_texts(n + 20, seed=5)]
        times = []
        for i, q in enumerate(queries):
            t = time.perf_counter()
            doc = orjson.loads(_get(f"{base}/search?" + urllib.parse.urlencode({"q": q, "k": 10})))
            if i >= 20:
                times.append(time.perf_counter() - t)
            assert len(doc["results"]) == 10
        times.sort()
        q = lambda p: round(times[min(len(times) - 1, int(p * len(times)))] * 1e3, 2)  # noqa: E731
        return {"device": device, "startup_s": round(start_s, 2), "n": len(times), "p50_ms": q(0.5), "p90_ms": q(0.9),
                "p99_ms": q(0.99), "mean_ms": round(statistics.mean(times) * 1e3, 2)}
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", required=True)
    ap.add_argument("--device", default="cpu,cuda")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--db", default=None)
    a = ap.parse_args()
    out = [one_device(a.table, d, a.n, a.port + i, a.db) for i, d in enumerate(a.device.split(","))]
    print(orjson.dumps(harness.stamp({"table": a.table, "runs": out}, a.db), option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
