"""The Worker: one device's pipeline, start to finish. It only assembles the stages (`ingest.stages`) and runs them:

    claim ──Task──► prepare ──Unit──► embed ──Embedded──► commit
    [claims thread]  [records thread    [main thread:       [writer threads]
                      + helper procs]    the device's loop]

The stages overlap through bounded queues (`flow.Prefetch`), so the device works while the next units are
prepared and the last ones are written; the per-row Python work runs in the helpers, so this process only
launches kernels and streams COPY buffers. A Heartbeat thread renews the leases and publishes the worker's
state, rates and GPU gauges (the fleet view).

A Worker is built from explicit settings and holds no state between jobs: the local launcher, a Ray actor and
`embedfleet worker` on any host construct the same object against the same ledger. Its heavy parts can be
swapped: `encoder=` (a test's HashEncoder: no torch) and `helpers=` (the pool that prepares units).
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import signal
import sys
import threading
import time
import warnings
from typing import Callable

import orjson

from embedfleet.encode.passages import parse_passages
from embedfleet.encode.tokenize import tokenizer_spec
from embedfleet.errors import EmbedfleetError, JobError
from embedfleet.ingest.bound import run_queue_seconds
from embedfleet.ingest.claim import ClaimStage
from embedfleet.ingest.commit import CommitStage, TableSink, Writer, default_writers
from embedfleet.ingest.embed import EmbedStage, compile_pays
from embedfleet.ingest.flow import Prefetch, Throttle, by_tenth
from embedfleet.ingest.prepare import PrepareContext, PrepareStage, UnitPool, settle_gc
from embedfleet.ingest.stages import FailedClaims
from embedfleet.ledger import Ledger
from embedfleet.logs import setup_logging
from embedfleet.pg.connect import Reconnect
from embedfleet.pg.ddl import ensure_table, vector_type
from embedfleet.pg.fts import DEFAULT_CONFIG
from embedfleet.platform.bytecode import keep_bytecode
from embedfleet.platform.gpu import gpu_reader
from embedfleet.platform.heap import keep_freed_memory
from embedfleet.platform.processes import NOT_REGISTERED, die_with_parent, exit_now, process_started
from embedfleet.settings import JobSpec, Settings, default_chunk_bytes
from embedfleet.sources.plan import id_root
from embedfleet.sources.presets import table_columns

__all__ = ["Worker", "main"]

log = logging.getLogger("embedfleet.worker")


def _no_durable_wait(conn) -> None:
    # A claim lost in a server crash only leaves its chunk pending again: it need not wait for the WAL flush
    # of the writers' rows before it (docs/decisions/claims-and-fencing.md).
    conn.execute("SET synchronous_commit = off")


class Heartbeat(threading.Thread):
    """Renews this worker's leases every third of a lease and publishes its state, rates and GPU gauges.
    `read()` gives (state, rows, tokens)."""

    def __init__(self, ledger: Ledger, job: str, worker: str, device: str, lease: float,
                 read: Callable[[], tuple[str, int, int]]):
        super().__init__(name="embedfleet-heartbeat", daemon=True)
        self.ledger, self.job, self.worker, self.device, self.lease, self.read = ledger, job, worker, device, lease, read
        self._halt = threading.Event()
        self._gpu = gpu_reader(device)
        self._last = self._first = (time.monotonic(), 0, 0)

    def beat(self, whole_run: bool = False) -> None:
        """Renew, and publish rates since the last beat (`whole_run`: since the first, for the last word)."""
        self.ledger.renew(self.job, self.worker, self.lease)
        (state, rows, tokens), now = self.read(), time.monotonic()
        t0, rows0, tokens0 = self._first if whole_run else self._last
        dt = max(now - t0, 1e-9)
        gauges = {"rows_s": (rows - rows0) / dt, "tokens_s": (tokens - tokens0) / dt, **self._gpu()}
        self._last = (now, rows, tokens)
        self.ledger.worker_beat(self.job, self.worker, self.device, state, rows, tokens, gauges)

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


def load_encoder(spec: JobSpec, device: str, settings: Settings):
    """The real encoder for a job (imports torch): the helpers tokenize, so it needs no tokenizer pool."""
    from embedfleet.encode.encoder import Encoder

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="prompt=.* has no prompts")  # the command said it once, not each worker
        return Encoder(spec.model, device=device, batch_tokens=spec.batch_tokens, dim=spec.dim, tokenizer_workers=0,
                       settings=settings, trust_remote_code=spec.trust_remote_code, prompt=spec.prompt,
                       task=spec.task)  # a model's own module takes the task (else the prompt's name)


def _record_failures(stages: dict) -> None:
    """The writer's failures recorded from the claims thread while nothing reaches the commit stage (one UPDATE a
    failure, on the commit stage's autocommit connection; a claim is recorded once, whichever thread sees it)."""
    if "commit" in stages:
        stages["commit"].record_failures()


