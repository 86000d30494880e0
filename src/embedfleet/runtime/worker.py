"""The Worker — the whole pipeline of one device, start to finish.

    claim chunks (ledger), never more than this worker's share of what is left   [claims thread]
    → keep every helper busy, collect prepared units in claim order              [records thread]
    → read, template/sanitize/join meta, tokenize, encode COPY rows              [helper processes, units.py]
    → forward pass, pooling, normalisation on the device                         [main thread: the loop]
    → COPY rows + vectors, rejects, chunk progress in one transaction            [writer threads]

The stages overlap through bounded queues, so the GPU works while the next units are prepared and the
previous ones are written; the per-row Python work runs in the helpers, so this process only launches
kernels and streams COPY buffers. Whatever goes wrong with a chunk travels as a `Failure` value to the
loop, which alone records failures in the ledger.

A Worker is built from explicit settings and holds no state between jobs: the local launcher, a Ray
actor and `embedfleet worker` on any host construct the same object against the same ledger, and a
faster GPU simply claims more chunks. Its heavy parts can be swapped: `encoder=` (a test's HashEncoder:
no torch) and `helpers=` (the pool that prepares units).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import resource
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Callable, Iterator

import orjson

from embedfleet.bytecode import keep_bytecode
from embedfleet.config import JobConfig, Settings, default_chunk_bytes, use_settings
from embedfleet.encode.tokenize import tokenizer_spec
from embedfleet.errors import EmbedfleetError, JobError
from embedfleet.logs import setup_logging
from embedfleet.process import NOT_REGISTERED, die_with_parent, exit_now
from embedfleet.runtime.bound import run_queue_seconds
from embedfleet.runtime.flow import Prefetch, Throttle, by_tenth, timed
from embedfleet.runtime.gpu import gpu_reader
from embedfleet.runtime.heap import keep_freed_memory
from embedfleet.runtime.units import FIRST_TASK_BYTES, Task, UnitContext, UnitPool, settle_gc, stream_tasks, task_sizes
from embedfleet.sources.plan import ChunkSpec, id_root
from embedfleet.encode.passages import parse_passages
from embedfleet.sources.presets import table_columns
from embedfleet.store.ledger import Claim, Ledger, Reconnect, process_started
from embedfleet.store.schema import ensure_table, vector_type
from embedfleet.store.writer import Failure, TableSink, Unit, Writer, default_writers

__all__ = ["Worker", "Stats"]

log = logging.getLogger("embedfleet.worker")


def _no_durable_wait(conn) -> None:
    # A claim is a commit. Made durable, it would wait for the server to flush all the WAL written
    # before it — the writers' rows, hundreds of MB a second: claims took 4-13 ms each on 2 GPUs
    # (bench/NOTES.md run 36). A claim lost in a server crash is harmless: WAL is flushed in order,
    # so no later commit of that chunk's rows survives without it; the chunk is simply pending again.
    conn.execute("SET synchronous_commit = off")


@dataclass
class Stats:
    rows: int = 0
    tokens: int = 0
    embed_seconds: float = 0.0  # time the main thread spent queuing forward passes and reading results
    launch_seconds: float = 0.0  # the queuing part of it (the rest waits for the device)
    wait_seconds: float = 0.0  # time the main thread waited for the prefetch thread
    end_wait_seconds: float = 0.0  # of the last of those waits, the part spent on this worker's last commits
    tail_wait_seconds: float = 0.0  # and the rest: other workers' last chunks (one may fail and come back)
    tail_started: float = 0.0  # perf_counter when nothing was left to claim and only others' chunks were running
    waits: list = field(default_factory=list)  # (seconds into the loop, seconds): the first wait, then those >= 1 ms
    done: list = field(default_factory=list)  # (seconds into the loop, rows): each unit's result read
    loop_start: float = 0.0  # perf_counter at the loop's start
    loop_seconds: float = 0.0
    sink_wait_seconds: float = 0.0  # time the main thread waited for the writer (back-pressure)
    sink_waits: list = field(default_factory=list)  # (seconds into the loop, seconds): those >= 1 ms
    read_seconds: float = 0.0  # records thread: waiting for claims (and streams read with them), for prepared units
    claim_seconds: float = 0.0  # claims thread: claiming chunks from the ledger (a query each)
    collect_seconds: float = 0.0  # records thread: waiting for the oldest unit in preparation, reading it
    helper_seconds: float = 0.0  # helpers' wall time preparing units (over helpers × wall: how busy they were)
    helper_cpu_seconds: float = 0.0  # and their CPU time (below helper_seconds when helpers share cores)
    state: str = "starting"


# ---- stage 1: claim chunks, have their units prepared (claims, records threads + helper processes) 


def claimed_tasks(ledger: Ledger, job: str, worker: str, lease: float, unit_bytes: int, stats: Stats,
                  ramp: bool = True) -> Iterator:
    """(claim, task) pairs until no chunk is left; None whenever nothing can be claimed right now (the
    caller then finishes what it has in flight: those chunks count as running too); a Failure for a
    stream that cannot be read. Keeps looking while chunks are still running: one of ours may fail and
    come back, and a dead worker's come back when its lease expires. `ramp`: a worker's first stream
    units start small and grow (`task_sizes`), so a GPU, far quicker than a helper, starts sooner."""
    sizes = task_sizes(unit_bytes, FIRST_TASK_BYTES if ramp else None)
    while True:
        t0 = time.perf_counter()
        claim = ledger.claim(job, worker, lease)
        stats.claim_seconds += time.perf_counter() - t0
        if claim is None:
            mine, others = ledger.running_split(job, worker)
            if mine == 0 and others and not stats.tail_started:
                stats.tail_started = time.perf_counter()  # ours all committed: the job's tail, others' last chunks
            if mine + others == 0:
                return
            yield None
            # Ours are only waiting for our writer, and this wait is the job's tail: look again soon.
            time.sleep(0.02 if others == 0 else min(0.25, lease / 4))
            continue
        stats.tail_started = 0.0  # a chunk came back and is ours now: not the tail after all
        spec = ChunkSpec(claim.source, claim.kind, claim.start, claim.end, claim.first_line)
        if claim.kind == "jsonl":  # a byte range of about chunk_bytes: one unit, read by the helper
            sizes = itertools.repeat(unit_bytes)  # full units have gone out: no ramp after them
            yield claim, Task(spec, claim.cursor_line, claim.last_line)
            continue
        try:  # a stream: read here in order, committed every unit_bytes so a crash resumes from there
            for task in stream_tasks(spec, claim.cursor_line, claim.last_line, sizes):
                yield claim, task
        except Exception as e:  # unreadable file, decompression error…: the chunk fails, the job goes on
            yield Failure(claim, e)


def produce_units(claims: Iterator, pool: UnitPool, throttle: Throttle, stats: Stats,
                  started: Callable[[Claim], None], hungry: Callable[[], bool] = lambda: False) -> Iterator:
    """Units (or Failures) in claim order, prepared up to `throttle.limit` tasks ahead on the pool's helpers.
    `started(claim)` as a chunk's first unit goes out. A prepared unit goes out at once while the GPU loop
    is `hungry()` (has nothing queued), else once the window is full: otherwise a job's first unit waits
    for a window's worth of tasks read from a stream (bench/NOTES.md, run 77)."""
    window: deque = deque()  # (claim, task, future), oldest first
    begun: set = set()  # claim tokens whose chunk has gone to the GPU

    def collect() -> Iterator:
        claim, task, future = window.popleft()
        t0 = time.perf_counter()
        try:
            p = pool.result(future)
        except BrokenProcessPool as e:  # a helper died on this chunk (killed, out of memory): the culprit
            yield Failure(claim, e)
            raise
        except Exception as e:  # a bad file in a helper: the chunk fails, the job goes on
            yield Failure(claim, e)
            return
        finally:
            stats.collect_seconds += time.perf_counter() - t0
        stats.helper_seconds += p.busy_s
        stats.helper_cpu_seconds += p.cpu_s
        throttle.prepared(p.busy_s)
        if claim.token not in begun:
            begun.add(claim.token)
            started(claim)
        yield Unit(claim, p.rows, p.seen, p.rejects, p.cursor_line, task.last, p.tok.num_tokens, p.tok)

    for item in claims:
        if isinstance(item, Failure):
            yield item
            continue
        if item is None:
            while window:
                yield from collect()
            continue
        claim, task = item
        window.append((claim, task, pool.submit(task)))
        while window and (len(window) > throttle.limit or (window[0][2].done() and hungry())):
            yield from collect()
    while window:
        yield from collect()


