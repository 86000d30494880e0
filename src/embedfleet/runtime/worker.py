"""The worker loop — the whole pipeline of one device, start to finish.

    claim chunk (ledger) → read records → template/sanitize/join meta   [records thread]
    → tokenize (the encoder's process pool)                             [tokenizer thread]
    → forward pass, pooling, normalisation on the device                [main thread]
    → COPY rows + rejects + chunk progress in one transaction            [writer threads]

The stages overlap through bounded queues, so the GPU works while the next chunk is read
and tokenized and the previous one is written. A worker is stateless: it needs only the job name
and the database, so the local launcher, a Ray actor or `embedfleet worker` on another host all run
this same loop against the same ledger, and a faster GPU simply claims more chunks.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import orjson

from embedfleet.config import JobConfig
from embedfleet.errors import EmbedfleetError, JobError
from embedfleet.records import to_records
from embedfleet.sources import read_chunk
from embedfleet.sources.plan import ChunkSpec
from embedfleet.sources.presets import get_preset
from embedfleet.store.ledger import Claim, Ledger, connect
from embedfleet.store.schema import ensure_table, vector_type
from embedfleet.store.writer import TableSink, Unit, Writer

log = logging.getLogger("embedfleet.worker")


@dataclass
class Stats:
    rows: int = 0
    tokens: int = 0
    embed_seconds: float = 0.0  # time the main thread spent queuing forward passes and reading results
    wait_seconds: float = 0.0  # time the main thread waited for the prefetch thread
    sink_wait_seconds: float = 0.0  # time the main thread waited for the writer (back-pressure)
    read_seconds: float = 0.0  # records thread: claiming, reading, templating
    tokenize_seconds: float = 0.0  # tokenizer thread: handing texts to the tokenizer and back
    state: str = "starting"


# ---- stage 1: claim, read, build records, tokenize (prefetch thread) -----------------------------


def chunk_units(claim: Claim, cfg: JobConfig, preset, meta_lookup) -> Iterator[Unit]:
    """Cut one claimed chunk into units of about `chunk_bytes` of input, each ready for the GPU.
    A plain JSONL chunk is a single unit; a compressed stream commits every `chunk_bytes` so a
    crash in a huge .gz file resumes from its last commit (the chunk's `cursor_line`)."""
    spec = ChunkSpec(claim.source, claim.kind, claim.start, claim.end, claim.first_line)
    group, size, cursor = [], 0, claim.cursor_line
    pending: Unit | None = None  # one unit of look-ahead, to know which one is the last
    for raw in read_chunk(spec, after_line=claim.cursor_line):
        if claim.last_line is not None and raw.line > claim.last_line:
            break
        group.append(raw)
        size += len(raw.raw) + 1
        cursor = raw.line
        if size >= cfg.chunk_bytes:
            if pending is not None:
                yield pending
            pending = _make_unit(claim, group, cursor, cfg, preset, meta_lookup)
            group, size = [], 0
    if group or pending is None:
        if pending is not None:
            yield pending
        pending = _make_unit(claim, group, cursor, cfg, preset, meta_lookup)
    pending.last = True
    yield pending


def _make_unit(claim, raws, cursor, cfg, preset, meta_lookup) -> Unit:
    records, rejects = to_records(
        raws, preset, template=cfg.text_template, text_field=cfg.text_field, id_field=cfg.id_field,
        meta_lookup=meta_lookup,
    )
    return Unit(claim, records, rejects, cursor_line=cursor, last=False)


def tokenized(units: Iterator[Unit], encoder, prompt: str | None, stats: Stats) -> Iterator[Unit]:
    """Stage 1b: tokenize each unit (in the encoder's process pool) while stage 1a reads the next."""
    for unit in units:
        if unit.records:
            t0 = time.perf_counter()
            unit.tok = encoder.tokenize([r.content for r in unit.records], prompt=prompt)
            unit.tokens = unit.tok.num_tokens
            stats.tokenize_seconds += time.perf_counter() - t0
        yield unit


def timed(gen: Iterator, stats: Stats) -> Iterator:
    """Count the time a generator spends producing each item as the records stage's busy time."""
    while True:
        t0 = time.perf_counter()
        item = next(gen, None)
        stats.read_seconds += time.perf_counter() - t0
        if item is None:
            return
        yield item


def produce_units(dsn: str, job: str, worker: str, cfg: JobConfig, meta_id: str | None,
                  on_fail) -> Iterator[Unit]:
    """Claim chunks until none is left, yielding their units. Waits (without claiming) while other
    workers still hold chunks, since a dead one's chunks come back when its lease expires."""
    conn = connect(dsn)
    ledger = Ledger(conn)
    preset = get_preset(cfg.preset)

    def meta_lookup(keys):
        return ledger.meta_lookup(meta_id, keys) if meta_id else {}

    try:
        while True:
            claim = ledger.claim(job, worker, cfg.lease_seconds)
            if claim is None:
                if ledger.counts(job)["running"] == 0:
                    return
                time.sleep(min(2.0, cfg.lease_seconds / 4))
                continue
            try:
                yield from chunk_units(claim, cfg, preset, meta_lookup if cfg.meta else None)
            except Exception as e:  # unreadable file, decompression error…: the chunk fails, the job goes on
                on_fail(claim, e)
    finally:
        conn.close()


class Prefetch:
    """Runs a generator on a thread, `depth` items ahead. Exceptions re-raise in the consumer."""

    _END = object()

    def __init__(self, gen: Iterator, depth: int = 2):
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, args=(gen,), name="embedfleet-prefetch", daemon=True)
        self._thread.start()

    def _run(self, gen):
        try:
            for item in gen:
                self._q.put(item)
            self._q.put(self._END)
        except BaseException as e:
            self._q.put(e)

    def ready(self) -> bool:
        """Whether the next item is already waiting (taking it will not block)."""
        return not self._q.empty()

    def __iter__(self):
        while (item := self._q.get()) is not self._END:
            if isinstance(item, BaseException):
                raise item
            yield item


