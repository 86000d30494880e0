"""The local launcher: plan the job into the ledger, start one worker process per device, watch
them, and finish the job (HNSW index, final state).

Workers are separate processes pinned with CUDA_VISIBLE_DEVICES, not threads or forks: each owns
its GPU, and a crash of one (CUDA error, OOM-killer) cannot take the others down. A dead worker's
chunks are re-queued at once and the worker is restarted while work remains.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from embedfleet.config import JobConfig, default_chunk_bytes
from embedfleet.errors import EmbedfleetError, InputError, JobError
from embedfleet.records import validate_template
from embedfleet.runtime.monitor import Monitor
from embedfleet.runtime.preflight import check_inputs_have_text
from embedfleet.runtime.units import helper_count
from embedfleet.sources.plan import ChunkSpec, expand_inputs, plan_chunks, table_name_for
from embedfleet.store.embedded import resolve_dsn
from embedfleet.store.ledger import Ledger, connect
from embedfleet.store.schema import (check_identifier, check_server, check_write_privileges, ensure_vector,
                                     finish_table, free_connections, table_exists)
from embedfleet.store.writer import default_writers

log = logging.getLogger("embedfleet")

MAX_RESTARTS = 3  # per worker slot


def parse_devices(devices: str, workers: int | None) -> list[str]:
    """Device for each worker: one per GPU by default, `--workers N` round-robin over them."""
    visible = _cuda_count() if devices != "cpu" else 0
    if devices == "cpu" or (devices == "auto" and not visible):
        return ["cpu"] * (workers or 1)
    if not visible:
        raise InputError(f"--devices {devices}: no CUDA GPU is visible; use --devices cpu")
    if devices in ("auto", "cuda"):
        gpus = list(range(visible))
    else:
        gpus = [int(x) for x in devices.split(":", 1)[1].split(",")]
        if max(gpus) >= visible:
            raise InputError(f"--devices {devices}: only {visible} GPU(s) visible (cuda:0…cuda:{visible - 1})")
    n = workers or len(gpus)
    return [f"cuda:{gpus[i % len(gpus)]}" for i in range(n)]


def _cuda_count() -> int:
    """GPUs visible to this process (NVML-based: does not initialise CUDA in the launcher)."""
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def apply_limit(chunks: list[ChunkSpec], limit: int | None) -> list[tuple[ChunkSpec, int | None]]:
    """Keep the chunks holding the first `limit` lines, the last one capped (`last_line`).
    A chunk's line count is known when the next chunk continues the same file; otherwise the cap
    falls inside it and planning stops there."""
    if limit is None:
        return [(c, None) for c in chunks]
    out, remaining = [], limit
    for i, c in enumerate(chunks):
        if remaining <= 0:
            break
        nxt = chunks[i + 1] if i + 1 < len(chunks) else None
        known = nxt is not None and nxt.source == c.source and c.kind == "jsonl"
        out.append((c, c.first_line + remaining - 1))
        if not known:
            break
        remaining -= nxt.first_line - c.first_line
    return out


def meta_identity(path: str) -> str:
    st = os.stat(path)
    return hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]


def check_job(cfg: JobConfig, conn) -> None:
    """Everything that can be known wrong before a job exists: names, the server (PostgreSQL, pgvector,
    privileges), the model and the inputs' text. An error here leaves no job behind."""
    cfg.inputs = expand_inputs(cfg.inputs)
    cfg.table = check_identifier(cfg.table or table_name_for(cfg.inputs[0]))
    cfg.job = cfg.job or cfg.table
    check_server(conn, cfg.dtype)
    from embedfleet.encode.models import check_model

    check_model(cfg.model)  # an unusable model fails here, once, not in every worker after planning
    if cfg.text_template:
        validate_template(cfg.text_template)
    check_write_privileges(conn, cfg.table, index=not cfg.no_index)
    ensure_vector(conn)
    if not cfg.meta:  # with --meta the text may come from the product fields, joined later
        check_inputs_have_text(cfg)


