"""TableDataset on any table's columns, against a real PostgreSQL: every feature type against psycopg's own
reading of the rows, fill_null, one-line refusals, ranks, resume in a new process, DataLoader and
DistributedSampler against a TensorDataset of the same values, `train --features` / `predict`, and Parquet."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import one_line_error

ROWS = 600
STEPS = Path(__file__).with_name("table_steps.py")
ALL = ["rssi", "snr", "n", "big", "small", "ok", "amt", "rx", "rxd", "rxi", "rxs", "emb", "h", "raw"]


def _row(i: int, rng: np.random.Generator) -> list:
    cls = ["north", "south", "east"][i % 3]
    return [i, float(i), float(rng.normal()), float(rng.normal() * 50), int(rng.integers(-5, 5)), int(i) * 10**10,
            int(i % 100), bool(i % 2), Decimal(i) / 7, [float(v) for v in rng.normal(size=4)],
            [float(v) for v in rng.normal(size=3)], [int(v) for v in rng.integers(-9, 9, 2)],
            [int(v) for v in rng.integers(-9, 9, 2)], "[" + ",".join(f"{v:.6f}" for v in rng.normal(size=3)) + "]",
            "[" + ",".join(f"{v:.3f}" for v in rng.normal(size=2)) + "]", rng.normal(size=2).astype("<f4").tobytes(),
            cls, "val" if i % 5 == 0 else "train"]


@pytest.fixture(scope="module")
def db(pg_server, tmp_path_factory):
    """One database: `meas` (every feature type, no NULLs) and `holes` (NULLs in each kind of column)."""
    import psycopg

    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg_server.get_uri(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    dsn = pg_server.get_uri(database=name)
    rng = np.random.default_rng(7)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        for table in ("meas", "holes"):
            conn.execute(f"""CREATE TABLE {table} (id bigint PRIMARY KEY, rid_f real, rssi real, snr double precision,
                n integer, big bigint, small smallint, ok boolean, amt numeric, rx real[], rxd double precision[],
                rxi integer[], rxs smallint[], emb vector(3), h halfvec(2), raw bytea, cls text, part text,
                note text)""")
        with conn.cursor() as cur, cur.copy("COPY meas (id, rid_f, rssi, snr, n, big, small, ok, amt, rx, rxd, rxi, "
                                            "rxs, emb, h, raw, cls, part) FROM STDIN") as copy:
            for i in range(ROWS):
                copy.write_row(_row(i, rng))
        conn.execute("INSERT INTO holes SELECT * FROM meas WHERE id < 40")
        conn.execute("UPDATE holes SET rssi = NULL WHERE id = 5")
        conn.execute("UPDATE holes SET rx = NULL WHERE id = 6")
        conn.execute("UPDATE holes SET rx = array[1, NULL, 3, 4]::real[] WHERE id = 7")
        conn.execute("UPDATE holes SET emb = NULL WHERE id = 8")
        conn.execute("UPDATE holes SET raw = NULL WHERE id = 9")
        conn.execute("UPDATE holes SET ok = NULL WHERE id = 10")
        conn.execute("CREATE TABLE ragged AS SELECT * FROM meas WHERE id < 30")
        conn.execute("ALTER TABLE ragged ADD PRIMARY KEY (id)")
        conn.execute("UPDATE ragged SET rx = array[1, 2, 3]::real[] WHERE id = 17")
        conn.execute("UPDATE ragged SET raw = '\\x00000000'::bytea WHERE id = 21")
        conn.execute("UPDATE ragged SET amt = 'NaN' WHERE id = 2")
        conn.execute("UPDATE ragged SET snr = 'NaN' WHERE id = 3")
        conn.execute("UPDATE ragged SET rxd[2] = '-Infinity' WHERE id = 4")
        conn.execute("CREATE TABLE square AS SELECT * FROM meas WHERE id < 30")  # rx as 2 × 2 from row 12 on
        conn.execute("ALTER TABLE square ADD PRIMARY KEY (id)")
        conn.execute("UPDATE square SET rx = array[[1, 2], [3, 4]]::real[] WHERE id >= 12")
        conn.execute("CREATE TABLE oddraw (id int PRIMARY KEY, raw bytea, y int)")
        conn.execute("INSERT INTO oddraw VALUES (1, '\\x000000', 0)")
    return dsn


def _reference(dsn: str, table: str, features: list[str], fill: float | None = None) -> dict[int, np.ndarray]:
    """id → x as psycopg reads the row (pgvector's adapter for vector and halfvec), concatenated in order."""
    import psycopg
    from pgvector.psycopg import register_vector

    with psycopg.connect(dsn) as conn:
        register_vector(conn)
        rows = conn.execute(f"SELECT id, {', '.join(features)} FROM {table}").fetchall()
    out = {}
    for row in rows:
        parts = []
        for v in row[1:]:
            if v is None:
                parts.append(None)
            elif isinstance(v, bytes):
                parts.append(np.frombuffer(v, "<f4"))
            elif isinstance(v, (list, tuple)):
                parts.append(np.asarray([fill if e is None else float(e) for e in v], np.float32))
            elif hasattr(v, "to_numpy"):
                parts.append(np.asarray(v.to_numpy(), np.float32))
            elif isinstance(v, np.ndarray):
                parts.append(v.astype(np.float32))
            else:
                parts.append(np.asarray([float(v)], np.float32))
        out[row[0]] = parts
    return out


def _all_x(ds) -> torch.Tensor:
    return torch.cat([x for x, _ in ds.batches(64, shuffle=False)]).float()


@pytest.mark.parametrize("mode", ["chunks", "rows"])
@pytest.mark.parametrize("tier", ["ram", "stream"])
def test_every_feature_type_equals_psycopg_row_by_row(db, mode, tier, monkeypatch):
    from embedfleet.train import TableDataset
    from embedfleet.train import read

    monkeypatch.setattr(read, "use_chunks", lambda *a, **k: mode == "chunks")
    ds = TableDataset.from_table("meas", features=ALL, label="cls", db=db, cache=tier, device="cpu",
                                 window_rows=256 if tier == "stream" else None)
    assert len(ds) == ROWS and ds.cache == tier
    widths = {"rx": 4, "rxd": 3, "rxi": 2, "rxs": 2, "emb": 3, "h": 2, "raw": 2}
    assert ds.dim == sum(widths.get(c, 1) for c in ALL)
    at = 0
    for c in ALL:  # the slices follow the order given
        assert ds.feature_slices[c] == slice(at, at + widths.get(c, 1))
        at += widths.get(c, 1)
    assert ds.classes == ["east", "north", "south"]
    ref = _reference(db, "meas", ALL)
    x = _all_x(ds)
    y = torch.cat([y for _, y in ds.batches(64, shuffle=False)])
    for k, i in enumerate(ds.ids):
        want = np.concatenate(ref[int(i)]).astype(np.float32)
        np.testing.assert_array_equal(x[k].numpy(), want, err_msg=f"row {i}")
        assert ds.classes[int(y[k])] == ["north", "south", "east"][int(i) % 3]
    ds.close()


@pytest.mark.parametrize("mode", ["chunks", "rows"])
def test_features_in_a_database_without_pgvector(dsn, conn, mode, monkeypatch):
    """A user's plain database: no vector extension; the features travel as float4[] and read the same."""
    from embedfleet.train import TableDataset
    from embedfleet.train import read

    monkeypatch.setattr(read, "use_chunks", lambda *a, **k: mode == "chunks")
    assert conn.execute("SELECT count(*) FROM pg_extension WHERE extname = 'vector'").fetchone()[0] == 0
    conn.execute("CREATE TABLE plain (id int PRIMARY KEY, a real, b double precision[], c bytea, d int)")
    rng = np.random.default_rng(3)
    rows = [(i, float(rng.normal()), [float(v) for v in rng.normal(size=3)], rng.normal(size=2).astype("<f4").tobytes(),
             i % 2) for i in range(300)]
    with conn.cursor() as cur, cur.copy("COPY plain FROM STDIN") as copy:
        for r in rows:
            copy.write_row(r)
    ds = TableDataset.from_table("plain", features=["b", "a", "c"], label="d", db=dsn, device="cpu")
    x = _all_x(ds)
    for k, i in enumerate(ds.ids):
        r = rows[int(i)]
        want = np.concatenate([np.asarray(r[2], np.float32), [np.float32(r[1])], np.frombuffer(r[3], "<f4")])
        np.testing.assert_array_equal(x[k].numpy(), want)
    # nothing on a float4[]'s way refuses NaN, as pgvector's vector does: it is checked, not trained on
    from embedfleet.errors import InputError

    conn.execute("UPDATE plain SET a = 'NaN' WHERE id = 7")
    conn.execute("UPDATE plain SET b[2] = 'Infinity' WHERE id = 4")
    for feats, needle in ((["a"], r"feature column 'a' \(float4\) holds NaN or an infinity in row id 7"),
                          (["b", "c"], r"feature column 'b' \(float8\[\]\) holds NaN or an infinity in row id 4")):
        with pytest.raises(InputError, match=needle):
            TableDataset.from_table("plain", features=feats, label="d", db=dsn, device="cpu")
    # a regression target that is NaN or infinite: refused, not a loss of nan
    conn.execute("CREATE TABLE reg (id int PRIMARY KEY, a real, y double precision)")
    conn.execute("INSERT INTO reg SELECT g, g, g * 2 FROM generate_series(1, 50) g")
    conn.execute("UPDATE reg SET y = 'NaN' WHERE id IN (3, 9)")
    with pytest.raises(InputError, match="--label 'y' holds NaN or an infinity in 2 selected rows"):
        TableDataset.from_table("reg", features=["a"], label="y", task="regress", db=dsn, device="cpu")
    assert len(TableDataset.from_table("reg", features=["a"], label="y", task="regress", where="y <> 'NaN'", db=dsn,
                                       device="cpu")) == 48
    conn.execute("CREATE TABLE nothing (id int PRIMARY KEY, a real, y int)")
    with pytest.raises(InputError, match="the selection is empty: table 'nothing' has no rows$"):
        TableDataset.from_table("nothing", features=["a"], label="y", db=dsn, device="cpu")


def test_fill_null_fills_each_kind_and_where_split_select(db):
    from embedfleet.train import TableDataset

    feats = ["rssi", "rx", "emb", "raw", "ok"]
    ds = TableDataset.from_table("holes", features=feats, db=db, device="cpu", fill_null=-1.0)
    ref = _reference(db, "holes", feats, fill=-1.0)
    widths = [1, 4, 3, 2, 1]
    x = _all_x(ds)
    assert len(ds) == 40
    for k, i in enumerate(ds.ids):
        want = np.concatenate([p if p is not None else np.full(w, -1.0, np.float32)
                               for p, w in zip(ref[int(i)], widths)])
        np.testing.assert_array_equal(x[k].numpy(), want, err_msg=f"row {i}")
    assert x[ds.ids.tolist().index("7"), ds.feature_slices["rx"]].tolist()[1] == -1.0
    # a mapping fills only the columns it names; where and split select as for the vector column
    ds2 = TableDataset.from_table("holes", features=["rssi", "n"], db=db, device="cpu", fill_null={"rssi": 9.5},
                                  where="id < 20", split="val", label="cls")
    from embedfleet.train.read import Split

    want_ids = sorted(i for i in range(20) if Split.key_of(str(i)) < Split("val").threshold)
    assert sorted(int(i) for i in ds2.ids) == want_ids
    if 5 in want_ids:
        assert _all_x(ds2)[ds2.ids.tolist().index("5"), 0] == 9.5


@pytest.mark.parametrize("kwargs, needle", [
    (dict(table="holes", features=["rssi"]), "feature column 'rssi' (float4) is NULL in row id 5"),
    (dict(table="holes", features=["n", "rx"]), "feature column 'rx' (float4[]) is NULL in row id 6"),
    (dict(table="holes", features=["rx"], where="id <> 6"), "feature column 'rx' (float4[]) has a NULL element in row id 7"),
    (dict(table="holes", features=["emb"]), "feature column 'emb' (vector) is NULL in row id 8"),
    (dict(table="holes", features=["raw"]), "feature column 'raw' (bytea) is NULL in row id 9"),
    (dict(table="ragged", features=["rssi", "rx"]), "feature column 'rx' (float4[]) has 3 values in row id 17 where "
                                                    "the first row has 4"),
    (dict(table="ragged", features=["raw"]), "feature column 'raw' (bytea) has 4 bytes in row id 21 where the first "
                                             "row has 8"),
    (dict(table="oddraw", features=["raw"]), "holds 3 bytes, not whole float32 values"),
    # it said "reading the table failed: NaN not allowed in vector"
    (dict(table="ragged", features=["rssi", "snr"]), "feature column 'snr' (float8) holds NaN or an infinity in row id 3"),
    (dict(table="ragged", features=["rxd"]), "feature column 'rxd' (float8[]) holds NaN or an infinity in row id 4"),
    (dict(table="ragged", features=["amt"]), "feature column 'amt' (numeric) holds NaN or an infinity in row id 2"),
    # it said "has 4 values in row id 12 where the first row has 4"
    (dict(table="square", features=["rx"]), "feature column 'rx' (float4[]) is a 2-dimensional array in row id 12"),
    (dict(table="meas", features=["rssi", "cls"]), "feature 'cls' is of type text"),
    (dict(table="meas", features=["rssi", "nope"]), "feature 'nope': table 'meas' has no such column"),
    (dict(table="meas", features=["rssi", "rssi"]), "feature 'rssi' is named twice"),
    (dict(table="meas", features=["rssi"], label="rssi"), "--label 'rssi' is also a feature"),
    (dict(table="meas", features=[]), "name at least one column"),
    (dict(table="meas", features=["rssi"], fill_null="x"), "fill_null 'x': use a number"),
    (dict(table="meas", features=["rssi"], fill_null=float("nan")), "fill_null nan: use a finite number"),
    (dict(table="meas"), "has no vector or halfvec column"),
])
def test_refusals_are_one_line_naming_the_column_and_row(db, kwargs, needle):
    from embedfleet.errors import EmbedfleetError
    from embedfleet.train import TableDataset

    table = kwargs.pop("table")
    if table == "meas" and "features" not in kwargs:
        import psycopg

        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS novec (id int PRIMARY KEY, a real)")
        table = "novec"
        needle = "table 'novec' has no vector or halfvec column"
    with pytest.raises(EmbedfleetError) as e:
        TableDataset.from_table(table, db=db, device="cpu", **kwargs)
    message = str(e.value)
    assert needle in message and "\n" not in message, message


@pytest.mark.parametrize("cache", ["ram", "stream"])
def test_a_refusal_comes_before_any_batch_in_every_tier(db, cache):
    """The stream tier reads features only in its windows: its rows are checked before from_table returns."""
    from embedfleet.errors import InputError
    from embedfleet.train import TableDataset

    with pytest.raises(InputError, match=r"feature column 'rx' \(float4\[\]\) has 3 values in row id 17"):
        TableDataset.from_table("ragged", features=["rssi", "rx"], db=db, device="cpu", cache=cache)
    ok = TableDataset.from_table("ragged", features=["rssi", "rx"], db=db, device="cpu", cache=cache,
                                 where="id <> 17 AND id <> 21")
    assert len(ok) == 28


def test_cli_refusal_is_one_line_without_traceback(db, cli):
    p = cli("train", "--table", "holes", "--features", "rssi,rx", "--label", "cls", "--task", "classify",
            "--devices", "cpu", "--db", db)
    one_line_error(p, "feature column 'rssi' (float4) is NULL in row id 5")


def _run(args: list[str], env=None, timeout=300):
    p = subprocess.Popen([sys.executable, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, start_new_session=True, cwd=str(STEPS.parent))
    try:
        _, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, err[-3000:]


@pytest.mark.parametrize("tier", ["ram", "stream"])
def test_resume_after_three_steps_in_a_new_process_is_bit_for_bit(db, tmp_path, tier):
    env = dict(os.environ, TIER=tier)
    for mode in ("all", "stop", "resume"):
        _run([STEPS, db, tmp_path, mode], env)
    whole = json.loads((tmp_path / "all.json").read_text())
    stopped = json.loads((tmp_path / "stop.json").read_text())
    resumed = json.loads((tmp_path / "resume.json").read_text())
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["epoch"] == 0 and state["step"] == 3 and state["world_size"] == 1 and state["batch_size"] == 32
    assert len(stopped) == 3 and stopped == whole[:3]
    assert resumed == whole[3:]  # the rest of epoch 0, then epochs 1 and 2: ids, x bytes and labels
    assert len({tuple(b["ids"]) for b in whole if b["epoch"] == 1}) == -(-ROWS // 32)


def test_resume_on_another_world_size(db):
    from embedfleet.errors import InputError
    from embedfleet.train import TableDataset

    ds = TableDataset.from_table("meas", features=["rid_f"], db=db, device="cpu")
    it = ds.batches(30, world_size=2, rank=0, epoch=1)
    for _ in range(4):
        next(it)
    state = ds.state_dict()
    assert (state["epoch"], state["step"], state["world_size"], state["batch_size"]) == (1, 4, 2, 60)
    whole = [x for x, _ in ds.batches(60, epoch=1, world_size=1)]
    fresh = TableDataset.from_table("meas", features=["rid_f"], db=db, device="cpu")
    parts = []  # three ranks, each resuming the same state: their steps together are the saved run's rest
    for r in range(3):
        fresh.load_state_dict(state)
        parts.append([x for x, _ in fresh.batches(20, epoch=1, world_size=3, rank=r)])
    assert len(parts[0]) == len(whole) - 4
    for step, joined in enumerate(zip(*parts)):
        assert torch.equal(torch.cat(joined), whole[4 + step])
    for world, batch, needle in [(7, 8, "7 ranks do not divide the saved global batch of 60"),
                                 (3, 10, "use batch_size 20")]:
        fresh.load_state_dict(state)
        with pytest.raises(InputError, match=needle):
            next(fresh.batches(batch, epoch=1, world_size=world, rank=0))


def test_two_gloo_ranks_see_each_row_once_with_equal_steps(db, tmp_path):
    _run(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", STEPS, db, tmp_path, "ranks"])
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for epoch in (0, 1):
        a = [b["ids"] for b in ranks[0] if b["epoch"] == epoch]
        b = [b["ids"] for b in ranks[1] if b["epoch"] == epoch]
        assert len(a) == len(b) == -(-ROWS // 32)
        seen = [i for batch in a + b for i in batch]
        assert sorted(seen) == list(range(ROWS))


def test_dataloader_and_distributed_sampler_equal_a_tensordataset(db):
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from embedfleet.train import TableDataset

    ds = TableDataset.from_table("meas", features=["rid_f", "rssi", "rx", "raw"], label="cls", db=db, device="cpu")
    X = torch.cat([x for x, _ in ds.batches(ROWS, shuffle=False)])
    Y = torch.cat([y for _, y in ds.batches(ROWS, shuffle=False)])
    plain = TensorDataset(X, Y)
    x0, y0 = ds[5]
    assert torch.equal(x0, X[5]) and y0 == Y[5]
    for kwargs in (dict(batch_size=50, shuffle=False), dict(batch_size=64, shuffle=True, drop_last=True)):
        ours = DataLoader(ds, generator=torch.Generator().manual_seed(3), **kwargs)
        theirs = DataLoader(plain, generator=torch.Generator().manual_seed(3), **kwargs)
        n = 0
        for (xa, ya), (xb, yb) in zip(ours, theirs, strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
            n += 1
        assert n == len(theirs)
    for rank in range(2):
        a = DistributedSampler(ds, num_replicas=2, rank=rank, seed=4)
        b = DistributedSampler(plain, num_replicas=2, rank=rank, seed=4)
        a.set_epoch(1)
        b.set_epoch(1)
        for (xa, ya), (xb, yb) in zip(DataLoader(ds, batch_size=33, sampler=a), DataLoader(plain, batch_size=33, sampler=b),
                                      strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    batch = ds.__getitems__([3, 1, 4])  # one gather; iterated, the rows
    assert torch.equal(batch[1][0], X[1]) and len(batch) == 3
    nolabel = TableDataset.from_table("meas", features=["rssi"], db=db, device="cpu")
    (xs,) = next(iter(DataLoader(nolabel, batch_size=4)))
    assert xs.shape == (4, 1)


def test_train_features_learns_and_predict_reproduces(db, cli, tmp_path):
    import psycopg

    rng = np.random.default_rng(1)
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("CREATE TABLE sep (id bigint PRIMARY KEY, rssi real, snr double precision, receivers real[], "
                     "ok boolean, zone text)")
        with conn.cursor() as cur, cur.copy("COPY sep FROM STDIN") as copy:
            for i in range(3000):
                z = i % 3
                copy.write_row([i, float(-90 + 6 * z + rng.normal()), float(1000 + 40 * rng.normal()),
                                [float(v) for v in rng.normal(size=6) + z], bool(rng.integers(2)), f"zone{z}"])
    out = tmp_path / "run"
    p = cli("train", "--table", "sep", "--features", "rssi,snr,receivers,ok", "--label", "zone", "--task", "classify",
            "--epochs", "20", "--lr", "0.01", "--head", "mlp", "--devices", "cpu", "--out", out, "--db", db, "--json",
            check=True)
    doc = json.loads(p.stdout)
    assert doc["final"]["val_accuracy"] > 0.9  # chance is 1/3
    head = json.loads((out / "head.json").read_text())
    assert head["features"] == ["rssi", "snr", "receivers", "ok"] and head["dim"] == 9
    assert head["feature_slices"]["receivers"] == [2, 8]
    p = cli("predict", "--run", out, "--table", "sep", "--device", "cpu", "--db", db, "--json", check=True)
    summary = json.loads(p.stdout)
    assert summary["rows"] == 3000
    assert summary["val_accuracy"] == pytest.approx(doc["final"]["val_accuracy"], abs=1e-9)
    # two gloo ranks: the same features read once for both, the same head
    p = cli("train", "--table", "sep", "--features", "rssi,snr,receivers,ok", "--label", "zone", "--task", "classify",
            "--epochs", "20", "--lr", "0.01", "--head", "mlp", "--devices", "cpu", "--ranks", "2", "--out",
            tmp_path / "run2", "--db", db, "--json", check=True)
    doc2 = json.loads((tmp_path / "run2" / "metrics.json").read_text())
    assert doc2["world_size"] == 2 and doc2["final"]["val_accuracy"] > 0.9


def test_a_small_feature_table_learns_with_every_default(db, cli, tmp_path):
    """120 rows, all defaults: 140 steps at 0.001 left a separable label at 0.11 validation accuracy (chance 0.5)."""
    import psycopg

    rng = np.random.default_rng(0)
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("CREATE TABLE small_feats (id int PRIMARY KEY, a float8, b float8, c float8, lab int)")
        with conn.cursor() as cur, cur.copy("COPY small_feats FROM STDIN") as copy:
            for i in range(120):
                a, b, c = rng.normal(size=3) * [3, 100, 0.01]
                copy.write_row([i, a, b, c, int(a + b / 50 > 0)])
    p = cli("train", "--table", "small_feats", "--features", "a,b,c", "--label", "lab", "--task", "classify",
            "--devices", "cpu", "--out", tmp_path / "small", "--db", db, "--json", check=True)
    doc = json.loads(p.stdout)
    assert doc["final"]["val_accuracy"] >= 0.8 and doc["lr"] == 0.01, doc
    assert "learning rate 0.01 (the default 0.001, raised for a run of only" in p.stderr
    p = cli("train", "--table", "small_feats", "--features", "a,b,c", "--label", "lab", "--task", "classify",
            "--devices", "cpu", "--out", tmp_path / "given", "--db", db, "--json", "--lr", "0.002", check=True)
    assert json.loads(p.stdout)["lr"] == 0.002 and "learning rate" not in p.stderr  # a given --lr is kept


def test_parquet_gives_the_same_batches_as_the_table(db, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import psycopg

    from embedfleet.train import TableDataset

    feats = ["rid_f", "rssi", "snr", "n", "ok", "rx", "rxi", "raw"]
    with psycopg.connect(db) as conn:
        rows = conn.execute(f"SELECT id, {', '.join(feats)}, cls FROM meas ORDER BY ctid").fetchall()
    cols = list(zip(*rows))
    table = pa.table({"id": pa.array(cols[0], pa.int64()), "rid_f": pa.array(cols[1], pa.float32()),
                      "rssi": pa.array(cols[2], pa.float32()), "snr": pa.array(cols[3], pa.float64()),
                      "n": pa.array(cols[4], pa.int32()), "ok": pa.array(cols[5], pa.bool_()),
                      "rx": pa.array(cols[6], pa.list_(pa.float32())), "rxi": pa.array(cols[7], pa.list_(pa.int32())),
                      "raw": pa.array(cols[8], pa.binary()), "cls": pa.array(cols[9], pa.string())})
    (tmp_path / "pq").mkdir()
    half = ROWS // 2  # two files: order is the files' (sorted), then each file's
    pq.write_table(table.slice(0, half), tmp_path / "pq" / "part-0.parquet")
    pq.write_table(table.slice(half), tmp_path / "pq" / "part-1.parquet")
    a = TableDataset.from_table("meas", features=feats, label="cls", db=db, device="cpu")
    for path in (tmp_path / "pq", str(tmp_path / "pq" / "*.parquet"), f"file://{tmp_path}/pq"):
        b = TableDataset.from_parquet(str(path), features=feats, label="cls", device="cpu", id_field="id")
        assert b.ids.tolist() == a.ids.tolist() and b.classes == a.classes and b.feature_slices == a.feature_slices
        for epoch in (0, 1):
            for (xa, ya), (xb, yb) in zip(a.batches(64, epoch=epoch), b.batches(64, epoch=epoch), strict=True):
                assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # a NULL in a file is refused as in a table, naming the row
    bad = table.set_column(2, "rssi", pa.array([None] + list(cols[2][1:]), pa.float32()))
    pq.write_table(bad, tmp_path / "bad.parquet")
    from embedfleet.errors import InputError

    with pytest.raises(InputError, match="feature column 'rssi' .* is NULL in row 0"):
        TableDataset.from_parquet(str(tmp_path / "bad.parquet"), features=["rssi"], id_field="id", device="cpu")


def test_embedding_dataset_keeps_its_signature_and_default_features(db):
    import psycopg

    from embedfleet.train import EmbeddingDataset, TableDataset

    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("CREATE TABLE vecs (id int PRIMARY KEY, embedding vector(3), y int)")
        conn.execute("INSERT INTO vecs VALUES (1, '[1,2,3]', 0), (2, NULL, 1), (3, '[4,5,6]', 1)")
    ds = EmbeddingDataset.from_table("vecs", "y", None, db, "ram", "cpu")  # positional, as it always was
    assert isinstance(ds, TableDataset) and len(ds) == 2 and ds.stats["skipped_null_vector"] == 1
    assert ds.feature_slices == {"embedding": slice(0, 3)} and ds.dim == 3
    assert torch.equal(ds.vectors(), torch.tensor([[1.0, 2, 3], [4, 5, 6]]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tiers_and_dataloader_agree_and_train_features_learns_on_the_gpu(db, cli, tmp_path):
    from torch.utils.data import DataLoader

    from embedfleet.train import TableDataset

    feats = ["rid_f", "rssi", "rx", "emb", "raw"]
    sets = {t: TableDataset.from_table("meas", features=feats, label="cls", db=db, device="cuda", cache=t,
                                       window_rows=256) for t in ("gpu", "ram", "stream")}
    got = {t: [(x.cpu(), y.cpu()) for x, y in d.batches(50, epoch=1)] for t, d in sets.items()}
    for t in ("ram", "stream"):
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got[t], got["gpu"], strict=True))
    ds = sets["gpu"]
    x, y = next(iter(DataLoader(ds, batch_size=64, shuffle=False)))
    assert x.device.type == "cuda" and torch.equal(x, ds.vectors()[:64]) and torch.equal(y, ds.labels[:64])
    rng = np.random.default_rng(2)
    import psycopg

    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS sepg (id bigint PRIMARY KEY, rssi real, receivers real[], zone int)")
        with conn.cursor() as cur, cur.copy("COPY sepg FROM STDIN") as copy:
            for i in range(6000):
                copy.write_row([i, float(-90 + 6 * (i % 3) + rng.normal()), [float(v) for v in rng.normal(size=5)],
                                i % 3])
    for tier in ("gpu", "ram"):
        out = tmp_path / tier
        p = cli("train", "--table", "sepg", "--features", "rssi,receivers", "--label", "zone", "--task", "classify",
                "--epochs", "20", "--lr", "0.01", "--devices", "cuda", "--tier", tier, "--out", out, "--db", db,
                "--json", check=True)
        doc = json.loads(p.stdout)
        assert doc["final"]["val_accuracy"] > 0.9 and doc["dtype"] == "float32"
        p = cli("predict", "--run", out, "--table", "sepg", "--device", "cuda", "--db", db, "--json", check=True)
        assert json.loads(p.stdout)["val_accuracy"] == pytest.approx(doc["final"]["val_accuracy"], abs=2e-3)