# ---- liveness: lease renewal and the per-worker row the progress display reads --------------------


class Heartbeat(threading.Thread):
    def __init__(self, dsn: str, job: str, worker: str, device: str, lease: float, stats: Stats):
        super().__init__(name="embedfleet-heartbeat", daemon=True)
        self.ledger = Ledger(connect(dsn))
        self.job, self.worker, self.device, self.lease, self.stats = job, worker, device, lease, stats
        self._halt = threading.Event()
        self._gpu = _gpu_util_reader(device)

    def beat(self) -> None:
        self.ledger.renew(self.job, self.worker, self.lease)
        s = self.stats
        self.ledger.worker_beat(self.job, self.worker, self.device, s.state, s.rows, s.tokens, self._gpu())

    def run(self) -> None:
        while not self._halt.wait(min(5.0, self.lease / 3)):
            try:
                self.beat()
            except Exception as e:  # a missed beat is not fatal; the lease is three beats long
                log.warning("heartbeat failed: %s", e)

    def stop(self) -> None:
        self._halt.set()
        self.join()
        try:
            self.beat()
        finally:
            self.ledger.conn.close()


def _gpu_util_reader(device: str):
    """GPU utilisation (%) of this worker's device via NVML, or a reader returning None."""
    if not device.startswith("cuda"):
        return lambda: None
    try:
        import pynvml

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")
        local = int(device.split(":")[1]) if ":" in device else 0
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible[local]))
        return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:
        return lambda: None


# ---- the loop ------------------------------------------------------------------------------------