def prepare(cfg: JobConfig, ledger: Ledger, device: str) -> str:
    """Load the meta file and plan the job (or find it planned). Returns the job name."""
    meta_id = None
    if cfg.meta:
        from embedfleet.sources.presets import get_preset, load_meta

        (meta_path,) = expand_inputs([cfg.meta])
        cfg.meta = meta_path
        meta_id = meta_identity(meta_path)
        if not ledger.meta_loaded(meta_id):
            skipped = []
            rows = load_meta(meta_path, get_preset(cfg.preset), on_skip=lambda line, why: skipped.append(line))
            n = ledger.load_meta(meta_id, meta_path, rows, lambda: len(skipped))
            log.info("loaded %d products from %s", n, meta_path)
    chunk_bytes = cfg.chunk_bytes or default_chunk_bytes(device)
    plan = [] if ledger.job(cfg.job) else apply_limit(plan_chunks(cfg.inputs, chunk_bytes), cfg.limit)
    if not ledger.create_job(cfg.job, cfg, plan, meta_id):  # it exists with the same settings: resume
        released = ledger.release_dead_local(cfg.job)
        retried = ledger.retry_failed(cfg.job)
        if released or retried:
            log.info("resuming %s: %d chunks of dead workers re-queued, %d failed chunks retried",
                     cfg.job, released, retried)
    return cfg.job


@dataclass
class Slot:
    worker: str
    device: str
    proc: subprocess.Popen | None = None
    restarts: int = 0


