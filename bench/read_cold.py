"""The one-connection bulk read of a table its server has not cached, under each of PostgreSQL 18's
io_method settings (issue 16): the embedded server is restarted (its shared buffers empty, the OS's
page cache kept), then the table is read once, then again.

    python bench/read_cold.py [--rows 10000000] [--dim 384] [--io-methods worker,sync] [--again sync] [--paths chunks,rows]
        [--out FILE]

The table is bench/train_loader.py's (`bench_train_<rows>_<dim>`, written if missing). Each read is
train_loader's read_rate into a destination whose pages were touched first: rows/s, the client's and
the server's CPU busy, the server's pages (pg_stat_io). The server is left with embedfleet's own
settings. One JSON document on stdout; progress on stderr.

A read's plan scans the table first; for a table smaller than a quarter of the shared buffers that scan
keeps its pages there, so a "cold" read is cold only for tables larger than that (the 10M-row one: 16 GB).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import train_loader  # noqa: E402

from embedfleet.store import embedded  # noqa: E402
from embedfleet.store.ledger import connect  # noqa: E402


def restart_with(dsn: str, io_method: str) -> None:
    with connect(dsn) as conn:
        conn.autocommit = True
        conn.execute(f"ALTER SYSTEM SET io_method = '{io_method}'")
    embedded._pgserver().pg_ctl(["-w", "restart"], pgdata=embedded.home() / "pgdata", user=embedded._user())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--io-methods", default="worker,sync")
    ap.add_argument("--again", default="sync", help="io methods whose cold read is followed by a warm one")
    ap.add_argument("--paths", default="chunks", help="comma list of: chunks (many rows a message, the default "
                    "on PostgreSQL 14+), rows (a message a row)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if os.environ.get("EMBEDFLEET_DB"):  # it restarts the embedded server: the one it reads must be that one
        sys.exit("read_cold.py measures the embedded server; unset EMBEDFLEET_DB")
    dsn = embedded.start()
    table = f"bench_train_{a.rows}_{a.dim}"
    doc = {"machine": train_loader._machine(), "table": train_loader.write_table(
        dsn, table, a.rows, a.dim, writers=max(1, min(8, (os.cpu_count() or 2) // 2))), "reads": []}
    try:
        for method, path in itertools.product(a.io_methods.split(","), a.paths.split(",")):
            restart_with(dsn, method)
            for state in ("cold", "warm") if method in a.again.split(",") else ("cold",):
                t0 = time.perf_counter()
                r = train_loader.read_rate(dsn, table, 1, None, prefault=True, chunked=path == "chunks")
                doc["reads"].append({"io_method": method, "path": path, "shared_buffers": state, **r})
                print(f"[read_cold] {method} {path} {state}: {r['rows_per_s']:,} rows/s "
                      f"({time.perf_counter() - t0:.1f} s), server busy {r['server_busy']}, "
                      f"client busy {r['client_busy']}, {r['server_io']}", file=sys.stderr, flush=True)
    finally:
        restart_with(dsn, embedded.bulk_settings()["io_method"])
    train_loader._write(doc, a.out)


if __name__ == "__main__":
    main()
