"""Training loaders on one table and one device: what a user would write instead, against
EmbeddingDataset's tiers, against the training step alone.

    python bench/train_loader.py [--rows 200000] [--dim 384] [--table NAME] [--device auto]
        [--batch-size 4096] [--epochs 2] [--slow-batches 60] [--workers 4] [--readers 1,4]
        [--read-prefault] [--read-only] [--file-rows 1000000] [--skip sql,file,stream,read,eager] [--ram-variants switch200us,…]
        [--gpu-inline] [--take-shapes 8192x4x32,…] [--ddp-devices cuda:0,1] [--db DSN] [--out FILE]

The table (`bench_train_<rows>_<dim>`, reused when it exists with that many rows) is written by
parallel binary COPY: random unit vectors, a rating that is a linear function's argmax of them (so
the head can learn it), ids `r0000000000`…, a primary key on id (the per-batch SQL loader looks rows
up by id). It is UNLOGGED, to write quickly: its pages read like any other table's.

Each loader feeds the same step (linear head, cross-entropy, AdamW; bf16 autocast and fused AdamW
on CUDA) with `--batch-size` rows:
    pure_compute     the trainer's step (TrainLoop: one CUDA graph a step on CUDA) on one batch
                     already on the device, an epoch's worth of steps: the floor
    gpu, ram         TrainLoop over EmbeddingDataset in each tier, as `embedfleet train` runs it (its
                     storage dtype: bf16 on CUDA; the ram tier is the gpu tier's rows copied to
                     pinned memory: the table is read once)
    *_eager          the same with the eager step of a user's loop (make_step) over `batches()`
                     (pure_compute_eager: contiguous slices of tensors on the device)
    stream           the eager step over the stream tier's batches()
    sql_per_batch    the first field report: a torch Dataset whose __getitem__ opens a new session
                     and SELECTs a batch's rows by id, DataLoader with --workers workers
    dataloader_file, dataloader_file_flock
                     the second: a per-row __getitem__ reading a file cache (pread of one row of
                     the first --file-rows rows) under DataLoader with --workers persistent workers,
                     without and with an fcntl.flock shared lock around each read
Slow loaders are timed over --slow-batches batches (after 2 x workers + 1 untimed: the first round of
prefetched batches arrives at once) and their epoch time
extrapolated (batches × time a batch); that is said in the output. Bulk read rates: one connection
(over the first --read-rows rows, a TID range) and --readers connections (the whole table).
On CUDA, `copies`: GB/s of a batch's bytes copied to the device from pinned and from pageable memory,
and the ram tier's floor (an epoch's bytes over the pinned rate).
`--ddp-devices cuda:0,1,…` also runs `embedfleet train --tier gpu` on 1 and on those devices and
reports their epoch seconds (issue 22's scaling).
One JSON document on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psycopg
import torch
import torch.nn.functional as F
from psycopg import sql

import harness

from embedfleet.settings import Settings
from embedfleet.pg.embedded import resolve_dsn
from embedfleet.pg.connect import connect
from embedfleet.pg.ddl import ensure_vector
from embedfleet.train import EmbeddingDataset
from embedfleet.train.heads import build_head
from embedfleet.train.order import step_sizes
from embedfleet.train.read import TableRead, describe
from embedfleet.train.loop import TrainLoop
from embedfleet.train.trainer import storage_dtype

CLASSES = 5


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def said(seconds: list[float]) -> list[float]:
    """Epoch seconds, also said as they come (a run cut short keeps what it measured)."""
    say(f"  epoch seconds {seconds}")
    return seconds


# ---- the table ------------------------------------------------------------------------------------

def _rows_bytes(start: int, n: int, dim: int, proj: np.ndarray, seed: int) -> bytes:
    """Binary COPY rows (id text, embedding vector, rating real) for ids start…start+n-1."""
    rng = np.random.default_rng([seed, start])
    v = rng.standard_normal((n, dim), dtype=np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    rating = (1 + np.argmax(v @ proj, axis=1)).astype(np.float32)
    dt = np.dtype([("nf", ">i2"), ("l0", ">i4"), ("id", "S11"), ("l1", ">i4"), ("vd", ">i2"), ("vu", ">i2"),
                   ("v", ">f4", (dim,)), ("l2", ">i4"), ("r", ">f4")])
    a = np.empty(n, dt)
    a["nf"], a["l0"], a["l1"], a["vd"], a["vu"], a["l2"] = 3, 11, 4 + 4 * dim, dim, 0, 4
    a["id"] = np.char.add(b"r", np.char.zfill(np.arange(start, start + n).astype("S10"), 10))
    a["v"], a["r"] = v, rating
    return a.tobytes()


def write_table(dsn: str, table: str, rows: int, dim: int, writers: int) -> dict:
    with connect(dsn) as conn:
        ensure_vector(conn)
        have = None
        if conn.execute("SELECT to_regclass(%s) IS NOT NULL", [sql.Identifier(table).as_string(conn)]).fetchone()[0]:
            have = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()[0]
        if have == rows:
            say(f"reusing {table} ({rows:,} rows)")
            return {"name": table, "rows": rows, "dim": dim, "written": False}
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))
        conn.execute(sql.SQL("CREATE UNLOGGED TABLE {} (id text NOT NULL, embedding vector({}), rating real) "
                             "WITH (toast_tuple_target = 8160, autovacuum_enabled = off)").format(
            sql.Identifier(table), sql.Literal(dim)))
    proj = np.random.default_rng(12345).standard_normal((dim, CLASSES)).astype(np.float32)
    chunk = 50_000
    starts = list(range(0, rows, chunk))
    say(f"writing {table}: {rows:,} rows x {dim} on {writers} connections")
    t0 = time.perf_counter()

    def write(k: int) -> None:
        with connect(dsn) as c, c.cursor() as cur, cur.copy(sql.SQL(
                "COPY {} (id, embedding, rating) FROM STDIN (FORMAT BINARY)").format(sql.Identifier(table))) as cp:
            cp.write(b"PGCOPY\n\xff\r\n\x00" + bytes(8))
            for s in starts[k::writers]:
                cp.write(_rows_bytes(s, min(chunk, rows - s), dim, proj, 7))
            cp.write(b"\xff\xff")

    with ThreadPoolExecutor(writers) as ex:
        list(ex.map(write, range(writers)))
    written = time.perf_counter() - t0
    t0 = time.perf_counter()
    with connect(dsn) as conn:
        conn.execute("SET maintenance_work_mem = '2GB'")
        conn.execute(sql.SQL("SET max_parallel_maintenance_workers = {}").format(
            sql.Literal(max(0, min(7, (os.cpu_count() or 2) - 1)))))
        conn.execute(sql.SQL("ALTER TABLE {} ADD PRIMARY KEY (id)").format(sql.Identifier(table)))
        # what autovacuum does after a bulk insert (off for this table): hint bits and the visibility map set,
        # so the reads below do not pay the first scan's page writes
        conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(sql.Identifier(table)))
    return {"name": table, "rows": rows, "dim": dim, "written": True, "write_s": round(written, 2),
            "write_rows_per_s": round(rows / written), "primary_key_s": round(time.perf_counter() - t0, 2),
            "unlogged": True}


# ---- bulk read ------------------------------------------------------------------------------------

def read_rate(dsn: str, table: str, connections: int, rows: int | None, prefault: bool = False) -> dict:
    """The read alone into host memory: rows/s with `connections` (the first `rows` rows by TID range)."""
    with connect(dsn) as conn:
        where = None
        if rows:
            pages = conn.execute("SELECT relpages FROM pg_class WHERE oid = %s::regclass",
                                 [sql.Identifier(table).as_string(conn)]).fetchone()[0]
            total = conn.execute(sql.SQL("SELECT reltuples FROM pg_class WHERE oid = %s::regclass"),
                                 [sql.Identifier(table).as_string(conn)]).fetchone()[0]
            if total and rows < total:
                where = f"ctid < '({max(1, int(pages * rows / total))},0)'::tid"
        source = describe(conn, table, "rating", where, "classify")
    io0 = _relation_io(dsn)
    t0 = time.perf_counter()
    with TableRead(dsn, source, connections=connections) as r:
        plan = r.plan()
        x = np.empty((plan.n, source.dim), np.float32)
        fill_s = time.perf_counter()
        if prefault:  # the destination's pages touched first (not timed): the read without its page faults
            x.fill(0)
        fill_s = time.perf_counter() - fill_s

        def put(o, v):
            np.copyto(x[o:o + len(v)], v)

        pids = [c.info.backend_pid for c in r.conns]
        t1, client0, server0 = time.perf_counter(), time.process_time(), [_cpu_s(p) for p in pids]
        r.read(plan, put)
        copy_s = time.perf_counter() - t1
        client_s = time.process_time() - client0
        server_s = [None if s is None or e is None else e - s for s, e in zip(server0, map(_cpu_s, pids))]
    dt = time.perf_counter() - t0 - fill_s
    # who holds a one-connection read: the server's backend or this process, busy for how much of the COPY
    busy = {"copy_s": round(copy_s, 3), "client_cpu_s": round(client_s, 2),
            "server_cpu_s": [round(s, 2) for s in server_s if s is not None],
            "server_busy": [round(s / copy_s, 3) for s in server_s if s is not None],
            "client_busy": round(client_s / copy_s, 3)}
    io1 = _relation_io(dsn, after=io0)
    # the plan's scan and the COPY's: pages found in shared buffers, and MB read in
    pages = {k: round(io1[k] - io0[k], 1) for k in io0} if io0 and io1 else None
    return {"connections": connections, "rows": plan.n, "seconds": round(dt, 3), "rows_per_s": round(plan.n / dt),
            "copy_rows_per_s": round(plan.n / copy_s), "plan_s": round(plan.seconds, 3), "prefault": prefault,
            "chunked": r.chunked, "ahead": r.ahead, **busy, "server_io": pages}


def _relation_io(dsn: str, after: dict | None = None) -> dict | None:
    """The server's relation pages so far: found in shared buffers (hits) or read in (PostgreSQL 16+'s
    pg_stat_io). With `after`: polled until the figures settle (up to 2 s), since a backend's counts
    arrive when it exits, after its client has closed the connection (each poll's own catalog lookups
    add a few hundred hits)."""
    last = None
    for _ in range(20 if after else 1):
        now = _relation_io_once(dsn)
        if now is None or (last and now["read_mb"] == last["read_mb"] and now["hits"] - last["hits"] < 1000):
            return now
        last = now
        time.sleep(0.1)
    return last


def _relation_io_once(dsn: str) -> dict | None:
    with connect(dsn) as conn:
        for read_bytes in ("read_bytes", "reads * op_bytes"):  # PostgreSQL 18, 16–17
            try:
                hits, read_mb, read_ms = conn.execute(
                    f"SELECT sum(hits), sum({read_bytes}) / 1e6, sum(read_time) FROM pg_stat_io "
                    "WHERE object = 'relation'").fetchone()
                break
            except psycopg.Error:
                conn.rollback()
        else:
            return None
    return {"hits": int(hits or 0), "read_mb": float(read_mb or 0), "read_ms": float(read_ms or 0)}


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) of a local server process, from /proc (None for a server on another host,
    or in another pid namespace, where that pid is someone else's)."""
    try:
        if not open(f"/proc/{pid}/comm").read().startswith("postgres"):
            return None
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- loaders --------------------------------------------------------------------------------------

