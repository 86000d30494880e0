"""Training on stored embeddings on several GPUs (issue 22): `embedfleet train` on 1, 2, 4… GPUs, where a
step's time goes (compute, all-reduce, input) per head and batch, and the field report's loader with
file locks under DDP beside ours.

    python bench/ddp_train.py [--rows 10000000] [--gpus 1,2,4] [--table NAME] [--epochs 3]
        [--batch-per-gpu 4096] [--sweep-rows 2000000] [--heads linear,mlp,mlp:4096]
        [--batches 1024,2048,…,65536] [--steps 100] [--file-rows 1000000] [--loader-batches 100]
        [--workers 8] [--skip train,sweep,loader] [--cpu] [--out FILE]

Parts, each on every count of --gpus (one process a GPU, started the way `embedfleet train` starts them):
  train   `embedfleet train --tier gpu` over the whole table (`bench_train_<rows>_384`, written like
          bench/train_loader.py writes it, or --table) with the global batch --batch-per-gpu × GPUs, so
          that each GPU takes the same rows a step at every count: epoch seconds, samples/s, the read.
  sweep   each rank reads the table's first --sweep-rows rows once (EmbeddingDataset, gpu tier), then
          for each head and per-rank batch times --steps steps of the eager step under DDP (make_step):
            compute   on one batch already gathered, without DDP's all-reduce (no_sync)
            ddp       the same batch, with the all-reduce
            full      what the trainer does: each step's batch gathered from the epoch's order
          all-reduce = ddp - compute, input = full - ddp, samples/s = GPUs x batch / full (the slowest
          rank's times). make_step is the eager step under DDP (a user's loop, and the trainer's before
          its TrainLoop); the loop_* columns time the trainer's TrainLoop the same way (one CUDA graph a
          step: compute alone per rank, with the all-reduce, a whole epoch of gathered steps). Weak speed-up: samples/s at N GPUs over one GPU's at the same per-rank batch;
          strong: at the same global batch (N GPUs at batch/N each).
  loader  the field report's loader under DDP: a DataLoader with --workers persistent workers per rank
          over a per-row __getitem__ reading a file cache (bench/train_loader.py's FileRows: a pread per
          row), with and without an fcntl.flock shared lock around each read, DistributedSampler,
          per-rank batch --batch-per-gpu, linear head; --loader-batches steps after 2 x workers + 1 untimed
          ones (the batches the workers prefetch at once would otherwise count as free),
          and the epoch over --rows extrapolated. Beside it: the sweep's gpu-tier `full` step for the
          same head and batch.
Scaling = samples/s at N GPUs over N x samples/s at one. One JSON document on stdout (and --out, written
after every part, so a run cut short keeps what it measured); progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import harness

CLASSES = 5


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def _head(spec: str) -> tuple[str, int | None]:
    """"linear", "mlp" (hidden 2 x dim) or "mlp:H" → (kind, hidden)."""
    kind, _, hidden = spec.partition(":")
    return kind, int(hidden) if hidden else None


# ---- one rank -------------------------------------------------------------------------------------

def _init(cpu: bool):
    import torch
    import torch.distributed as dist

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    dev = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1:
        if dev.type == "cuda":
            dist.init_process_group("nccl", device_id=dev)
        else:
            dist.init_process_group("gloo")
    return dev, rank, world


def _slowest(values: list[float], dev, world: int) -> list[float]:
    """Each value's maximum over the ranks: a DDP step is as slow as its slowest rank."""
    import torch

    t = torch.tensor(values, dtype=torch.float64, device=dev)
    if world > 1:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.tolist()


def _timer(dev, world: int):
    import torch

    def timed(fn, steps: int) -> float:
        if world > 1:
            torch.distributed.barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return (time.perf_counter() - t0) / steps

    return timed


def _eager_step(kind: str, hidden: int | None, dim: int, dev, world: int):
    """(net, step): the head, DDP over several ranks, fused AdamW — the eager step of a user's loop (and
    of `embedfleet train` before its TrainLoop)."""
    import torch

    from embedfleet.train.heads import build_head
    from train_loader import make_step

    torch.manual_seed(0)
    model = build_head(kind, dim, CLASSES, hidden).to(dev)
    net = model
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=dev.type == "cuda")
    return net, make_step(net, opt, None, "classify", dev, world)


