"""`embedfleet train` / `predict` and EmbeddingDataset end to end: a corpus whose text says its
rating, embedded by the real CLI (real MiniLM on CPU) into a real PostgreSQL, read back once."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import one_line_error

ROWS, NULL_RATINGS = 400, 5
PHRASES = {
    1: ["terrible, it broke after one day", "complete waste of money", "do not buy this", "awful quality, returned it",
        "worst purchase I have made", "stopped working immediately, very angry"],
    2: ["disappointing overall", "cheap plastic that feels flimsy", "not worth the price", "works poorly most days",
        "below my expectations", "the battery drains too fast"],
    3: ["it is okay", "an average product", "does the job but nothing special", "fine for the price",
        "neither good nor bad", "acceptable, some minor issues"],
    4: ["good product", "works well", "happy with it", "solid quality for daily use", "would buy again",
        "nice fit and finish"],
    5: ["excellent, I love it", "perfect, highly recommend", "best purchase ever", "amazing quality",
        "absolutely fantastic", "exceeded every expectation"],
}
ITEMS = ["phone case", "charger", "usb cable", "screen protector", "car mount", "earbuds"]
TRAIN = ("--task", "classify", "--epochs", "30", "--batch-size", "32", "--lr", "0.01", "--val-fraction", "0.3",
         "--devices", "cpu")


def write_reviews(path: Path, n: int, seed: int = 0) -> Path:
    """Amazon-format reviews whose text follows the rating (the first NULL_RATINGS have none)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            r = 1 + i % 5
            text = f"Order {i}. This {rng.choice(ITEMS)}: " + ". ".join(rng.sample(PHRASES[r], 2)) + "."
            f.write(json.dumps({
                "rating": float(r) if i >= NULL_RATINGS else None, "title": "", "text": text,
                "asin": f"B{i % 37:09d}", "parent_asin": f"P{i % 37:09d}", "user_id": f"U{i:06d}",
                "timestamp": 1_600_000_000_000 + i, "helpful_vote": i % 7, "verified_purchase": bool(i % 2)}) + "\n")
    return path


