"""Latency of `embedfleet serve` over HTTP, as applications send requests.

    python bench/serve_latency.py --table T [--device cpu,cuda] [--n 200] [--port 8765] [--db DSN]
                                  [--clients 1,8] [--routes search,hybrid,rerank,embeddings] [--rerank MODEL]

For each device: starts `embedfleet serve --table T --device D` (its start-up timed until /health answers;
with --rerank MODEL, `serve --rerank MODEL`), and for each route and each client count: 20 warm-up requests,
then --n distinct requests spread over that many clients, each sending its next request when the last one
answered (a bounded client: at most --clients requests in flight). Reports p50, p90 and p99 of each request's
wall time (the client's view: HTTP, embedding, the search) and requests/s. Routes: `search` (GET /search, k 10),
`hybrid` (hybrid=true; the table needs a full-text index), `rerank` (rerank=true, depth 50), `embeddings` (POST
/v1/embeddings, one text). One JSON document on stdout.
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
from concurrent.futures import ThreadPoolExecutor

import orjson

import harness
from embedfleet.synth import world_texts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _get(url: str, body: bytes | None = None) -> bytes:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"} if body else {})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read()


def _request(base: str, route: str, text: str) -> None:
    if route == "embeddings":
        doc = orjson.loads(_get(base + "/v1/embeddings", orjson.dumps({"input": text, "model": "m"})))
        assert len(doc["data"]) == 1
        return
    params = {"q": text, "k": 10, **({"hybrid": "true"} if route == "hybrid" else {}),
              **({"rerank": "true"} if route == "rerank" else {})}
    doc = orjson.loads(_get(f"{base}/search?" + urllib.parse.urlencode(params)))
    assert len(doc["results"]) == 10


def _load(base: str, route: str, texts: list[str], clients: int) -> dict:
    """`texts` requests over `clients` clients (20 warm-up first): their latencies' percentiles, requests/s."""
    for t in texts[:20]:
        _request(base, route, t)
    work = texts[20:]

    def timed(t: str) -> float:
        t0 = time.perf_counter()
        _request(base, route, t)
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        times = sorted(pool.map(timed, work))
    wall = time.perf_counter() - t0
    q = lambda p: round(times[min(len(times) - 1, int(p * len(times)))] * 1e3, 2)  # noqa: E731
    return {"route": route, "clients": clients, "n": len(times), "p50_ms": q(0.5), "p90_ms": q(0.9),
            "p99_ms": q(0.99), "mean_ms": round(statistics.mean(times) * 1e3, 2),
            "requests_s": round(len(times) / wall, 1)}


def one_device(table: str, device: str, n: int, port: int, db: str | None, clients=(1,), routes=("search",),
               rerank: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "embedfleet.cli", "serve", "--table", table, "--device", device, "--port", str(port)]
    if db:
        cmd += ["--db", db]
    if rerank:
        cmd += ["--rerank", rerank]
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
        runs = []
        for route in routes:
            for c in clients:
                try:
                    runs.append(_load(base, route, queries, c))
                except OSError as e:  # one route's failure (an HTTP error) is reported; the others still run
                    runs.append({"route": route, "clients": c, "error": str(e)})
                print(f"[serve_latency] {device} {runs[-1]}", file=sys.stderr, flush=True)
        return {"device": device, "startup_s": round(start_s, 2), "runs": runs}
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
    ap.add_argument("--clients", default="1", help="client counts: 1,8")
    ap.add_argument("--routes", default="search", help="search,hybrid,rerank,embeddings")
    ap.add_argument("--rerank", default=None, help="the cross-encoder serve loads (for the rerank route)")
    a = ap.parse_args()
    clients = [int(c) for c in a.clients.split(",")]
    out = [one_device(a.table, d, a.n, a.port + i, a.db, clients, a.routes.split(","), a.rerank)
           for i, d in enumerate(a.device.split(","))]
    print(orjson.dumps(harness.stamp({"table": a.table, "runs": out}, a.db), option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