# ---- liveness: lease renewal and the worker's row in the fleet view --------------------------------


class Heartbeat(threading.Thread):
    """Renews this worker's leases every third of a lease and publishes its state, rates and GPU gauges."""

    def __init__(self, ledger: Ledger, job: str, worker: str, device: str, lease: float, stats: Stats):
        super().__init__(name="embedfleet-heartbeat", daemon=True)
        self.ledger, self.job, self.worker, self.device, self.lease, self.stats = ledger, job, worker, device, lease, stats
        self._halt = threading.Event()
        self._gpu = gpu_reader(device)
        self._last = self._first = (time.monotonic(), 0, 0)

    def beat(self, whole_run: bool = False) -> None:
        """Renew, and publish rates since the last beat (`whole_run`: since the first, for the last word)."""
        self.ledger.renew(self.job, self.worker, self.lease)
        s, now = self.stats, time.monotonic()
        t0, rows0, tokens0 = self._first if whole_run else self._last
        dt = max(now - t0, 1e-9)
        gauges = {"rows_s": (s.rows - rows0) / dt, "tokens_s": (s.tokens - tokens0) / dt, **self._gpu()}
        self._last = (now, s.rows, s.tokens)
        self.ledger.worker_beat(self.job, self.worker, self.device, s.state, s.rows, s.tokens, gauges)

    def run(self) -> None:
        while not self._halt.wait(min(5.0, self.lease / 3)):
            try:
                self.beat()
            except Exception as e:  # a missed beat is not fatal; the lease is three beats long
                log.warning("heartbeat failed: %s", e)

    def stop(self, summary: dict | None = None, error: str | None = None) -> None:
        """The last beat, then the worker's last word in the ledger: its summary, or the error it stopped on."""
        self._halt.set()
        if self.is_alive():
            self.join()
        try:
            self.beat(whole_run=True)  # a finished worker's rows/s is its run's, as the job's is
            self.ledger.worker_ended(self.job, self.worker, "failed" if error else "finished", error, summary)
        finally:
            self.ledger.close()