def _loop_times(ds, kind: str, hidden: int | None, b: int, rank: int, world: int, steps: int, timed) -> list[float]:
    """Seconds a step of the trainer's TrainLoop: (compute alone on one batch — each rank on its own,
    no all-reduce —, the same with the all-reduce, a whole epoch of gathered steps / its steps)."""
    import torch

    from embedfleet.train.heads import build_head
    from embedfleet.train.loop import TrainLoop
    from embedfleet.train.order import step_sizes

    sizes = step_sizes(len(ds), b, world)
    lrs = [1e-3] * (3 * len(sizes) + 2 * steps + 16)

    def loop(w: int, r: int, gather: bool | None) -> TrainLoop:
        torch.manual_seed(0)
        model = build_head(kind, ds.dim, CLASSES, hidden).to(ds.device)
        return TrainLoop(model, ds, b, r, w, "classify", (0.0, 1.0), lrs, 0.01, gather=gather)

    x0, y0 = next(iter(ds.batches(b, shuffle=False, rank=rank, world_size=world)))
    alone, together = loop(1, 0, False), loop(world, rank, False)
    times = []
    for one in (alone, together):
        one.steps_on(x0, y0, 8)  # warm-up, capture
        times.append(timed(lambda one=one: one.steps_on(x0, y0, 1), steps))
    full = loop(world, rank, None)  # as the trainer builds it
    full.epoch(0)  # warm-up, capture
    full_steps = int((sizes == b * world).sum())
    times.append(timed(lambda: float(full.epoch(1)), 1) / max(1, full_steps))
    return times