@pytest.fixture(scope="module")
def env(pg_server, tmp_path_factory):
    """One database for the module: the corpus ingested as vector (`reviews`) and halfvec (`half`)."""
    import psycopg

    root = tmp_path_factory.mktemp("train")
    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg_server.get_uri(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    dsn = pg_server.get_uri(database=name)
    environ = dict(os.environ, EMBEDFLEET_HOME=str(root / "home"), PYTHONUNBUFFERED="1")
    environ.pop("EMBEDFLEET_DB", None)

    def cli(*args, check=True):
        p = subprocess.run([sys.executable, "-m", "embedfleet.cli", *map(str, args)], capture_output=True, text=True,
                           timeout=600, env=environ, stdin=subprocess.DEVNULL)
        if check and p.returncode:
            raise AssertionError(f"embedfleet {' '.join(map(str, args))} exited {p.returncode}:\n{p.stderr[-3000:]}")
        return p

    corpus = write_reviews(root / "reviews.jsonl", ROWS)
    cli("ingest", corpus, "--preset", "amazon-reviews", "--db", dsn, "--quiet", "--no-index", "--devices", "cpu")
    cli("ingest", corpus, "--preset", "amazon-reviews", "--db", dsn, "--quiet", "--no-index", "--devices", "cpu",
        "--dtype", "half", "--table", "half", "--job", "half")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE plain (id text PRIMARY KEY, rating real)")
        conn.execute("INSERT INTO plain VALUES ('a', 1), ('b', 2)")
        conn.execute("CREATE SEQUENCE counter")
    return {"dsn": dsn, "cli": cli, "root": root, "environ": environ}


def test_train_beats_chance_and_predict_agrees_with_the_head(env):
    cli, dsn, root = env["cli"], env["dsn"], env["root"]
    out = root / "run1"
    p = cli("train", "--table", "reviews", "--label", "rating", *TRAIN, "--db", dsn, "--out", out, "--json")
    doc = json.loads(p.stdout)  # exactly one JSON document on stdout
    assert doc == json.loads((out / "metrics.json").read_text())
    assert f"reviews: {NULL_RATINGS} rows without a label left out (NULL)" in p.stderr  # said, not only counted
    final = doc["final"]
    assert final["val_accuracy"] >= 0.6 and final["val_macro_f1"] >= 0.5  # chance is 0.2
    assert doc["rows"]["skipped_null_label"] == NULL_RATINGS
    assert doc["rows"]["train"] + doc["rows"]["val"] == ROWS - NULL_RATINGS and doc["rows"]["val"] > 60
    assert doc["cache"] == "ram" and doc["dtype"] == "float32" and doc["world_size"] == 1
    assert doc["classes"] == [1, 2, 3, 4, 5]  # an integer column's classes, not 1.0…5.0
    assert len(doc["epochs"]) == 30
    for e in doc["epochs"]:
        assert {"train_loss", "val_accuracy", "val_macro_f1", "confusion", "seconds", "samples_per_s"} <= set(e)
    assert np.array(final["confusion"]).shape == (5, 5) and np.sum(final["confusion"]) == doc["rows"]["val"]
    assert doc["epochs"][-1]["train_loss"] < doc["epochs"][0]["train_loss"]
    head = json.loads((out / "head.json").read_text())
    assert head["task"] == "classify" and head["dim"] == 384 and head["table"] == "reviews"
    assert head["classes"] == [1, 2, 3, 4, 5] and head["label_map"]["5"] == 4
    assert "MiniLM" in head["model"]["model"] and head["split"]["val_fraction"] == 0.3 and "md5" in head["split"]["rule"]
    assert (out / "head.safetensors").stat().st_size > 384 * 5 * 4

    # predict: the saved head on the same table agrees with the run's own validation
    pq_path = root / "pred.parquet"
    summary = json.loads(cli("predict", "--run", out, "--table", "reviews", "--db", dsn, "--out", pq_path,
                             "--json").stdout)
    assert summary["rows"] == ROWS and summary["val_rows"] == doc["rows"]["val"]
    assert summary["val_accuracy"] == pytest.approx(final["val_accuracy"])
    import pyarrow.parquet as pq

    table = pq.read_table(pq_path)
    assert table.column_names == ["id", "prediction", "probabilities"] and table.num_rows == ROWS
    probs = np.array(table.column("probabilities").to_pylist())
    assert np.allclose(probs.sum(1), 1, atol=1e-5)
    assert np.array_equal(np.array([1, 2, 3, 4, 5])[probs.argmax(1)], table.column("prediction").to_numpy())
    assert str(table.schema.field("prediction").type) == "int64" and set(summary["predicted"]) <= set("12345")
    # ... and with the head applied by hand to the stored vectors
    from embedfleet.train import EmbeddingDataset
    from embedfleet.train.predict import load_head

    _, model = load_head(out)
    ds = EmbeddingDataset.from_table("reviews", db=dsn, device="cpu")
    with torch.no_grad():
        mine = dict(zip(ds.ids, model(ds.vectors().float()).argmax(1).tolist()))
    got = dict(zip(table.column("id").to_pylist(), probs.argmax(1).tolist()))
    assert mine == got
    # rows with no label yet are what a head is for: predicted, with no accuracy to give
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE unrated AS SELECT * FROM reviews")
        conn.execute("UPDATE unrated SET rating = NULL")
    blind = json.loads(cli("predict", "--run", out, "--table", "unrated", "--db", dsn, "--json").stdout)
    assert blind["rows"] == ROWS and sum(blind["predicted"].values()) == ROWS and blind["accuracy"] is None
    # labels the head never saw count as wrong (they were left out, so 1 of 3,000 rows "predicted" all right), and
    # rows without a vector are said to be left out
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE relabelled AS SELECT * FROM reviews")
        conn.execute("UPDATE relabelled SET rating = 9 WHERE id IN (SELECT id FROM relabelled WHERE rating IS NOT "
                     "NULL ORDER BY id LIMIT 20)")
        conn.execute("UPDATE relabelled SET embedding = NULL WHERE id IN (SELECT id FROM relabelled ORDER BY id DESC "
                     "LIMIT 2)")
        labels = dict(conn.execute("SELECT id, rating FROM relabelled WHERE embedding IS NOT NULL").fetchall())
    predicted = dict(zip(table.column("id").to_pylist(), table.column("prediction").to_pylist()))
    labelled = [i for i, r in labels.items() if r is not None]
    p = cli("predict", "--run", out, "--table", "relabelled", "--db", dsn, "--json")
    odd = json.loads(p.stdout)
    assert odd["unseen_label_rows"] == 20 and odd["skipped_null_vector"] == 2 and odd["rows"] == ROWS - 2
    assert odd["accuracy"] == pytest.approx(sum(predicted[i] == labels[i] for i in labelled) / len(labelled))
    said = cli("predict", "--run", out, "--table", "relabelled", "--db", dsn).stderr
    assert "20 rows with a label the head was not trained on" in said and "2 rows without a vector" in said
    # a run directory holding a run is not written over in silence
    again = cli("train", "--table", "reviews", "--label", "rating", *TRAIN, "--db", dsn, "--out", out, check=False)
    assert one_line_error(again, f"--out {out} holds a trained run already").startswith("error: ")
    afile = out.parent / "afile"
    afile.write_text("not a run")
    one_line_error(cli("train", "--table", "reviews", "--label", "rating", *TRAIN, "--db", dsn, "--out", afile,
                       check=False),
                   f"--out {afile} is a file")
    assert json.loads((out / "metrics.json").read_text()) == doc
    # the run without --out goes under $EMBEDFLEET_HOME/runs
    p = cli("train", "--table", "reviews", "--label", "helpful_vote", "--task", "regress", "--head", "mlp",
            "--epochs", "2", "--devices", "cpu", "--db", dsn)
    runs = list((root / "home" / "runs").iterdir())
    assert [r.name[:len("reviews-helpful_vote-")] for r in runs] == ["reviews-helpful_vote-"]
    reg = json.loads((runs[0] / "metrics.json").read_text())
    assert reg["task"] == "regress" and {"val_mae", "val_rmse"} <= set(reg["final"]) and p.stdout == ""


def test_two_gloo_processes_train_like_one(env):
    cli, dsn, root = env["cli"], env["dsn"], env["root"]
    one = json.loads(cli("train", "--table", "reviews", "--label", "rating", *TRAIN, "--db", dsn,
                         "--out", root / "one", "--json").stdout)
    two = json.loads(cli("train", "--table", "reviews", "--label", "rating", *TRAIN, "--workers", "2", "--db", dsn,
                         "--out", root / "two", "--json").stdout)
    assert two["world_size"] == 2 and two["batch_size"] == one["batch_size"] == 32
    assert two["rows"] == one["rows"]
    for a, b in zip(one["epochs"], two["epochs"]):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4, abs=1e-6)
        assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-4, abs=1e-6)
    assert two["final"]["val_accuracy"] == pytest.approx(one["final"]["val_accuracy"], abs=1.5 / one["rows"]["val"])
    assert (root / "two" / "head.safetensors").exists()