def run_worker(job: str, dsn: str, worker: str, device: str = "auto") -> Stats:
    from embedfleet.encode.encoder import Encoder

    conn = connect(dsn)
    ledger = Ledger(conn)
    row = ledger.job(job)
    if row is None:
        raise JobError(f"no job {job!r} in this database; start it with `embedfleet ingest`")
    cfg = JobConfig.from_json(row["config"])
    preset = get_preset(cfg.preset)
    encoder = Encoder(cfg.model, device=device, batch_tokens=cfg.batch_tokens, dim=cfg.dim)
    vtype = vector_type(conn, cfg.dtype)
    ensure_table(conn, cfg.table, preset.columns, encoder.dim, vtype)
    ledger.set_model(job, encoder.name, encoder.dim)

    stats = Stats()
    failed: set = set()  # claim tokens whose chunk failed: their remaining units are dropped

    def on_fail(claim: Claim, err: BaseException) -> None:
        failed.add(claim.token)
        state = ledger.fail(claim, f"{type(err).__name__}: {err}")
        log.error("worker %s: chunk %d (%s) failed, now %s: %s", worker, claim.chunk, claim.source, state, err)

    done_lock = threading.Lock()  # writer threads report concurrently

    def on_done(unit: Unit, inserted: int) -> None:
        with done_lock:
            stats.rows += len(unit.records)
            stats.tokens += unit.tokens

    heartbeat = Heartbeat(dsn, job, worker, encoder.device, cfg.lease_seconds, stats)
    heartbeat.start()
    writer = Writer(lambda: TableSink(connect(dsn), cfg.table, preset.columns, vtype, job),
                    on_error=lambda u, e: on_fail(u.claim, e), on_done=on_done)
    encoder.warmup()  # tokenizer processes, kernel compilation: start-up, not throughput
    t_start = time.perf_counter()

    def finish(unit: Unit, handle) -> None:
        """Read a unit's vectors (waiting for the device if needed) and hand it to the writer."""
        t0 = time.perf_counter()
        try:
            unit.embeddings = handle.result() if handle is not None else None
        except Exception as e:
            on_fail(unit.claim, e)
            return
        finally:
            stats.embed_seconds += time.perf_counter() - t0
        unit.tok = None  # free the token arrays before the unit waits in the writer queue
        t0 = time.perf_counter()
        writer.submit(unit)
        stats.sink_wait_seconds += time.perf_counter() - t0

    try:
        records = Prefetch(timed(produce_units(dsn, job, worker, cfg, row["meta_id"], on_fail), stats))
        ahead = Prefetch(tokenized(iter(records), encoder, cfg.prompt, stats))
        units = iter(ahead)
        pending = None  # (unit, handle) queued on the device whose result is not read yet
        while True:
            if pending is not None and not ahead.ready():
                # Nothing to overlap with: commit now. (Holding it could also stall our own
                # producer, which waits for this chunk to finish before ending.)
                finish(*pending)
                pending = None
            stats.state = "waiting for input"
            t0 = time.perf_counter()
            unit = next(units, None)
            stats.wait_seconds += time.perf_counter() - t0
            if unit is None:
                break
            if unit.claim.token in failed:
                continue  # the rest of a chunk that failed; it is retried from its last commit
            stats.state = f"chunk {unit.claim.chunk}"
            t0 = time.perf_counter()
            try:
                handle = encoder.embed_async(unit.tok) if unit.records else None
            except Exception as e:
                on_fail(unit.claim, e)
                continue
            finally:
                stats.embed_seconds += time.perf_counter() - t0
            # Unit k+1 is queued on the device before unit k's result is read: no idle gap.
            if pending is not None:
                finish(*pending)
            pending = (unit, handle)
        if pending is not None:
            finish(*pending)
        writer.close()
    finally:
        stats.state = "finished"
        heartbeat.stop()
        encoder.close()
        conn.close()
    wall = time.perf_counter() - t_start
    summary = {
        "worker": worker, "device": encoder.device, "rows": stats.rows, "tokens": stats.tokens,
        "wall_s": round(wall, 3), "rows_per_s": round(stats.rows / wall, 1) if wall else 0.0,
        "embed_s": round(stats.embed_seconds, 3), "input_wait_s": round(stats.wait_seconds, 3),
        "db_s": round(writer.db_seconds, 3), "sink_wait_s": round(stats.sink_wait_seconds, 3),
        "read_s": round(stats.read_seconds, 3), "tokenize_s": round(stats.tokenize_seconds, 3),
    }
    if not cfg.quiet:  # one parseable line per worker (bench/ingest.py reads them)
        print("embedfleet-worker-summary " + orjson.dumps(summary).decode(), file=sys.stderr, flush=True)
    return stats


def main(argv: list[str] | None = None) -> int:
    """`python -m embedfleet.runtime.worker` — what the local launcher starts, one per device."""
    p = argparse.ArgumentParser(prog="embedfleet-worker")
    p.add_argument("--job", required=True)
    p.add_argument("--db", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--device", default="auto")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run_worker(a.job, a.db, a.worker_id, a.device)
    except EmbedfleetError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
