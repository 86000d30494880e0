"""`embedfleet train`: a head on a table's stored vectors, on one device or several (one process each).

    train(spec)        what the command calls: one device runs here; several start one process
                           each (`python -m embedfleet.train.trainer`, torchrun's environment:
                           RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); under torchrun
                           itself (those variables already set) this process is one of the ranks.
    run_rank(spec)     one rank: the shared bulk read (EmbeddingDataset), the split by row id,
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
import sys
import time
from datetime import datetime
from pathlib import Path

from embedfleet.errors import EmbedfleetError, InputError
from embedfleet.logs import plural, setup_logging
from embedfleet.platform.processes import die_with_parent, exit_now, first_failure, spawn, stop
from embedfleet.settings import Settings, TrainSpec

__all__ = ["auto_batch", "auto_lr", "train", "run_rank", "lr_factor", "default_out"]

log = logging.getLogger("embedfleet")

EVAL_BATCH = 65_536  # rows per rank per validation batch
MAX_AUTO_BATCH = 4096  # the default batch of a large table: big steps keep the device busy


def auto_batch(train_rows: int) -> int:
    """The default global batch: at most MAX_AUTO_BATCH, and no more than an eighth of the train split (rounded
    down to a power of two), so that a small table still takes enough steps an epoch to learn."""
    eighth = max(1, train_rows // 8)
    return min(MAX_AUTO_BATCH, 1 << (eighth.bit_length() - 1))


def default_out(table: str, label: str, home: Path) -> str:
    """A new run directory under `home` (Settings.home_path): runs/TABLE-LABEL-TIME."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = home / "runs" / f"{table}-{label}-{stamp}"
    out, k = base, 1
    while out.exists():
        k += 1
        out = base.with_name(f"{base.name}-{k}")
    return str(out)


def train(spec: TrainSpec, knobs: Settings) -> dict | None:
    """Run `spec` here (one device, or as a rank started by torchrun) or start one process per
    device and wait for them. Returns the metrics document where this process made it."""
    spec.checked()
    if os.environ.get("RANK", "0") == "0":  # (rank 0 writes the run; `_launch`'s ranks were checked by their parent)
        check_out(spec.out)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun (or by us)
        return _as_rank(spec, knobs, None)
    from embedfleet.platform.devices import parse_devices

    devices = parse_devices(spec.devices, spec.workers)
    gpus = [d for d in devices if d != "cpu"]
    if len(set(gpus)) < len(gpus):
        raise InputError(f"--workers {spec.workers}: training runs one process per GPU; "
                         f"{len(set(gpus))} GPU(s) in --devices {spec.devices}")
    spec = spec.replace(out=spec.out or default_out(spec.table, spec.label, knobs.home_path))
    if len(devices) == 1:
        return run_rank(spec, devices[0], knobs)
    _launch(spec, devices, knobs)
    return None


def check_out(out: str | None) -> None:
    """A run directory given with --out must not hold another run's head: it would be overwritten in silence."""
    if out and Path(out).exists() and not Path(out).is_dir():
        raise InputError(f"--out {out} is a file: a run is a directory; pass another --out")
    if out and (Path(out) / "head.json").exists():
        raise InputError(f"--out {out} holds a trained run already (head.json): pass another --out, or remove it first")