class Worker:
    """One device's pipeline. `Worker(job, dsn, worker_id, device, settings).run()` embeds until no chunk
    of the job is left and returns its summary (also stored in the ledger)."""

    def __init__(self, job: str, dsn: str, worker_id: str, device: str = "auto", settings: Settings | None = None, *,
                 encoder: Callable[[JobSpec, str, Settings], object] | None = None,
                 helpers: Callable[..., UnitPool] | None = None, registered_after: float = 0.0):
        self.job, self.dsn, self.id, self.device = job, dsn, worker_id, device
        self.registered_after = registered_after  # started early: seconds it waited for its registration
        self.settings = settings or Settings.from_env()
        self._make_encoder = encoder or load_encoder
        self._make_helpers = helpers or UnitPool
        self.state = "starting"

    def run(self) -> dict:
        s, t_begin = self.settings, time.perf_counter()
        epoch_begin = time.time()
        # Threads here mostly wait on the device, helpers and sockets; after each wait one must take the GIL
        # back from whichever thread runs Python, which by default may hold it 5 ms: a shorter interval keeps
        # those hand-offs (many per unit) from stalling the pipeline.
        sys.setswitchinterval(s.switch_interval)
        keep_freed_memory()  # each unit's buffers reuse the last one's pages instead of faulting in new ones
        ledger = Ledger.connect(self.dsn, s.db_patience_seconds, host=s.host_id)
        try:
            row = ledger.job(self.job)
            if row is None:
                raise JobError(f"no job {self.job!r} in this database; start it with `embedfleet ingest`")
            spec = JobSpec.from_json(row["config"])
            culprit, requeued = ledger.take_over(self.job, self.id)
            if culprit is not None or requeued:
                log.warning("worker %s: an earlier process under this name died; chunk %s counts a failure, "
                            "chunks %s re-queued", self.id, culprit, requeued)
            # The helpers start (seconds: each imports and loads the tokenizer) while this process loads the model.
            ctx = PrepareContext(spec.preset, spec.text_template, spec.text_field, spec.id_field,
                                 tokenizer_spec(spec.model, spec.prompt, word_cache=s.word_cache, default_model=s.model),
                                 self.dsn if spec.meta else None, row["meta_id"] if spec.meta else None,
                                 s.db_patience_seconds, parse_passages(spec.passages), id_root(spec.inputs),
                                 spec.columns, (s.source_db or self.dsn) if spec.source_table else None,
                                 row.get("snapshot"), spec.where, spec.source_table)
            pool = self._make_helpers(ctx, s.helpers, s.helper_nice)
            helpers_ready = pool.start_in_background()
            encoder = None
            try:
                t_model = time.perf_counter()
                encoder = self._make_encoder(spec, self.device, s)
                model_s = time.perf_counter() - t_model
                vtype = vector_type(ledger.conn, spec.dtype)
                ensure_table(ledger.conn, spec.table, table_columns(spec.preset, bool(spec.passages), spec.columns),
                             encoder.dim, vtype, spec.partitions,
                             (spec.fts_config or DEFAULT_CONFIG) if spec.fts else None)
                ledger.set_model(self.job, encoder.name, encoder.dim, encoder.digest())
                # The compile (from the cache after a machine's first run) starts now, beside the helpers' start,
                # unless the job is too small to pay for it; the loop starts eager and switches when it is ready.
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
                settle_gc()  # a full collection over torch's objects would stall the device loop (it holds the GIL)
                startup["compile_first"], startup["compile_wait"] = compile_first, s.compile_wait
                return self._run_stages(ledger, spec, pool, encoder, vtype, startup)
            finally:
                pool.close()
                encoder.close()
        finally:
            ledger.close()

    def _run_stages(self, ledger: Ledger, spec: JobSpec, pool: UnitPool, encoder, vtype: str, startup: dict) -> dict:
        """Everything after start-up: the stages wired together and drained, then the summary."""
        s = self.settings
        device = "cpu" if encoder.device == "cpu" else "cuda"
        failed = FailedClaims()
        stages: dict = {}
        heartbeat = Heartbeat(Ledger.connect(self.dsn, s.db_patience_seconds, host=s.host_id), self.job, self.id,
                              encoder.device, s.lease_seconds, lambda: self._gauges(stages))
        heartbeat.beat()  # registered (live) before the first claim: others count this worker in their share
        heartbeat.start()
        try:
            writer = self._writer(spec, encoder.device, vtype, spare=1 + (pool.workers if spec.meta else 0),
                                  done=lambda unit, n: stages["commit"].done(unit, n))
            t_start, epoch_start = time.perf_counter(), time.time()
            cpu_start, loop_cpu_start = time.process_time(), time.thread_time()
            queued_start = run_queue_seconds(), run_queue_seconds(threading.get_native_id())
            usage_start = resource.getrusage(resource.RUSAGE_SELF)
            throttle = Throttle(pool.workers, s.tasks_ahead)
            records = Ledger.connect(self.dsn, s.db_patience_seconds, setup=_no_durable_wait, host=s.host_id)
            try:
                claim = stages["claim"] = ClaimStage(records, self.job, self.id, s.lease_seconds,
                                                     spec.chunk_bytes or default_chunk_bytes(device),
                                                     ramp=device == "cuda", idle=lambda: _record_failures(stages))
                ahead = None  # a unit ready while the device loop has none queued goes to it at once
                prepare = stages["prepare"] = PrepareStage(pool, throttle, records.mark_started,
                                                           hungry=lambda: ahead is None or ahead.backlog() == 0)
                # Claims come from their own thread, a few ahead: a query waited for on the records thread would
                # hold back both the next unit for the device and the next task for an idle helper.
                tasks = Prefetch(claim(), depth=2, name="embedfleet-claims")
                ahead = Prefetch(prepare(iter(tasks)), depth=1, name="embedfleet-records")
                embed = stages["embed"] = EmbedStage(encoder, throttle, failed, ahead.ready, ahead.backlog)
                commit = stages["commit"] = CommitStage(writer, ledger, failed, self.id, lambda: embed.stats.loop_start)
                for _ in commit(embed(iter(ahead))):
                    pass
                loop_cpu = time.thread_time() - loop_cpu_start
                queued = run_queue_seconds(), run_queue_seconds(threading.get_native_id())
                usage = resource.getrusage(resource.RUSAGE_SELF)
                writer.close()
                commit.record_failures()
            finally:
                records.close()
        except BaseException as e:
            self.state = "failed"
            heartbeat.stop(error=f"{type(e).__name__}: {e}"[:2000])
            raise
        summary = self._summary(stages, writer, ahead, pool, throttle, encoder.device, startup,
                                wall=time.perf_counter() - t_start, cpu=time.process_time() - cpu_start,
                                loop_cpu=loop_cpu, queued=(queued_start, queued), usage=(usage_start, usage),
                                epoch_start=epoch_start)
        # A compile still going (a machine's first, longer than this job) ends before this worker says it is
        # finished: no device work of the job's outlives the command, and its graphs reach the cache.
        t0 = time.perf_counter()
        encoder.wait_compiled()
        summary["end_compile_wait_s"] = round(time.perf_counter() - t0, 3)
        summary["startup"]["compile"] = encoder.compile_report()  # how it ended: whether the cache served it
        self.state = "finished"
        heartbeat.stop(summary)  # in the ledger (`ingest --json` shows it), not on the user's terminal
        log.debug("worker summary: %s", orjson.dumps(summary).decode())
        return summary

    def _gauges(self, stages: dict) -> tuple[str, int, int]:
        """(state, rows, tokens) for the heartbeat: the embed stage's state while it runs."""
        commit, embed = stages.get("commit"), stages.get("embed")
        state = self.state if self.state != "starting" or embed is None else embed.stats.state
        return state, commit.stats.rows if commit else 0, commit.stats.tokens if commit else 0

    def _summary(self, stages: dict, writer: Writer, ahead: Prefetch, pool: UnitPool, throttle: Throttle,
                 device: str, startup: dict, *, wall: float, cpu: float, loop_cpu: float, queued, usage,
                 epoch_start: float) -> dict:
        """What the worker says when it finishes: each stage's stats, its threads' CPU, its start-up."""
        claim, prepare, embed, commit = (stages[k].stats for k in ("claim", "prepare", "embed", "commit"))
        # The loop's last wait: for its writers' backlog, then for other workers' last chunks (the tail).
        end_at, last_wait = embed.last_wait
        tail = min(last_wait, end_at - claim.tail_started) if claim.tail_started else 0.0
        (queued_start, queued_end), (usage_start, usage_end) = queued, usage
        return {
            "worker": self.id, "device": device, "rows": commit.rows, "tokens": commit.tokens,
            "wall_s": round(wall, 3), "rows_per_s": round(commit.rows / wall, 1) if wall else 0.0,
            "embed_s": round(embed.embed_seconds, 3), "launch_s": round(embed.launch_seconds, 3),
            "input_wait_s": round(embed.wait_seconds, 3),
            "end_wait_s": round(last_wait - tail, 3), "tail_wait_s": round(tail, 3),
            "first_wait_s": round(embed.waits[0][1] if embed.waits else 0.0, 3),
            "input_wait_by_tenth_s": by_tenth(embed.waits, embed.loop_seconds),
            "sink_wait_by_tenth_s": by_tenth(commit.sink_waits, embed.loop_seconds),
            "rows_by_tenth": [int(v) for v in by_tenth(embed.done, embed.loop_seconds)],
            "db_s": round(writer.db_seconds, 3), "sink_wait_s": round(commit.sink_wait_seconds, 3),
            "read_s": round(prepare.busy_seconds, 3), "claim_s": round(claim.claim_seconds, 3),
            "collect_s": round(prepare.collect_seconds, 3), "records_blocked_s": round(ahead.blocked_s, 3),
            "helpers": pool.workers, "writers": writer.connections,
            "claims_ahead_mean": round(throttle.mean, 2), "claims_ahead_end": throttle.limit,
            "helper_busy_s": round(prepare.helper_seconds, 3), "helper_cpu_s": round(prepare.helper_cpu_seconds, 3),
            "cpu_s": round(cpu, 3),  # this process, all its threads (its helpers are in helper_cpu_s)
            "thread_cpu_s": {"loop": round(loop_cpu, 3), "records": round(ahead.cpu_s, 3),
                             "writers": round(writer.cpu_seconds, 3)},
            # seconds its threads were ready but waited for a CPU over the loop: the host short of CPUs
            "run_queue_s": {k: round(b - a, 3) for k, a, b in zip(("process", "loop"), queued_start, queued_end)
                            if a is not None and b is not None},
            # this process over the loop: page faults, and context switches waiting (voluntary) or preempted
            "rusage": {k: getattr(usage_end, f"ru_{k}") - getattr(usage_start, f"ru_{k}")
                       for k in ("minflt", "majflt", "nvcsw", "nivcsw")},
            "started_at": round(epoch_start, 3),  # wall-clock start: to line several workers up
            "startup": {k: round(v, 3) if isinstance(v, float) else v for k, v in startup.items()},
        }

    def _writer(self, spec: JobSpec, device: str, vtype: str, spare: int, done) -> Writer:
        s = self.settings
        writers, depth = default_writers(device)
        columns = table_columns(spec.preset, bool(spec.passages), spec.columns)
        return Writer(lambda conn: TableSink(conn, spec.table, columns, vtype, self.job),
                      Reconnect(self.dsn, s.db_patience_seconds), on_done=done,
                      threads=s.writers or writers, depth=s.writer_depth or depth, spare=spare)


