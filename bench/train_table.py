"""Training on a table's own columns (not a vector embedfleet wrote): the first field report's shape, read by
TableDataset, against what its users write instead.

    python bench/train_table.py [--rows 2000000] [--connections 8] [--batch-size 4096] [--epochs 3]
        [--slow-batches 40] [--fetchall-rows 500000] [--device auto] [--skip sql,fetchall] [--db DSN] [--out FILE]

The table (`bench_meas_<rows>`, reused when it has that many rows): 7 receivers x 4 measurements as four
real[7] columns, five real scalars and a class label (8 classes, a function of the columns, so the head
learns), written by the server itself (INSERT ... SELECT on several connections), UNLOGGED.

Parts (each the same eager step as a user writes: an MLP head on the standardized features, cross-entropy,
AdamW; bf16 autocast and fused AdamW on CUDA):
    read             TableDataset.from_table on --connections connections: wall and rows/s (two reads; the
                     first in this fresh process)
    pure_compute     an epoch's worth of steps on one batch already on the device: the floor
    gpu, ram         ds.batches() in each tier
    dataloader       torch's DataLoader(ds, batch_size, shuffle=True) over the gpu tier (__getitems__)
    fetchall         psycopg fetchall of the same columns (--fetchall-rows rows, extrapolated to the table),
                     numpy, a TensorDataset and DataLoader(shuffle=True): its read and its epoch
    sql_per_batch    the field report's loader: a new connection and a SELECT by id a batch (--slow-batches
                     batches, the epoch extrapolated)
One JSON document on stdout and --out; progress on stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psycopg
import torch
import torch.nn.functional as F

import harness

ARRAYS = ("rssi", "snr", "delay", "angle")  # one real[7] each: 7 receivers
SCALARS = ("temp", "hum", "speed", "alt", "batt")
FEATURES = list(ARRAYS) + list(SCALARS)
CLASSES = 8


def say(*parts) -> None:
    print("[train_table]", *parts, file=sys.stderr, flush=True)


def write_table(dsn: str, table: str, rows: int, writers: int) -> dict:
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            if conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0] == rows:
                return {"reused": True}
        except psycopg.errors.UndefinedTable:
            pass
        conn.execute(f"DROP TABLE IF EXISTS {table}")
        conn.execute(f"CREATE UNLOGGED TABLE {table} (id bigint, {', '.join(f'{a} real[]' for a in ARRAYS)}, "
                     f"{', '.join(f'{s} real' for s in SCALARS)}, position_class int)")
    seven = "ARRAY[" + ", ".join(["random()::real"] * 7) + "]"
    # the label from the row's own values, computed as it is inserted (an UPDATE would leave every page half dead)
    insert = (f"INSERT INTO {table} SELECT g, {', '.join(ARRAYS)}, {', '.join(SCALARS)}, "
              f"least(7, floor((rssi[1] + snr[3] + temp) * 8 / 3))::int FROM (SELECT g, "
              f"{', '.join(f'{seven} AS {a}' for a in ARRAYS)}, {', '.join(f'random()::real AS {c}' for c in SCALARS)} "
              f"FROM generate_series(%s::bigint, %s::bigint) g) s")
    t0 = time.perf_counter()

    def part(k):
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(insert, [rows * k // writers, rows * (k + 1) // writers - 1])

    with ThreadPoolExecutor(writers) as ex:
        list(ex.map(part, range(writers)))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE {table} ADD PRIMARY KEY (id)")
        conn.execute(f"VACUUM ANALYZE {table}")
    return {"reused": False, "write_s": round(time.perf_counter() - t0, 1)}


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def fresh_step(dim: int, dev, sample: torch.Tensor):
    from embedfleet.train.heads import build_head

    torch.manual_seed(0)
    model = build_head("mlp", dim, CLASSES, standardize=True).to(dev)
    model[0].fit(sample.to(dev))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=dev.type == "cuda")
    cuda = dev.type == "cuda"

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            out = model(x)
        loss = F.cross_entropy(out.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def fresh_loop(ds, batch: int, epochs: int, sample: torch.Tensor, gather: bool | None = None):
    """The trainer's loop (one CUDA graph a step on CUDA) with the head `train --features` builds."""
    from embedfleet.train.heads import build_head
    from embedfleet.train.loop import TrainLoop
    from embedfleet.train.order import step_sizes

    torch.manual_seed(0)
    model = build_head("mlp", ds.dim, CLASSES, standardize=True).to(ds.device)
    model[0].fit(sample.to(ds.device))
    steps = len(step_sizes(len(ds), batch))
    return TrainLoop(model, ds, batch, 0, 1, "classify", (0.0, 1.0), [1e-3] * (steps * (epochs + 1)), 0.01,
                     gather=gather)