def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def make_step(model, optimizer, scheduler, task: str, device, world: int, target=(0.0, 1.0)):
    """The eager step as a user writes it (DDP over ranks; what `embedfleet train` ran before its
    TrainLoop): step(x, y, rows) → the batch's summed loss (a device tensor, no sync). `rows`: the
    step's row count over all ranks; DDP averages gradients over ranks, hence the factor `world`."""
    cuda = device.type == "cuda"
    mean, std = target

    def step(x, y, rows: int):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            out = model(x if cuda else x.float())
        out = out.float()
        if task == "classify":
            loss = F.cross_entropy(out, y, reduction="sum")
        else:
            loss = F.mse_loss(out.squeeze(1), (y - mean) / std, reduction="sum")
        optimizer.zero_grad(set_to_none=True)
        (loss * (world / rows)).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        return loss.detach()

    return step


def _fresh_step(dim: int, dev: torch.device, n: int, batch: int):
    torch.manual_seed(0)
    model = build_head("linear", dim, CLASSES).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=dev.type == "cuda")
    return make_step(model, opt, None, "classify", dev, 1), step_sizes(n, batch).tolist()


def _seconds_each(run_epoch, dev: torch.device, epochs: int) -> list[float]:
    """Seconds of each of `epochs` calls run_epoch(e), which returns a device tensor (waited for)."""
    out = []
    for e in range(epochs):
        _sync(dev)
        t0 = time.perf_counter()
        float(run_epoch(e))
        out.append(round(time.perf_counter() - t0, 4))
    return out