def main(argv: list[str] | None = None) -> int:
    """`python -m embedfleet.ingest.worker` — what the local launcher starts, one per device."""
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
        settings = Settings.from_json(orjson.loads(a.settings)) if a.settings else Settings.from_env()
        keep_bytecode(settings)  # started by hand rather than by the CLI: torch's imports (below) still cached
        waited = 0.0
        if a.wait_registered > 0:
            threading.Thread(target=start_device, args=(a.device,), name="embedfleet-preload", daemon=True).start()
            t0 = time.perf_counter()
            if not wait_registered(a.db, a.job, a.worker_id, a.wait_registered, a.registered_since, settings):
                return NOT_REGISTERED  # not needed (fewer chunks than devices, nothing left), the launcher gone
            waited = time.perf_counter() - t0
        Worker(a.job, a.db, a.worker_id, a.device, settings, registered_after=waited).run()
    except EmbedfleetError as e:
        # a launcher reads it from the ledger and says it once, for the job; else (or no ledger) it is said here
        if not (_record_failure(a.db, a.job, a.worker_id, str(e)) and a.launcher_pid):
            print(f"error: {e}", file=sys.stderr)
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


def _record_failure(dsn: str, job: str, worker: str, error: str) -> bool:
    """A worker that could not start (model, device) says why in the ledger, where the launcher reads it.
    Returns whether it could."""
    try:
        ledger = Ledger.connect(dsn)
        try:
            ledger.worker_ended(job, worker, "failed", error)
        finally:
            ledger.close()
    except EmbedfleetError:
        return False  # the database itself is what failed
    return True


def leave(code: int) -> None:
    """Exit, skipping the interpreter's teardown (torch's CUDA context, Inductor's compile workers)
    that the job's end would wait for, once no thread of ours has work left (a compile still being
    written to the cache has: then as usual)."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    exit_now(code)


if __name__ == "__main__":
    leave(main())
