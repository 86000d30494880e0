"""Make a fresh server's WAL segment files before its first load, as a later load finds them.

    python bench/wal_segments.py [--gb 30] [--db DSN]

A server's first long load writes every WAL segment file for the first time (the walwriter's
`IO:WalInitWrite`); later loads find the segments a checkpoint recycled. At four GPUs that making was
the first load's wait on the database, and making them ahead took longer than the wait it removed
(bench/NOTES.md, runs 162-169; the embedded server now sets `wal_init_zero = off` instead).

It switches segments until `--gb` of them were made (a logical message between switches, since a
switch with nothing written does nothing), with min_wal_size and max_wal_size raised so that no
checkpoint starts on the way and the closing one recycles them all, then sets both back: segments
recycled ahead stay until written.
The embedded server unless --db.
"""

from __future__ import annotations

import argparse
import time

import psycopg

from psycopg import sql

from embedfleet.store.embedded import alter_system, resolve_dsn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=30.0)
    ap.add_argument("--db", default=None)
    a = ap.parse_args()
    with psycopg.connect(resolve_dsn(a.db), autocommit=True) as conn:
        size = conn.execute("SELECT setting::bigint FROM pg_settings WHERE name = 'wal_segment_size'").fetchone()[0]
        was = {name: conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()[0]
               for name in ("min_wal_size", "max_wal_size")}
        alter_system(conn, {"min_wal_size": f"{int(a.gb * 1024)}MB", "max_wal_size": f"{int(a.gb * 2048)}MB"}, reload=True)
        try:
            t0 = time.perf_counter()
            for _ in range(int(a.gb * 2**30 // size)):
                conn.execute("SELECT pg_logical_emit_message(false, 'embedfleet', '')")
                conn.execute("SELECT pg_switch_wal()")
            t1 = time.perf_counter()
            conn.execute("CHECKPOINT")
        finally:
            alter_system(conn, was, reload=True)
        files, total = conn.execute("SELECT count(*), sum(size) FROM pg_ls_waldir()").fetchone()
    print(f"[wal_segments] {files} segment files, {total / 2**30:.1f} GiB: switches {t1 - t0:.1f} s, "
          f"checkpoint {time.perf_counter() - t1:.1f} s; min/max_wal_size back to {was['min_wal_size']}/{was['max_wal_size']}",
          flush=True)


if __name__ == "__main__":
    main()
