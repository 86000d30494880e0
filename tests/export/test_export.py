"""Export: every format and dtype read back against the table (bit for bit), columns, a read-only
--where, parallel shards, and an export killed part way, on a real PostgreSQL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from decimal import Decimal
from pathlib import Path

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest

from embedfleet.errors import InputError
from embedfleet.export import export
from embedfleet.synth_table import write_vector_table

TYPED = """ALTER TABLE {t} ADD COLUMN rating real, ADD COLUMN tags text[], ADD COLUMN info jsonb,
    ADD COLUMN ts timestamptz, ADD COLUMN day date, ADD COLUMN price numeric;
UPDATE {t} SET rating = (substr(id, 8)::int % 5) + 0.5,
    tags = CASE WHEN substr(id, 13)::int % 3 = 0 THEN NULL ELSE ARRAY['a', 'b' || substr(id, 10)] END,
    info = jsonb_build_object('k', substr(id, 10), 'nested', jsonb_build_array(1, 'x')),
    ts = timestamptz '2024-01-01 00:00:00+00' + substr(id, 8)::int * interval '1 minute',
    day = date '2024-01-01' + substr(id, 8)::int % 400, price = substr(id, 8)::int / 7.0"""


def _table(conn, name: str, n: int, vtype: str = "vector", typed: bool = False) -> dict:
    """Write the table; return {id: row} with the stored vector as PostgreSQL's own real[] (exact)."""
    write_vector_table(conn, name, n, vtype=vtype, seed=3)
    if typed:
        conn.execute(TYPED.format(t=name))
    rows = conn.execute(f"SELECT id, embedding::real[] AS v, * FROM {name}").fetchall()
    cols = [d.name for d in conn.execute(f"SELECT id, embedding::real[] AS v, * FROM {name} LIMIT 0").description]
    out = {}
    for r in rows:
        d = dict(zip(cols, r))
        d["v"] = np.array(d["v"], dtype=np.float32)
        out[d["id"]] = d
    return out


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16 if a.dtype == np.float16 else np.uint32)


def _read(out: Path, fmt: str) -> tuple[list[str], np.ndarray, list[dict]]:
    """(ids, vectors, other columns per row) as a reader of the files would get them."""
    if fmt == "npy":
        vecs = np.load(out / "embeddings.npy", mmap_mode="r")
        ids = (out / "ids.txt").read_text().split("\n")[:-1]
        rows = pq.read_table(out / "ids.parquet").to_pylist()
        assert [r["id"] for r in rows] == ids
        return ids, np.asarray(vecs), rows
    if fmt == "parquet":
        table = pq.read_table(out)
        emb = table.column("embedding")
        assert str(emb.type).startswith("fixed_size_list")
        vecs = emb.combine_chunks().values.to_numpy(zero_copy_only=False).reshape(len(table), -1)
        rows = table.drop_columns(["embedding"]).to_pylist()
        return [r["id"] for r in rows], vecs, rows
    files = sorted(out.glob("*.jsonl")) if out.is_dir() else [out]
    rows = [orjson.loads(line) for f in files for line in f.read_bytes().splitlines()]
    vecs = [r.pop("embedding") for r in rows]
    return [r["id"] for r in rows], np.array(vecs, dtype=np.float32), rows


@pytest.mark.parametrize("vtype, dtype", [("vector", None), ("vector", "float16"), ("halfvec", None),
                                          ("halfvec", "float32")])
@pytest.mark.parametrize("fmt", ["parquet", "npy", "jsonl"])
def test_round_trip_gives_the_stored_vectors_and_columns(dsn, conn, tmp_path, fmt, vtype, dtype):
    table = _table(conn, "t", 1500, vtype=vtype, typed=True)
    out = tmp_path / ("out" if fmt == "npy" else f"out.{fmt}")
    summary = export(dsn, "t", fmt, str(out), dtype=dtype, columns=None if fmt != "npy" else ["tags", "info"],
                     progress=False)
    want = dtype or ("float16" if vtype == "halfvec" else "float32")
    assert (summary["rows"], summary["dim"], summary["dtype"], summary["vector_type"]) == (1500, 384, want, vtype)
    ids, vecs, rows = _read(out, fmt)
    assert sorted(ids) == sorted(table) and vecs.shape == (1500, 384)
    ref = np.stack([table[i]["v"] for i in ids]).astype(want)
    if fmt != "jsonl":
        assert vecs.dtype == np.dtype(want)
    # bit for bit: float32 from vector, float16 from halfvec (and the casts a user asked for, as numpy makes them)
    assert (_bits(vecs.astype(want)) == _bits(ref)).all()
    for r in rows[:50]:
        t = table[r["id"]]
        if fmt != "npy":
            assert r["content"] == t["content"] and r["rating"] == t["rating"] and r["day"] in (t["day"], str(t["day"]))
            assert Decimal(r["price"]) == t["price"]  # numeric: no exact form in Arrow or JSON, so its text
            ts = r["ts"] if fmt == "parquet" else datetime.fromisoformat(r["ts"])
            assert ts == t["ts"] and ts.tzinfo is not None
        assert r["tags"] == t["tags"]
        assert (orjson.loads(r["info"]) if fmt != "jsonl" else r["info"]) == t["info"]  # jsonl: JSON, not a string
        if fmt == "npy":
            assert set(r) == {"id", "tags", "info"}