def _as_rank(spec: TrainSpec, knobs: Settings, device: str | None) -> dict | None:
    """This process as one rank of torch.distributed's environment (RANK, WORLD_SIZE…): started by `_launch`
    with its `device`, or by torchrun (None: its local rank's GPU, or the CPU)."""
    rank = int(os.environ["RANK"])
    spec = spec.replace(out=spec.out or default_out(spec.table, spec.label, knobs.home_path))  # rank 0's is used
    if device is None:  # torchrun: one process per local GPU, or CPU
        from embedfleet.train.dataset import resolve_device

        base = resolve_device(spec.devices.split(":")[0] if spec.devices != "auto" else "auto")
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if base.type == "cuda" else "cpu"
    try:
        return run_rank(spec, device, knobs)
    except EmbedfleetError as e:
        if rank == 0:
            raise
        raise SystemExit(e.exit_code) from None  # rank 0 says it, once


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(spec: TrainSpec, devices: list[str], knobs: Settings) -> None:
    """One process per device, torchrun's environment; the first failure stops the others."""
    world = len(devices)
    port = _free_port()
    cores = os.cpu_count() or 1
    procs = []
    try:
        for rank, device in enumerate(devices):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            if device == "cpu":
                env.setdefault("OMP_NUM_THREADS", str(max(1, cores // world)))
            procs.append(spawn([sys.executable, "-m", "embedfleet.train.trainer", json.dumps(spec.to_json()),
                                "--device", device, "--settings", json.dumps(knobs.to_json()),
                                "--launcher-pid", str(os.getpid())], env))
        code = first_failure(procs)
    finally:
        stop(procs, grace=30)
    if code:
        raise SystemExit(code)


def _made_by(dsn: str, table: str) -> dict | None:
    """The job that made `table` (model, prompt, template…), for head.json; None: not one of embedfleet's."""
    from embedfleet.ledger import table_job
    from embedfleet.pg.connect import connect

    with connect(dsn) as conn:
        made = table_job(conn, table)
    if made is not None:
        made.pop("requested_dim", None)
    return made


DEFAULT_LR = 1e-3


def auto_lr(total_steps: int) -> float:
    """The default learning rate: AdamW's usual 0.001, raised for a short run (a small table) so that its
    steps together can still move a weight by about 2 (AdamW moves each by about lr a step), at most 0.01."""
    return min(1e-2, max(DEFAULT_LR, 2.0 / max(total_steps, 1)))


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


def run_rank(spec: TrainSpec, device: str, knobs: Settings) -> dict | None:
    """Train on this process's device; under torch.distributed's environment, as one of its ranks."""
    import torch

    from embedfleet.pg.embedded import resolve_dsn
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
        return _train(spec, dev, rank, world, resolve_dsn(spec.db, knobs), knobs)
    finally:
        if world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def continuous_label(classes: list | None, rows: int) -> str | None:
    """Why a numeric label looks like a measurement rather than classes (values not whole, or about as many
    values as rows), or None."""
    if not classes or not all(isinstance(c, (int, float)) for c in classes):
        return None
    if any(isinstance(c, float) for c in classes):
        return f"{len(classes):,} distinct values among {rows:,} rows, not whole numbers"
    if len(classes) > 100 and len(classes) * 20 > rows:
        return f"{len(classes):,} distinct values among {rows:,} rows"
    return None


def _train(spec: TrainSpec, dev, rank: int, world: int, dsn: str, knobs: Settings) -> dict | None:
    import torch

    from embedfleet.train import order as ordering
    from embedfleet.train.dataset import load
    from embedfleet.train.heads import build_head
    from embedfleet.train.loop import TrainLoop

    ds = load(spec.table, label=spec.label, where=spec.where, db=dsn, cache=spec.cache, device=dev, task=spec.task,
              seed=spec.seed, keys=True, dtype=None if spec.features else storage_dtype(dev), settings=knobs,
              features=spec.features, fill_null=spec.fill_null)
    train_ds, val_ds = ds.split_by_key(spec.val_fraction)
    if len(train_ds) == 0:
        raise InputError(f"no training rows: all {len(ds):,} selected rows fall in the validation split "
                         f"(--val-fraction {spec.val_fraction})")
    task = ds.task
    classes = len(ds.classes) if task == "classify" else 0
    left = [f"{plural(n, 'row')} without {what}" for n, what in ((ds.stats["skipped_null_label"], "a label"),
                                                                (ds.stats["skipped_null_vector"], "a vector")) if n]
    if rank == 0 and left:  # said, not only counted in metrics.json
        log.info("%s: %s left out (NULL); %s train and validate", spec.table, " and ".join(left),
                 plural(len(ds), "row"))
    if rank == 0 and task == "classify" and (why := continuous_label(ds.classes, len(ds))):
        log.warning("--label %s: %s; --task classify trains each value as a class of its own: for a numeric target "
                    "pass --task regress", spec.label, why)
    target = (0.0, 1.0)
    if task == "regress":
        y = train_ds.labels.double()
        target = (float(y.mean()), float(y.std()) if len(y) > 1 and float(y.std()) > 0 else 1.0)
    torch.manual_seed(spec.seed)
    model = build_head(spec.head, ds.dim, classes or 1, standardize=bool(spec.features)).to(dev)
    if spec.features:
        model[0].fit(_sample(train_ds).to(dev))
    batch = spec.batch_size or auto_batch(len(train_ds))
    if spec.batch_size is None and rank == 0:
        log.info("batch size %d (the default: an eighth of the %d train rows, as a power of two, at most %d)",
                 batch, len(train_ds), MAX_AUTO_BATCH)
    per_rank = -(-batch // world)
    total_steps = spec.epochs * len(ordering.step_sizes(len(train_ds), per_rank, world))
    lr = spec.lr or auto_lr(total_steps)
    if spec.lr is None and rank == 0 and lr != DEFAULT_LR:
        log.info("learning rate %g (the default %g, raised for a run of only %d steps so that it still learns; --lr "
                 "sets it)", lr, DEFAULT_LR, total_steps)
    lrs = [lr * lr_factor(s, total_steps) for s in range(total_steps)]
    loop = TrainLoop(model, train_ds, per_rank, rank, world, task, target, lrs, spec.weight_decay,
                     graph=knobs.train_graph, triton=knobs.triton)
    epochs = []
    for epoch in range(spec.epochs):
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
        if rank == 0 and not spec.json:
            log.info(_epoch_line(row, spec.epochs, task))
        if not math.isfinite(train_loss):  # every rank sees the same reduced loss: all stop, nothing is saved
            ds.close()
            raise EmbedfleetError(f"training diverged: the loss is {train_loss} after epoch {epoch + 1}, so the head "
                                  f"would predict nothing; nothing was saved: lower --lr (it was {lr:g})")
    doc = _metrics(spec, ds, train_ds, val_ds, epochs, world, dev, per_rank, lr)
    doc["step"] = loop.mode
    if rank == 0:
        _save(spec, dsn, ds, model, doc, target)
        if spec.json:
            sys.stdout.write(json.dumps(doc, indent=2) + "\n")
            sys.stdout.flush()
        else:
            log.info("saved %s", spec.out)
    ds.close()
    return doc if rank == 0 else None


def _sample(ds, rows: int = 1 << 18):
    """Up to `rows` of the dataset's rows, evenly spaced: what the features' standardization is fitted on."""
    import numpy as np

    n = len(ds)
    index = np.unique(np.linspace(0, n - 1, min(n, rows)).astype(np.int64)) if n else np.zeros(0, np.int64)
    return ds.subset(index).vectors() if len(index) != n else ds.vectors()


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


def _metrics(spec, ds, train_ds, val_ds, epochs, world, dev, per_rank, lr: float) -> dict:
    last = epochs[-1]
    final = {k: v for k, v in last.items() if k not in ("epoch", "seconds", "samples_per_s")}
    return {
        "table": spec.table, "label": spec.label, "task": ds.task, "head": spec.head,
        "where": spec.where, "out": spec.out,
        "rows": {"train": len(train_ds), "val": len(val_ds), "skipped_null_label": ds.stats["skipped_null_label"],
                 "skipped_null_vector": ds.stats["skipped_null_vector"]},
        "classes": ds.classes,
        "cache": ds.cache, "dtype": str(ds.dtype).replace("torch.", ""), "device": str(dev), "world_size": world,
        "batch_size": per_rank * world, "batch_size_per_rank": per_rank, "lr": lr,
        "epochs_run": len(epochs), "val_fraction": spec.val_fraction, "seed": spec.seed,
        "read": {k: ds.stats[k] for k in ("read_s", "plan_s", "rows_per_s", "connections", "bytes")},
        "epochs": epochs,
        "final": final,
    }


def _save(spec, dsn, ds, model, doc, target) -> None:
    from safetensors.torch import save_file

    from embedfleet.train.heads import hidden_size
    from embedfleet.train.read import Split

    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "head.safetensors"))
    head = {
        "format": 1, "task": ds.task, "head": spec.head, "dim": ds.dim,
        "outputs": len(ds.classes) if ds.task == "classify" else 1,
        "hidden": hidden_size(ds.dim) if spec.head == "mlp" else None,
        "features": spec.features, "fill_null": spec.fill_null, "standardize": bool(spec.features),
        "feature_slices": {k: [v.start, v.stop] for k, v in ds.feature_slices.items()},
        "label": spec.label, "label_kind": ds.source.label_kind,
        "classes": ds.classes,
        "label_map": {str(c): i for i, c in enumerate(ds.classes)} if ds.classes else None,
        "target": {"mean": target[0], "std": target[1]} if ds.task == "regress" else None,
        "table": spec.table, "where": spec.where, "vector_column": ds.source.column,
        "vector_type": ds.source.vtype, "id_column": ds.source.id_column,
        "model": _made_by(dsn, spec.table),
        "split": {"val_fraction": spec.val_fraction, "rule": Split("val", spec.val_fraction).rule()},
        "created": datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    (out / "head.json").write_text(json.dumps(head, indent=2) + "\n")
    (out / "metrics.json").write_text(json.dumps(doc, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    """A rank started by `train`: its spec as JSON, its device, the launcher's settings."""
    import argparse

    p = argparse.ArgumentParser(prog="embedfleet-train-rank")
    p.add_argument("spec")
    p.add_argument("--device", required=True)
    p.add_argument("--settings", required=True)
    p.add_argument("--launcher-pid", type=int, default=0)
    a = p.parse_args(argv)
    if a.launcher_pid:
        die_with_parent(a.launcher_pid)
    spec, knobs = TrainSpec.from_json(json.loads(a.spec)), Settings.from_json(json.loads(a.settings))
    setup_logging()
    rank = int(os.environ.get("RANK", "0"))
    try:
        _as_rank(spec, knobs, a.device)
    except EmbedfleetError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - one line per rank, like the CLI
        if knobs.debug:
            raise
        sys.stderr.write(f"error (rank {rank}): {type(e).__name__}: {e}\n")
        sys.exit(1)
    exit_now(0)  # its work written: C++'s exit-time destructors once aborted a finished gloo rank


if __name__ == "__main__":
    main()
