"""TableDataset: a table's columns (its vector column, or any numeric features), read once, iterated as
device-side batches; a torch Dataset too. EmbeddingDataset is the same class with its default features.

Glossary (see order.py for order, block, window and step):
    tier      where the vectors live: "gpu" (device memory: a batch is one index_select there),
              "ram" (host memory, pinned on CUDA: a side thread gathers each batch into a pinned
              buffer and copies it on a side stream, ahead of use) or "stream" (the database:
              windows of the epoch's order are read by TID, one ahead, in the read's snapshot).
              "auto" picks the first that fits. Every tier gives the same batches.
    view      a dataset over some rows of another's storage (`subset`): the trainer reads a table
              once and views its training and validation rows.

With torch.distributed initialised, `from_table` reads once for all ranks: each rank copies its
share of the table's page ranges in one snapshot, then the ranks broadcast their shares.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import abc
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Sequence

import numpy as np
import torch

from embedfleet.errors import InputError
from embedfleet.settings import Settings
from embedfleet.train import order as ordering
from embedfleet.train.read import Columns, Ids, Plan, Source, Split, TableRead, default_connections, describe

__all__ = ["TableDataset", "EmbeddingDataset", "Split", "TIERS", "load"]

log = logging.getLogger(__name__)

TIERS = ("auto", "gpu", "ram", "stream")
GPU_HEADROOM = 2 << 30  # device memory left for the model, optimizer, activations and the allocator
# The gpu tier's indices beside its vectors: the epoch's order, its rows, the training loop's copies of
# both, the next epoch's pair made meanwhile and the temporaries of making it — int64 each.
INDEX_BYTES_PER_ROW = 9 * 8
RAM_SHARE = 0.6  # share of available host memory the ram tier may take (all local ranks together)
PREFETCH = 3  # batches (ram tier) gathered and copied ahead of the one in use


def _dist():
    d = torch.distributed
    return d if d.is_available() and d.is_initialized() else None


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"device {device!s}: this machine has no CUDA device (use cpu)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise InputError(f"device {device!s}: this machine has {torch.cuda.device_count()} CUDA devices")
    elif dev.type != "cpu":
        raise InputError(f"device {device!s}: use auto, cpu, cuda or cuda:N")
    return dev


def resolve_dtype(dtype, vtype: str) -> torch.dtype:
    if dtype is None:
        return torch.float16 if vtype == "halfvec" else torch.float32
    if isinstance(dtype, torch.dtype):
        out = dtype
    else:
        out = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}.get(str(dtype).replace("torch.", ""))
    if out not in (torch.float32, torch.float16, torch.bfloat16):
        raise InputError(f"dtype {dtype!r}: use float32, float16 or bfloat16")
    return out


def choose_tier(cache: str, device: torch.device, nbytes: int, local_ranks: int = 1, rows: int = 0) -> str:
    """The tier for `nbytes` of vectors (`rows` rows): the one asked for, or with "auto" the fastest that
    fits (device memory for them and their indices with GPU_HEADROOM to spare; RAM_SHARE of available
    host memory for every rank of this host; else the database)."""
    if cache not in TIERS:
        raise InputError(f"cache {cache!r} (--tier): use {', '.join(TIERS)}")
    if cache == "gpu" and device.type != "cuda":
        none = "" if torch.cuda.is_available() else " and this machine has none"
        raise InputError(f"the gpu tier (cache='gpu', --tier gpu) needs a CUDA device{none}; use ram or auto")
    if cache != "auto":
        return cache
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if nbytes + rows * INDEX_BYTES_PER_ROW + GPU_HEADROOM <= free:
            return "gpu"
    import psutil

    if nbytes * local_ranks <= RAM_SHARE * psutil.virtual_memory().available:
        return "ram"
    return "stream"


def make_put(dst: torch.Tensor):
    """put(offset, big-endian float values) writing rows into `dst` (host or device), from any thread."""
    if dst.device.type == "cpu" and dst.dtype in (torch.float32, torch.float16):
        arr = dst.numpy()

        def put_host(o: int, values: np.ndarray) -> None:
            np.copyto(arr[o:o + len(values)], values, casting="unsafe")

        return put_host
    local = threading.local()

    def put_staged(o: int, values: np.ndarray) -> None:
        k = len(values)
        native = values.dtype.newbyteorder("=")
        stage = getattr(local, "stage", None)
        if stage is None or stage.shape[0] < k or stage.dtype != native or stage.shape[1:] != values.shape[1:]:
            stage = local.stage = np.empty(values.shape, native)
        np.copyto(stage[:k], values)
        dst[o:o + k].copy_(torch.from_numpy(stage[:k]))

    return put_staged


def _bits(t: torch.Tensor) -> np.ndarray:
    """A host tensor as a numpy array of same-size integers (numpy has no bfloat16)."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy()


