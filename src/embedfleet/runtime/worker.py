"""The worker loop — the whole pipeline of one device, start to finish.

    claim chunks (ledger), up to three ahead                             [claims thread]
    → keep every helper busy, collect prepared units in claim order      [records thread]
    → read, template/sanitize/join meta, tokenize, encode COPY rows      [helper processes, units.py]
    → forward pass, pooling, normalisation on the device                 [main thread]
    → COPY rows + vectors, rejects, chunk progress in one transaction    [writer threads]

The stages overlap through bounded queues, so the GPU works while the next units are prepared
and the previous ones are written; the per-row Python work runs in the helpers, so this process
only launches kernels and streams COPY buffers. A worker is stateless: it needs only the job name
and the database, so the local launcher, a Ray actor or `embedfleet worker` on another host all run
this same loop against the same ledger, and a faster GPU simply claims more chunks.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import queue
import sys
import threading
import time
from collections import deque
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Iterator

import orjson

from embedfleet.config import JobConfig, default_chunk_bytes, env_float, env_int
from embedfleet.errors import EmbedfleetError, JobError
from embedfleet.encode.tokenize import tokenizer_spec
from embedfleet.runtime.units import Task, UnitContext, UnitPool, settle_gc, stream_tasks
from embedfleet.sources.plan import ChunkSpec
from embedfleet.sources.presets import get_preset
from embedfleet.store.ledger import Claim, Ledger, connect, process_started
from embedfleet.store.schema import ensure_table, vector_type
from embedfleet.store.writer import TableSink, Unit, Writer, default_writers

log = logging.getLogger("embedfleet.worker")


@dataclass
class Stats:
    rows: int = 0
    tokens: int = 0
    embed_seconds: float = 0.0  # time the main thread spent queuing forward passes and reading results
    wait_seconds: float = 0.0  # time the main thread waited for the prefetch thread
    sink_wait_seconds: float = 0.0  # time the main thread waited for the writer (back-pressure)
    read_seconds: float = 0.0  # records thread: waiting for claims (and streams read with them), for prepared units
    claim_seconds: float = 0.0  # claims thread: claiming chunks from the ledger (a query each)
    collect_seconds: float = 0.0  # records thread: waiting for the oldest unit in preparation, reading it
    helper_seconds: float = 0.0  # helpers' wall time preparing units (over helpers × wall: how busy they were)
    helper_cpu_seconds: float = 0.0  # and their CPU time (below helper_seconds when helpers share cores)
    state: str = "starting"


# ---- stage 1: claim chunks, have their units prepared (claims, records threads + helper processes) 


def claimed_tasks(ledger: Ledger, job: str, worker: str, cfg: JobConfig, unit_bytes: int, on_fail,
                  stats: Stats) -> Iterator:
    """(claim, task) pairs until no chunk is left, and None whenever nothing can be claimed right
    now (the caller then finishes what it has in flight: those chunks count as running too). Keeps
    looking while chunks are still running: one of ours may fail and come back, and a dead worker's
    come back when its lease expires."""
    while True:
        t0 = time.perf_counter()
        claim = ledger.claim(job, worker, cfg.lease_seconds)
        stats.claim_seconds += time.perf_counter() - t0
        if claim is None:
            mine, others = ledger.running_split(job, worker)
            if mine + others == 0:
                return
            yield None
            # Ours are only waiting for our writer, and this wait is the job's tail: look again soon.
            time.sleep(0.02 if others == 0 else min(0.25, cfg.lease_seconds / 4))
            continue
        spec = ChunkSpec(claim.source, claim.kind, claim.start, claim.end, claim.first_line)
        if claim.kind == "jsonl":  # a byte range of about chunk_bytes: one unit, read by the helper
            yield claim, Task(spec, claim.cursor_line, claim.last_line)
            continue
        try:  # a stream: read here in order, committed every unit_bytes so a crash resumes from there
            for task in stream_tasks(spec, claim.cursor_line, claim.last_line, unit_bytes):
                yield claim, task
        except Exception as e:  # unreadable file, decompression error…: the chunk fails, the job goes on
            on_fail(claim, e)


class Throttle:
    """How many tasks the records thread keeps in preparation. It starts with every helper busy, as
    many prepared units waiting for the GPU, and two more queued (a helper that finishes starts on
    the next at once). Units are taken in claim order, so finished
    ones wait behind a slower one; with room for only a couple of them, helpers sat idle while the
    GPU loop was busy and the loop waited while they caught up (2 GPUs, MiniLM: 110k → 140k rows/s,
    bench/NOTES.md run 25b). Only when the GPU is the bottleneck — its loop has spent under 5% of
    the last second or so waiting for input — and prepared units queue up for it (the next one is
    waiting and the one after it is ready too) does the limit drop by one, down to two: claiming
    more chunks then would only leave other workers idle at the end of the job. Each time the GPU
    loop had to wait raises it by one. When the helpers are the bottleneck (small models) the limit
    stays up even though units sometimes arrive in bursts: shrinking then would idle helpers."""

    GPU_BOUND = 0.05  # recent share of the loop's time spent waiting for input, below which the GPU is the bottleneck
    MEMORY_S = 1.0  # how far back "recent" reaches (seconds)

    def __init__(self, helpers: int, most: int | None = None):
        self.most, self.least = (most or 2 * helpers + 2, 2) if helpers else (0, 0)
        self.limit = self.most
        self.waiting = 1.0  # moving average of the loop's share of time waiting for input
        self._sum = self._n = 0

    def feedback(self, waited: bool, backlog: int = 0, wait_s: float = 0.0, cycle_s: float = 0.0) -> None:
        """`waited`: the GPU loop found no unit ready; `backlog`: units ready when it looked;
        `wait_s` of `cycle_s`: how long it waited, out of the time since its previous unit."""
        if cycle_s > 0:  # averaged over time (about the last second), so a burst of quick units barely moves it
            keep = math.exp(-cycle_s / self.MEMORY_S)
            self.waiting = keep * self.waiting + (1 - keep) * min(1.0, wait_s / cycle_s)
        if waited:
            self.limit = min(self.most, self.limit + 1)
        elif backlog >= 2 and self.waiting < self.GPU_BOUND:
            self.limit = max(self.least, self.limit - 1)
        self._sum, self._n = self._sum + self.limit, self._n + 1

    @property
    def mean(self) -> float:
        return self._sum / self._n if self._n else float(self.limit)


def produce_units(dsn: str, job: str, worker: str, cfg: JobConfig, unit_bytes: int, pool: UnitPool,
                  throttle: Throttle, on_fail, stats: Stats) -> Iterator[Unit]:
    """Units in claim order, prepared up to `throttle.limit` tasks ahead on the pool's helpers."""
    conn = connect(dsn)
    # A claim is a commit. Made durable, it would wait for the server to flush all the WAL written
    # before it — the writers' rows, hundreds of MB a second: claims took 4-13 ms each on 2 GPUs
    # (bench/NOTES.md run 36). A claim lost in a server crash is harmless: WAL is flushed in order,
    # so no later commit of that chunk's rows survives without it; the chunk is simply pending again.
    conn.execute("SET synchronous_commit = off")
    ledger = Ledger(conn)
    window: deque = deque()  # (claim, task, future), oldest first
    # Claims come from their own thread, up to three ahead (two queued, one in hand): a query waited
    # for here would hold back both the next unit for the GPU and the next task for an idle helper.
    # At the job's end those few chunks are this worker's, like the tasks in its window.
    claims = Prefetch(claimed_tasks(ledger, job, worker, cfg, unit_bytes, on_fail, stats), depth=2,
                      name="embedfleet-claims")
    started: set = set()  # claim tokens whose chunk has gone to the GPU (marked in the ledger)

    def collect() -> Iterator[Unit]:
        claim, task, future = window.popleft()
        t0 = time.perf_counter()
        try:
            p = pool.result(future)
        except BrokenProcessPool as e:  # a helper died on this chunk (killed, out of memory): it is the culprit
            on_fail(claim, e)
            raise
        except Exception as e:  # a bad file in a helper: the chunk fails, the job goes on
            on_fail(claim, e)
            return
        finally:
            stats.collect_seconds += time.perf_counter() - t0
        stats.helper_seconds += p.busy_s
        stats.helper_cpu_seconds += p.cpu_s
        if claim.token not in started:
            started.add(claim.token)
            ledger.mark_started(claim)
        yield Unit(claim, p.rows, p.seen, p.rejects, p.cursor_line, task.last, p.tok.num_tokens, p.tok)

    try:
        for item in claims:
            if item is None:
                while window:
                    yield from collect()
                continue
            claim, task = item
            window.append((claim, task, pool.submit(task)))
            while len(window) > throttle.limit:
                yield from collect()
        while window:
            yield from collect()
    finally:
        conn.close()