def time_epochs(batches_of_epoch, dim: int, dev: torch.device, n: int, batch: int, epochs: int) -> list[float]:
    """Seconds of each epoch of `batches_of_epoch(epoch)` through the eager training step."""
    step, sizes = _fresh_step(dim, dev, n, batch)

    def run(e):
        loss = torch.zeros((), device=dev)
        for s, (x, y) in enumerate(batches_of_epoch(e)):
            loss += step(x, y, sizes[s])
        return loss

    return _seconds_each(run, dev, epochs)


def _fresh_loop(ds, batch: int, epochs: int, gather: bool | None = None,
                ahead: bool | None = None) -> TrainLoop:
    """The trainer's loop (loop.py: one CUDA graph a step on CUDA) over `ds`, the same head and AdamW."""
    torch.manual_seed(0)
    model = build_head("linear", ds.dim, CLASSES).to(ds.device)
    steps = len(step_sizes(len(ds), batch))
    return TrainLoop(model, ds, batch, 0, 1, "classify", (0.0, 1.0), [1e-3] * (steps * (epochs + 1)), 0.01,
                     gather=gather, ahead=ahead)


def time_loop_epochs(ds, batch: int, epochs: int, ahead: bool | None = None) -> list[float]:
    """Seconds of each epoch of TrainLoop over `ds`: what `embedfleet train` runs (`ahead`: forced)."""
    return _seconds_each(_fresh_loop(ds, batch, epochs, ahead=ahead).epoch, ds.device, epochs)


