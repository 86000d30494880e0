"""TableDataset from Parquet files: the named columns of every file read once into the gpu or ram tier, with
a table's feature types, refusals, order and split rule (no per-item file reads, no locks).

Row order is the files' (sorted by path) and each file's own; `ids` are `id_field`'s values, else the row's
position. A feature is a numeric or boolean column (one value), a list of numbers of one length (that
length), or a binary column of little-endian float32 (its bytes / 4).
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch

from embedfleet.errors import InputError
from embedfleet.train import order as ordering
from embedfleet.train.read import MAX_CLASSES, Feature, Ids, Source, Split, _fill, numeric_classes

__all__ = ["load_parquet", "parquet_files"]


def parquet_files(path: str) -> tuple[object, list[str]]:
    """(fsspec filesystem, the Parquet files `path` names: a file, a folder's *.parquet, or a glob; sorted)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(path)
    if any(ch in root for ch in "*?["):
        files = sorted(fs.glob(root))
    elif fs.isdir(root):
        files = sorted(f for f in fs.find(root) if f.endswith((".parquet", ".pq")))
    elif fs.exists(root):
        files = [root]
    else:
        raise InputError(f"{path}: no such file or folder")
    if not files:
        raise InputError(f"{path}: no Parquet files there")
    return fs, files


def _read(fs, files: list[str], columns: list[str]):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for f in files:
        with fs.open(f, "rb") as fh:
            pf = pq.ParquetFile(fh)
            missing = [c for c in columns if c not in pf.schema_arrow.names]
            if missing:
                raise InputError(f"{f}: no column {missing[0]!r} (it has {', '.join(pf.schema_arrow.names)})")
            tables.append(pf.read(columns=columns))
    try:
        return pa.concat_tables(tables)
    except pa.ArrowInvalid as e:
        raise InputError(f"the files' columns differ in type: {str(e).splitlines()[0]}") from None


def _first_bad(mask: np.ndarray, ids: Ids) -> str:
    i = int(np.flatnonzero(mask)[0])
    return f"row {ids[i]}"


def _feature(name: str, col, ids: Ids, fill: float | None) -> tuple[Feature, np.ndarray]:
    """One column as (its Feature, float32 values [n, width]); refusals name the column and the first row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    t = col.type
    nulls = col.is_null().to_numpy(zero_copy_only=False)
    where = f"feature column {name!r} ({t})"
    if nulls.any() and fill is None:
        raise InputError(f"{where} is NULL in {_first_bad(nulls, ids)}: pass fill_null to use a value instead")
    n = len(col)
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_decimal(t):
        values = pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False).astype(np.float32)
        if nulls.any():
            values[nulls] = fill
        return Feature(name, "scalar", 1, str(t), pa.types.is_boolean(t)), values.reshape(n, 1)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        inner = t.value_type
        if not (pa.types.is_integer(inner) or pa.types.is_floating(inner) or pa.types.is_decimal(inner)):
            raise InputError(f"{where}: a list of {inner}; a list feature holds numbers")
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
        present = lengths[~nulls]
        width = int(present[0]) if len(present) else 0
        wrong = ~nulls & (np.nan_to_num(lengths.astype(np.float64), nan=-1) != width)
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            raise InputError(f"{where} has {int(lengths[i])} values in row {ids[i]} where the first row has "
                             f"{width}: a feature's width is fixed")
        out = np.full((n, width), np.nan if fill is None else fill, np.float32)
        flat = pc.list_flatten(col)  # the non-null lists' values, in order
        if flat.null_count:
            owner = np.repeat(np.flatnonzero(~nulls), width)
            if fill is None:
                bad = owner[flat.is_null().to_numpy(zero_copy_only=False)][0]
                raise InputError(f"{where} has a NULL element in row {ids[int(bad)]}: pass fill_null")
            flat = flat.fill_null(fill)
        out[~nulls] = pc.cast(flat, pa.float32()).to_numpy(zero_copy_only=False).reshape(-1, width)
        return Feature(name, "array", width, str(t)), out
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        lengths = pc.binary_length(col).to_numpy(zero_copy_only=False)
        present = lengths[~nulls]
        size = int(present[0]) if len(present) else 0
        if size == 0 or size % 4:
            raise InputError(f"{where} holds {size} bytes, not whole float32 values (little-endian, 4 bytes each)")
        wrong = ~nulls & (np.nan_to_num(lengths.astype(np.float64), nan=-1) != size)
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            raise InputError(f"{where} has {int(lengths[i])} bytes in row {ids[i]} where the first row has {size}: "
                             "a feature's width is fixed")
        out = np.full((n, size // 4), np.nan if fill is None else fill, np.float32)
        data = b"".join(v for v in col.to_pylist() if v is not None)
        out[~nulls] = np.frombuffer(data, "<f4").reshape(-1, size // 4)
        return Feature(name, "bytea", size // 4, str(t)), out
    raise InputError(f"{where}: a feature is a number, a boolean, a list of numbers or binary float32")


def load_parquet(path: str, features: Sequence[str], label: str | None = None, cache: str = "auto",
                 device="auto", split=None, dtype=None, id_field: str | None = None, fill_null=None,
                 task: str | None = None, seed: int = 0, window_rows: int | None = None, cls=None):
    import pyarrow as pa
    import pyarrow.compute as pc

    from embedfleet.train.dataset import (TableDataset, _DeviceStore, _HostStore, choose_tier, resolve_device,
                                          resolve_dtype)

    cls = cls or TableDataset
    t0 = time.perf_counter()
    if isinstance(features, str):
        features = [f.strip() for f in features.split(",") if f.strip()]
    features = list(features or [])
    if not features:
        raise InputError("from_parquet: name the feature columns (features=[...])")
    if label is not None and label in features:
        raise InputError(f"label {label!r} is also a feature: the label cannot be an input")
    if isinstance(split, str):
        split = Split(split)
    if task is not None and task not in ("classify", "regress"):
        raise InputError(f"task {task!r}: use classify or regress")
    if task is not None and label is None:
        raise InputError(f"task {task} needs a label column")
    dev = resolve_device(device)
    fs, files = parquet_files(path)
    columns = list(dict.fromkeys(features + [c for c in (label, id_field) if c]))
    table = _read(fs, files, columns)
    n_all = table.num_rows
    ids = _ids(table.column(id_field).to_pylist() if id_field else range(n_all))  # default: the row's position
    keep = np.ones(n_all, bool)
    labels, classes, kind = None, None, None
    if label is not None:
        lab = table.column(label).combine_chunks()
        lt = lab.type
        numeric = pa.types.is_integer(lt) or pa.types.is_floating(lt) or pa.types.is_boolean(lt) or pa.types.is_decimal(lt)
        if not numeric and not (pa.types.is_string(lt) or pa.types.is_large_string(lt)):
            raise InputError(f"label {label!r} is of type {lt}: use a numeric or text column")
        kind = "numeric" if numeric else "text"
        task = task or "classify"
        if task == "regress" and kind != "numeric":
            raise InputError(f"task regress needs a numeric label; {label!r} is of type {lt}")
        keep &= ~lab.is_null().to_numpy(zero_copy_only=False)
        if not keep.any():
            raise InputError(f"label {label!r} is NULL in all {n_all:,} rows")
    keys = np.zeros(0, np.uint32)
    if split is not None:
        keys = np.fromiter((Split.key_of(i) for i in ids), np.uint64, count=n_all)
        val = Split.is_val(keys, split.val_fraction)
        keep &= val if split.part == "val" else ~val
    index = np.flatnonzero(keep)
    sub = table.take(pa.array(index)) if len(index) != n_all else table
    ids = ids.take(index) if len(index) != n_all else ids
    fills = dict(_fill(fill_null, features))
    feats, parts = [], []
    for name in features:
        f, values = _feature(name, sub.column(name), ids, fills.get(name))
        feats.append(f)
        parts.append(values)
    x_np = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
    n, dim = x_np.shape
    if label is not None:
        lab = sub.column(label).combine_chunks()
        if task == "classify":
            values = lab.to_pylist() if kind == "text" else pc.cast(lab, pa.float64()).to_numpy(zero_copy_only=False)
            classes = numeric_classes(set(values.tolist())) if kind == "numeric" else sorted(set(values))
            if len(classes) > MAX_CLASSES:
                raise InputError(f"label {label!r} has {len(classes):,} distinct values (more than {MAX_CLASSES:,}): "
                                 "use task regress for a numeric target")
            pos = {c: i for i, c in enumerate(classes)}
            labels = torch.from_numpy(np.fromiter((pos[v] for v in (values if kind == "text" else values.tolist())),
                                                  np.int64, count=n))
        else:
            labels = torch.from_numpy(pc.cast(lab, pa.float32()).to_numpy(zero_copy_only=False).copy())
        labels = labels.to(dev)
    source = Source(path, None, "vector", dim, id_field, label, kind, task if label else None, None,
                    features=tuple(feats), fill=tuple(fills.items()))
    torch_dtype = resolve_dtype(dtype, "vector")
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    tier = choose_tier(cache, dev, n * dim * itemsize, rows=n)
    if tier == "stream":
        raise InputError(f"{n:,} rows of {dim} features fit neither the device nor host memory; Parquet files are "
                         "read whole (use a table, whose stream tier reads windows)")
    host = torch.from_numpy(np.ascontiguousarray(x_np)).to(torch_dtype)
    if tier == "gpu":
        store = _DeviceStore(host.to(dev), dev)
    else:
        store = _HostStore(host.pin_memory() if dev.type == "cuda" else host, dev)
    seconds = time.perf_counter() - t0
    stats = {"rows": n, "skipped_null_label": int((~keep).sum()) if split is None else 0, "skipped_null_vector": 0,
             "read_s": round(seconds, 3), "plan_s": 0.0, "rows_per_s": round(n / seconds) if seconds > 0 else None,
             "connections": 0, "bytes": n * dim * itemsize, "files": len(files)}
    window = window_rows or ordering.default_window_rows(dim)
    if window % ordering.BLOCK_ROWS:
        raise InputError(f"window_rows {window}: use a multiple of {ordering.BLOCK_ROWS}")
    kept_keys = keys[index].astype(np.uint32) if len(keys) else keys
    return cls(store, source, n, None, labels, classes, ids, kept_keys, np.arange(n, dtype=np.uint64), stats, seed,
               window)


def _ids(values) -> Ids:
    data = [str(v).encode() for v in values]
    return Ids(b"".join(data), np.cumsum([len(d) for d in data], dtype=np.int64))
