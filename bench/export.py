"""Export and map, timed against the physical bound: a plain COPY of the same rows.

    python bench/export.py [--n 1000000] [--dim 384] [--vtype vector] [--formats parquet,npy,jsonl]
                           [--shards 1,2] [--map-points 200000] [--db DSN] [--dir /tmp]

Writes (once; reused while it has --n rows) a table of random unit vectors as ingest would leave it
(id, ~150-character content, embedding) by binary COPY. Then, in one run:
  - the bound: `COPY (SELECT id, content, embedding …) TO '/dev/null'` on the server (binary), the
    same stream read by a client and dropped, and read by a client into a file;
  - `embedfleet export` per format and shard count, as users run it (the CLI in a fresh process:
    start-up included in `wall_s`, the export's own time in `export_s`);
  - `embedfleet map` of --map-points rows in 8 topics (CLI, fresh process: imports and numba's
    compilation included), with its read / UMAP / render split and the page's size.
Prints one JSON document. Files go to a temporary directory under --dir, removed as it goes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import psycopg
from psycopg import sql

import harness
from embedfleet.settings import Settings
from embedfleet.pg.embedded import resolve_dsn
from embedfleet.synth_table import write_vector_table


def ensure(conn: psycopg.Connection, table: str, n: int, dim: int, vtype: str, topics: int = 0) -> float:
    """Seconds spent writing the table (0 when it is already there with n rows)."""
    try:
        if conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()[0] == n:
            return 0.0
    except psycopg.errors.UndefinedTable:
        pass
    t0 = time.perf_counter()
    write_vector_table(conn, table, n, dim=dim, vtype=vtype, topics=topics)
    conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(table)))
    return time.perf_counter() - t0


def bound(dsn: str, table: str, directory: Path) -> dict:
    """A plain binary COPY of (id, content, embedding): to the server's /dev/null, to a client that drops
    it, and to a client that writes it to a file."""
    query = sql.SQL("COPY (SELECT id, content, embedding FROM {}) TO STDOUT (FORMAT BINARY)").format(
        sql.Identifier(table))
    out = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        t0 = time.perf_counter()
        try:  # needs a superuser or pg_write_server_files (the embedded server's user is one)
            conn.execute(sql.SQL("COPY (SELECT id, content, embedding FROM {}) TO '/dev/null' (FORMAT BINARY)").format(
                sql.Identifier(table)))
            out["server_to_devnull_s"] = time.perf_counter() - t0
        except psycopg.errors.InsufficientPrivilege:
            pass
        for name, path in (("client_to_devnull", None), ("client_to_file", directory / "copy.bin")):
            size = 0
            t0 = time.perf_counter()
            with conn.cursor() as cur, cur.copy(query) as copy:
                f = open(path, "wb") if path else None
                for data in copy:
                    size += len(data)
                    if f:
                        f.write(data)
                if f:
                    f.flush()
                    os.fsync(f.fileno())
                    f.close()
            out[f"{name}_s"] = time.perf_counter() - t0
            out["copy_bytes"] = size
            if path:
                path.unlink()
    return out


def cli(*args: str) -> tuple[dict, float]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "embedfleet.cli", *args, "--json"], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"embedfleet {' '.join(args)} failed:\n{p.stderr[-3000:]}")
    return orjson.loads(p.stdout), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--vtype", default="vector", choices=["vector", "halfvec"])
    ap.add_argument("--formats", default="parquet,npy,jsonl")
    ap.add_argument("--shards", default="1,2")
    ap.add_argument("--map-points", type=int, default=200_000, help="0: no map")
    ap.add_argument("--db")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go (then removed)")
    args = ap.parse_args()
    dsn = resolve_dsn(args.db, Settings.from_env())
    table = f"bench_export_{args.n}_{args.dim}_{args.vtype}"
    result: dict = harness.stamp({"n": args.n, "dim": args.dim, "vtype": args.vtype, "cores": os.cpu_count(),
                                  "table": table}, dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        result["table_write_s"] = round(ensure(conn, table, args.n, args.dim, args.vtype), 2)
        result["table_bytes"] = conn.execute("SELECT pg_table_size(%s::regclass)", [table]).fetchone()[0]
    directory = Path(tempfile.mkdtemp(prefix="embedfleet-export-bench-", dir=args.dir))
    try:
        b = bound(dsn, table, directory)  # also warms the cache for what follows
        b = bound(dsn, table, directory)
        mb = b["copy_bytes"] / 1e6
        result["copy"] = {**{k: round(v, 3) for k, v in b.items()}, "copy_mb": round(mb, 1),
                          **{k[:-2] + "_rows_per_s": round(args.n / v) for k, v in b.items() if k.endswith("_s")},
                          **{k[:-2] + "_mb_per_s": round(mb / v, 1) for k, v in b.items() if k.endswith("_s")}}
        runs = []
        for fmt in args.formats.split(","):
            for shards in map(int, args.shards.split(",")):
                out = directory / (f"out-{fmt}" if fmt == "npy" or shards > 1 else f"out.{fmt}")
                summary, wall = cli("export", "--table", table, "--format", fmt, "--out", str(out), "--db", dsn,
                                    "--shards", str(shards), "--quiet")
                s = summary["seconds"]
                runs.append({"format": fmt, "shards": shards, "rows": summary["rows"], "wall_s": round(wall, 2),
                             "export_s": s, "rows_per_s": round(summary["rows"] / s),
                             "out_mb": round(summary["bytes"] / 1e6, 1), "out_mb_per_s": round(summary["bytes"] / 1e6 / s, 1),
                             "copy_mb_per_s": round(mb / s, 1), "vs_client_copy_to_file": round(b["client_to_file_s"] / s, 3)})
                shutil.rmtree(out) if out.is_dir() else out.unlink()
                print(orjson.dumps(runs[-1]).decode(), file=sys.stderr)
        result["exports"] = runs
        if args.map_points:
            map_table = f"bench_map_{args.map_points}_{args.dim}"
            with psycopg.connect(dsn, autocommit=True) as conn:
                ensure(conn, map_table, args.map_points, args.dim, "vector", topics=8)
            page = directory / "map.html"
            summary, wall = cli("map", "--table", map_table, "--color-by", "topic", "--sample", str(args.map_points),
                                "--out", str(page), "--db", dsn)
            result["map"] = {"points": summary["rows"], "wall_s": round(wall, 1), "method": summary["method"],
                             **{k: summary[k] for k in ("read_s", "umap_s", "render_s", "seconds")},
                             "html_mb": round(page.stat().st_size / 1e6, 1)}
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
