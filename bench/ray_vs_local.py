"""What Ray adds: the same ingest with the local launcher and with `--ray` on a 2-node Ray cluster of this
machine, one after the other, on the same corpus (CPU workers, MiniLM, the embedded PostgreSQL).

    python bench/ray_vs_local.py [--n 3000] [--workers 2] [--rounds 2]

For each run: wall time of the whole command, start-up (command start to the first worker's loop), the
workers' loop rate (rows over the span of their loops) and the wall rate. One JSON document on stdout.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import orjson

from _cli import loop_span, run_json
from embedfleet.store.embedded import resolve_dsn
from embedfleet.synth import write_amazon_reviews


def run(args: list[str], env: dict) -> dict:
    t0, wall, doc = run_json(args, env)
    workers = doc["workers"]
    first, loop = loop_span(workers)
    return {"rows": doc["rows_written"], "wall_s": round(wall, 2), "startup_s": round(first - t0, 2),
            "loop_s": round(loop, 2), "rows_per_s_loop": round(doc["rows_written"] / loop, 1),
            "rows_per_s_wall": round(doc["rows_written"] / wall, 1), "workers": len(workers)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    from ray.cluster_utils import Cluster

    dsn = resolve_dsn(None)
    with tempfile.TemporaryDirectory() as tmp:
        src = write_amazon_reviews(Path(tmp) / "r.jsonl", a.n, seed=3)
        cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": a.workers})
        cluster.add_node(num_cpus=a.workers)
        cluster.wait_for_nodes()
        results = []
        try:
            for r in range(a.rounds):
                for how in ("local", "ray"):
                    table = f"rvl_{how}_{r}_{int(time.time())}"
                    cmd = ["ingest", str(src), "--preset", "amazon-reviews",
                           "--db", dsn, "--table", table, "--devices", "cpu", "--workers", str(a.workers),
                           "--no-index", "--json", "--quiet"]
                    if how == "ray":
                        cmd += ["--ray", cluster.address]
                    results.append({"launcher": how, "round": r, **run(cmd, dict(os.environ))})
                    print(results[-1], file=sys.stderr, flush=True)
        finally:
            cluster.shutdown()
    print(orjson.dumps({"n": a.n, "workers": a.workers, "cores": os.cpu_count(),
                        "load_avg_at_end": os.getloadavg(), "runs": results}, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
