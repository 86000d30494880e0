"""Make a fresh server's WAL segment files before its first load, as a later load finds them.

    python bench/wal_segments.py [--gb 30] [--db DSN]

A server's first long load writes every WAL segment file for the first time: whoever holds the WAL
write lock creates (and zero-fills) each 16 MB file, while every backend wanting WAL buffer space
waits. Later loads find the segments a checkpoint recycled. This switches segments until `--gb` of
them exist (a logical message between switches, since a switch with nothing written does nothing),
keeps them with min_wal_size, and checkpoints so they are recycled for the next load. For the
first-load experiment of bench/NOTES.md (issue 21); the embedded server unless --db.
"""

from __future__ import annotations

import argparse
import time

import psycopg

from embedfleet.store.embedded import resolve_dsn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=30.0)
    ap.add_argument("--db", default=None)
    a = ap.parse_args()
    with psycopg.connect(resolve_dsn(a.db), autocommit=True) as conn:
        size = conn.execute("SELECT setting::bigint FROM pg_settings WHERE name = 'wal_segment_size'").fetchone()[0]
        conn.execute(f"ALTER SYSTEM SET min_wal_size = '{int(a.gb * 1024)}MB'")
        conn.execute("SELECT pg_reload_conf()")
        t0 = time.perf_counter()
        for _ in range(int(a.gb * 2**30 // size)):
            conn.execute("SELECT pg_logical_emit_message(false, 'embedfleet', '')")
            conn.execute("SELECT pg_switch_wal()")
        t1 = time.perf_counter()
        conn.execute("CHECKPOINT")
        files, total = conn.execute("SELECT count(*), sum(size) FROM pg_ls_waldir()").fetchone()
    print(f"[wal_segments] {files} segment files, {total / 2**30:.1f} GiB: switches {t1 - t0:.1f} s, "
          f"checkpoint {time.perf_counter() - t1:.1f} s", flush=True)


if __name__ == "__main__":
    main()