# ---- the worker ----------------------------------------------------------------------------------


# Below this much input left, the compile costs more than eager steps lose (bench/NOTES.md, run 63).
COMPILE_MIN_BYTES = 32 << 20
# A small model's loop is bound by its host (helpers, writers), not by the glue the compile fuses:
# MiniLM's compiled loop was 8% faster, and compiling beside the loop cost it ~1.8 s (run 89), so the
# compile pays only past ~2.3M reviews (~1.3 GB of JSONL).
SMALL_COMPILE_MIN_BYTES = 1 << 30


def compile_pays(pending_bytes: int | None, small: bool = False) -> bool | None:
    """Whether a worker compiles (`Encoder.warmup`'s `compile`), given the job's input bytes left (None:
    not known, e.g. Parquet) and whether its model is small (`Encoder.small`): True, at once; for a
    big model's short job None, the encoder's own rule (once it has seen enough work); for a small
    model's, False: never. With an unknown size a big model compiles and a small one does not."""
    if pending_bytes is None:
        return not small
    if pending_bytes >= (SMALL_COMPILE_MIN_BYTES if small else COMPILE_MIN_BYTES):
        return True
    return False if small else None


def load_encoder(cfg: JobConfig, device: str, settings: Settings):
    """The real encoder for a job (imports torch): the helpers tokenize, so it needs no tokenizer pool."""
    from embedfleet.encode.encoder import Encoder

    return Encoder(cfg.model, device=device, batch_tokens=cfg.batch_tokens, dim=cfg.dim, tokenizer_workers=0)