def gather_threads(settings: Settings) -> int:
    """Threads gathering a batch on the host (Settings.train_gather_threads): the ram tier's gather must keep
    up with the host-to-device copy, and one thread does not."""
    import os

    return settings.train_gather_threads or max(1, min(8, (os.cpu_count() or 2) // 2))


_pool_lock = threading.Lock()
_gather_pool: ThreadPoolExecutor | None = None


def host_take(x: torch.Tensor, index: np.ndarray, out: torch.Tensor | None = None, threads: int = 1) -> torch.Tensor:
    """x[index] for a host tensor: np.take (it releases the GIL) over row slices on a few threads;
    torch's index_select on the host was far slower on a busy small machine (OpenMP contention)."""
    global _gather_pool
    if out is None:
        out = torch.empty((len(index), *x.shape[1:]), dtype=x.dtype)
    src, dst = _bits(x), _bits(out)
    if threads == 1 or len(index) * x[0].numel() * x.element_size() < (4 << 20):
        np.take(src, index, axis=0, out=dst)
        return out
    with _pool_lock:
        if _gather_pool is None:
            _gather_pool = ThreadPoolExecutor(threads, thread_name_prefix="embedfleet-take")
    cuts = [len(index) * i // threads for i in range(threads + 1)]
    jobs = [_gather_pool.submit(np.take, src, index[a:b], 0, dst[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a]
    for j in jobs:
        j.result()
    return out


def _offer(q: queue.Queue, item, stop: threading.Event) -> bool:
    """Put `item` unless the consumer has gone (`stop`): a producer thread never blocks for good."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


class _Store:
    """A tier's storage of the vectors of every row read (views index into it)."""

    tier = ""

    def __init__(self, x: torch.Tensor | None, device: torch.device, threads: int = 1):
        self.x, self.device, self.threads = x, device, threads  # threads: the host gather's

    def batches(self, under: np.ndarray, starts, ends, window_rows: int) -> Iterator[torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _DeviceStore(_Store):
    tier = "gpu"  # batches: EmbeddingDataset.batches slices the order on the device itself


class _HostStore(_Store):
    tier = "ram"

    def batches(self, under, starts, ends, window_rows):
        if self.device.type != "cuda":
            for a, b in zip(starts.tolist(), ends.tolist()):
                yield host_take(self.x, under[a:b], threads=self.threads)
            return
        yield from _ahead(lambda a, b, out: host_take(self.x, under[a:b], out, self.threads),
                          starts, ends, self.x.shape[1:], self.x.dtype, self.device)


class _StreamStore(_Store):
    tier = "stream"

    def __init__(self, reader: TableRead, tids: np.ndarray, dim: int, dtype: torch.dtype, device: torch.device,
                 threads: int = 1):
        super().__init__(None, device, threads)
        self.reader, self.tids, self.dim, self.dtype = reader, tids, dim, dtype
        self.lock = threading.Lock()  # one window read at a time on the snapshot's connection

    def close(self) -> None:
        self.reader.close()

    def _window(self, rows: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
        """The vectors of `rows` (any order): (sorted rows, their vectors in that order)."""
        u = np.unique(rows)
        buf = torch.empty((len(u), self.dim), dtype=self.dtype, pin_memory=self.device.type == "cuda")
        with self.lock:
            self.reader.read_vectors(self.tids[u], make_put(buf))
        return u, buf

    def batches(self, under, starts, ends, window_rows):
        n = len(under)
        windows = list(range(0, n, window_rows))
        loaded: queue.Queue = queue.Queue(maxsize=1)  # one window read ahead of the ones in use
        stop = threading.Event()

        def load():
            try:
                for w in windows:
                    if not _offer(loaded, (w, *self._window(under[w:w + window_rows])), stop):
                        return
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
                _offer(loaded, e, stop)

        thread = threading.Thread(target=load, daemon=True, name="embedfleet-stream")
        thread.start()
        resident: dict[int, tuple[np.ndarray, torch.Tensor]] = {}
        try:
            for a, b in zip(starts.tolist(), ends.tolist()):
                first = a - a % window_rows
                for w in list(resident):
                    if w < first:
                        del resident[w]
                last = (b - 1) - (b - 1) % window_rows if b > a else first
                while any(w not in resident for w in range(first, last + 1, window_rows)):
                    item = loaded.get()
                    if isinstance(item, BaseException):
                        raise item
                    resident[item[0]] = item[1:]
                parts = []
                for w in range(first, last + 1, window_rows):
                    lo, hi = max(a, w), min(b, w + window_rows)
                    if hi <= lo:
                        continue
                    u, buf = resident[w]
                    parts.append(host_take(buf, np.searchsorted(u, under[lo:hi]), threads=self.threads))
                x = parts[0] if len(parts) == 1 else (torch.cat(parts) if parts else
                                                      torch.empty((0, self.dim), dtype=self.dtype))
                yield x.to(self.device, non_blocking=True)
        finally:
            stop.set()
            thread.join(timeout=60)


def _ahead(gather, starts, ends, row_shape, dtype, device) -> Iterator[torch.Tensor]:
    """Batches gathered on the host by a side thread into pinned buffers, copied to `device` on a
    side stream, PREFETCH ahead of the one in use: the device does not wait for the host's gather."""
    steps = list(zip(starts.tolist(), ends.tolist()))
    if not steps:
        return
    width = max(b - a for a, b in steps)
    ring = [torch.empty((width, *row_shape), dtype=dtype, pin_memory=True) for _ in range(PREFETCH + 1)]
    copied: list[torch.cuda.Event | None] = [None] * len(ring)
    stream = torch.cuda.Stream(device)
    ready: queue.Queue = queue.Queue(maxsize=PREFETCH)
    stop = threading.Event()

    def produce():
        try:
            with torch.cuda.device(device):
                for i, (a, b) in enumerate(steps):
                    slot = i % len(ring)
                    if copied[slot] is not None:
                        copied[slot].synchronize()  # the copy out of this buffer is done
                    host = ring[slot][:b - a]
                    gather(a, b, host)
                    with torch.cuda.stream(stream):
                        x = host.to(device, non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(stream)
                    copied[slot] = ev
                    if not _offer(ready, (x, ev), stop):
                        return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            _offer(ready, (e, None), stop)

    thread = threading.Thread(target=produce, daemon=True, name="embedfleet-gather")
    thread.start()
    try:
        for _ in steps:
            x, ev = ready.get()
            if isinstance(x, BaseException):
                raise x
            current = torch.cuda.current_stream(device)
            current.wait_event(ev)
            x.record_stream(current)  # x was allocated on the side stream, is used on this one
            yield x
    finally:
        stop.set()
        thread.join(timeout=60)


class TableDataset:
    """A table's features (and labels) read in one bulk read; `batches` yields device tensors. As a torch
    Dataset, `ds[i]` is (x_i, y_i) — (x_i,) without a label, as a TensorDataset's — on the dataset's device."""

    def __init__(self, store: _Store, source: Source, n_all: int, rows: np.ndarray | None, labels: torch.Tensor | None,
                 classes: list | None, ids: Ids, keys: np.ndarray, tids: np.ndarray, stats: dict, seed: int,
                 window_rows: int):
        self._store, self.source = store, source
        self._n_all = n_all
        self._rows = rows  # None: every row of the storage, in order
        self.labels = labels
        self.classes = classes
        self.ids = ids
        self.keys = keys
        self.tids = tids
        self.stats = stats
        self.seed = seed
        self.window_rows = window_rows
        self._orders: dict[tuple[int, bool], Future] = {}
        self._rows_on_device: torch.Tensor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._at: dict | None = None  # where the last `batches` got to (state_dict)
        self._resume: dict | None = None  # a loaded state, for the next `batches` of its epoch

    # ---- the contract ----------------------------------------------------------------------------

    @classmethod
    def from_table(cls, table: str, features: Sequence[str] | None = None, label: str | None = None,
                   where: str | None = None, db: str | None = None, cache: str = "auto",
                   device: str | torch.device = "auto", split: str | Split | None = None, dtype=None,
                   id_field: str | None = None, fill_null=None, *, task: str | None = None, seed: int = 0,
                   window_rows: int | None = None, connections: int | None = None,
                   settings: Settings | None = None) -> TableDataset:
        """Read `table`'s `features` (and `label`) once. `features`: column names whose values, concatenated
        in that order, make x — numbers and booleans one value each, fixed-length arrays their length,
        vector/halfvec their dimension, bytea of little-endian float32 its length (default: the table's
        vector column, whose NULL rows are skipped; a named feature's NULL is refused unless `fill_null`, a
        number or {column: number}, stands in for it). `where`: a SQL filter, run read-only. `db`: a DSN
        (default $EMBEDFLEET_DB, else the embedded server). `cache`: the tier; `device`: where batches go
        (auto: cuda if there is one). `split`: "train" / "val" (or a Split with its val_fraction) keeps that
        side of the deterministic split by row id. `dtype`: how x is kept (float32, float16 or bfloat16;
        default float32, float16 for a halfvec column alone). `id_field`: the column `ids` holds (default
        the primary key). `task`: classify (the default with a label; `classes` are the sorted label
        values) or regress. `window_rows` changes the order's windows (a multiple of 256 rows; default ~1 GB
        of float32 rows); `connections` the read's connections (default EMBEDFLEET_TRAIN_READERS).
        `settings`: the process's knobs, read from the environment when not given."""
        return load(table, label=label, where=where, db=db, cache=cache, device=device, split=split, dtype=dtype,
                    task=task, seed=seed, window_rows=window_rows, connections=connections,
                    settings=settings or Settings.from_env(), features=features, fill_null=fill_null,
                    id_field=id_field, cls=cls)

    @classmethod
    def from_parquet(cls, path: str, features: Sequence[str], label: str | None = None, cache: str = "auto",
                     device: str | torch.device = "auto", split: str | Split | None = None, dtype=None,
                     id_field: str | None = None, fill_null=None, *, task: str | None = None, seed: int = 0,
                     window_rows: int | None = None) -> TableDataset:
        """The same dataset from the columns of Parquet files (a file, a folder, a glob; local or any fsspec
        URL), read whole into the gpu or ram tier: rows in file order (files sorted by name), the same
        feature types and refusals as a table's (a list column is an array, a binary one raw float32), the
        same batches, sharding and resume."""
        from embedfleet.train.parquet import load_parquet

        return load_parquet(path, features, label=label, cache=cache, device=device, split=split, dtype=dtype,
                            id_field=id_field, fill_null=fill_null, task=task, seed=seed, window_rows=window_rows,
                            cls=cls)

    def __len__(self) -> int:
        return self._n_all if self._rows is None else len(self._rows)

    @property
    def dim(self) -> int:
        return self.source.dim

    @property
    def feature_slices(self) -> dict[str, slice]:
        """Each feature column's slice of x."""
        return self.source.feature_slices

    @property
    def cache(self) -> str:
        return self._store.tier

    @property
    def device(self) -> torch.device:
        return self._store.device

    @property
    def dtype(self) -> torch.dtype:
        return self._store.dtype if isinstance(self._store, _StreamStore) else self._store.x.dtype

    @property
    def task(self) -> str | None:
        return self.source.task

    def batches(self, batch_size: int, shuffle: bool = True, epoch: int = 0, rank: int | None = None,
                world_size: int | None = None, drop_last: bool = False,
                start_step: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """This rank's (x, y) batches of one epoch, on the dataset's device (y None without a label).
        `batch_size` is per rank. Every rank gets the same number of batches; all ranks together see
        each row once (drop_last=False); the order depends only on (seed, epoch). `start_step`: skip the
        epoch's first steps (a loaded state_dict sets it for its epoch)."""
        if batch_size < 1:
            raise InputError(f"batch size {batch_size}: use at least 1")
        dist = _dist()
        if world_size is None:
            world_size = dist.get_world_size() if dist else 1
        if rank is None:
            rank = dist.get_rank() if dist and world_size == dist.get_world_size() else 0
        if start_step is None:
            start_step = self._resumed_step(batch_size, world_size, epoch, shuffle, drop_last)
        starts, ends = ordering.step_bounds(len(self), batch_size, rank, world_size, drop_last)
        total = len(starts)
        if not 0 <= start_step <= total:
            raise InputError(f"start_step {start_step}: an epoch of this dataset has {total} steps "
                             f"at batch size {batch_size} on {world_size} ranks")
        starts, ends = starts[start_step:], ends[start_step:]
        at = {"epoch": epoch, "step": start_step, "steps": total, "batch_size": batch_size * world_size,
              "world_size": world_size, "shuffle": shuffle, "drop_last": drop_last}
        self._mark(at)
        for k, batch in enumerate(self._epoch_batches(starts, ends, epoch, shuffle), start_step + 1):
            at["step"] = k  # consumed: a state taken now resumes at the next one
            self._mark(at)
            yield batch

    def _epoch_batches(self, starts: np.ndarray, ends: np.ndarray, epoch: int, shuffle: bool):
        if isinstance(self._store, _DeviceStore):  # the order made on the device, sliced there
            rows, pos = self.epoch_rows_on_device(epoch, shuffle)
            for a, b in zip(starts.tolist(), ends.tolist()):
                yield (self._store.x.index_select(0, rows[a:b]),
                       None if self.labels is None else self.labels.index_select(0, pos[a:b]))
            return
        under, positions = self.epoch_rows(epoch, shuffle)
        xs = self._store.batches(under, starts, ends, self.window_rows)
        if self.labels is None:
            for x in xs:
                yield x, None
            return
        pos = torch.from_numpy(positions).to(self.labels.device, non_blocking=True)
        for (a, b), x in zip(zip(starts.tolist(), ends.tolist()), xs):
            yield x, self.labels.index_select(0, pos[a:b])

    # ---- resume ----------------------------------------------------------------------------------

    def _mark(self, at: dict) -> None:
        """Record where an epoch's batches got to; a finished epoch is the next epoch's start."""
        self._at = dict(at, epoch=at["epoch"] + 1, step=0) if at["step"] >= at["steps"] else dict(at)

    def state_dict(self) -> dict:
        """Where the last `batches` got to: seed, epoch, step (batches consumed), world size, global batch,
        shuffle, drop_last and rows. `load_state_dict` of it, in a new process, makes the next `batches` of
        that epoch yield exactly the remaining batches; later epochs are the same as the uninterrupted run's."""
        at = self._at or {"epoch": 0, "step": 0, "batch_size": None, "world_size": None, "shuffle": True,
                          "drop_last": False}
        return {"seed": self.seed, "epoch": at["epoch"], "step": at["step"], "world_size": at["world_size"],
                "batch_size": at["batch_size"], "shuffle": at["shuffle"], "drop_last": at["drop_last"],
                "rows": len(self)}

    def load_state_dict(self, state: dict) -> None:
        try:
            rows, seed, epoch, step = int(state["rows"]), int(state["seed"]), int(state["epoch"]), int(state["step"])
        except (KeyError, TypeError, ValueError):
            raise InputError("load_state_dict: not a TableDataset state (state_dict() makes one)") from None
        if rows != len(self):
            raise InputError(f"load_state_dict: the state was taken over {rows:,} rows; this dataset has "
                             f"{len(self):,} (the same table, filter and split resume)")
        self.seed, self._orders = seed, {}
        self._resume = dict(state, epoch=epoch, step=step)
        self._at = {k: state[k] for k in ("epoch", "step", "batch_size", "world_size", "shuffle", "drop_last")}
        self._at["steps"] = None

    def _resumed_step(self, batch_size: int, world_size: int, epoch: int, shuffle: bool, drop_last: bool) -> int:
        """The first step of this epoch's batches: a loaded state's, once, for its epoch (0 otherwise)."""
        r = self._resume
        if r is None or epoch != r["epoch"]:
            return 0
        self._resume = None
        if r["step"] and r["batch_size"]:
            g = r["batch_size"]
            if g % world_size:
                raise InputError(f"resume: {world_size} ranks do not divide the saved global batch of {g} rows "
                                 f"({r['world_size']} ranks); resume on a world size that divides it")
            if batch_size * world_size != g:
                raise InputError(f"resume: the saved global batch is {g} rows; on {world_size} ranks use "
                                 f"batch_size {g // world_size} (asked {batch_size})")
            if bool(shuffle) != bool(r["shuffle"]) or bool(drop_last) != bool(r["drop_last"]):
                raise InputError("resume: shuffle and drop_last must be the saved state's "
                                 f"(shuffle={r['shuffle']}, drop_last={r['drop_last']})")
        return r["step"]

    # ---- torch Dataset ---------------------------------------------------------------------------

    def __getitem__(self, i: int):
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"{type(self).__name__} indices are integers (a batch: __getitems__)")
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} is out of range for {n} rows")
        return tuple(t[0] for t in self._gather(np.asarray([i % n], np.int64)))

    def __getitems__(self, indices) -> _Batch:
        """The rows at `indices` in one gather, as a batch DataLoader's default collate takes as it is."""
        idx = np.asarray(indices, np.int64).reshape(-1)
        n = len(self)
        if len(idx) and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"an index is out of range for {n} rows")
        return _Batch(self._gather(idx % n if len(idx) else idx))

    def _gather(self, idx: np.ndarray) -> tuple[torch.Tensor, ...]:
        """(x, y) — (x,) without a label — of the dataset's positions `idx`, on its device."""
        rows = idx if self._rows is None else self._rows[idx]
        store, dev = self._store, self.device
        if isinstance(store, _DeviceStore):
            both = rows if self._rows is None or self.labels is None else np.stack([rows, idx])
            on_dev = self._index_to(both, dev)
            x = store.x.index_select(0, on_dev if on_dev.dim() == 1 else on_dev[0])
            pos = on_dev if on_dev.dim() == 1 else on_dev[1]
        else:
            if isinstance(store, _HostStore):
                host = host_take(store.x, rows, threads=store.threads)
            else:
                u, buf = store._window(rows)
                host = host_take(buf, np.searchsorted(u, rows), threads=store.threads)
            x = (host.pin_memory() if dev.type == "cuda" else host).to(dev, non_blocking=True)
            pos = None
        if self.labels is None:
            return (x,)
        if pos is None or pos.device != self.labels.device:
            pos = self._index_to(idx, self.labels.device)
        return x, self.labels.index_select(0, pos)

    @staticmethod
    def _index_to(index: np.ndarray, device: torch.device) -> torch.Tensor:
        """Host indices on `device`; through pinned memory on CUDA, so the copy does not wait for the queued work."""
        t = torch.from_numpy(np.ascontiguousarray(index))
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t

    # ---- beyond the contract ---------------------------------------------------------------------

    @property
    def storage(self) -> torch.Tensor | None:
        """The tier's tensor of the vectors of every row read: in device memory (gpu) or host memory
        (ram; pinned on CUDA); None in the stream tier."""
        return self._store.x

    def epoch_rows(self, epoch: int, shuffle: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(rows of the storage, positions in this dataset) in the epoch's order: what `batches`
        slices step by step (`storage[rows]` are the vectors, `labels[positions]` their labels)."""
        positions = self._order(epoch, shuffle)
        return (positions if self._rows is None else self._rows[positions]), positions

    def epoch_rows_on_device(self, epoch: int, shuffle: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """epoch_rows as int64 tensors on the dataset's device, computed there (no host work on CUDA)."""
        positions = ordering.epoch_order(len(self), self.seed, epoch, ordering.BLOCK_ROWS, self.window_rows, shuffle,
                                         device=self.device)
        if self._rows is None:
            return positions, positions
        if self._rows_on_device is None:
            self._rows_on_device = torch.from_numpy(self._rows).to(self.device)
        return self._rows_on_device.index_select(0, positions), positions

    def subset(self, index: np.ndarray) -> EmbeddingDataset:
        """A view of some of this dataset's rows (ascending positions or a boolean mask), sharing storage."""
        index = np.asarray(index)
        index = np.flatnonzero(index) if index.dtype == bool else index.astype(np.int64)
        if len(index) > 1 and np.any(np.diff(index) <= 0):
            raise ValueError("subset positions must be ascending and distinct")
        rows = index if self._rows is None else self._rows[index]
        labels = None
        if self.labels is not None:
            labels = self.labels.index_select(0, torch.from_numpy(index).to(self.labels.device))
        view = type(self)(self._store, self.source, self._n_all, rows, labels, self.classes, self.ids.take(index),
                                self.keys[index] if len(self.keys) else self.keys, self.tids[index],
                                dict(self.stats, rows=len(index)), self.seed, self.window_rows)
        return view

    def split_by_key(self, val_fraction: float) -> tuple[EmbeddingDataset, EmbeddingDataset]:
        """(training view, validation view) by the deterministic split rule (see Split)."""
        if len(self.keys) != len(self):
            raise ValueError("this dataset was read without split keys")
        val = Split.is_val(self.keys, val_fraction)
        return self.subset(~val), self.subset(val)

    def with_cache(self, cache: str) -> EmbeddingDataset:
        """The same rows with the vectors copied to another tier ("gpu" or "ram"), without reading
        the table again."""
        if isinstance(self._store, _StreamStore) or cache not in ("gpu", "ram"):
            raise InputError("with_cache copies from the gpu or ram tier to the gpu or ram tier")
        x, dev = self._store.x, self._store.device
        nbytes = x.numel() * x.element_size()
        if choose_tier(cache, dev, nbytes, rows=x.shape[0]) != cache:
            raise InputError(f"cache {cache!r} on {dev}")
        if cache == "gpu":
            store: _Store = _DeviceStore(x.to(dev), dev, self._store.threads)
        else:
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=dev.type == "cuda")
            host.copy_(x)
            store = _HostStore(host, dev, self._store.threads)
        return type(self)(store, self.source, self._n_all, self._rows, self.labels, self.classes, self.ids,
                                self.keys, self.tids, dict(self.stats), self.seed, self.window_rows)

    def vectors(self) -> torch.Tensor:
        """This dataset's vectors in its order, where the tier keeps them (the stream tier reads them)."""
        if isinstance(self._store, _StreamStore):
            return self._store._window(self._rows if self._rows is not None else np.arange(self._n_all))[1]
        x = self._store.x
        if self._rows is None:
            return x
        if x.device.type == "cpu":
            return host_take(x, self._rows, threads=self._store.threads)
        return x.index_select(0, torch.from_numpy(self._rows).to(x.device))

    def close(self) -> None:
        self._store.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.source.table!r}, rows={len(self)}, dim={self.dim}, cache={self.cache!r}, "
                f"device={str(self.device)!r}, label={self.source.label!r})")

    def _order(self, epoch: int, shuffle: bool) -> np.ndarray:
        """The epoch's order on the host, computed on a side thread one epoch ahead (on the dataset's GPU
        where it has one: 10M rows take ~0.4 s of a CPU core, milliseconds there)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="embedfleet-order")
        n, seed, w, dev = len(self), self.seed, self.window_rows, self.device

        def compute(e):
            if dev.type != "cuda":
                return ordering.epoch_order(n, seed, e, ordering.BLOCK_ROWS, w, shuffle)
            with torch.cuda.device(dev), torch.cuda.stream(torch.cuda.Stream(dev)):  # not behind the training's work
                return ordering.epoch_order(n, seed, e, ordering.BLOCK_ROWS, w, shuffle, device=dev).cpu().numpy()

        key = (epoch, shuffle)
        fut = self._orders.get(key) or self._pool.submit(compute, epoch)
        self._orders = {key: fut}
        if shuffle:
            self._orders[(epoch + 1, shuffle)] = self._pool.submit(compute, epoch + 1)
        return fut.result()


class EmbeddingDataset(TableDataset):
    """A table's vector column and label: TableDataset with its default features (the signature it has
    always had)."""

    @classmethod
    def from_table(cls, table: str, label: str | None = None, where: str | None = None, db: str | None = None,
                   cache: str = "auto", device: str | torch.device = "auto", split: str | Split | None = None,
                   dtype=None, *, task: str | None = None, seed: int = 0, window_rows: int | None = None,
                   connections: int | None = None, settings: Settings | None = None) -> EmbeddingDataset:
        return load(table, label=label, where=where, db=db, cache=cache, device=device, split=split, dtype=dtype,
                    task=task, seed=seed, window_rows=window_rows, connections=connections,
                    settings=settings or Settings.from_env(), cls=cls)


class _Sample(tuple):
    """One row of a `_Batch`, as a TensorDataset's row is: (x_i, y_i) or (x_i,)."""


class _Batch(abc.Sequence):
    """Rows gathered at once by `__getitems__`: a sequence of samples to whoever iterates it, and to
    DataLoader's default collate the batch tensors themselves (no per-row stack)."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]):
        self.tensors = tensors

    def __len__(self) -> int:
        return self.tensors[0].shape[0]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return _Batch(tuple(t[i] for t in self.tensors))
        return _Sample(t[i] for t in self.tensors)


def _collate(batch, *, collate_fn_map=None):
    """default_collate of `_Sample`s: a whole `_Batch` as its tensors; other lists of them stacked."""
    if isinstance(batch, _Batch):
        return list(batch.tensors)
    return [torch.stack(list(col)) for col in zip(*batch)]


def _register_collate() -> None:
    from torch.utils.data._utils.collate import default_collate_fn_map  # torch's documented extension point

    default_collate_fn_map[_Sample] = _collate


_register_collate()


def _local_world() -> int:
    import os

    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def load(table: str, label: str | None = None, where: str | None = None, db: str | None = None,
         cache: str = "auto", device: str | torch.device = "auto", split: str | Split | None = None, dtype=None,
         task: str | None = None, seed: int = 0, window_rows: int | None = None, connections: int | None = None,
         keys: bool = False, null_labels: str = "skip", classes: Sequence | None = None,
         settings: Settings | None = None, features: Sequence[str] | None = None, fill_null=None,
         id_field: str | None = None, cls: type = TableDataset) -> TableDataset:
    """TableDataset.from_table with the knobs the trainer and predict use: `keys` reads each
    row's split key (for `split_by_key`), `null_labels="keep"` keeps rows without a label (class
    -1, or NaN), `classes` fixes the class list (a saved head's)."""
    from embedfleet.pg.embedded import resolve_dsn
    from embedfleet.pg.connect import connect

    if cache not in TIERS:
        raise InputError(f"cache {cache!r} (--tier): use {', '.join(TIERS)}")
    if isinstance(split, str):
        split = Split(split)
    dev = resolve_device(device)
    settings = settings or Settings.from_env()
    dsn = resolve_dsn(db, settings)
    threads = gather_threads(settings)
    with connect(dsn) as conn:
        source = describe(conn, table, label, where, task, features, fill_null, id_field)
    torch_dtype = resolve_dtype(dtype, source.vtype)
    connections = connections or default_connections(settings)
    dist = _dist()
    world = dist.get_world_size() if dist else 1
    rank = dist.get_rank() if dist else 0
    t0 = time.perf_counter()
    reader, plan, error = None, None, None
    if rank == 0:
        try:
            reader = TableRead(dsn, source, split, null_labels, connections, classes=classes, with_keys=keys)
            plan = reader.plan(parts=connections * world)
        except Exception as e:  # noqa: BLE001 - every rank raises it (no rank may wait on a collective)
            error = e
    if world > 1:
        box = [error, plan, reader.snapshot if reader else None]
        dist.broadcast_object_list(box, src=0)
        error, plan, snapshot = box
        if rank != 0 and error is None:
            try:
                reader = TableRead(dsn, source, split, null_labels, connections, snapshot=snapshot,
                                   classes=plan.classes, with_keys=keys)
            except Exception as e:  # noqa: BLE001
                error = e
        error = _agree(error)  # also: every rank has imported the snapshot before rank 0 moves on
    if error is not None:
        if reader is not None:
            reader.close()
        raise error
    n = plan.n
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    tier = choose_tier(cache, dev, n * source.dim * itemsize, _local_world(), rows=n)
    if dist and world > 1:
        tiers = [None] * world
        dist.all_gather_object(tiers, tier)  # one rank's memory may not fit what another's does
        order = ["stream", "ram", "gpu"]
        tier = min(tiers, key=order.index)
    cols, x = None, None
    try:
        if tier == "gpu":
            x = torch.empty((n, source.dim), dtype=torch_dtype, device=dev)
        elif tier == "ram":
            x = torch.empty((n, source.dim), dtype=torch_dtype, pin_memory=dev.type == "cuda")
        mine = ordering.shard_bounds(len(plan.ranges), rank, world)
        cols = reader.read(plan, make_put(x) if x is not None else None, range(*mine))
    except torch.OutOfMemoryError:
        error = InputError(f"{n:,} vectors of {source.dim} dimensions do not fit the {tier} tier; "
                           "use cache 'stream' or 'auto'")
    except Exception as e:  # noqa: BLE001 - every rank raises it
        error = e
    if world > 1:
        error = _agree(error)
    if error is not None:
        reader.close()
        raise error
    if world > 1:
        _share(plan, cols, x, dev, world)
    # the stream tier reads the features only in its windows, and a float4[] (no pgvector) refuses no NaN on the
    # way: check them now
    check = bool(source.features) and (x is None or source.transport == "array")
    if check and rank == 0:
        error = reader.check_features()
    if world > 1 and check:
        error = _agree(error)
    if error is not None:
        reader.close()
        raise error
    if x is None:
        reader.keep_first()
        store: _Store = _StreamStore(reader, cols.tids, source.dim, torch_dtype, dev, threads)
    else:
        reader.close()
        store = _DeviceStore(x, dev, threads) if tier == "gpu" else _HostStore(x, dev, threads)
    labels = None
    if cols.labels is not None:
        y = torch.from_numpy(cols.labels if source.task == "classify" else cols.labels.astype(np.float32))
        labels = y.to(dev)
    seconds = time.perf_counter() - t0
    stats = {"rows": n, "skipped_null_label": plan.skipped_null_label, "skipped_null_vector": plan.skipped_null_vector,
             "read_s": round(seconds, 3), "plan_s": round(plan.seconds, 3),
             "rows_per_s": round(n / seconds) if seconds > 0 else None,
             "connections": connections * world, "bytes": n * source.dim * itemsize}
    window = window_rows or ordering.default_window_rows(source.dim)
    if window % ordering.BLOCK_ROWS:
        raise InputError(f"window_rows {window}: use a multiple of {ordering.BLOCK_ROWS}")
    log.debug("read %s: %s", table, stats)
    return cls(store, source, n, None, labels, plan.classes, cols.ids, cols.keys, cols.tids, stats, seed, window)


def _agree(error: BaseException | None) -> BaseException | None:
    """Every rank learns whether any rank failed (the first failure), so none waits on the others."""
    dist = _dist()
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


def _share(plan: Plan, cols: Columns, x: torch.Tensor | None, device: torch.device, world: int) -> None:
    """Each rank read a contiguous share of the ranges: broadcast every share to every rank."""
    dist = _dist()
    nccl = dist.get_backend() == "nccl"
    offsets = plan.offsets + [plan.n]
    pieces: list = [None] * world
    for q in range(world):
        a, b = ordering.shard_bounds(len(plan.ranges), q, world)
        lo, hi = offsets[a], offsets[b]
        arrays = [torch.from_numpy(cols.tids.view(np.int64)[lo:hi])]
        if len(cols.keys):
            arrays.append(torch.from_numpy(cols.keys.view(np.int32)[lo:hi]))
        if cols.labels is not None:
            arrays.append(torch.from_numpy(cols.labels[lo:hi]))
        if x is not None:
            arrays.append(x[lo:hi])
        for t in arrays:
            _broadcast_into(t, q, device if nccl else torch.device("cpu"))
        box = [cols.ids if dist.get_rank() == q else None]
        dist.broadcast_object_list(box, src=q)
        pieces[q] = box[0]
    cols.ids = Ids.concat(pieces)


def _broadcast_into(t: torch.Tensor, src: int, comm: torch.device, chunk_bytes: int = 256 << 20) -> None:
    """Broadcast `t` (a slice, filled on rank `src`) in place, through `comm` when `t` lives elsewhere."""
    dist = _dist()
    if t.numel() == 0:
        return
    if t.device == comm:
        dist.broadcast(t, src)
        return
    rows = max(1, chunk_bytes // max(1, t[0].numel() * t.element_size()))
    for a in range(0, t.shape[0], rows):
        part = t[a:a + rows]
        stage = part.to(comm) if dist.get_rank() == src else torch.empty_like(part, device=comm)
        dist.broadcast(stage, src)
        if dist.get_rank() != src:
            part.copy_(stage)
