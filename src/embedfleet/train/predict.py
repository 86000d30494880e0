"""`embedfleet predict`: a saved head (a `train` run directory) applied to a table's stored vectors.

Writes id, prediction and (classification) probabilities in the head's class order to Parquet with
--out; either way returns a summary: rows, predictions per class (or their spread), and where the
table has the head's label column, agreement with it — on all rows and on the rows of the head's
validation split (the same rule as training), which equals the run's final validation accuracy
(or MAE) when the table has not changed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from embedfleet.errors import InputError
from embedfleet.settings import Settings

__all__ = ["load_head", "predict"]


def load_head(run: str | Path, device=None):
    """(head.json as a dict, the head as a module in eval mode) from a run directory."""
    import torch
    from safetensors.torch import load_file

    from embedfleet.train.heads import build_head

    run = Path(run)
    meta_path, weights = run / "head.json", run / "head.safetensors"
    if not meta_path.is_file() or not weights.is_file():
        raise InputError(f"--run {str(run)!r}: no head.json and head.safetensors there (the directory `embedfleet "
                         "train` wrote: its --out)")
    try:
        meta = json.loads(meta_path.read_text())
        model = build_head(meta["head"], meta["dim"], meta["outputs"], meta.get("hidden"),
                           standardize=bool(meta.get("standardize")))
        model.load_state_dict(load_file(str(weights)))
    except (ValueError, KeyError, RuntimeError) as e:
        raise InputError(f"--run {str(run)!r}: unreadable head ({type(e).__name__}: {e})") from None
    return meta, model.to(device or torch.device("cpu")).eval()


def predict(run: str, table: str, where: str | None = None, out: str | None = None, db: str | None = None,
            device: str = "auto", batch_size: int = 65_536, settings: Settings | None = None) -> dict:
    if out is not None and not out.lower().endswith((".parquet", ".pq")):
        raise InputError(f"--out {out}: predictions are written as Parquet; name the file FILE.parquet")
    import torch

    from embedfleet.pg.embedded import resolve_dsn
    from embedfleet.pg.connect import connect
    from embedfleet.train.dataset import load, resolve_device
    from embedfleet.train.read import UNSEEN_CLASS, Split, describe

    dev = resolve_device(device)
    meta, model = load_head(run, dev)
    settings = settings or Settings.from_env()
    dsn = resolve_dsn(db, settings)
    task = meta["task"]
    features, fill_null = meta.get("features"), meta.get("fill_null")
    with connect(dsn) as conn:
        source = describe(conn, table, None, where, None, features, fill_null)
        try:
            has_label = describe(conn, table, meta["label"], where, task, features,
                                 fill_null).label_kind == meta["label_kind"]
        except InputError:
            has_label = False  # the table lacks the head's label: predictions only
    if source.dim != meta["dim"]:
        what = f"features {', '.join(features)} make" if features else "holds"
        raise InputError(f"table {table!r} {what} {source.dim}-dimensional vectors; the head in {run!r} "
                         f"takes {meta['dim']}")
    ds = load(table, label=meta["label"] if has_label else None, where=where, db=dsn, cache="auto", device=dev,
              task=task if has_label else None, keys=True, null_labels="keep", features=features, fill_null=fill_null,
              classes=meta["classes"] if has_label and task == "classify" else None, settings=settings)
    cuda = dev.type == "cuda"
    outs = []
    with torch.inference_mode():
        for x, _ in ds.batches(batch_size, shuffle=False):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                o = model(x if cuda else x.float())
            outs.append(o.float())
    logits = torch.cat(outs) if outs else torch.zeros((0, meta["outputs"]))
    labels = ds.labels.cpu().numpy() if ds.labels is not None else None
    val = Split.is_val(ds.keys, meta["split"]["val_fraction"])
    summary = {"run": str(run), "table": table, "where": where, "task": task, "rows": len(ds), "out": out,
               "skipped_null_vector": ds.stats["skipped_null_vector"]}
    if task == "classify":
        probs = torch.softmax(logits, 1).cpu().numpy()
        index = logits.argmax(1).cpu().numpy()
        classes = meta["classes"]
        prediction = np.asarray(classes, dtype=object if meta["label_kind"] == "text" else None)[index] \
            if len(index) else np.zeros(0)
        counts = np.bincount(index, minlength=len(classes)).tolist()
        summary["predicted"] = {str(c): k for c, k in zip(classes, counts)}
        if labels is not None:
            known = labels != -1  # a label the head never saw is counted, and never predicted right
            summary["accuracy"] = _share(index == labels, known)
            summary["val_accuracy"] = _share(index == labels, known & val)
            summary["val_rows"] = int((known & val).sum())
            summary["unseen_label_rows"] = int((labels == UNSEEN_CLASS).sum())
    else:
        target = meta["target"]
        prediction = logits[:, 0].double().cpu().numpy() * target["std"] + target["mean"]
        probs = None
        summary["predicted"] = {"mean": _num(prediction.mean()), "std": _num(prediction.std()),
                                "min": _num(prediction.min()), "max": _num(prediction.max())} if len(prediction) else {}
        if labels is not None:
            known = ~np.isnan(labels)
            err = np.abs(prediction - labels)
            summary["mae"] = _num(err[known].mean()) if known.any() else None
            summary["val_mae"] = _num(err[known & val].mean()) if (known & val).any() else None
            summary["val_rows"] = int((known & val).sum())
    if out:
        _write(out, ds.ids.tolist(), prediction, probs)
    ds.close()
    return summary


def _share(hits: np.ndarray, mask: np.ndarray) -> float | None:
    return float(hits[mask].mean()) if mask.any() else None


def _num(v) -> float:
    return float(v)


def _write(path: str, ids: list[str], prediction: np.ndarray, probs: np.ndarray | None) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {"id": pa.array(ids, pa.string()), "prediction": pa.array(prediction.tolist())}
    if probs is not None:
        width = probs.shape[1]
        columns["probabilities"] = pa.FixedSizeListArray.from_arrays(pa.array(probs.reshape(-1), pa.float32()), width)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), str(target))