def test_the_training_loop_makes_a_plain_pytorch_loops_updates(env):
    """TrainLoop (a flat gradient buffer, learning rates read from a device-side schedule; on CUDA one
    graph a step) against the loop a user writes: AdamW and LambdaLR over batches(). The same epoch
    losses and weights, for both tasks, with the epochs' short last steps, with the rows taken by the
    order on the device (classify) or handed in by batches() (regress)."""
    import torch.nn.functional as F

    from embedfleet.train import order
    from embedfleet.train.dataset import load
    from embedfleet.train.heads import build_head
    from embedfleet.train.loop import TrainLoop
    from embedfleet.train.trainer import lr_factor

    batch, epochs, lr = 40, 3, 0.01
    for task in ("classify", "regress"):
        ds = load("reviews", label="rating", db=env["dsn"], device="cpu", cache="ram", task=task, keys=True)
        train, _ = ds.split_by_key(0.3)
        assert len(train) % batch  # a short last step every epoch
        total = epochs * len(order.step_sizes(len(train), batch))
        outputs = len(ds.classes) if task == "classify" else 1
        target = (3.0, 1.5) if task == "regress" else (0.0, 1.0)
        torch.manual_seed(0)
        ref = build_head("mlp", ds.dim, outputs)
        torch.manual_seed(0)
        mine = build_head("mlp", ds.dim, outputs)
        opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total))
        # gather=True: the steps take their rows from the storage by the epoch's order, as the gpu tier's
        # graph does on CUDA (here eagerly, from the ram tier's storage)
        loop = TrainLoop(mine, train, batch, 0, 1, task, target, [lr * lr_factor(s, total) for s in range(total)],
                         0.01, gather=task == "classify")
        assert (loop.src is not None) == (task == "classify")
        for epoch in range(epochs):
            want = 0.0
            for x, y in train.batches(batch, epoch=epoch):
                out = ref(x.float())
                loss = (F.cross_entropy(out, y, reduction="sum") if task == "classify" else
                        F.mse_loss(out.squeeze(1), (y - target[0]) / target[1], reduction="sum"))
                opt.zero_grad()
                (loss / len(x)).backward()
                opt.step()
                sched.step()
                want += loss.item()
            assert float(loop.epoch(epoch)) == pytest.approx(want, rel=1e-5), (task, epoch)
        for a, b in zip(ref.parameters(), mine.parameters()):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), task
        assert loop.mode == "eager"  # the CPU runs the steps eagerly
        with pytest.raises(ValueError, match="schedule"):  # past the schedule: an error, not a device assert
            loop.epoch(epochs)
        ds.close()