def time_loop_compute(ds, batch: int, epochs: int) -> list[float]:
    """Seconds of an epoch's worth of TrainLoop's steps on one batch already on the device: the
    step without its input."""
    loop = _fresh_loop(ds, batch, epochs, gather=False)
    x, y = next(iter(ds.batches(batch, shuffle=False)))
    steps = int((step_sizes(len(ds), batch) == batch).sum())

    def run(_):
        loop.steps_on(x, y, steps)
        return loop.loss_sum

    return _seconds_each(run, ds.device, epochs)


def time_batches(loader, dim: int, dev: torch.device, n: int, batch: int, count: int) -> dict:
    """Seconds a batch over `count` batches, after as many untimed ones as the workers prefetch at
    once (2 each, plus one): those arrive together, and timed would make a loader look up to
    workers x prefetch batches faster than its steady state. The epoch extrapolated."""
    step, sizes = _fresh_step(dim, dev, n, batch)
    warmup = min(2 * max(1, loader.num_workers) + 1, len(loader) - 1)
    count = max(1, min(count, len(loader) - warmup))
    it = iter(loader)
    t_first = time.perf_counter()
    for k in range(warmup):
        x, y = next(it)
        step(x.to(dev, non_blocking=True), y.to(dev, non_blocking=True), sizes[k])
    _sync(dev)
    first = time.perf_counter() - t_first
    t0 = time.perf_counter()
    done = 0
    for x, y in it:
        step(x.to(dev, non_blocking=True), y.to(dev, non_blocking=True), sizes[warmup + done])
        done += 1
        if done == count:
            break
    _sync(dev)
    per = (time.perf_counter() - t0) / max(1, done)
    return {"batches_timed": done, "untimed_batches": warmup, "untimed_s": round(first, 3),
            "per_batch_s": round(per, 5), "epoch_s_extrapolated": round(per * len(sizes), 2),
            "steps_per_epoch": len(sizes)}