class Worker:
    """One device's pipeline. `Worker(job, dsn, worker_id, device, settings).run()` embeds until no chunk
    of the job is left and returns its summary (also stored in the ledger)."""

    def __init__(self, job: str, dsn: str, worker_id: str, device: str = "auto", settings: Settings | None = None, *,
                 encoder: Callable[[JobConfig, str, Settings], object] | None = None,
                 helpers: Callable[[UnitContext, int | None], UnitPool] | None = None, registered_after: float = 0.0):
        self.job, self.dsn, self.id, self.device = job, dsn, worker_id, device
        self.registered_after = registered_after  # started early: seconds it waited for its registration
        self.settings = settings or Settings.from_env()
        self._make_encoder = encoder or load_encoder
        self._make_helpers = helpers or UnitPool
        self.stats = Stats()
        self._failed: set = set()  # claim tokens whose chunk failed: their remaining units are dropped

    def run(self) -> dict:
        s, t_begin = self.settings, time.perf_counter()
        epoch_begin = time.time()
        # Threads here mostly wait on the GPU, helpers and sockets; after each wait one must take the GIL
        # back from whichever thread is running Python, which by default may hold it 5 ms. A shorter
        # switch interval keeps those hand-offs (many per unit) from stalling the pipeline.
        sys.setswitchinterval(s.switch_interval)
        keep_freed_memory()  # each unit's buffers reuse the last one's pages instead of faulting in new ones
        use_settings(s)  # what the encoder reads deep down (compile, Triton, word cache): this worker's knobs
        ledger = Ledger.connect(self.dsn, s.db_patience_seconds, host=s.host_id)
        try:
            row = ledger.job(self.job)
            if row is None:
                raise JobError(f"no job {self.job!r} in this database; start it with `embedfleet ingest`")
            cfg = JobConfig.from_json(row["config"])
            culprit, requeued = ledger.take_over(self.job, self.id)
            if culprit is not None or requeued:
                log.warning("worker %s: an earlier process under this name died; chunk %s counts a failure, "
                            "chunks %s re-queued", self.id, culprit, requeued)
            # The helpers start (seconds: each imports and loads the tokenizer) while this process loads the model.
            ctx = UnitContext(cfg.preset, cfg.text_template, cfg.text_field, cfg.id_field,
                              tokenizer_spec(cfg.model, cfg.prompt), self.dsn if cfg.meta else None,
                              row["meta_id"] if cfg.meta else None, s.db_patience_seconds, parse_passages(cfg.passages),
                              id_root(cfg.inputs), tuple(cfg.columns) if cfg.columns else None)
            pool = self._make_helpers(ctx, s.helpers)
            helpers_ready = pool.start_in_background()
            encoder = None
            try:
                t_model = time.perf_counter()
                encoder = self._make_encoder(cfg, self.device, s)
                model_s = time.perf_counter() - t_model
                vtype = vector_type(ledger.conn, cfg.dtype)
                ensure_table(ledger.conn, cfg.table, table_columns(cfg.preset, bool(cfg.passages), cfg.columns), encoder.dim, vtype,
                             cfg.partitions)
                ledger.set_model(self.job, encoder.name, encoder.dim)
                # The compile (from the cache after a machine's first run) starts now, beside the helpers'
                # start, unless the job is too small to pay for it; the loop starts eager beside it and
                # switches when it is ready (Settings.compile_wait: or waits for it).
                compile_first = compile_pays(ledger.pending_bytes(self.job), encoder.small)
                t0 = time.perf_counter()
                encoder.warmup(wait=False, compile=compile_first)
                warmup_s = time.perf_counter() - t0
            except BaseException:
                pool.close()
                if encoder is not None:
                    encoder.close()
                raise
            try:
                startup = {"imports_s": epoch_begin - (process_started(os.getpid()) or epoch_begin) - self.registered_after,
                           "registered_after_s": self.registered_after,
                           "model_s": model_s, "before_model_s": t_model - t_begin, "warmup_s": warmup_s}
                t0 = time.perf_counter()
                startup["helpers_s"] = helpers_ready.result()  # started with the model load; usually ready by now
                startup["helpers_wait_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                if s.compile_wait:
                    encoder.wait_compiled()
                startup["compile_wait_s"] = time.perf_counter() - t0  # what the loop waited for it
                settle_gc()  # a full collection over torch's objects would stall the GPU loop (it holds the GIL)
                startup["compile_first"], startup["compile_wait"] = compile_first, s.compile_wait
                return self._embed(ledger, cfg, pool, encoder, vtype, startup)
            finally:
                pool.close()
                encoder.close()
        finally:
            ledger.close()

    def _embed(self, ledger: Ledger, cfg: JobConfig, pool: UnitPool, encoder, vtype: str, startup: dict) -> dict:
        """Everything after start-up: the stages wired together, the loop, the summary."""
        s, stats = self.settings, self.stats
        device = "cpu" if encoder.device == "cpu" else "cuda"
        heartbeat = Heartbeat(Ledger.connect(self.dsn, s.db_patience_seconds, host=s.host_id), self.job, self.id, encoder.device,
                              s.lease_seconds, stats)
        heartbeat.beat()  # registered (live) before the first claim: others count this worker in their share
        heartbeat.start()
        try:
            writer = self._writer(cfg, encoder.device, vtype, spare=1 + (pool.workers if cfg.meta else 0))
            t_start, epoch_start = time.perf_counter(), time.time()
            cpu_start, loop_cpu_start = time.process_time(), time.thread_time()
            queued_start = run_queue_seconds(), run_queue_seconds(threading.get_native_id())
            usage_start = resource.getrusage(resource.RUSAGE_SELF)
            throttle = Throttle(pool.workers, s.tasks_ahead)
            records = Ledger.connect(self.dsn, s.db_patience_seconds, setup=_no_durable_wait, host=s.host_id)
            try:
                # Claims come from their own thread, a few ahead: a query waited for on the records thread
                # would hold back both the next unit for the GPU and the next task for an idle helper.
                claims = Prefetch(claimed_tasks(records, self.job, self.id, s.lease_seconds,
                                                cfg.chunk_bytes or default_chunk_bytes(device), stats,
                                                ramp=device == "cuda"),
                                  depth=2, name="embedfleet-claims")
                ahead = None  # a unit ready while the loop has none queued goes to it at once
                units = produce_units(iter(claims), pool, throttle, stats, records.mark_started,
                                      hungry=lambda: ahead is None or ahead.backlog() == 0)
                ahead = Prefetch(timed(units, stats), depth=1)
                self._loop(ahead, encoder, writer, ledger, throttle)
                loop_cpu = time.thread_time() - loop_cpu_start
                queued = run_queue_seconds(), run_queue_seconds(threading.get_native_id())
                usage = resource.getrusage(resource.RUSAGE_SELF)
                writer.close()
                self._record_failures(writer, ledger)
            finally:
                records.close()
        except BaseException as e:
            stats.state = "failed"
            heartbeat.stop(error=f"{type(e).__name__}: {e}"[:2000])
            raise
        wall, cpu = time.perf_counter() - t_start, time.process_time() - cpu_start
        summary = {
            "worker": self.id, "device": encoder.device, "rows": stats.rows, "tokens": stats.tokens,
            "wall_s": round(wall, 3), "rows_per_s": round(stats.rows / wall, 1) if wall else 0.0,
            "embed_s": round(stats.embed_seconds, 3), "launch_s": round(stats.launch_seconds, 3),
            "input_wait_s": round(stats.wait_seconds, 3),
            "end_wait_s": round(stats.end_wait_seconds, 3), "tail_wait_s": round(stats.tail_wait_seconds, 3),
            "first_wait_s": round(stats.waits[0][1] if stats.waits else 0.0, 3),
            "input_wait_by_tenth_s": by_tenth(stats.waits, stats.loop_seconds),
            "sink_wait_by_tenth_s": by_tenth(stats.sink_waits, stats.loop_seconds),
            "rows_by_tenth": [int(v) for v in by_tenth(stats.done, stats.loop_seconds)],
            "db_s": round(writer.db_seconds, 3), "sink_wait_s": round(stats.sink_wait_seconds, 3),
            "read_s": round(stats.read_seconds, 3), "claim_s": round(stats.claim_seconds, 3),
            "collect_s": round(stats.collect_seconds, 3), "records_blocked_s": round(ahead.blocked_s, 3),
            "helpers": pool.workers, "writers": writer.connections,
            "claims_ahead_mean": round(throttle.mean, 2), "claims_ahead_end": throttle.limit,
            "helper_busy_s": round(stats.helper_seconds, 3), "helper_cpu_s": round(stats.helper_cpu_seconds, 3),
            "cpu_s": round(cpu, 3),  # this process, all its threads (its helpers are in helper_cpu_s)
            "thread_cpu_s": {"loop": round(loop_cpu, 3), "records": round(ahead.cpu_s, 3),
                             "writers": round(writer.cpu_seconds, 3)},
            # seconds its threads were ready but waited for a CPU over the loop: the host short of CPUs
            "run_queue_s": {k: round(b - a, 3) for k, a, b in zip(("process", "loop"), queued_start, queued)
                            if a is not None and b is not None},
            # this process over the loop: page faults, and context switches waiting (voluntary) or preempted
            "rusage": {k: getattr(usage, f"ru_{k}") - getattr(usage_start, f"ru_{k}")
                       for k in ("minflt", "majflt", "nvcsw", "nivcsw")},
            "started_at": round(epoch_start, 3),  # wall-clock start: to line several workers up
            "startup": {k: round(v, 3) if isinstance(v, float) else v for k, v in startup.items()},
        }
        # A compile still going (a machine's first, longer than this job) ends before this worker says it
        # is finished: no GPU work of the job's outlives the command, and its graphs reach the cache.
        t0 = time.perf_counter()
        encoder.wait_compiled()
        summary["end_compile_wait_s"] = round(time.perf_counter() - t0, 3)
        summary["startup"]["compile"] = encoder.compile_report()  # how it ended: whether the cache served it
        stats.state = "finished"
        heartbeat.stop(summary)  # in the ledger (`ingest --json` shows it), not on the user's terminal
        log.debug("worker summary: %s", orjson.dumps(summary).decode())
        return summary

    def _writer(self, cfg: JobConfig, device: str, vtype: str, spare: int) -> Writer:
        s, stats = self.settings, self.stats
        writers, depth = default_writers(device)
        columns = table_columns(cfg.preset, bool(cfg.passages), cfg.columns)
        done_lock = threading.Lock()  # writer threads report concurrently

        def on_done(unit: Unit, inserted: int) -> None:
            with done_lock:
                stats.rows += unit.rows.n
                stats.tokens += unit.tokens

        return Writer(lambda conn: TableSink(conn, cfg.table, columns, vtype, self.job),
                      Reconnect(self.dsn, s.db_patience_seconds), on_done=on_done,
                      threads=s.writers or writers, depth=s.writer_depth or depth, spare=spare)

    def _loop(self, ahead: Prefetch, encoder, writer: Writer, ledger: Ledger, throttle: Throttle) -> None:
        """The main thread: queue unit k+1 on the device before reading unit k's result (no idle gap),
        hand results to the writer, and record every failure that reaches it."""
        stats = self.stats
        units = iter(ahead)
        pending = None  # (unit, handle) queued on the device whose result is not read yet
        t_cycle = t_loop = stats.loop_start = time.perf_counter()
        embedded = False  # whether the last cycle embedded a unit (the throttle's measure of the GPU's time)
        while True:
            if pending is not None and not ahead.ready():
                # Nothing to overlap with: commit now. (Holding it could also stall our own
                # producer, which waits for this chunk to finish before ending.)
                self._finish(*pending, writer, ledger)
                pending = None
            self._record_failures(writer, ledger)
            stats.state = "waiting for input"
            ready, backlog = ahead.ready(), ahead.backlog()
            t0 = time.perf_counter()
            item = next(units, None)
            waited = time.perf_counter() - t0
            stats.wait_seconds += waited
            if waited >= 1e-3 or not stats.waits:
                stats.waits.append((t0 - t_loop, waited))
            throttle.feedback(not ready, backlog, waited, time.perf_counter() - t_cycle, embedded)
            t_cycle, embedded = time.perf_counter(), False
            if item is None:
                stats.loop_seconds = t_cycle - t_loop
                # The loop's last wait: for its writers' backlog, then for other workers' last chunks.
                tail = min(waited, t_cycle - stats.tail_started) if stats.tail_started else 0.0
                stats.end_wait_seconds, stats.tail_wait_seconds = waited - tail, tail
                break
            if isinstance(item, Failure):
                self._fail(ledger, item)
                continue
            if item.claim.token in self._failed:
                continue  # the rest of a chunk that failed; it is retried from its last commit
            embedded = True
            stats.state = f"chunk {item.claim.chunk}"
            t0 = time.perf_counter()
            try:
                handle = encoder.embed_async(item.tok) if item.rows.n else None
            except Exception as e:
                self._fail(ledger, Failure(item.claim, e))
                continue
            finally:
                launched = time.perf_counter() - t0
                stats.launch_seconds += launched
                stats.embed_seconds += launched
            if pending is not None:
                self._finish(*pending, writer, ledger)
            pending = (item, handle)
        if pending is not None:
            self._finish(*pending, writer, ledger)

    def _finish(self, unit: Unit, handle, writer: Writer, ledger: Ledger) -> None:
        """Read a unit's vectors (waiting for the device if needed) and hand it to the writer."""
        t0 = time.perf_counter()
        try:
            unit.embeddings = handle.result() if handle is not None else None
        except Exception as e:
            self._fail(ledger, Failure(unit.claim, e))
            return
        finally:
            self.stats.embed_seconds += time.perf_counter() - t0
        self.stats.done.append((time.perf_counter() - self.stats.loop_start, unit.rows.n))
        unit.tok = None  # free the token arrays before the unit waits in the writer queue
        t0 = time.perf_counter()
        writer.submit(unit)
        waited = time.perf_counter() - t0
        self.stats.sink_wait_seconds += waited
        if waited >= 1e-3:
            self.stats.sink_waits.append((t0 - self.stats.loop_start, waited))

    def _record_failures(self, writer: Writer, ledger: Ledger) -> None:
        while not writer.failures.empty():
            self._fail(ledger, writer.failures.get())

    def _fail(self, ledger: Ledger, failure: Failure) -> None:
        """Count a failure against its chunk, once per claim (later units of that chunk fail too)."""
        claim, err = failure.claim, failure.error
        if claim.token in self._failed:
            return
        self._failed.add(claim.token)
        state = ledger.fail(claim, f"{type(err).__name__}: {err}")
        log.error("worker %s: chunk %d (%s) failed, now %s: %s", self.id, claim.chunk, claim.source, state, err)


def main(argv: list[str] | None = None) -> int:
    """`python -m embedfleet.runtime.worker` — what the local launcher starts, one per device."""
    p = argparse.ArgumentParser(prog="embedfleet-worker")
    p.add_argument("--job", required=True)
    p.add_argument("--db", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--settings", help="the launcher's Settings as JSON (default: this process's environment)")
    p.add_argument("--wait-registered", type=float, default=0.0, metavar="SECONDS",
                   help="started before the job is planned: wait this long for the launcher to register this "
                        "worker (importing torch and starting the device meanwhile); unregistered, exit")
    p.add_argument("--registered-since", type=float, default=0.0, metavar="EPOCH",
                   help="with --wait-registered: only a registration at or after this time counts")
    p.add_argument("--launcher-pid", type=int, default=0, help="the launcher's pid: this worker ends when it does")
    a = p.parse_args(argv)
    if a.launcher_pid:
        die_with_parent(a.launcher_pid)
    signal.signal(signal.SIGTERM, lambda signum, frame: _stop_now(a.db, a.job, a.worker_id, signum))
    setup_logging()
    try:
        keep_bytecode()  # started by hand rather than by the CLI: torch's imports (below) still cached
        settings = Settings.from_json(orjson.loads(a.settings)) if a.settings else Settings.from_env()
        waited = 0.0
        if a.wait_registered > 0:
            threading.Thread(target=start_device, args=(a.device,), name="embedfleet-preload", daemon=True).start()
            t0 = time.perf_counter()
            if not wait_registered(a.db, a.job, a.worker_id, a.wait_registered, a.registered_since, settings):
                return NOT_REGISTERED  # not needed (fewer chunks than devices, nothing left), the launcher gone
            waited = time.perf_counter() - t0
        Worker(a.job, a.db, a.worker_id, a.device, settings, registered_after=waited).run()
    except EmbedfleetError as e:
        print(f"error: {e}", file=sys.stderr)
        _record_failure(a.db, a.job, a.worker_id, str(e))
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C reaches the launcher's whole process group: the CLI says it once
        return 130
    return 0


def start_device(device: str) -> None:
    """Import torch and start the device (seconds on a GPU host), for a worker that waits to be registered."""
    try:
        import torch

        if device.startswith("cuda") and torch.cuda.is_available():
            torch.empty(1, device=device)
    except Exception as e:  # noqa: BLE001 - the worker's own model load will meet it and say so
        log.debug("preloading the device failed: %s", e)


def wait_registered(dsn: str, job: str, worker: str, seconds: float, since: float, settings: Settings) -> bool:
    """Wait until the launcher registers `worker` for `job` at or after `since` (True), or it is gone,
    `seconds` pass or the user interrupts (False)."""
    parent, deadline = os.getppid(), time.monotonic() + seconds
    try:
        ledger = Ledger.connect(dsn, settings.db_patience_seconds, host=settings.host_id)
        try:
            while not ledger.registered(job, worker, since):
                if os.getppid() != parent or time.monotonic() > deadline:
                    return False
                time.sleep(0.02)
            return True
        finally:
            ledger.close()
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the CLI says it once
        return False


def _stop_now(dsn: str, job: str, worker: str, signum: int) -> None:
    """SIGTERM (its launcher stopping it, or gone): say so in the ledger, where `status` reads it, and leave at
    once. What it held is freed by its launcher or by the next run; what it committed stays."""
    try:
        ledger = Ledger.connect(dsn)
        try:
            ledger.worker_ended(job, worker, "exited")
        finally:
            ledger.close()
    finally:
        exit_now(128 + signum)


def _record_failure(dsn: str, job: str, worker: str, error: str) -> None:
    """A worker that could not start (model, device) says why in the ledger, where the launcher reads it."""
    try:
        ledger = Ledger.connect(dsn)
        try:
            ledger.worker_ended(job, worker, "failed", error)
        finally:
            ledger.close()
    except EmbedfleetError:
        pass  # the database itself is what failed: the launcher reports the exit code


def leave(code: int) -> None:
    """Exit, skipping the interpreter's teardown (torch's CUDA context, Inductor's compile workers)
    that the job's end would wait for, once no thread of ours has work left (a compile still being
    written to the cache has: then as usual)."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    exit_now(code)


if __name__ == "__main__":
    leave(main())
