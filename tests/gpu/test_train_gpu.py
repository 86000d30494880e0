"""EmbeddingDataset and `embedfleet train` on CUDA: the tiers' batches agree on the device, and
the command trains on one GPU (gpu and ram tiers alike, replayed as CUDA graphs or eagerly) and on two
(NCCL) like on one."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROWS, DIM = 6000, 64


def _table(conn, name="g"):
    # a correlated subquery (i > 0) draws a new vector for every row; the rating follows its first value
    conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    conn.execute(f"CREATE TABLE {name} (id text PRIMARY KEY, embedding vector({DIM}), rating real)")
    conn.execute(
        f"INSERT INTO {name} SELECT 'r' || i, v::vector({DIM}), 1 + floor(v[1] * 5) FROM generate_series(1, {ROWS}) i, "
        f"LATERAL (SELECT array_agg(random()) AS v FROM generate_series(1, {DIM}) WHERE i > 0) r")


def test_tiers_give_the_same_device_batches(dsn, conn):
    from embedfleet.train import EmbeddingDataset

    _table(conn)
    for dtype in (None, "bfloat16"):
        sets = {t: EmbeddingDataset.from_table("g", label="rating", db=dsn, device="cuda", cache=t, dtype=dtype,
                                               window_rows=1024) for t in ("gpu", "ram", "stream")}
        assert [d.cache for d in sets.values()] == ["gpu", "ram", "stream"]
        for kw in ({"epoch": 0}, {"epoch": 1, "rank": 1, "world_size": 2}, {"epoch": 2, "shuffle": False}):
            got = {t: [(x.cpu(), y.cpu()) for x, y in d.batches(500, **kw)] for t, d in sets.items()}
            for t in ("ram", "stream"):
                assert len(got[t]) == len(got["gpu"])
                assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got[t], got["gpu"]))
        x, y = next(iter(sets["ram"].batches(500)))
        assert x.device.type == "cuda" and y.device.type == "cuda"
        for d in sets.values():
            d.close()


def _train(tmp_path, dsn, *args, **environ):
    env = dict(os.environ, EMBEDFLEET_HOME=str(tmp_path), **environ)
    p = subprocess.run([sys.executable, "-m", "embedfleet.cli", "train", "--table", "g", "--label", "rating",
                        "--task", "classify", "--epochs", "10", "--batch-size", "256", "--lr", "0.05", "--db", dsn,
                        "--json", *args], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_train_on_one_gpu_in_both_tiers(dsn, conn, tmp_path):
    _table(conn)
    gpu = _train(tmp_path, dsn, "--devices", "cuda:0", "--cache", "gpu")
    ram = _train(tmp_path, dsn, "--devices", "cuda:0", "--cache", "ram")
    assert gpu["cache"] == "gpu" and ram["cache"] == "ram" and gpu["device"] == "cuda:0"
    assert gpu["final"]["val_accuracy"] > 0.45  # chance is 0.2: the rating is a step function of one component
    for a, b in zip(gpu["epochs"], ram["epochs"]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_train_like_one(dsn, conn, tmp_path):
    _table(conn)
    one = _train(tmp_path, dsn, "--devices", "cuda:0")
    two = _train(tmp_path, dsn, "--devices", "cuda:0,1")
    assert two["world_size"] == 2 and two["rows"] == one["rows"]
    assert one["step"] == two["step"] == "cuda-graph"  # the all-reduce captured inside the graph
    for a, b in zip(one["epochs"], two["epochs"]):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=2e-2)
    assert abs(two["final"]["val_accuracy"] - one["final"]["val_accuracy"]) < 0.05


def test_steps_replayed_as_cuda_graphs_train_like_eager_steps(dsn, conn, tmp_path):
    _table(conn)
    graphed = _train(tmp_path, dsn, "--devices", "cuda:0", "--cache", "gpu")
    eager = _train(tmp_path, dsn, "--devices", "cuda:0", "--cache", "gpu", EMBEDFLEET_TRAIN_GRAPH="0")
    assert graphed["step"] == "cuda-graph" and eager["step"] == "eager"
    for a, b in zip(graphed["epochs"], eager["epochs"]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-3)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-3)


def test_the_epoch_order_on_the_gpu_is_the_cpus():
    from embedfleet.train.order import epoch_order

    for n, window in ((1_000_003, 262_144), (70_000, None)):
        assert (epoch_order(n, 3, 2, 256, window, device="cuda").cpu().numpy() == epoch_order(n, 3, 2, 256, window)).all()