def seconds_each(run_epoch, dev, epochs: int) -> list[float]:
    out = []
    for e in range(epochs):
        _sync(dev)
        t0 = time.perf_counter()
        float(run_epoch(e))
        out.append(round(time.perf_counter() - t0, 4))
    return out


def epochs_of(batches_of_epoch, step, dev, epochs: int) -> list[float]:
    out = []
    for e in range(epochs):
        _sync(dev)
        t0 = time.perf_counter()
        loss = torch.zeros((), device=dev)
        for x, y in batches_of_epoch(e):
            loss += step(x, y)
        float(loss)
        out.append(round(time.perf_counter() - t0, 4))
    return out


def fetchall_rows(dsn: str, table: str, limit: int):
    """What a user writes: one SELECT, fetchall, then numpy."""
    t0 = time.perf_counter()
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(f"SELECT {', '.join(FEATURES)}, position_class FROM {table} ORDER BY id LIMIT %s",
                            [limit]).fetchall()
    fetched = time.perf_counter() - t0
    x = np.asarray([[v for a in r[:4] for v in a] + list(r[4:9]) for r in rows], np.float32)
    y = np.asarray([r[9] for r in rows], np.int64)
    return x, y, fetched, time.perf_counter() - t0


def sql_batches(dsn: str, table: str, n: int, batch: int, count: int, dev, step) -> dict:
    """The field report's loader: a connection and a query a batch, rows by id in the epoch's order."""
    order = np.random.default_rng(0).permutation(n)
    cols = f"{', '.join(FEATURES)}, position_class"
    times = []
    for k in range(count + 1):
        t0 = time.perf_counter()
        ids = order[k * batch:(k + 1) * batch].tolist()
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(f"SELECT {cols} FROM {table} WHERE id = ANY(%s)", [ids]).fetchall()
        x = torch.tensor([[v for a in r[:4] for v in a] + list(r[4:9]) for r in rows], dtype=torch.float32)
        y = torch.tensor([r[9] for r in rows])
        float(step(x.to(dev), y.to(dev)))
        if k:  # the first connects cold
            times.append(time.perf_counter() - t0)
    per = float(np.median(times))
    steps = -(-n // batch)
    return {"batches_timed": count, "per_batch_s": round(per, 4), "epoch_s_extrapolated": round(per * steps, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--more-connections", default="", help="also time reads on these connection counts: 4,16")
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--slow-batches", type=int, default=40)
    ap.add_argument("--fetchall-rows", type=int, default=500_000)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--skip", default="", help="parts to leave out: sql, fetchall, ram, dataloader")
    ap.add_argument("--db", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t_start = time.perf_counter()
    from embedfleet.pg.embedded import resolve_dsn
    from embedfleet.settings import Settings
    from embedfleet.train import TableDataset
    from embedfleet.train.dataset import resolve_device

    skip = set(filter(None, a.skip.split(",")))
    dev = resolve_device(a.device)
    dsn = resolve_dsn(a.db, Settings.from_env())
    table = f"bench_meas_{a.rows}"
    doc: dict = {"environment": harness.environment(dsn), "rows": a.rows, "features": FEATURES,
                 "batch_size": a.batch_size, "device": str(dev)}
    doc["table"] = write_table(dsn, table, a.rows, a.connections)
    say("table", doc["table"])

    import resource

    reads = []
    counts = [a.connections] * 2 + [int(c) for c in a.more_connections.split(",") if c]
    for k, conns in enumerate(counts):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        ds = TableDataset.from_table(table, features=FEATURES, label="position_class", db=dsn, cache="gpu" if
                                     dev.type == "cuda" else "ram", device=dev, connections=conns)
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        reads.append({"connections": conns, "wall_s": round(wall, 3), "rows_per_s": round(len(ds) / wall),
                      "dim": ds.dim, "client_cpu_s": round(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, 2),
                      "stats": ds.stats, "since_start_s": round(time.perf_counter() - t_start, 2) if k == 0 else None})
        say(f"read {k}: {len(ds):,} rows x {ds.dim} on {conns} connections in {wall:.2f} s "
            f"({len(ds) / wall:,.0f} rows/s; plan {ds.stats['plan_s']} s)")
        if k == 1:
            kept = ds  # the second read at --connections: the one trained on
        else:
            ds.close()
    ds = kept
    doc["read"] = reads
    n, dim, b = len(ds), ds.dim, a.batch_size
    sample = ds.vectors()[:: max(1, n // 100_000)]
    results: dict = {}

    x0, y0 = next(iter(ds.batches(b, shuffle=False)))
    steps = -(-n // b)
    tier = "gpu" if dev.type == "cuda" else "ram"
    # the trainer's loop (what `embedfleet train --features` runs): the step alone, then each tier
    loop = fresh_loop(ds, b, a.epochs, sample, gather=False)
    full = n // b

    def compute(_):
        loop.steps_on(x0, y0, full)
        return loop.loss_sum

    results["pure_compute"] = seconds_each(compute, dev, a.epochs)
    results[tier] = seconds_each(fresh_loop(ds, b, a.epochs, sample).epoch, dev, a.epochs)
    if dev.type == "cuda" and "ram" not in skip:
        ram = ds.with_cache("ram")
        results["ram"] = seconds_each(fresh_loop(ram, b, a.epochs, sample).epoch, dev, a.epochs)
        ram.close()
    # a user's own eager loop: over ds.batches, and over torch's DataLoader(ds) (__getitems__)
    step = fresh_step(dim, dev, sample)
    results["eager_pure_compute"] = epochs_of(lambda e: ((x0, y0) for _ in range(steps)), step, dev, a.epochs)
    step = fresh_step(dim, dev, sample)
    results["eager_batches"] = epochs_of(lambda e: ds.batches(b, epoch=e), step, dev, a.epochs)
    if "dataloader" not in skip:
        from torch.utils.data import DataLoader

        step = fresh_step(dim, dev, sample)
        gen = torch.Generator().manual_seed(0)
        results["eager_dataloader"] = epochs_of(lambda e: DataLoader(ds, batch_size=b, shuffle=True, generator=gen),
                                                step, dev, a.epochs)
    say("epochs", results)
    if "fetchall" not in skip:
        from torch.utils.data import DataLoader, TensorDataset

        limit = min(n, a.fetchall_rows)
        x, y, fetched, converted = fetchall_rows(dsn, table, limit)
        scale = n / limit
        plain = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        step = fresh_step(dim, dev, sample)
        gen = torch.Generator().manual_seed(0)
        epoch = epochs_of(lambda e: ((xb.to(dev), yb.to(dev)) for xb, yb in
                                     DataLoader(plain, batch_size=b, shuffle=True, generator=gen)), step, dev, 1)[0]
        doc["fetchall"] = {"rows": limit, "fetch_s": round(fetched, 2), "fetch_and_numpy_s": round(converted, 2),
                           "read_s_extrapolated": round(converted * scale, 1),
                           "epoch_s_extrapolated": round(epoch * scale, 2)}
        say("fetchall", doc["fetchall"])
    if "sql" not in skip:
        step = fresh_step(dim, dev, sample)
        doc["sql_per_batch"] = sql_batches(dsn, table, n, b, a.slow_batches, dev, step)
        say("sql_per_batch", doc["sql_per_batch"])
    doc["epochs_s"] = results
    best = {k: min(v) for k, v in results.items()}
    ratios = {f"{k}_over_pure": round(best[k] / best["pure_compute"], 3) for k in ("gpu", "ram") if k in best}
    ratios["eager_batches_over_pure"] = round(best["eager_batches"] / best["eager_pure_compute"], 3)
    if "eager_dataloader" in best:
        ratios["dataloader_over_batches"] = round(best["eager_dataloader"] / best["eager_batches"], 3)
    ours = reads[1]["wall_s"] + best[tier]
    if "fetchall" in doc:
        theirs = doc["fetchall"]["read_s_extrapolated"] + doc["fetchall"]["epoch_s_extrapolated"]
        ratios["fetchall_read_and_epoch_over_ours"] = round(theirs / ours, 1)
    if "sql_per_batch" in doc:
        ratios["sql_per_batch_epoch_over_ours"] = round(doc["sql_per_batch"]["epoch_s_extrapolated"] / best[tier], 1)
    doc["ratios"] = ratios
    doc["targets"] = {
        "read_rows_per_s_1_5M": max(r["rows_per_s"] for r in reads if r["connections"] == a.connections) >= 1_500_000,
        "gpu_within_10pct": ratios.get("gpu_over_pure", 9) <= 1.10,
        "ram_within_25pct": ratios.get("ram_over_pure", 9) <= 1.25,
        "sql_per_batch_100x": ratios.get("sql_per_batch_epoch_over_ours", 0) >= 100,
        "fetchall_20x": ratios.get("fetchall_read_and_epoch_over_ours", 0) >= 20,
        "dataloader_within_2x": ratios.get("dataloader_over_batches", 9) <= 2.0,
    }
    ds.close()
    print(harness.record(doc, a.out))


if __name__ == "__main__":
    main()