def rank_sweep(job: dict) -> dict | None:
    import contextlib

    from embedfleet.train.dataset import load

    dev, rank, world = _init(job["cpu"])
    ds = load(job["table"], label="rating", where=job["where"], db=job["db"], cache="gpu" if dev.type == "cuda" else "ram",
              device=dev)
    timed = _timer(dev, world)
    rows = []
    for spec in job["heads"]:
        kind, hidden = _head(spec)
        for b in job["batches"]:
            net, step = _eager_step(kind, hidden, ds.dim, dev, world)

            def endless():
                e = 0
                while True:
                    yield from ds.batches(b, shuffle=True, epoch=e)
                    e += 1

            batches = endless()
            x0, y0 = next(batches)
            g = b * world
            for _ in range(3):  # warm-up: kernels, the optimizer's state, DDP's buckets
                step(x0, y0, g)
            no_sync = net.no_sync if world > 1 else contextlib.nullcontext
            steps = job["steps"]
            t_input = timed(lambda: next(batches), steps)
            with no_sync():
                t_compute = timed(lambda: step(x0, y0, g), steps)
            t_ddp = timed(lambda: step(x0, y0, g), steps)
            t_full = timed(lambda: step(*next(batches), g), steps)
            loop_times = _loop_times(ds, kind, hidden, b, rank, world, steps, timed)
            t_input, t_compute, t_ddp, t_full = _slowest([t_input, t_compute, t_ddp, t_full], dev, world)
            loop_compute, loop_reduce, loop_full = _slowest(loop_times, dev, world)
            rows.append({"head": spec, "batch_per_rank": b, "global_batch": g, "gpus": world,
                         "params": sum(p.numel() for p in net.parameters()),
                         "step_ms": round(t_full * 1e3, 4), "compute_ms": round(t_compute * 1e3, 4),
                         "all_reduce_ms": round(max(0.0, t_ddp - t_compute) * 1e3, 4),
                         "input_ms": round(max(0.0, t_full - t_ddp) * 1e3, 4),
                         "gather_alone_ms": round(t_input * 1e3, 4),
                         "steps_per_epoch": -(-len(ds) // g),  # few: the epoch's set-up weighs on "input"
                         "samples_per_s": round(g / t_full, 1),
                         # the trainer's TrainLoop (one CUDA graph a step, no DDP): the same split
                         "loop_step_ms": round(loop_full * 1e3, 4), "loop_compute_ms": round(loop_compute * 1e3, 4),
                         "loop_all_reduce_ms": round(max(0.0, loop_reduce - loop_compute) * 1e3, 4),
                         "loop_input_ms": round(max(0.0, loop_full - loop_reduce) * 1e3, 4),
                         "loop_samples_per_s": round(g / loop_full, 1)})
            if rank == 0:
                say(f"  {world} GPU(s) {spec} batch {b}: {rows[-1]}")
                _keep(job, {"rows_read": len(ds), "results": rows})  # a rank failing later loses no row

    ds.close()
    return {"rows_read": len(ds), "results": rows} if rank == 0 else None


def _keep(job: dict, result: dict) -> None:
    Path(job["result"]).write_text(json.dumps(result))


def rank_loader(job: dict) -> dict | None:
    import torch
    from torch.utils.data import DataLoader, RandomSampler
    from torch.utils.data.distributed import DistributedSampler

    from train_loader import FileRows

    dev, rank, world = _init(job["cpu"])
    labels = np.load(job["labels"])
    out = {}
    for lock in (False, True):
        name = "flock" if lock else "no_lock"
        rows = FileRows(job["path"], len(labels), job["dim"], labels, lock)
        sampler = (DistributedSampler(rows, num_replicas=world, rank=rank, shuffle=True, seed=0) if world > 1
                   else RandomSampler(rows, generator=torch.Generator().manual_seed(0)))
        loader = DataLoader(rows, batch_size=job["batch"], sampler=sampler, num_workers=job["workers"],
                            persistent_workers=job["workers"] > 0, pin_memory=dev.type == "cuda", drop_last=True)
        _, step = _eager_step("linear", None, job["dim"], dev, world)
        g = job["batch"] * world

        def endless():  # a file smaller than the steps timed is read again, as a next epoch
            e = 0
            while True:
                if world > 1:
                    sampler.set_epoch(e)
                yield from loader
                e += 1

        it = endless()

        def one_step():
            x, y = next(it)
            step(x.to(dev, non_blocking=True), y.to(dev, non_blocking=True), g)

        timed = _timer(dev, world)
        # untimed until the workers' first round of batches (prefetched at once) is used up: a steady state
        first = timed(one_step, 2 * job["workers"] + 1)
        t = timed(one_step, job["count"])
        first, t = _slowest([first, t], dev, world)
        out[name] = {"step_ms": round(t * 1e3, 3), "warmup_step_ms": round(first * 1e3, 1),
                     "samples_per_s": round(g / t, 1), "workers_per_rank": job["workers"],
                     "epoch_s_extrapolated": round(job["epoch_rows"] / g * t, 2)}
        if rank == 0:
            say(f"  {world} GPU(s) DataLoader {name}: {out[name]}")

    return out if rank == 0 else None


def rank_main(path: str) -> None:
    job = json.loads(Path(path).read_text())
    sys.path.insert(0, str(Path(__file__).parent))
    result = {"sweep": rank_sweep, "loader": rank_loader}[job["part"]](job)
    if result is not None:
        Path(job["result"]).write_text(json.dumps(result))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# ---- the driver -----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(job: dict, world: int, timeout: float) -> dict:
    """`world` ranks of this script on `job`, torchrun's environment; rank 0's result, or {"error": …}."""
    with tempfile.TemporaryDirectory(prefix="ddp-bench-") as tmp:
        job = dict(job, result=os.path.join(tmp, "result.json"))
        spec = os.path.join(tmp, "job.json")
        Path(spec).write_text(json.dumps(job))
        port = _free_port()
        procs = []
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            if job["cpu"]:
                env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
            procs.append(subprocess.Popen([sys.executable, __file__, "--rank-job", spec], env=env,
                                          stdin=subprocess.DEVNULL))
        deadline = time.time() + timeout
        failed = None
        while any(p.poll() is None for p in procs):
            bad = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if bad or time.time() > deadline:
                failed = f"exit {bad[0]}" if bad else f"over {timeout:.0f} s"
                break
            time.sleep(0.2)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        failed = failed or next((f"exit {p.returncode}" for p in procs if p.returncode), None)
        kept = json.loads(Path(job["result"]).read_text()) if os.path.exists(job["result"]) else {}
        return {**kept, "error": failed} if failed else kept


def run_train(a, table: str, dsn: str, counts: list[int]) -> dict:
    out = {}
    for n in counts:
        devices = ["--devices", "cpu", "--workers", str(n)] if a.cpu else \
            ["--devices", "cuda:" + ",".join(map(str, range(n)))]
        cmd = [sys.executable, "-m", "embedfleet.cli", "train", "--table", table, "--label", "rating", "--task",
               "classify", "--epochs", str(a.epochs), "--batch-size", str(a.batch_per_gpu * n), *devices,
               "--tier", "ram" if a.cpu else "gpu", "--db", dsn, "--json", "--out", tempfile.mkdtemp(prefix="ddp-")]
        say("running", " ".join(cmd[2:]))
        t0 = time.perf_counter()
        # a session of its own: past its time, the command and the rank processes it started go together
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = p.communicate(timeout=a.part_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            out[str(n)] = {"error": f"over {a.part_timeout:.0f} s"}
            continue
        finally:
            shutil.rmtree(cmd[-1], ignore_errors=True)
        wall = time.perf_counter() - t0
        if p.returncode:
            out[str(n)] = {"error": (stderr.strip().splitlines() or [str(p.returncode)])[-1]}
            continue
        doc = json.loads(stdout)
        epochs = doc["epochs"]
        best = min(epochs[1:] or epochs, key=lambda e: e["seconds"])  # the first epoch pays for warm-up
        out[str(n)] = {"world_size": doc["world_size"], "global_batch": doc["batch_size"],
                       "epoch_s": [e["seconds"] for e in epochs], "samples_per_s": [e["samples_per_s"] for e in epochs],
                       "best_epoch_s": best["seconds"], "best_samples_per_s": best["samples_per_s"],
                       "read": doc["read"], "cache": doc["cache"], "train_rows": doc["rows"]["train"],
                       "final_val_accuracy": doc["final"].get("val_accuracy"), "command_wall_s": round(wall, 1)}
        say(f"  {n}: {out[str(n)]}")
    base = out.get(str(counts[0]), {}).get("best_samples_per_s")
    for n in counts:
        r = out[str(n)]
        if base and "best_samples_per_s" in r:
            r["scaling"] = round(r["best_samples_per_s"] / (base / counts[0] * n), 3)
    return out


def scaling(sweep: dict, counts: list[int]) -> list[dict]:
    """Per head and per-rank batch: the speed-up in samples/s at each count over the first count, weak
    (the same per-rank batch) and strong (the same global batch) — times, not a share of N."""
    got = {}
    for n, part in sweep.items():
        for r in part.get("results", []):
            got[(r["head"], r["batch_per_rank"], int(n))] = r
    one = counts[0]
    rows = []
    for (head, b, n), r in sorted(got.items()):
        if n == one:
            continue
        base = got.get((head, b, one))
        strong = got.get((head, b * n // one, one))
        rows.append({"head": head, "gpus": n, "batch_per_rank": b, "step_ms": r["step_ms"],
                     "compute_ms": r["compute_ms"], "all_reduce_ms": r["all_reduce_ms"], "input_ms": r["input_ms"],
                     "weak_speedup": None if base is None else round(r["samples_per_s"] / base["samples_per_s"], 2),
                     "strong_speedup": None if strong is None else round(r["samples_per_s"] / strong["samples_per_s"], 2),
                     "strong_global_batch": b * n})
        if "loop_step_ms" in r:
            rows[-1].update({k: r[k] for k in ("loop_step_ms", "loop_compute_ms", "loop_all_reduce_ms", "loop_input_ms")})
            rows[-1]["loop_weak_speedup"] = None if base is None else round(
                r["loop_samples_per_s"] / base["loop_samples_per_s"], 2)
            rows[-1]["loop_strong_speedup"] = None if strong is None else round(
                r["loop_samples_per_s"] / strong["loop_samples_per_s"], 2)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--gpus", default="1,2,4")
    ap.add_argument("--table", default=None)
    ap.add_argument("--db", default=None)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-per-gpu", type=int, default=4096)
    ap.add_argument("--sweep-rows", type=int, default=2_000_000)
    ap.add_argument("--heads", default="linear,mlp,mlp:4096")
    ap.add_argument("--batches", default="1024,2048,4096,8192,16384,32768,65536")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--file-rows", type=int, default=1_000_000, help="at least; more where the steps need them")
    ap.add_argument("--loader-batches", type=int, default=100)
    ap.add_argument("--workers", type=int, default=8, help="DataLoader workers per rank")
    ap.add_argument("--skip", default="", help="comma list of: train, sweep, loader")
    ap.add_argument("--part-timeout", type=float, default=300, help="seconds one launch may take")
    ap.add_argument("--cpu", action="store_true", help="ranks on the CPU with gloo (a dry run without GPUs)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--rank-job", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank_job:
        return rank_main(a.rank_job)
    sys.path.insert(0, str(Path(__file__).parent))
    from embedfleet.pg.embedded import resolve_dsn
    from embedfleet.settings import Settings
    from train_loader import _machine, write_table

    skip = set(filter(None, a.skip.split(",")))
    counts = [int(n) for n in a.gpus.split(",")]
    dsn = resolve_dsn(a.db, Settings.from_env())
    table = a.table or f"bench_train_{a.rows}_{a.dim}"
    doc: dict = harness.stamp({"machine": _machine(), "gpus": counts, "batch_per_gpu": a.batch_per_gpu}, dsn)
    t_start = time.perf_counter()

    def save():
        doc["total_s"] = round(time.perf_counter() - t_start, 1)
        if a.out:
            Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")

    if not ({"train", "sweep"} <= skip):
        doc["table"] = write_table(dsn, table, a.rows, a.dim, writers=max(1, min(16, (os.cpu_count() or 2) // 2)))
        save()
    if "train" not in skip:
        say("embedfleet train")
        doc["train"] = run_train(a, table, dsn, counts)
        save()
    if "sweep" not in skip:
        job = {"part": "sweep", "cpu": a.cpu, "table": table, "db": dsn, "steps": a.steps,
               "where": f"id < 'r{a.sweep_rows:010d}'" if a.sweep_rows < a.rows else None,
               "heads": a.heads.split(","), "batches": [int(b) for b in a.batches.split(",")]}
        doc["sweep"] = {}
        for n in counts:
            say(f"sweep on {n}")
            doc["sweep"][str(n)] = launch(job, n, a.part_timeout)
            save()
        doc["scaling"] = scaling(doc["sweep"], counts)
        save()
    if "loader" not in skip:
        # rows enough that warm-up and timed steps stay inside one epoch on every rank at the most GPUs
        file_rows = max(a.file_rows, counts[-1] * a.batch_per_gpu * (2 * a.workers + 2 + a.loader_batches))
        with tempfile.TemporaryDirectory(prefix="ddp-files-") as tmp:
            path, labels = os.path.join(tmp, "cache.f32"), os.path.join(tmp, "labels.npy")
            rng = np.random.default_rng(0)
            with open(path, "wb") as f:  # random rows: a read's cost does not depend on values
                for s in range(0, file_rows, 100_000):
                    rng.standard_normal((min(100_000, file_rows - s), a.dim), dtype=np.float32).tofile(f)
            np.save(labels, rng.integers(0, CLASSES, file_rows))
            job = {"part": "loader", "cpu": a.cpu, "path": path, "labels": labels, "dim": a.dim,
                   "batch": a.batch_per_gpu, "workers": a.workers, "count": a.loader_batches, "epoch_rows": a.rows}
            doc["loader"] = {}
            for n in sorted({counts[0], counts[-1]}):
                say(f"file loader on {n}")
                doc["loader"][str(n)] = launch(job, n, a.part_timeout)
                gpu = next((r for r in doc.get("sweep", {}).get(str(n), {}).get("results", [])
                            if r["head"] == "linear" and r["batch_per_rank"] == a.batch_per_gpu), None)
                if gpu:
                    doc["loader"][str(n)]["gpu_tier_step_ms"] = gpu["step_ms"]
                    for name in ("no_lock", "flock"):
                        r = doc["loader"][str(n)].get(name)
                        if r:
                            r["over_gpu_tier"] = round(r["step_ms"] / gpu["step_ms"], 2)
                save()
            one, many = (doc["loader"].get(str(k), {}) for k in (counts[0], counts[-1]))
            for name in ("no_lock", "flock"):
                if name in one and name in many:
                    doc["loader"][f"{name}_scaling"] = round(many[name]["samples_per_s"] / one[name]["samples_per_s"]
                                                             * counts[0] / counts[-1], 3)
    save()
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
