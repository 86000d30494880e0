"""`embedfleet train`: a head on a table's stored vectors, on one device or several (one process each).

    train(settings)        what the command calls: one device runs here; several start one process
                           each (`python -m embedfleet.train.trainer`, torchrun's environment:
                           RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); under torchrun
                           itself (those variables already set) this process is one of the ranks.
    run_rank(settings)     one rank: the shared bulk read (EmbeddingDataset), the split by row id,
                           the loop, validation sums reduced across ranks, and on rank 0 the run
                           directory (head.safetensors, head.json, metrics.json).

The steps are loop.py's: gradients summed across ranks by one all-reduce of a flat buffer, and on
CUDA each step replayed as one CUDA graph (EMBEDFLEET_TRAIN_GRAPH=0: eager).

`--batch-size` is the global batch: each of W ranks takes batch_size / W rows a step, and the loss
of a step is its rows' summed loss over the step's global row count, so W processes make the same
updates as one (up to the order of floating-point sums).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from embedfleet.errors import EmbedfleetError, InputError
from embedfleet.process import exit_now

__all__ = ["TrainSettings", "auto_batch", "train", "run_rank", "lr_factor", "default_out", "table_model"]

log = logging.getLogger("embedfleet")

EVAL_BATCH = 65_536  # rows per rank per validation batch
MAX_AUTO_BATCH = 4096  # the default batch of a large table: big steps keep the device busy


def auto_batch(train_rows: int) -> int:
    """The default global batch: at most MAX_AUTO_BATCH, and no more than an eighth of the train split (rounded
    down to a power of two), so that a small table still takes enough steps an epoch to learn."""
    eighth = max(1, train_rows // 8)
    return min(MAX_AUTO_BATCH, 1 << (eighth.bit_length() - 1))


@dataclass
class TrainSettings:
    table: str
    label: str
    task: str = "classify"
    head: str = "linear"
    epochs: int = 10
    batch_size: int | None = None  # global, across ranks (None: auto_batch of the train split)
    lr: float = 1e-3
    weight_decay: float = 0.01
    where: str | None = None
    val_fraction: float = 0.1
    devices: str = "auto"
    workers: int | None = None
    cache: str = "auto"
    out: str | None = None
    db: str | None = None
    seed: int = 0
    json: bool = False
    extra: dict = field(default_factory=dict)

    def check(self) -> None:
        from embedfleet.train.heads import HEADS

        if self.task not in ("classify", "regress"):
            raise InputError(f"--task {self.task!r}: use classify or regress")
        if self.head not in HEADS:
            raise InputError(f"--head {self.head!r}: use {' or '.join(HEADS)}")
        if self.epochs < 1 or (self.batch_size is not None and self.batch_size < 1):
            raise InputError("--epochs and --batch-size must be at least 1")
        if not self.lr > 0:
            raise InputError(f"--lr {self.lr}: use a positive learning rate")
        if not 0.0 <= self.val_fraction < 1.0:
            raise InputError(f"--val-fraction {self.val_fraction}: use a value in [0, 1)")


def default_out(table: str, label: str) -> str:
    from embedfleet.store.embedded import home

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = home() / "runs" / f"{table}-{label}-{stamp}"
    out, k = base, 1
    while out.exists():
        k += 1
        out = base.with_name(f"{base.name}-{k}")
    return str(out)


def train(settings: TrainSettings) -> dict | None:
    """Run `settings` here (one device, or as a rank started by torchrun) or start one process per
    device and wait for them. Returns the metrics document where this process made it."""
    settings.check()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun (or by us)
        return _as_rank(settings)
    from embedfleet.runtime.local import parse_devices

    devices = parse_devices(settings.devices, settings.workers)
    gpus = [d for d in devices if d != "cpu"]
    if len(set(gpus)) < len(gpus):
        raise InputError(f"--workers {settings.workers}: training runs one process per GPU; "
                         f"{len(set(gpus))} GPU(s) in --devices {settings.devices}")
    settings.out = settings.out or default_out(settings.table, settings.label)
    if len(devices) == 1:
        return run_rank(settings, devices[0])
    _launch(settings, devices)
    return None


def _as_rank(settings: TrainSettings) -> dict | None:
    rank = int(os.environ["RANK"])
    settings.out = settings.out or default_out(settings.table, settings.label)  # rank 0's is the one used
    device = os.environ.get("EMBEDFLEET_TRAIN_DEVICE")
    if device is None:  # torchrun: one process per local GPU, or CPU
        from embedfleet.train.dataset import resolve_device

        base = resolve_device(settings.devices.split(":")[0] if settings.devices != "auto" else "auto")
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if base.type == "cuda" else "cpu"
    try:
        return run_rank(settings, device)
    except EmbedfleetError as e:
        if rank == 0:
            raise
        raise SystemExit(e.exit_code) from None  # rank 0 says it, once


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(settings: TrainSettings, devices: list[str]) -> None:
    """One process per device, torchrun's environment; the first failure stops the others."""
    world = len(devices)
    port = _free_port()
    cores = os.cpu_count() or 1
    procs = []
    for rank, device in enumerate(devices):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   EMBEDFLEET_TRAIN_DEVICE=device)
        if device == "cpu":
            env.setdefault("OMP_NUM_THREADS", str(max(1, cores // world)))
        cmd = [sys.executable, "-m", "embedfleet.train.trainer", json.dumps(asdict(settings))]
        procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
    code = 0
    try:
        while procs and any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed:
                code = failed[0]
                break
            time.sleep(0.2)
        code = code or next((p.returncode for p in procs if p.returncode), 0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    if code:
        raise SystemExit(code)


def table_model(dsn: str, table: str) -> dict | None:
    """The model the newest ingest job that wrote `table` used, from the ledger (None: no ledger
    or no such job, e.g. a table written by something else)."""
    from psycopg.rows import dict_row

    from embedfleet.store.ledger import connect

    with connect(dsn) as conn:
        if not conn.execute("SELECT to_regclass('embedfleet.jobs') IS NOT NULL").fetchone()[0]:
            return None
        with conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute(
                "SELECT job, model, dim, config->>'model' AS requested, config->>'prompt' AS prompt, "
                "config->>'text_template' AS text_template, config->>'preset' AS preset "
                "FROM embedfleet.jobs WHERE table_name = %s ORDER BY created DESC LIMIT 1", [table]).fetchone()
    return dict(row) if row else None


def lr_factor(step: int, total_steps: int) -> float:
    """The learning rate's share at `step`: linear warm-up over the first 2% of steps, then cosine
    decay to zero."""
    warm = max(1, total_steps // 50)
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, total_steps - warm)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _evaluate(model, ds, task: str, classes: int, device, target, world: int) -> dict:
    """Validation over this rank's share of the rows (no padding), summed across ranks."""
    import torch
    import torch.nn.functional as F

    from embedfleet.train.metrics import classify_metrics, regress_metrics

    cuda = device.type == "cuda"
    mean, std = target
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, |err| or 0, err^2 or 0
    confusion = torch.zeros(classes * classes if task == "classify" else 1, dtype=torch.int64, device=device)
    model.eval()
    with torch.inference_mode():
        for x, y in ds.batches(EVAL_BATCH, shuffle=False):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                out = model(x if cuda else x.float())
            out = out.float()
            if task == "classify":
                sums[0] += F.cross_entropy(out, y, reduction="sum").double()
                confusion += torch.bincount(y * classes + out.argmax(1), minlength=classes * classes)
            else:
                pred = out.squeeze(1).double() * std + mean
                err = pred - y.double()
                sums[0] += F.mse_loss(out.squeeze(1), (y - mean) / std, reduction="sum").double()
                sums[1] += err.abs().sum()
                sums[2] += (err * err).sum()
    model.train()
    if world > 1:
        torch.distributed.all_reduce(sums)
        torch.distributed.all_reduce(confusion)
    rows = len(ds)
    s = sums.tolist()
    out = {"val_loss": s[0] / rows if rows else None}
    if task == "classify":
        m = classify_metrics(confusion.view(classes, classes).cpu().numpy())
        out.update(val_accuracy=m["accuracy"], val_macro_f1=m["macro_f1"], confusion=m["confusion"])
    else:
        m = regress_metrics(s[1], s[2], rows)
        out.update(val_mae=m["mae"], val_rmse=m["rmse"])
    return out


def run_rank(settings: TrainSettings, device: str) -> dict | None:
    """Train on this process's device; under torch.distributed's environment, as one of its ranks."""
    import torch

    from embedfleet.store.embedded import resolve_dsn
    from embedfleet.train.dataset import resolve_device

    dev = resolve_device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and not torch.distributed.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            torch.distributed.init_process_group("nccl", device_id=dev)
        else:
            torch.distributed.init_process_group("gloo")
    try:
        return _train(settings, dev, rank, world, resolve_dsn(settings.db))
    finally:
        if world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _train(settings: TrainSettings, dev, rank: int, world: int, dsn: str) -> dict | None:
    import torch

    from embedfleet.config import Settings
    from embedfleet.train import order as ordering
    from embedfleet.train.dataset import load
    from embedfleet.train.heads import build_head
    from embedfleet.train.loop import TrainLoop

    ds = load(settings.table, label=settings.label, where=settings.where, db=dsn, cache=settings.cache,
              device=dev, task=settings.task, seed=settings.seed, keys=True, dtype=storage_dtype(dev))
    train_ds, val_ds = ds.split_by_key(settings.val_fraction)
    if len(train_ds) == 0:
        raise InputError(f"no training rows: all {len(ds):,} selected rows fall in the validation split "
                         f"(--val-fraction {settings.val_fraction})")
    task = ds.task
    classes = len(ds.classes) if task == "classify" else 0
    target = (0.0, 1.0)
    if task == "regress":
        y = train_ds.labels.double()
        target = (float(y.mean()), float(y.std()) if len(y) > 1 and float(y.std()) > 0 else 1.0)
    torch.manual_seed(settings.seed)
    model = build_head(settings.head, ds.dim, classes or 1).to(dev)
    batch = settings.batch_size or auto_batch(len(train_ds))
    if settings.batch_size is None and rank == 0:
        log.info("batch size %d (the default: an eighth of the %d train rows, as a power of two, at most %d)",
                 batch, len(train_ds), MAX_AUTO_BATCH)
    per_rank = -(-batch // world)
    total_steps = settings.epochs * len(ordering.step_sizes(len(train_ds), per_rank, world))
    lrs = [settings.lr * lr_factor(s, total_steps) for s in range(total_steps)]
    loop = TrainLoop(model, train_ds, per_rank, rank, world, task, target, lrs, settings.weight_decay,
                     graph=Settings.from_env().train_graph)
    epochs = []
    for epoch in range(settings.epochs):
        _sync(dev)
        t0 = time.perf_counter()
        loss = loop.epoch(epoch)
        if world > 1:
            torch.distributed.all_reduce(loss)
        train_loss = float(loss) / len(train_ds)  # float(): waits for the epoch's last step
        seconds = time.perf_counter() - t0
        row = {"epoch": epoch + 1, "train_loss": train_loss, "seconds": round(seconds, 4),
               "samples_per_s": round(len(train_ds) / seconds, 1) if seconds > 0 else None}
        if len(val_ds):
            row.update(_evaluate(model, val_ds, task, classes, dev, target, world))
        epochs.append(row)
        if rank == 0 and not settings.json:
            log.info(_epoch_line(row, settings.epochs, task))
    doc = _metrics(settings, ds, train_ds, val_ds, epochs, world, dev, per_rank)
    doc["step"] = loop.mode
    if rank == 0:
        _save(settings, dsn, ds, model, doc, target)
        if settings.json:
            sys.stdout.write(json.dumps(doc, indent=2) + "\n")
            sys.stdout.flush()
        else:
            log.info("saved %s", settings.out)
    ds.close()
    return doc if rank == 0 else None


def storage_dtype(dev) -> str | None:
    """The vectors' dtype in the dataset the trainer reads: bf16 on CUDA, where autocast casts a head's
    first Linear's input to bf16 anyway (the same values reach the head), in half the memory and half
    the PCIe bytes a step in the ram tier; the table's own dtype on the CPU."""
    return "bfloat16" if dev.type == "cuda" else None


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _epoch_line(row: dict, epochs: int, task: str) -> str:
    head = f"epoch {row['epoch']}/{epochs}: train loss {row['train_loss']:.4f}"
    if task == "classify" and row.get("val_accuracy") is not None:
        head += f", val accuracy {row['val_accuracy']:.4f}, macro-F1 {row['val_macro_f1']:.4f}"
    elif row.get("val_mae") is not None:
        head += f", val MAE {row['val_mae']:.4f}, RMSE {row['val_rmse']:.4f}"
    return head + f" ({row['seconds']:.2f} s, {row['samples_per_s']:,.0f} samples/s)"


def _metrics(settings, ds, train_ds, val_ds, epochs, world, dev, per_rank) -> dict:
    last = epochs[-1]
    final = {k: v for k, v in last.items() if k not in ("epoch", "seconds", "samples_per_s")}
    return {
        "table": settings.table, "label": settings.label, "task": ds.task, "head": settings.head,
        "where": settings.where, "out": settings.out,
        "rows": {"train": len(train_ds), "val": len(val_ds), "skipped_null_label": ds.stats["skipped_null_label"],
                 "skipped_null_vector": ds.stats["skipped_null_vector"]},
        "classes": ds.classes,
        "cache": ds.cache, "dtype": str(ds.dtype).replace("torch.", ""), "device": str(dev), "world_size": world,
        "batch_size": per_rank * world, "batch_size_per_rank": per_rank, "lr": settings.lr,
        "epochs_run": len(epochs), "val_fraction": settings.val_fraction, "seed": settings.seed,
        "read": {k: ds.stats[k] for k in ("read_s", "plan_s", "rows_per_s", "connections", "bytes")},
        "epochs": epochs,
        "final": final,
    }


def _save(settings, dsn, ds, model, doc, target) -> None:
    from safetensors.torch import save_file

    from embedfleet.train.heads import hidden_size
    from embedfleet.train.read import Split

    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "head.safetensors"))
    head = {
        "format": 1, "task": ds.task, "head": settings.head, "dim": ds.dim,
        "outputs": len(ds.classes) if ds.task == "classify" else 1,
        "hidden": hidden_size(ds.dim) if settings.head == "mlp" else None,
        "label": settings.label, "label_kind": ds.source.label_kind,
        "classes": ds.classes,
        "label_map": {str(c): i for i, c in enumerate(ds.classes)} if ds.classes else None,
        "target": {"mean": target[0], "std": target[1]} if ds.task == "regress" else None,
        "table": settings.table, "where": settings.where, "vector_column": ds.source.column,
        "vector_type": ds.source.vtype, "id_column": ds.source.id_column,
        "model": table_model(dsn, settings.table),
        "split": {"val_fraction": settings.val_fraction, "rule": Split("val", settings.val_fraction).rule()},
        "created": datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    (out / "head.json").write_text(json.dumps(head, indent=2) + "\n")
    (out / "metrics.json").write_text(json.dumps(doc, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    """A rank started by `train` (settings as JSON in argv[1])."""
    args = sys.argv[1:] if argv is None else argv
    settings = TrainSettings(**json.loads(args[0]))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("pgserver").setLevel(logging.WARNING)
    rank = int(os.environ.get("RANK", "0"))
    try:
        _as_rank(settings)
    except EmbedfleetError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - one line per rank, like the CLI
        if os.environ.get("EMBEDFLEET_DEBUG"):
            raise
        sys.stderr.write(f"error (rank {rank}): {type(e).__name__}: {e}\n")
        sys.exit(1)
    exit_now(0)  # its work written: C++'s exit-time destructors once aborted a finished gloo rank


if __name__ == "__main__":
    main()