def timed(gen: Iterator, stats: Stats) -> Iterator:
    """Count the time a generator spends producing each item as the records stage's busy time."""
    while True:
        t0 = time.perf_counter()
        item = next(gen, None)
        stats.read_seconds += time.perf_counter() - t0
        if item is None:
            return
        yield item


class Prefetch:
    """Runs a generator on a thread, `depth` items ahead. Exceptions re-raise in the consumer."""

    _END = object()

    def __init__(self, gen: Iterator, depth: int = 2, name: str = "embedfleet-prefetch"):
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._putting = 0
        self.cpu_s = 0.0  # the thread's CPU time, once it has finished
        self.blocked_s = 0.0  # time it waited for room: its items were ready before the consumer was
        self._thread = threading.Thread(target=self._run, args=(gen,), name=name, daemon=True)
        self._thread.start()

    def _run(self, gen):
        try:
            for item in gen:
                self._put(item)
            self.cpu_s = time.thread_time()
            self._q.put(self._END)
        except BaseException as e:
            self._q.put(e)

    def ready(self) -> bool:
        """Whether the next item is already waiting (taking it will not block)."""
        return not self._q.empty()

    def backlog(self) -> int:
        """Items ready: those queued, plus the one the producer holds while it waits for room."""
        return self._q.qsize() + self._putting

    def _put(self, item) -> None:
        self._putting = 1
        t0 = time.perf_counter()
        try:
            self._q.put(item)
        finally:
            self._putting = 0
            self.blocked_s += time.perf_counter() - t0

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
        self.beat()  # registered (live) before the first claim: others count this worker in their share
        while not self._halt.wait(min(5.0, self.lease / 3)):
            try:
                self.beat()
            except Exception as e:  # a missed beat is not fatal; the lease is three beats long
                log.warning("heartbeat failed: %s", e)

    def stop(self, summary: dict | None = None, error: str | None = None) -> None:
        """The last beat, then the worker's last word in the ledger: its summary, or the error it stopped on."""
        self._halt.set()
        self.join()
        try:
            self.beat()
            self.ledger.worker_ended(self.job, self.worker, "failed" if error else "finished", error, summary)
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
    t_begin, epoch_begin = time.perf_counter(), time.time()
    # Threads here mostly wait on the GPU, helpers and sockets; after each wait one must take the GIL
    # back from whichever thread is running Python, which by default may hold it 5 ms. A shorter
    # switch interval keeps those hand-offs (many per unit) from stalling the pipeline.
    sys.setswitchinterval(env_float("EMBEDFLEET_SWITCH_INTERVAL", 0.0005))
    conn = connect(dsn)
    ledger = Ledger(conn)
    row = ledger.job(job)
    if row is None:
        raise JobError(f"no job {job!r} in this database; start it with `embedfleet ingest`")
    cfg = JobConfig.from_json(row["config"])
    preset = get_preset(cfg.preset)
    # A measuring knob: the most tasks in preparation at once (0 or unset: 2 × helpers + 2).
    tasks_ahead = env_int("EMBEDFLEET_TASKS_AHEAD", 0, least=0) or None
    # The helpers (units.py) tokenize, so the encoder needs no tokenizer pool of its own. They start
    # (seconds: each imports and loads the tokenizer) while this process loads torch and the model.
    ctx = UnitContext(cfg.preset, cfg.text_template, cfg.text_field, cfg.id_field, tokenizer_spec(cfg.model, cfg.prompt),
                      dsn if cfg.meta else None, row["meta_id"] if cfg.meta else None)
    pool = UnitPool(ctx)
    helpers_ready = pool.start_in_background()
    try:
        t0 = time.perf_counter()
        from embedfleet.encode.encoder import Encoder

        torch_s = time.perf_counter() - t0
        encoder = Encoder(cfg.model, device=device, batch_tokens=cfg.batch_tokens, dim=cfg.dim, tokenizer_workers=0)
        vtype = vector_type(conn, cfg.dtype)
        ensure_table(conn, cfg.table, preset.columns, encoder.dim, vtype)
        ledger.set_model(job, encoder.name, encoder.dim)
    except BaseException:
        pool.close()
        raise

    stats = Stats()
    failed: set = set()  # claim tokens whose chunk failed: their remaining units are dropped

    def on_fail(claim: Claim, err: BaseException) -> None:
        if claim.token in failed:  # a later unit of a chunk already counted as failed
            return
        failed.add(claim.token)
        state = ledger.fail(claim, f"{type(err).__name__}: {err}")
        log.error("worker %s: chunk %d (%s) failed, now %s: %s", worker, claim.chunk, claim.source, state, err)

    done_lock = threading.Lock()  # writer threads report concurrently

    def on_done(unit: Unit, inserted: int) -> None:
        with done_lock:
            stats.rows += unit.rows.n
            stats.tokens += unit.tokens

    heartbeat = Heartbeat(dsn, job, worker, encoder.device, cfg.lease_seconds, stats)
    heartbeat.start()
    writers, writer_depth = default_writers(encoder.device)
    writers = env_int("EMBEDFLEET_WRITERS", writers)  # the launcher sets it to fit the server's connections
    writer_depth = env_int("EMBEDFLEET_WRITER_DEPTH", writer_depth)
    writer = Writer(lambda: TableSink(connect(dsn), cfg.table, preset.columns, vtype, job),
                    on_error=lambda u, e: on_fail(u.claim, e), on_done=on_done, threads=writers, depth=writer_depth,
                    spare=1 + (pool.workers if cfg.meta else 0))  # the claims' connection, the helpers' with --meta

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
        startup = {"imports_s": epoch_begin - (process_started(os.getpid()) or epoch_begin),
                   "torch_s": torch_s, "model_s": time.perf_counter() - t_begin - torch_s}
        t0 = time.perf_counter()
        startup["helpers_s"] = helpers_ready.result()  # started with the model load; usually ready by now
        startup["helpers_wait_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        encoder.warmup()  # kernel compilation: start-up, not throughput
        startup["warmup_s"] = time.perf_counter() - t0
        settle_gc()  # a full collection over torch's objects would stall the GPU loop (it holds the GIL)
        t_start, epoch_start = time.perf_counter(), time.time()
        cpu_start, loop_cpu_start = time.process_time(), time.thread_time()
        throttle = Throttle(pool.workers, tasks_ahead)
        unit_bytes = cfg.chunk_bytes or default_chunk_bytes("cpu" if encoder.device == "cpu" else "cuda")
        ahead = Prefetch(timed(produce_units(dsn, job, worker, cfg, unit_bytes, pool, throttle, on_fail, stats),
                               stats), depth=1)
        units = iter(ahead)
        pending = None  # (unit, handle) queued on the device whose result is not read yet
        t_cycle = time.perf_counter()
        while True:
            if pending is not None and not ahead.ready():
                # Nothing to overlap with: commit now. (Holding it could also stall our own
                # producer, which waits for this chunk to finish before ending.)
                finish(*pending)
                pending = None
            stats.state = "waiting for input"
            ready, backlog = ahead.ready(), ahead.backlog()
            t0 = time.perf_counter()
            unit = next(units, None)
            waited = time.perf_counter() - t0
            stats.wait_seconds += waited
            throttle.feedback(not ready, backlog, waited, time.perf_counter() - t_cycle)
            t_cycle = time.perf_counter()
            if unit is None:
                break
            if unit.claim.token in failed:
                continue  # the rest of a chunk that failed; it is retried from its last commit
            stats.state = f"chunk {unit.claim.chunk}"
            t0 = time.perf_counter()
            try:
                handle = encoder.embed_async(unit.tok) if unit.rows.n else None
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
        loop_cpu = time.thread_time() - loop_cpu_start
        writer.close()
    except BaseException as e:
        stats.state = "failed"
        heartbeat.stop(error=f"{type(e).__name__}: {e}"[:2000])
        raise
    finally:
        pool.close()
        encoder.close()
        conn.close()
    wall, cpu = time.perf_counter() - t_start, time.process_time() - cpu_start
    summary = {
        "worker": worker, "device": encoder.device, "rows": stats.rows, "tokens": stats.tokens,
        "wall_s": round(wall, 3), "rows_per_s": round(stats.rows / wall, 1) if wall else 0.0,
        "embed_s": round(stats.embed_seconds, 3), "input_wait_s": round(stats.wait_seconds, 3),
        "db_s": round(writer.db_seconds, 3), "sink_wait_s": round(stats.sink_wait_seconds, 3),
        "read_s": round(stats.read_seconds, 3), "claim_s": round(stats.claim_seconds, 3),
        "collect_s": round(stats.collect_seconds, 3), "records_blocked_s": round(ahead.blocked_s, 3),
        "helpers": pool.workers, "writers": writer.connections,
        "claims_ahead_mean": round(throttle.mean, 2), "claims_ahead_end": throttle.limit,
        "helper_busy_s": round(stats.helper_seconds, 3), "helper_cpu_s": round(stats.helper_cpu_seconds, 3),
        "cpu_s": round(cpu, 3),  # this process, all its threads (its helpers are in helper_cpu_s)
        "thread_cpu_s": {"loop": round(loop_cpu, 3), "records": round(ahead.cpu_s, 3),
                         "writers": round(writer.cpu_seconds, 3)},
        "started_at": round(epoch_start, 3),  # wall-clock start: to line several workers up
        "startup": {k: round(v, 3) for k, v in startup.items()},
    }
    stats.state = "finished"
    heartbeat.stop(summary)  # in the ledger (`ingest --json` shows it), not on the user's terminal
    log.debug("worker summary: %s", orjson.dumps(summary).decode())
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
        _record_failure(a.db, a.job, a.worker_id, str(e))
        return e.exit_code
    return 0


def _record_failure(dsn: str, job: str, worker: str, error: str) -> None:
    """A worker that could not start (model, device) says why in the ledger, where the launcher reads it."""
    try:
        with connect(dsn) as conn:
            Ledger(conn).worker_ended(job, worker, "failed", error)
    except EmbedfleetError:
        pass  # the database itself is what failed: the launcher reports the exit code


if __name__ == "__main__":
    sys.exit(main())
