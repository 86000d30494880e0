"""A table of synthetic unit vectors, as ingest would have left it, written by binary COPY in seconds.

Export and map tests and benchmarks need tables of a known shape (a million rows of 384 dimensions)
without embedding anything: ids `r000000000042`, a short text, optionally a `topic` (vectors then
lie around one random centre per topic, so a map has something to show) and the embedding.
"""

from __future__ import annotations

import numpy as np
import psycopg
from psycopg import sql

from embedfleet.sources.records import Column
from embedfleet.pg.copyin import SIGNATURE, TRAILER, RowEncoder, assemble, vector_fields
from embedfleet.pg.ddl import ensure_table, ensure_vector

__all__ = ["write_vector_table"]

_FILLER_WORDS = ("the a of and phone case battery screen works well after week quality price fast slow "
                 "great good love broke return cable fits color light sturdy glass charge").split()


def write_vector_table(conn: psycopg.Connection, table: str, n: int, dim: int = 384, vtype: str = "vector",
                       seed: int = 0, topics: int = 0, block: int = 50_000) -> None:
    """(Re)create `table` with `n` rows: id, content, [topic,] embedding (`vtype`: vector or halfvec)."""
    ensure_vector(conn)
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))
    ensure_table(conn, table, [Column("topic", "text")] if topics else [], dim, vtype)
    rng = np.random.default_rng(seed)
    centres = _unit(rng.standard_normal((max(topics, 1), dim)))
    filler = " ".join(rng.choice(_FILLER_WORDS, 20_000))
    encoder = RowEncoder(["text", "text", "text"] if topics else ["text", "text"])
    names = ["id", "content", "topic", "embedding"] if topics else ["id", "content", "embedding"]
    copy = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(
        sql.Identifier(table), sql.SQL(", ").join(map(sql.Identifier, names)))
    with conn.cursor() as cur, cur.copy(copy) as cp:
        cp.write(SIGNATURE)
        for start in range(0, n, block):
            m = min(block, n - start)
            label = rng.integers(0, max(topics, 1), m)
            vecs = _unit(centres[label] * (1.5 if topics else 0) + rng.standard_normal((m, dim)) / np.sqrt(dim))
            starts = rng.integers(0, len(filler) - 400, m).tolist()
            lengths = np.clip(rng.lognormal(5.0, 0.5, m), 20, 400).astype(int).tolist()
            rows = []
            for i in range(m):
                rid, text = f"r{start + i:012d}", filler[starts[i]:starts[i] + lengths[i]]
                if topics:
                    topic = f"topic {label[i]}"
                    rows.append((rid, f"{topic}, row {start + i}: {text}", topic))
                else:
                    rows.append((rid, f"row {start + i}: {text}"))
            data = assemble(encoder.encode(rows), vector_fields(vecs.astype(np.float32), vtype))
            cp.write(memoryview(data)[len(SIGNATURE):-len(TRAILER)])  # one stream: one signature, one trailer
        cp.write(TRAILER)


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=1, keepdims=True)