def writers_each(wanted: int, workers: int, free: int, others_each: int) -> int:
    """Writer connections for each of `workers` workers: `wanted`, or as many as the server's `free`
    connections leave once each worker has its `others_each` other connections; never under one."""
    return max(1, min(wanted, free // workers - others_each))


def _spawn(slot: Slot, job: str, dsn: str, threads: int, writers: int) -> subprocess.Popen:
    env = dict(os.environ)
    device = slot.device
    if device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.split(":")[1]
        device = "cuda:0"
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Each worker's helper processes get a share of this machine's cores, not all of them.
    env.setdefault("EMBEDFLEET_PREP_WORKERS", str(helper_count(threads)))
    env.setdefault("EMBEDFLEET_WRITERS", str(writers))
    cmd = [sys.executable, "-m", "embedfleet.runtime.worker", "--job", job, "--db", dsn,
           "--worker-id", slot.worker, "--device", device]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)


def finalize(ledger: Ledger, job: str, cfg: JobConfig) -> dict:
    """Mark the job done or failed; once everything landed, make the table searchable (statistics,
    autovacuum back, the HNSW index) — safe when two runs of the job finish together."""
    counts = ledger.counts(job)
    loaded = table_exists(ledger.conn, cfg.table)
    if counts["failed"]:
        failed = ledger.failed_chunks(job)
        msg = "; ".join(f"chunk {c} ({Path(s).name}): {e}" for c, s, e in failed[:5])
        if loaded:
            finish_table(ledger.conn, cfg.table, index=False)
        ledger.set_job_state(job, "failed", f"{len(failed)} chunks failed: {msg}")
        return counts
    if counts["pending"] or counts["running"]:
        errors = ledger.worker_errors(job)
        if errors:  # every worker stopped on an error it cannot get past (a model or device it cannot use)
            ledger.set_job_state(job, "failed", "; ".join(f"{w}: {e}" for w, e in errors[:3]))
        return counts  # otherwise stopped early (interrupted): a rerun resumes
    if loaded:
        index = finish_table(ledger.conn, cfg.table, index=not cfg.no_index)
        if index:
            log.info("table %s is searchable (HNSW index %s)", cfg.table, index)
    ledger.set_job_state(job, "done")
    return counts


def ingest(cfg: JobConfig) -> dict:
    """Run an ingest job on this machine. Returns the job's final progress dict (with each worker's
    summary under "workers")."""
    cfg.inputs = expand_inputs(cfg.inputs)  # a missing file or GPU fails before any server starts
    devices = parse_devices(cfg.devices, cfg.workers)
    dsn = resolve_dsn(cfg.db)
    conn = connect(dsn)
    check_job(cfg, conn)
    ledger = Ledger(conn)
    job = prepare(cfg, ledger, devices[0])
    counts = ledger.counts(job)
    if counts["pending"] or counts["running"]:
        threads = max(1, (os.cpu_count() or 1) // len(devices))
        # A worker also holds its ledger, claims and heartbeat connections, and with --meta one per
        # helper: 8 GPU workers with --meta would pass the 100 connections of a stock server. Two are
        # left spare (a psql, `embedfleet status`).
        others = 3 + (helper_count(threads) if cfg.meta else 0)
        writers = writers_each(default_writers(devices[0])[0], len(devices), free_connections(conn) - 2, others)
        # Unique across launchers and hosts: two runs of one job at once must not share a worker's row.
        slots = [Slot(f"{os.uname().nodename}-{os.getpid()}-w{i}", d) for i, d in enumerate(devices)]
        ledger.set_job_state(job, "running")
        ledger.register_workers(job, [(s.worker, s.device) for s in slots])
        _run_slots(slots, ledger, job, dsn, threads, writers, cfg.quiet)
    counts = finalize(ledger, job, cfg)
    progress = ledger.progress(job)
    progress["summaries"] = ledger.summaries(job)
    errors = ledger.worker_errors(job)
    conn.close()
    if counts["failed"]:
        raise JobError(f"job {job!r} finished with {counts['failed']} failed chunks; "
                       f"`embedfleet status --job {job}` shows why; rerun to retry them")
    if counts["pending"] or counts["running"]:
        if errors:
            raise JobError(f"job {job!r} stopped: {errors[0][1]}")
        raise JobError(f"job {job!r} stopped with {counts['pending'] + counts['running']} chunks left "
                       "(all workers died); rerun the same command to resume")
    return progress


def _run_slots(slots: list[Slot], ledger: Ledger, job: str, dsn: str, threads: int, writers: int,
               quiet: bool) -> None:
    try:
        with Monitor(job, quiet=quiet) as mon:
            mon.update(ledger.progress(job))  # where this run starts from
            for s in slots:
                s.proc = _spawn(s, job, dsn, threads, writers)
            while any(s.proc is not None for s in slots):
                time.sleep(0.5)
                for s in slots:
                    if s.proc is None or (code := s.proc.poll()) is None:
                        continue
                    pid, s.proc = s.proc.pid, None
                    if code == 0:
                        continue
                    # Exit code 2 is a worker's one-line EmbedfleetError (model or device it cannot
                    # use), which it recorded itself: restarting cannot help. A crash is restarted.
                    error = f"worker {s.worker} exited with code {code}"
                    if code != EmbedfleetError.exit_code:
                        ledger.worker_ended(job, s.worker, "exited", error)
                    culprit, requeued = ledger.fail_dead_worker(job, pid, error)
                    log.error("%s (%s): %s; %s", error, s.device,
                              f"chunk {culprit} (the one it was embedding) counts a failure" if culprit is not None
                              else "no chunk was being embedded",
                              f"chunks {requeued} re-queued" if requeued else "nothing else re-queued")
                    left = ledger.counts(job)
                    if code != EmbedfleetError.exit_code and (left["pending"] or left["running"]) \
                            and s.restarts < MAX_RESTARTS:
                        s.restarts += 1
                        ledger.register_workers(job, [(s.worker, s.device)])
                        s.proc = _spawn(s, job, dsn, threads, writers)
                mon.update(ledger.progress(job))
            mon.update(ledger.progress(job), force=True)
    finally:
        for s in slots:  # Ctrl-C: stop the workers; their chunks are re-queued on the next run
            if s.proc is not None and s.proc.poll() is None:
                s.proc.terminate()
        for s in slots:
            if s.proc is not None:
                try:
                    s.proc.wait(10)
                except subprocess.TimeoutExpired:
                    s.proc.kill()
