"""The one-connection bulk read of a table its server has not cached, under each of PostgreSQL 18's
io_method settings (issue 16): the embedded server is restarted (its shared buffers empty, the OS's
page cache kept), then the table is read once, then again.

    python bench/read_cold.py [--rows 10000000] [--dim 384] [--io-methods worker,sync] [--again sync]
        [--paths chunks,rows,rows-inline] [--dataset] [--out FILE]

The table is bench/train_loader.py's (`bench_train_<rows>_<dim>`, written if missing). Each read is
train_loader's read_rate into a destination whose pages were touched first: rows/s, the client's and
the server's CPU busy, the server's pages (pg_stat_io); with --dataset, `EmbeddingDataset.from_table`
on one connection (gpu tier on CUDA, else ram): the product's own read, its staging copy included. A
path is `chunks` (many rows a message) or `rows` (a message a row), whatever use_chunks would choose;
`-inline` puts each block in place on the reading thread (TableRead.ahead off). The server is left with
embedfleet's own settings. One JSON document on stdout; progress on stderr.

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
from embedfleet.train.read import TableRead  # noqa: E402

_read = TableRead.read


def forcing(path: str) -> None:
    """Every TableRead from now on reads as `path` says (chunks or rows, -inline or not)."""
    chunked, ahead = path.split("-")[0] == "chunks", not path.endswith("-inline")

    def read(self, *args, **kwargs):
        self.chunked, self.ahead = chunked, ahead
        return _read(self, *args, **kwargs)

    TableRead.read = read


def dataset_rate(dsn: str, table: str) -> dict:
    """EmbeddingDataset.from_table on one connection, as a user calls it: rows/s with its plan."""
    import torch

    from embedfleet.train import EmbeddingDataset

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    c0 = time.process_time()
    ds = EmbeddingDataset.from_table(table, label="rating", db=dsn, device=dev,
                                     cache="gpu" if dev == "cuda" else "ram", connections=1)
    out = {"tier": ds.cache, "client_cpu_s": round(time.process_time() - c0, 2), **ds.stats}
    out["copy_rows_per_s"] = round(out["rows"] / (out["read_s"] - out["plan_s"]))
    del ds
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


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
    ap.add_argument("--paths", default="chunks", help="comma list of: chunks (many rows a message), rows (a "
                    "message a row), each optionally with -inline (blocks put in place on the reading thread)")
    ap.add_argument("--dataset", action="store_true", help="EmbeddingDataset.from_table instead of the bare read")
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
            forcing(path)
            for state in ("cold", "warm") if method in a.again.split(",") else ("cold",):
                t0 = time.perf_counter()
                if a.dataset:
                    r = dataset_rate(dsn, table)
                    said = f"client cpu {r['client_cpu_s']} s, {r['tier']} tier, copy {r['copy_rows_per_s']:,} rows/s"
                else:
                    r = train_loader.read_rate(dsn, table, 1, None, prefault=True)
                    said = f"server busy {r['server_busy']}, client busy {r['client_busy']}, {r['server_io']}"
                doc["reads"].append({"io_method": method, "path": path, "shared_buffers": state,
                                     "dataset": a.dataset, **r})
                print(f"[read_cold] {method} {path} {state}: {r['rows_per_s']:,} rows/s "
                      f"({time.perf_counter() - t0:.1f} s), {said}", file=sys.stderr, flush=True)
    finally:
        restart_with(dsn, embedded.bulk_settings()["io_method"])
    train_loader._write(doc, a.out)


if __name__ == "__main__":
    main()