def test_columns_where_and_errors(dsn, conn, tmp_path):
    _table(conn, "t", 300, typed=True)
    out = tmp_path / "c.parquet"
    export(dsn, "t", "parquet", str(out), columns=["rating", "id", "embedding"], where="rating >= 3",
           progress=False)
    got = pq.read_table(out)
    assert got.column_names == ["id", "rating", "embedding"]
    want = conn.execute("SELECT count(*) FROM t WHERE rating >= 3").fetchone()[0]
    assert 0 < len(got) == want < 300 and min(got.column("rating").to_pylist()) >= 3
    with pytest.raises(InputError, match="no column 'nope'.*it has: id, content, rating"):
        export(dsn, "t", "parquet", str(tmp_path / "x.parquet"), columns=["nope"], progress=False)
    with pytest.raises(InputError, match="--format 'csv'"):
        export(dsn, "t", "csv", str(tmp_path / "x.csv"), progress=False)
    with pytest.raises(InputError, match="writes a directory"):
        export(dsn, "t", "npy", str(tmp_path / "x.npy"), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.parquet"]
    conn.execute("ALTER TABLE t ADD COLUMN content_tsv tsvector GENERATED ALWAYS AS (to_tsvector('simple', content)) "
                 "STORED")  # the full-text index's column restates content: out unless named
    export(dsn, "t", "parquet", str(tmp_path / "all.parquet"), progress=False)
    assert "content_tsv" not in pq.read_schema(tmp_path / "all.parquet").names
    export(dsn, "t", "parquet", str(tmp_path / "tsv.parquet"), columns=["content_tsv"], progress=False)
    assert pq.read_schema(tmp_path / "tsv.parquet").names == ["id", "content_tsv", "embedding"]
    for name in ("all.parquet", "tsv.parquet"):
        (tmp_path / name).unlink()
    export(dsn, "t", "npy", str(tmp_path / "as_npy"), progress=False)
    with pytest.raises(InputError, match="is an earlier export as a directory .*: this one writes a file"):
        export(dsn, "t", "parquet", str(tmp_path / "as_npy"), progress=False)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    with pytest.raises(InputError, match="is a directory that is not an embedfleet export"):
        export(dsn, "t", "npy", str(tmp_path / "mine"), progress=False)


def test_a_writing_where_is_refused_and_writes_nothing(cli, dsn, conn, tmp_path):
    _table(conn, "t", 200)
    conn.execute("CREATE FUNCTION wipe() RETURNS boolean LANGUAGE sql AS 'DELETE FROM t RETURNING true'")
    for fmt, shards in (("parquet", 1), ("npy", 1), ("jsonl", 2)):
        for where in ("wipe()", "true; DELETE FROM t", "lo_create(0) > 0"):
            out = tmp_path / f"o-{fmt}"
            p = cli("export", "--table", "t", "--format", fmt, "--out", out, "--db", dsn, "--where", where,
                    "--shards", shards)
            assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
            assert p.stderr.strip().splitlines()[-1].startswith(f"error: --where {where!r}")
            assert not out.exists()
    assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 200
    assert conn.execute("SELECT count(*) FROM pg_largeobject_metadata").fetchone()[0] == 0
    assert list(tmp_path.iterdir()) == []  # no temporaries either


@pytest.mark.parametrize("fmt", ["parquet", "npy", "jsonl"])
def test_shards_write_the_same_rows_as_one_file(cli, dsn, conn, tmp_path, fmt):
    table = _table(conn, "t", 2000)
    conn.execute("DELETE FROM t WHERE substr(id, 12)::int % 10 = 0")  # holes in the pages, as after updates
    one, four = tmp_path / "one", tmp_path / "four"
    for out, shards in ((one, 1), (four, 4)):
        p = cli("export", "--table", "t", "--format", fmt, "--out", out, "--db", dsn, "--shards", shards, "--json",
                check=True)
        doc = orjson.loads(p.stdout)
        assert doc["rows"] == 1800
        assert all((out / f if out.is_dir() else out.parent / f).is_file() for f in doc["files"]), doc["files"]
        if fmt != "npy" and shards == 1:
            assert doc["files"] == [out.name]  # the file as it is, not as it was built
    ids1, vecs1, _ = _read(one, fmt)
    ids4, vecs4, _ = _read(four, fmt)
    assert len(ids4) == len(set(ids4)) == 1800 and set(ids4) == set(ids1)
    order = {i: n for n, i in enumerate(ids4)}
    assert (_bits(vecs4[[order[i] for i in ids1]]) == _bits(vecs1)).all()
    assert (_bits(vecs4) == _bits(np.stack([table[i]["v"] for i in ids4]))).all()
    manifest = orjson.loads((four / "_export.json").read_bytes())
    assert manifest["rows"] == 1800 and manifest["shards"] == 4
    if fmt != "npy":
        parts = sorted(p.name for p in four.iterdir() if not p.name.startswith("_"))
        assert parts == [f"part-{i:05d}-of-00004.{fmt}" for i in range(4)] == manifest["files"]
    # exporting again over our own export replaces it
    cli("export", "--table", "t", "--format", fmt, "--out", four, "--db", dsn, "--shards", 2, "--where",
        "id < 'r000000001000'", "--quiet", check=True)
    assert len(_read(four, fmt)[0]) == conn.execute("SELECT count(*) FROM t WHERE id < 'r000000001000'").fetchone()[0]


def test_a_killed_export_leaves_nothing_at_the_target(dsn, conn, tmp_path):
    write_vector_table(conn, "big", 100_000, seed=1)
    out = tmp_path / "big.jsonl"
    args = [sys.executable, "-m", "embedfleet.cli", "export", "--table", "big", "--format", "jsonl", "--out", str(out),
            "--db", dsn, "--quiet"]
    run = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline, written = time.time() + 120, 0
    while time.time() < deadline and run.poll() is None:
        temps = list(tmp_path.glob(".big.jsonl.export-*.tmp"))
        written = temps[0].stat().st_size if temps else 0
        if written > 20 << 20:
            break
        time.sleep(0.02)
    assert run.poll() is None, f"the export finished before it could be killed; make the table bigger\n{run.stderr.read()}"
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    assert written > 0 and not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == [f".big.jsonl.export-{run.pid}.tmp"]  # what the kill left
    # the next export to the same target finishes, and clears what the killed one left
    summary = export(dsn, "big", "jsonl", str(out), where="id < 'r000000000100'", progress=False)
    assert summary["rows"] == 100 and len(out.read_bytes().splitlines()) == 100
    assert [p.name for p in tmp_path.iterdir()] == ["big.jsonl"]


def test_a_partitioned_tables_shards_each_take_a_share(cli, dsn, conn, tmp_path):
    """A hash-partitioned table: a ctid range reads those pages of every partition, so the shards split the
    largest partition's pages (the parent has none of its own) and still give every row once."""
    table = _table(conn, "flat", 2000)
    conn.execute("CREATE TABLE pt (LIKE flat INCLUDING ALL) PARTITION BY HASH (id)")
    for i in range(3):
        conn.execute(f"CREATE TABLE pt_{i} PARTITION OF pt FOR VALUES WITH (MODULUS 3, REMAINDER {i})")
    conn.execute("INSERT INTO pt SELECT * FROM flat")
    out = tmp_path / "four"
    p = cli("export", "--table", "pt", "--format", "parquet", "--out", out, "--db", dsn, "--shards", 4, "--json",
            check=True)
    assert orjson.loads(p.stdout)["rows"] == 2000
    ids, vecs, _ = _read(out, "parquet")
    assert len(ids) == len(set(ids)) == 2000 and set(ids) == set(table)
    assert (_bits(vecs) == _bits(np.stack([table[i]["v"] for i in ids]))).all()
    shares = [pq.read_metadata(f).num_rows for f in sorted(out.glob("part-*.parquet"))]
    assert len(shares) == 4 and min(shares) > 2000 / 8, shares


def test_shards_are_capped_by_the_tables_pages_and_no_part_is_empty(cli, dsn, conn, tmp_path):
    from embedfleet.export import MIN_SHARD_PAGES, shard_count

    assert shard_count(0, 32) == 1 and shard_count(10 * MIN_SHARD_PAGES, 500) == 10 and shard_count(10**6, 4) == 4
    _table(conn, "small", 200)
    out = tmp_path / "many"
    p = cli("export", "--table", "small", "--format", "parquet", "--out", out, "--db", dsn, "--shards", 500, "--json",
            "--quiet", check=True)
    doc = orjson.loads(p.stdout)
    pages = conn.execute("SELECT pg_relation_size('small') / current_setting('block_size')::int").fetchone()[0]
    assert doc["rows"] == 200 and doc["shards"] == shard_count(pages, 500) < 500
    files = sorted(f.name for f in out.glob("part-*.parquet"))
    assert files == doc["files"] and all(pq.read_metadata(out / f).num_rows > 0 for f in files)
    # a filter that leaves most parts empty: only the parts with rows are written, numbered in a row
    p = cli("export", "--table", "small", "--format", "jsonl", "--out", tmp_path / "few", "--db", dsn, "--shards",
            4, "--where", "id = (SELECT max(id) FROM small)", "--json", "--quiet", check=True)
    doc = orjson.loads(p.stdout)
    assert doc["rows"] == 1 and doc["files"] == ["part-00000-of-00001.jsonl"]
    assert sorted(f.name for f in (tmp_path / "few").glob("part-*")) == doc["files"]