def ram_variant(name: str, batches_of_epoch, dim: int, dev: torch.device, n: int, batch: int, epochs: int):
    """The ram tier's epochs (eager step, as ram_eager) with one thing changed (what holds its side thread back?):
        switch200us   the interpreter's GIL switch interval at 200 µs (default 5 ms) during the epochs
        one_thread    the host gather in one np.take call (no gather pool)
        torch_gather  the host gather as one torch.index_select into the pinned buffer"""
    from embedfleet.train import dataset

    def torch_take(x, index, out=None):
        return torch.index_select(x, 0, torch.from_numpy(index), out=out)

    saved = sys.getswitchinterval(), dataset.gather_threads, dataset.host_take
    if name == "switch200us":
        sys.setswitchinterval(2e-4)
    elif name == "one_thread":
        dataset.gather_threads = lambda: 1
    elif name == "torch_gather":
        dataset.host_take = torch_take
    else:
        raise SystemExit(f"--ram-variants: unknown {name!r}")
    try:
        return time_epochs(batches_of_epoch, dim, dev, n, batch, epochs)
    finally:
        sys.setswitchinterval(saved[0])
        dataset.gather_threads, dataset.host_take = saved[1], saved[2]


class SqlPerBatch(torch.utils.data.Dataset):
    """The first field report's loader: each batch a new session and a query for its rows."""

    def __init__(self, dsn: str, table: str, ids: list[str], batch: int, seed: int = 0):
        self.dsn, self.table, self.batch = dsn, table, batch
        self.ids = np.asarray(ids, dtype=object)[np.random.default_rng(seed).permutation(len(ids))]

    def __len__(self) -> int:
        return -(-len(self.ids) // self.batch)

    def __getitem__(self, k: int):
        from pgvector.psycopg import register_vector

        want = self.ids[k * self.batch:(k + 1) * self.batch].tolist()
        with psycopg.connect(self.dsn) as conn:
            register_vector(conn)
            rows = conn.execute(sql.SQL("SELECT embedding, rating FROM {} WHERE id = ANY(%s)").format(
                sql.Identifier(self.table)), [want]).fetchall()
        x = torch.from_numpy(np.stack([np.asarray(r[0].to_numpy() if hasattr(r[0], "to_numpy") else r[0], np.float32)
                                       for r in rows]))
        y = torch.tensor([int(r[1]) - 1 for r in rows])
        return x, y


class FileRows(torch.utils.data.Dataset):
    """The second field report's loader: one row a __getitem__ from a read-only file cache, with an
    optional fcntl.flock shared lock around each read."""

    def __init__(self, path: str, rows: int, dim: int, labels: np.ndarray, lock: bool):
        self.path, self.rows, self.dim, self.labels, self.lock = path, rows, dim, labels, lock
        self.row_bytes = dim * 4
        self.fd = None

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int):
        if self.fd is None:  # one descriptor per worker process
            self.fd = os.open(self.path, os.O_RDONLY)
        if self.lock:
            fcntl.flock(self.fd, fcntl.LOCK_SH)
        try:
            raw = os.pread(self.fd, self.row_bytes, i * self.row_bytes)
        finally:
            if self.lock:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
        return torch.frombuffer(bytearray(raw), dtype=torch.float32), int(self.labels[i])