RANKS = Path(__file__).with_name("train_ranks.py")


def test_ranks_under_torchrun_see_every_row_once_in_the_same_order(env, tmp_path):
    """Two gloo ranks started by torchrun: EmbeddingDataset.from_table reads once for both (each
    copies half the page ranges, then they share), batches() takes rank and world size from
    torch.distributed."""
    from embedfleet.train import EmbeddingDataset

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(RANKS), env["dsn"], str(tmp_path)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env["environ"],
                         start_new_session=True)
    try:
        _, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:  # a hung rank: stop torchrun and both ranks
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, err[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    ds = EmbeddingDataset.from_table("reviews", label="rating", db=env["dsn"], device="cpu")
    assert ranks[0]["ids"] == ranks[1]["ids"] == list(ds.ids)  # the shared read: the same rows, same order
    for epoch in ("0", "1"):
        a, b = ranks[0]["epochs"][epoch], ranks[1]["epochs"][epoch]
        assert len(a) == len(b)  # equal step counts
        seen = [i for batch in a + b for i in batch]
        assert sorted(seen) == sorted(ds.ids)  # every row exactly once across the ranks
        # the same order as one process taking both ranks' rows a step (any run, any world size)
        one = [ds.ids[positions] for positions in _positions(ds, 2 * 7, int(epoch))]
        assert [x + y for x, y in zip(a, b)] == one
    assert ranks[0]["epochs"]["0"] != ranks[0]["epochs"]["1"]


def _positions(ds, batch, epoch):
    from embedfleet.train import order

    o = order.epoch_order(len(ds), ds.seed, epoch, order.BLOCK_ROWS, ds.window_rows)
    starts, ends = order.step_bounds(len(ds), batch)
    return [o[a:b] for a, b in zip(starts, ends)]


def test_every_tier_gives_the_same_batches(env):
    from embedfleet.train import EmbeddingDataset

    dsn = env["dsn"]
    sets = {tier: EmbeddingDataset.from_table("reviews", label="rating", db=dsn, device="cpu", cache=tier,
                                              window_rows=256, connections=2 if tier == "ram" else 1)
            for tier in ("auto", "ram", "stream")}
    assert {t: d.cache for t, d in sets.items()} == {"auto": "ram", "ram": "ram", "stream": "stream"}
    assert len(sets["ram"]) == ROWS - NULL_RATINGS and sets["ram"].stats["skipped_null_label"] == NULL_RATINGS
    ref = sets["ram"]
    for d in sets.values():
        assert list(d.ids) == list(ref.ids) and d.classes == ref.classes and d.dim == 384
    for kw in ({"epoch": 0}, {"epoch": 3}, {"epoch": 1, "rank": 1, "world_size": 3}, {"epoch": 2, "shuffle": False},
               {"epoch": 4, "drop_last": True}):
        batches = {t: list(d.batches(48, **kw)) for t, d in sets.items()}
        for t, got in batches.items():
            assert len(got) == len(batches["ram"])
            for (x, y), (rx, ry) in zip(got, batches["ram"]):
                assert torch.equal(x, rx) and torch.equal(y, ry), (t, kw)
    # views (the trainer's training rows) too, across windows of their own rows
    from embedfleet.train.dataset import load

    keyed = {t: load("reviews", label="rating", db=dsn, device="cpu", cache=t, window_rows=256, keys=True)
             for t in ("ram", "stream")}
    views = {t: d.split_by_key(0.3)[0] for t, d in keyed.items()}
    a, b = (list(v.batches(40, epoch=1)) for v in views.values())
    assert len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    for d in list(sets.values()) + list(keyed.values()):
        d.close()
    # the rows are the table's: a vector and a label compared with a plain query
    import psycopg
    from pgvector.psycopg import register_vector

    with psycopg.connect(dsn) as conn:
        register_vector(conn)
        for i in (0, 7, len(ref) - 1):
            vec, rating = conn.execute("SELECT embedding, rating FROM reviews WHERE id = %s", [ref.ids[i]]).fetchone()
            assert np.array_equal(vec.to_numpy(), ref.vectors()[i].numpy()) and ref.classes[int(ref.labels[i])] == rating


def test_a_halfvec_table_reads_correctly(env):
    from embedfleet.train import EmbeddingDataset

    dsn = env["dsn"]
    half = EmbeddingDataset.from_table("half", label="rating", db=dsn, device="cpu", cache="ram")
    full = EmbeddingDataset.from_table("reviews", label="rating", db=dsn, device="cpu", cache="ram")
    assert half.dtype == torch.float16 and half.source.vtype == "halfvec" and list(half.ids) == list(full.ids)
    assert torch.allclose(half.vectors().float(), full.vectors(), atol=1e-3)
    import psycopg

    with psycopg.connect(dsn) as conn:  # exactly the stored halves
        stored = conn.execute("SELECT embedding::vector::real[] FROM half WHERE id = %s", [half.ids[3]]).fetchone()[0]
    assert np.array_equal(np.array(stored, np.float32), half.vectors()[3].float().numpy())
    # without a label every row is read (NULL ratings too); streamed, widened to float32 on the way
    wide = EmbeddingDataset.from_table("half", db=dsn, device="cpu", cache="stream", dtype="float32")
    assert wide.dtype == torch.float32 and wide.labels is None and len(wide) == ROWS
    x, y = next(iter(wide.batches(8, shuffle=False)))
    assert y is None and torch.equal(x.half(), EmbeddingDataset.from_table("half", db=dsn, device="cpu").vectors()[:8])
    wide.close()


BAD = [
    (("--table", "reviews", "--label", "nope"), "no such column"),
    (("--table", "reviews", "--label", "images"), "numeric or text"),
    (("--table", "reviews", "--label", "price"), "NULL in all"),
    (("--table", "plain", "--label", "rating"), "no vector or halfvec column"),
    (("--table", "missing", "--label", "rating"), "does not exist"),
    (("--table", "reviews", "--label", "rating", "--where", "false"), "selection is empty"),
    (("--table", "reviews", "--label", "rating", "--where", "rating >"), "--where"),
    (("--table", "reviews", "--label", "rating", "--where", "1=1; DELETE FROM reviews"), "--where"),
    (("--table", "reviews", "--label", "rating", "--where", "nextval('counter') > 0"), "read-only"),
    (("--table", "reviews", "--label", "title", "--task", "regress"), "numeric --label"),
]


def _same_batches(a, b) -> int:
    """Both datasets' batches of one shuffled epoch are equal; how many rows they held."""
    seen = 0
    for (xa, ya), (xb, yb) in zip(a.batches(48, shuffle=True, epoch=1), b.batches(48, shuffle=True, epoch=1),
                                  strict=True):
        assert torch.equal(xa, xb) and (ya is None and yb is None or torch.equal(ya, yb))
        seen += len(xa)
    return seen


def test_a_partitioned_table_reads_into_memory_and_streams_the_same_vectors(env):
    """Hash partitions of the reviews, whose rows share ctids: read into memory, the same rows and vectors as
    the table itself; streamed, each window found partition by partition, the same batches as in memory."""
    import psycopg

    from embedfleet.train import EmbeddingDataset

    dsn = env["dsn"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE reviews_parts (LIKE reviews INCLUDING ALL) PARTITION BY HASH (id)")
        for i in range(3):
            conn.execute(f"CREATE TABLE reviews_parts_{i} PARTITION OF reviews_parts "
                         f"FOR VALUES WITH (MODULUS 3, REMAINDER {i})")
        conn.execute("INSERT INTO reviews_parts SELECT * FROM reviews")
    try:
        ref = EmbeddingDataset.from_table("reviews", label="rating", db=dsn, device="cpu", cache="ram")
        parts = EmbeddingDataset.from_table("reviews_parts", label="rating", db=dsn, device="cpu", cache="ram",
                                            connections=2, window_rows=256)  # the stream's windows: its order
        assert sorted(parts.ids) == sorted(ref.ids) and len(parts) == ROWS - NULL_RATINGS
        at = {i: k for k, i in enumerate(ref.ids)}
        order = [at[i] for i in parts.ids]
        assert torch.equal(parts.vectors(), ref.vectors()[order])
        assert [parts.classes[int(k)] for k in parts.labels] == [ref.classes[int(ref.labels[k])] for k in order]
        streamed = EmbeddingDataset.from_table("reviews_parts", label="rating", db=dsn, device="cpu", cache="stream",
                                               connections=2, window_rows=256)
        try:  # its snapshot's connection stays open: the table cannot be dropped under it
            assert streamed.cache == "stream" and list(streamed.ids) == list(parts.ids)
            assert _same_batches(streamed, parts) == len(parts)
        finally:
            streamed.close()
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DROP TABLE reviews_parts")


def test_a_parent_by_inheritance_with_rows_of_its_own_streams_them_and_its_childrens(env):
    import psycopg

    from embedfleet.train import EmbeddingDataset

    dsn = env["dsn"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE reviews_base (LIKE reviews INCLUDING ALL)")
        conn.execute("CREATE TABLE reviews_kid (LIKE reviews INCLUDING ALL) INHERITS (reviews_base)")
        conn.execute("INSERT INTO reviews_base SELECT * FROM reviews WHERE rating >= 3")
        conn.execute("INSERT INTO reviews_kid SELECT * FROM reviews WHERE rating < 3 OR rating IS NULL")
    try:
        ram = EmbeddingDataset.from_table("reviews_base", db=dsn, device="cpu", cache="ram", window_rows=256)
        streamed = EmbeddingDataset.from_table("reviews_base", db=dsn, device="cpu", cache="stream",
                                               window_rows=256)
        try:
            assert len(ram) == ROWS and list(streamed.ids) == list(ram.ids)
            assert _same_batches(streamed, ram) == ROWS
        finally:
            streamed.close()
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DROP TABLE reviews_kid, reviews_base")


def test_classify_on_a_label_that_is_a_measurement_says_so_and_regress_does_not(env):
    """A price as `--task classify`: 400 classes of one row each, trained without a word."""
    import psycopg

    with psycopg.connect(env["dsn"], autocommit=True) as conn:
        conn.execute("CREATE TABLE priced AS SELECT id, embedding, rating, "
                     "round((hashtext(id) & 65535)::numeric / 100, 2)::float8 AS price FROM reviews")
    common = ("train", "--table", "priced", "--epochs", "1", "--devices", "cpu", "--db", env["dsn"])
    said = env["cli"](*common, "--label", "price", "--task", "classify", "--out", env["root"] / "price-c").stderr
    [line] = [x for x in said.splitlines() if "--label price:" in x]
    assert "distinct values among" in line and "not whole numbers" in line and "--task regress" in line
    for label, task in (("price", "regress"), ("rating", "classify")):  # what a user means: nothing to say
        p = env["cli"](*common, "--label", label, "--task", task, "--out", env["root"] / f"{label}-{task}")
        assert "--task regress" not in p.stderr, p.stderr


def test_bad_inputs_give_one_line_errors(env):
    procs = []
    for args, _ in BAD:  # in parallel: most of each is starting Python and torch
        task = () if "--task" in args else ("--task", "classify")
        cmd = [sys.executable, "-m", "embedfleet.cli", "train", *args, *task, "--devices", "cpu", "--epochs", "1",
               "--db", env["dsn"]]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=env["environ"], stdin=subprocess.DEVNULL))
    for (args, expected), p in zip(BAD, procs):
        out, err = p.communicate(timeout=300)
        lines = [line for line in err.splitlines() if line.strip()]
        assert p.returncode == 2, (args, err)
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], (args, err)
        assert "Traceback" not in err and out == ""
    import psycopg

    with psycopg.connect(env["dsn"]) as conn:
        assert conn.execute("SELECT count(*) FROM reviews").fetchone()[0] == ROWS
        assert conn.execute("SELECT last_value, is_called FROM counter").fetchone() == (1, False)


def test_a_run_whose_loss_becomes_nan_fails_and_saves_nothing(env):
    """A learning rate far too high made a head of NaNs that was saved, and the run exited 0."""
    cli, dsn, root = env["cli"], env["dsn"], env["root"]
    out = root / "diverged"
    p = cli("train", "--table", "reviews", "--label", "rating", "--task", "classify", "--devices", "cpu", "--epochs",
            "2", "--lr", "1e38", "--db", dsn, "--out", out, check=False)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and last.startswith("error: training diverged: the loss is ") and "lower --lr" in last
    assert "Traceback" not in p.stderr and not (out / "head.safetensors").exists()
