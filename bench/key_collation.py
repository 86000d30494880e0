"""COPY rows into a table whose text primary key has the database's collation, or "C": the server's time a row.

    EMBEDFLEET_HOME=/tmp/h python bench/key_collation.py [N]     # the embedded server; N rows (1,000,000)

Ids as the amazon-reviews preset makes them (user|asin|timestamp), from 8 shards interleaved in runs of 2,000
(as 8 writers insert them); two rounds of both collations.
"""
from __future__ import annotations

import sys
import time

import psycopg

from embedfleet.store.embedded import resolve_dsn

n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
dsn = resolve_dsn(None)
# ids as the amazon-reviews preset makes them, from 8 shards interleaved in batches of 2000 (8 writers)
shards = 8
rows = []
per = n // shards
for start in range(0, per, 2000):
    for s in range(shards):
        for i in range(start, min(per, start + 2000)):
            rows.append(f"U{s:03d}{i:010d}|B{(i*7919)%100000:09d}|{1_600_000_000_000 + i*1000}")
data = "".join(f"{r}\t{k}\n" for k, r in enumerate(rows)).encode()
with psycopg.connect(dsn, autocommit=True) as c:
    for rep in range(2):
        for coll in ("", ' COLLATE "C"'):
            c.execute("DROP TABLE IF EXISTS coll_t")
            c.execute(f"CREATE TABLE coll_t (id text{coll} PRIMARY KEY, v bigint)")
            t0 = time.perf_counter()
            with c.cursor() as cur:
                with cur.copy("COPY coll_t (id, v) FROM STDIN") as cp:
                    step = len(data) // 50
                    pos = 0
                    while pos < len(data):
                        end = data.find(b"\n", pos + step) + 1 or len(data)
                        cp.write(data[pos:end]); pos = end
            dt = time.perf_counter() - t0
            print(f"collation {coll or 'database (C.UTF-8, libc)':28s}: {n/dt:,.0f} rows/s, {dt/n*1e6:.2f} us a row", flush=True)
    c.execute("DROP TABLE IF EXISTS coll_t")
