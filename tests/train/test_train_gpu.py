"""EmbeddingDataset and `embedfleet train` on CUDA: the tiers' batches agree on the device, and
the command trains on one GPU (gpu and ram tiers alike, replayed as CUDA graphs or eagerly) and on two
(NCCL) like on one."""

import itertools
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
    gpu = _train(tmp_path, dsn, "--devices", "cuda:0", "--tier", "gpu")
    ram = _train(tmp_path, dsn, "--devices", "cuda:0", "--tier", "ram")
    assert gpu["cache"] == "gpu" and ram["cache"] == "ram" and gpu["device"] == "cuda:0"
    assert gpu["dtype"] == ram["dtype"] == "bfloat16"  # what autocast feeds the head: stored so on CUDA
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
    graphed = _train(tmp_path, dsn, "--devices", "cuda:0", "--tier", "gpu")
    eager = _train(tmp_path, dsn, "--devices", "cuda:0", "--tier", "gpu", EMBEDFLEET_TRAIN_GRAPH="0")
    assert graphed["step"] == "cuda-graph" and eager["step"] == "eager"
    for a, b in zip(graphed["epochs"], eager["epochs"]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-3)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-3)


def test_the_epoch_order_on_the_gpu_is_the_cpus():
    from embedfleet.train.order import epoch_order

    for n, window in ((1_000_003, 262_144), (70_000, None)):
        assert (epoch_order(n, 3, 2, 256, window, device="cuda").cpu().numpy() == epoch_order(n, 3, 2, 256, window)).all()


def test_the_take_kernel_reads_device_and_pinned_host_rows_like_torch():
    """The step's rows by the order, one Triton kernel: from device memory and from pinned host memory
    (read across PCIe), cast to bf16, at the step the device counter says, ahead of it, and a short
    step; positions past the order's end are not read. In the default shapes and with fewer programs
    than tiles (each program then loops over several)."""
    from embedfleet.train.take import kernel_available, take
    from embedfleet.train.take_kernel import take_rows

    assert kernel_available(torch.device("cuda"))
    g = torch.Generator().manual_seed(1)
    n, dim, per, stride = 10_007, 384, 512, 1024
    rows = torch.randperm(n, generator=g).cuda()
    pos = torch.randperm(n, generator=g).cuda()
    labels = torch.randint(0, 5, (n,), generator=g).cuda()
    step_no, base = torch.tensor([7], device="cuda"), torch.tensor([2], device="cuda")
    for dtype in (torch.float32, torch.float16):
        table = torch.randn(n, dim, generator=g).to(dtype)
        for src, shape in itertools.product((table.cuda(), table.pin_memory()), (None, (8192, 4, 3), (1024, 1, 5))):
            for first, step_stride, ahead, count in ((512, stride, 0, per), (0, stride, 1, per), (9_900, 0, 0, 107),
                                                     (4_675, stride, 0, per)):  # the last: 212 rows, then the end
                x = torch.full((per, dim), -1.0, dtype=torch.bfloat16, device="cuda")
                y = torch.full((per,), -1, dtype=torch.int64, device="cuda")
                if shape is None:
                    take(src, rows, pos, labels, x, y, step_no, base, first, step_stride, ahead, count, kernel=True)
                else:
                    take_rows(src, rows, pos, labels, x, y, step_no, base, first, step_stride, ahead, count, shape)
                at = first + (7 - 2 + ahead) * step_stride
                ok = min(count, n - at)
                want = table.cuda()[rows[at:at + ok]].to(torch.bfloat16)
                assert torch.equal(x[:ok], want), (dtype, src.device, shape, first, ahead)
                assert torch.equal(y[:ok], labels[pos[at:at + ok]])
                assert (x[count:] == -1).all() and (y[count:] == -1).all()  # nothing written past count


def test_the_ram_tier_steps_read_pinned_rows_ahead_and_train_like_the_gpu_tier(dsn, conn):
    """TrainLoop in the ram tier on CUDA: its graphs take each step's rows from pinned host memory one
    step ahead (two graphs, two buffers), as the gpu tier's from device memory, and give its losses
    and weights."""
    from embedfleet.train import order
    from embedfleet.train.dataset import load
    from embedfleet.train.heads import build_head
    from embedfleet.train.loop import TrainLoop

    _table(conn)
    batch, epochs = 256, 4
    results = {}
    for tier, ahead in (("gpu", None), ("ram", None), ("gpu", False)):  # False: the rows taken within the step
        ds = load("g", label="rating", db=dsn, device="cuda", cache=tier, task="classify", keys=True)
        train, _ = ds.split_by_key(0.2)
        steps = epochs * len(order.step_sizes(len(train), batch))
        torch.manual_seed(0)
        model = build_head("mlp", ds.dim, len(ds.classes)).cuda()
        loop = TrainLoop(model, train, batch, 0, 1, "classify", (0.0, 1.0), [0.01] * steps, 0.01, ahead=ahead)
        assert loop.src is not None and loop.ahead == (ahead is None)
        losses = [float(loop.epoch(e)) for e in range(epochs)]
        assert loop.mode == "cuda-graph" and all(g is not None for g in loop.graphs)
        results[tier, ahead] = (losses, [p.detach().cpu() for p in model.parameters()])
        ds.close()
    for other in (("ram", None), ("gpu", False)):
        assert results[other][0] == pytest.approx(results["gpu", None][0], rel=1e-5)
        for a, b in zip(results["gpu", None][1], results[other][1]):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_each_epoch_replays_the_order_made_during_the_one_before(dsn, conn):
    """TrainLoop makes each epoch's order once, on its order stream (epoch e+1's during epoch e), and
    the steps read exactly that order; the last epoch makes none."""
    from embedfleet.train import order
    from embedfleet.train.dataset import load
    from embedfleet.train.heads import build_head
    from embedfleet.train.loop import TrainLoop

    _table(conn)
    ds = load("g", label="rating", db=dsn, device="cuda", cache="gpu", task="classify")
    batch, epochs = 128, 3
    loop = TrainLoop(build_head("linear", ds.dim, len(ds.classes)).cuda(), ds, batch, 0, 1, "classify", (0.0, 1.0),
                     [0.01] * (epochs * len(order.step_sizes(len(ds), batch))), 0.01)
    made, real = [], ds.epoch_rows_on_device

    def spy(e, *args, **kw):
        made.append((e, torch.cuda.current_stream() == loop.order_stream))
        return real(e, *args, **kw)

    ds.epoch_rows_on_device = spy
    for e in range(epochs):
        loop.epoch(e)
        rows, positions = real(e)
        assert torch.equal(loop.order_rows, rows) and torch.equal(loop.order_pos, positions)
        assert (loop.next_order[0] == e + 1) if e + 1 < epochs else loop.next_order is None
    assert made == [(e, True) for e in range(epochs)]
    ds.close()