def _machine() -> dict:
    out = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
           "torch": torch.__version__}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpus"] = torch.cuda.device_count()
    try:
        out["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)
    except (ValueError, OSError):
        pass
    return out


def copy_rates(batch_bytes: int, dev: torch.device, count: int = 50) -> dict:
    """GB/s of host-to-device copies of one batch's bytes, from pinned and from pageable memory: what the
    ram tier's batches cost to move, however fast they are gathered."""
    host = torch.empty(batch_bytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(batch_bytes, dtype=torch.uint8)
    out = torch.empty(batch_bytes, dtype=torch.uint8, device=dev)
    rates = {}
    for name, src in (("h2d_pinned_gb_s", host), ("h2d_pageable_gb_s", pageable)):
        out.copy_(src, non_blocking=True)
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(count):
            out.copy_(src, non_blocking=True)
        _sync(dev)
        rates[name] = round(batch_bytes * count / (time.perf_counter() - t0) / 1e9, 2)
    return {"batch_bytes": batch_bytes, **rates}


def ddp_epochs(dsn: str, table: str, devices: str, batch: int, epochs: int) -> dict:
    """`embedfleet train` on one device and on `devices`: epoch seconds of each (issue 22)."""
    out = {}
    for devs in (devices.split(",")[0], devices):
        cmd = [sys.executable, "-m", "embedfleet.cli", "train", "--table", table, "--label", "rating", "--task",
               "classify", "--epochs", str(epochs), "--batch-size", str(batch), "--devices", devs, "--tier", "gpu",
               "--db", dsn, "--json", "--out", tempfile.mkdtemp(prefix="bench-train-")]
        say("running", " ".join(cmd[2:]))
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            out[devs] = {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}
            continue
        doc = json.loads(p.stdout)
        out[devs] = {"world_size": doc["world_size"], "epoch_s": [e["seconds"] for e in doc["epochs"]],
                     "read": doc["read"], "final_val_accuracy": doc["final"].get("val_accuracy")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--table", default=None, help="an existing table with embedding and rating (default: write one)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=2, help="epochs of the pure-compute, gpu and ram runs")
    ap.add_argument("--slow-batches", type=int, default=60, help="batches timed for the slow loaders")
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 2), help="DataLoader workers")
    ap.add_argument("--readers", default=None, help="connection counts for the bulk read (default 1 and the default)")
    ap.add_argument("--read-rows", type=int, default=2_000_000, help="rows of the one-connection read")
    ap.add_argument("--read-prefault", action="store_true", help="each bulk read again into a destination "
                    "whose pages were touched first (page faults out of the figure)")
    ap.add_argument("--read-only", action="store_true", help="only the reads: the bulk reads, then "
                    "EmbeddingDataset.from_table on each --readers count")
    ap.add_argument("--file-rows", type=int, default=1_000_000, help="rows in the DataLoader's file cache")
    ap.add_argument("--skip", default="", help="comma list of: sql, file, stream, read, eager")
    ap.add_argument("--ram-variants", default="", help="comma list of: switch200us, one_thread, torch_gather "
                    "(the ram tier again with that change)")
    ap.add_argument("--gpu-inline", action="store_true", help="also the gpu tier's loop with each step's rows "
                    "taken within the step (TrainLoop's ahead=False; by default during the step before)")
    ap.add_argument("--take-shapes", default="", help="comma list of ELEMENTSxWARPS[xPROGRAMS]: the ram tier's "
                    "loop again with the take kernel in that shape (train/take_kernel.py's SHAPES['cpu'])")
    ap.add_argument("--ddp-devices", default=None, help="also `embedfleet train` on these devices (issue 22)")
    ap.add_argument("--db", default=None)
    ap.add_argument("--out", default=None, help="also write the JSON document here")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    t_start = time.perf_counter()
    dsn = resolve_dsn(a.db, Settings.from_env())
    dev = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if a.device == "auto" else a.device))
    doc: dict = harness.stamp({"machine": _machine(), "device": str(dev), "batch_size": a.batch_size,
                               "head": "linear", "classes": CLASSES, "notes": []}, dsn)
    from embedfleet.train.read import default_connections

    readers = [int(k) for k in (a.readers or f"1,{max(2, default_connections(Settings.from_env()))}").split(",")]
    table = a.table or f"bench_train_{a.rows}_{a.dim}"
    if a.table is None:
        doc["table"] = write_table(dsn, table, a.rows, a.dim, writers=max(1, min(8, (os.cpu_count() or 2) // 2)))
    else:
        doc["table"] = {"name": table, "written": False}

    if "read" not in skip:
        doc["read"] = []
        for k in readers:
            rows = a.read_rows if k == 1 else None
            say(f"bulk read, {k} connection(s){'' if rows is None else f', first ~{rows:,} rows'}")
            doc["read"].append(read_rate(dsn, table, k, rows))
            if a.read_prefault:
                say(f"bulk read again, {k} connection(s), the destination's pages touched first")
                doc["read"].append(read_rate(dsn, table, k, rows, prefault=True))

    if a.read_only:  # the user's read as well: EmbeddingDataset into its tier, on each connection count
        doc["dataset_reads"] = []
        for k in readers:
            say(f"EmbeddingDataset.from_table (cache auto), {k} connection(s)")
            d = EmbeddingDataset.from_table(table, label="rating", db=dsn, device=dev, cache="auto", connections=k,
                                            dtype=storage_dtype(dev))
            doc["dataset_reads"].append({"cache": d.cache, **d.stats})
            d.close()
        doc["total_s"] = round(time.perf_counter() - t_start, 1)
        _write(doc, a.out)
        return

    # EmbeddingDataset: read once into the fastest tier, the ram tier copied from it
    say("EmbeddingDataset.from_table (cache auto)")
    ds = EmbeddingDataset.from_table(table, label="rating", db=dsn, device=dev, cache="auto",
                                     connections=readers[-1], dtype=storage_dtype(dev))  # as `embedfleet train`
    n, dim = len(ds), ds.dim
    doc["dataset"] = {"rows": n, "dim": dim, "cache": ds.cache, "dtype": str(ds.dtype), **ds.stats}
    if dev.type == "cuda":  # the ram tier's floor: an epoch's bytes over the pinned copy's rate
        doc["copies"] = copy_rates(a.batch_size * dim * ds.dtype.itemsize, dev)
        doc["copies"]["ram_epoch_floor_s"] = round(n * dim * ds.dtype.itemsize / 1e9 / doc["copies"]["h2d_pinned_gb_s"], 3)
    epoch_s: dict = {}
    tiers = {ds.cache: ds}
    if ds.cache == "gpu":
        tiers["ram"] = ds.with_cache("ram")
    x_dev = ds.vectors().to(dev)
    y_dev = ds.labels

    say("pure compute (the trainer's step on one batch on the device)")
    epoch_s["pure_compute"] = said(time_loop_compute(ds, a.batch_size, a.epochs))
    if "eager" not in skip:
        say("pure compute, eager step")
        epoch_s["pure_compute_eager"] = said(time_epochs(
            lambda e: ((x_dev[s:s + a.batch_size], y_dev[s:s + a.batch_size]) for s in range(0, n, a.batch_size)),
            dim, dev, n, a.batch_size, a.epochs))
    for tier, d in tiers.items():
        say(f"tier {tier} (the trainer's loop)")
        epoch_s[tier] = said(time_loop_epochs(d, a.batch_size, a.epochs))
        if "eager" not in skip:
            say(f"tier {tier}, eager step over batches()")
            epoch_s[f"{tier}_eager"] = said(time_epochs(lambda e, d=d: d.batches(a.batch_size, epoch=e), dim, dev, n,
                                                        a.batch_size, a.epochs))
    if "ram" in tiers and a.ram_variants:
        for name in a.ram_variants.split(","):
            say(f"tier ram, {name}")
            epoch_s[f"ram_{name}"] = ram_variant(name, lambda e: tiers["ram"].batches(a.batch_size, epoch=e),
                                                 dim, dev, n, a.batch_size, a.epochs)
    if a.gpu_inline and "gpu" in tiers:  # bench/take_pcie.py: a device take costs less in the step than beside it
        say("tier gpu, rows taken within the step")
        epoch_s["gpu_inline"] = said(time_loop_epochs(tiers["gpu"], a.batch_size, a.epochs, ahead=False))
    if "ram" in tiers and a.take_shapes and tiers["ram"].device.type == "cuda":
        from embedfleet.train import take_kernel

        default = take_kernel.SHAPES["cpu"]  # the shape of a take from pinned host memory
        try:
            for text in a.take_shapes.split(","):
                e, w, *p = (int(v) for v in text.split("x"))
                take_kernel.SHAPES["cpu"] = (e, w, p[0] if p else None)
                say(f"tier ram, take shape {take_kernel.SHAPES['cpu']}")
                epoch_s[f"ram_take_{text}"] = said(time_loop_epochs(tiers["ram"], a.batch_size, a.epochs))
        finally:
            take_kernel.SHAPES["cpu"] = default
    if "stream" not in skip:
        say("tier stream (1 epoch)")
        st = EmbeddingDataset.from_table(table, label="rating", db=dsn, device=dev, cache="stream")
        doc["stream_index_read_s"] = st.stats["read_s"]
        epoch_s["stream"] = time_epochs(lambda e: st.batches(a.batch_size, epoch=e), dim, dev, n, a.batch_size, 1)
        st.close()
    del x_dev
    extrapolated: dict = {}
    if "sql" not in skip:
        say(f"per-batch SQL loader, {a.workers} workers, {a.slow_batches} batches")
        loader = torch.utils.data.DataLoader(SqlPerBatch(dsn, table, list(ds.ids), a.batch_size), batch_size=None,
                                             num_workers=a.workers, pin_memory=dev.type == "cuda")
        extrapolated["sql_per_batch"] = time_batches(loader, dim, dev, n, a.batch_size, a.slow_batches)
        extrapolated["sql_per_batch"]["workers"] = a.workers
        del loader
    if "file" not in skip:
        rows = min(n, a.file_rows)
        with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
            path = os.path.join(tmp, "cache.f32")
            say(f"file cache of {rows:,} rows")
            t0 = time.perf_counter()
            host = ds.vectors()[:rows].float().cpu().numpy()
            host.tofile(path)
            doc["file_cache"] = {"rows": rows, "write_s": round(time.perf_counter() - t0, 2)}
            labels = ds.labels[:rows].cpu().numpy()
            for lock in (False, True):
                name = "dataloader_file_flock" if lock else "dataloader_file"
                say(f"{name}, {a.workers} workers, {a.slow_batches} batches")
                loader = torch.utils.data.DataLoader(FileRows(path, rows, dim, labels, lock), batch_size=a.batch_size,
                                                     shuffle=True, num_workers=a.workers, persistent_workers=True,
                                                     pin_memory=dev.type == "cuda", drop_last=True)
                extrapolated[name] = time_batches(loader, dim, dev, n, a.batch_size, a.slow_batches)
                extrapolated[name]["workers"] = a.workers
                del loader
    for name, r in extrapolated.items():
        epoch_s[name] = [r["epoch_s_extrapolated"]]
    doc["epoch_s"] = epoch_s
    doc["extrapolated"] = extrapolated
    if extrapolated:
        doc["notes"].append(f"{', '.join(extrapolated)}: epoch seconds extrapolated from {a.slow_batches} batches "
                            "(time a batch x batches an epoch)")
    best = {k: min(v) for k, v in epoch_s.items()}
    fast = best.get("gpu") or best.get("ram")
    ratios = {}
    if fast:
        ratios["fastest_tier_over_pure_compute"] = round(fast / best["pure_compute"], 3)
        for k in ("sql_per_batch", "dataloader_file", "dataloader_file_flock", "stream"):
            if k in best:
                ratios[f"{k}_over_fastest_tier"] = round(best[k] / fast, 2)
    if "gpu" in best and "ram" in best:
        ratios["ram_over_gpu"] = round(best["ram"] / best["gpu"], 3)
    doc["ratios"] = ratios
    reads = doc.get("read", [])
    one = next((r["rows_per_s"] for r in reads if r["connections"] == 1), None)
    par = max((r["rows_per_s"] for r in reads if r["connections"] > 1), default=None)
    doc["targets"] = {
        "read_one_connection_185k": None if one is None else one >= 185_000,
        "read_parallel_500k": None if par is None else par >= 500_000,
        "gpu_within_10pct_of_pure_compute": None if "gpu" not in best else best["gpu"] <= 1.1 * best["pure_compute"],
        "20x_sql_per_batch": None if "gpu" not in best or "sql_per_batch" not in best else
        best["sql_per_batch"] >= 20 * best["gpu"],
        "5x_dataloader": None if "gpu" not in best or "dataloader_file" not in best else
        min(best["dataloader_file"], best.get("dataloader_file_flock", 1e18)) >= 5 * best["gpu"],
        "ram_within_25pct_of_gpu": None if "ratios" not in doc or "ram_over_gpu" not in ratios else
        ratios["ram_over_gpu"] <= 1.25,
    }
    if a.ddp_devices:
        doc["ddp"] = ddp_epochs(dsn, table, a.ddp_devices, a.batch_size, a.epochs)
    doc["total_s"] = round(time.perf_counter() - t_start, 1)
    _write(doc, a.out)
    for d in tiers.values():
        d.close()
    ds.close()


def _write(doc: dict, out: str | None) -> None:
    text = json.dumps(doc, indent=2)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    threading.excepthook = lambda args: say(f"thread {args.thread.name}: {args.exc_value!r}")
    main()
