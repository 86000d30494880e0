"""The local launcher: one worker process per device of this machine, watched and restarted.

Workers are separate processes pinned with CUDA_VISIBLE_DEVICES, not threads or forks: each owns its
GPU, and a crash of one (CUDA error, OOM-killer) cannot take the others down. A dead worker's chunks
are re-queued at once (only the one it was embedding counts a failure) and the worker is restarted
while work remains. Each worker gets the launcher's Settings as an argument, never through the
environment. `embedfleet ingest` runs it through `job.run_job`; `embedfleet worker` runs it alone to
join a job planned elsewhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, replace

import orjson

from embedfleet.config import Settings
from embedfleet.errors import EmbedfleetError, InputError
from embedfleet.process import NOT_REGISTERED
from embedfleet.runtime.monitor import Monitor
from embedfleet.runtime.units import helper_count
from embedfleet.store.ledger import Ledger
from embedfleet.store.schema import free_connections
from embedfleet.store.writer import default_writers

__all__ = ["LocalLauncher", "parse_devices", "worker_count", "writers_each"]

log = logging.getLogger("embedfleet")

MAX_RESTARTS = 3  # per worker slot
# A worker started before its job is planned waits this long to be registered, then exits unneeded.
PRESTART_WAIT_S = 600.0


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
    """GPUs visible to this process (NVML first: the launcher need not import torch)."""
    from embedfleet.runtime.gpu import visible_gpu_count

    return visible_gpu_count()


def worker_count(available: int, chunks: dict[str, int]) -> int:
    """Workers to keep: one a device, but no more than the chunks left to claim (`chunks`: the ledger's
    counts) — an extra one would load the model and warm up for nothing (one started early is stopped
    once it has only imported torch); at least one, which reports a job with nothing left."""
    return max(1, min(available, chunks.get("pending", 0) + chunks.get("running", 0)))


def writers_each(wanted: int, workers: int, free: int, others_each: int) -> int:
    """Writer connections for each of `workers` workers: `wanted`, or as many as the server's `free`
    connections leave once each worker has its `others_each` other connections; never under one."""
    return max(1, min(wanted, free // workers - others_each))


@dataclass
class Slot:
    worker: str
    device: str
    proc: subprocess.Popen | None = None
    restarts: int = 0
    finished: bool = False  # its last word is in the ledger: its process's exit is not waited for


class LocalLauncher:
    """Workers on this machine's `devices` (one process each), named `<prefix>-w<i>`."""

    def __init__(self, devices: list[str], settings: Settings, prefix: str | None = None):
        self.devices, self.settings = devices, settings
        # Unique across launchers and hosts: two runs of one job at once must not share a worker's row.
        self.prefix = prefix or f"{settings.host_id}-{os.getpid()}"
        self.device_kind = "cpu" if devices[0] == "cpu" else "cuda"
        self._early: list[Slot] = []  # workers started before the job was planned (prestart)
        self._early_settings: tuple[Settings, int] | None = None

    def _slots(self, count: int, suffix: str = "") -> list[Slot]:
        return [Slot(f"{self.prefix}-w{i}{suffix}", d) for i, d in enumerate(self.devices[:count])]

    def prestart(self, job: str, dsn: str, conn, uses_meta: bool) -> None:
        """Start a worker for every device now, while the job is planned (reading a large input's lines
        takes seconds): each imports torch and starts its device meanwhile, and waits until `run`
        registers it (a registration newer than now: a row left by an earlier run does not count).
        `run` keeps them when the job needs them all, else starts afresh those it needs with their own
        settings; `discard` stops the rest."""
        since = float(conn.execute("SELECT extract(epoch FROM now())").fetchone()[0])
        self._early_settings = self._worker_settings(conn, uses_meta, len(self.devices))
        settings, threads = self._early_settings
        for s in self._slots(len(self.devices)):
            self._early.append(s)  # before it starts: whatever happens next, discard finds it
            s.proc = _spawn(s, job, dsn, settings, threads, wait=(PRESTART_WAIT_S, since))

    def discard(self, wait: bool = True) -> None:
        """Stop the early workers not taken by `run` (unneeded, or the job never ran); `wait` for them."""
        _stop(self._early, wait)
        if wait:
            self._early = []

    def _worker_settings(self, conn, uses_meta: bool, workers: int) -> tuple[Settings, int]:
        """Each of `workers` workers' Settings: its share of the cores for helpers, and writers that fit
        the server's free connections (unless the user set them); and the threads each may use."""
        threads = max(1, (os.cpu_count() or 1) // workers)
        helpers = self.settings.helpers if self.settings.helpers is not None else helper_count(threads)
        # A worker also holds its ledger, claims and heartbeat connections, and with --meta one per
        # helper: 8 GPU workers with --meta would pass the 100 connections of a stock server. Two are
        # left spare (a psql, `embedfleet status`).
        writers = self.settings.writers or writers_each(default_writers(self.devices[0])[0], workers,
                                                        free_connections(conn) - 2, 3 + (helpers if uses_meta else 0))
        return replace(self.settings, helpers=helpers, writers=writers), threads

    def run(self, ledger: Ledger, job: str, dsn: str, quiet: bool) -> None:
        count = worker_count(len(self.devices), ledger.counts(job))
        if len(self._early) == count and all(s.proc.poll() is None for s in self._early):
            # started early, for this many workers: their go is the registration below
            slots, self._early = self._early, []
            settings, threads = self._early_settings
        else:  # none started early, or a job that needs fewer (their settings are for a fuller fleet)
            # names of their own: an early worker being stopped must not take their registration for its go
            suffix = "b" if self._early else ""
            self.discard(wait=False)  # waited for at the end (run_job's discard): a GPU's teardown is slow
            slots = self._slots(count, suffix)
            settings, threads = self._worker_settings(ledger.conn, bool((ledger.job(job) or {}).get("meta_id")),
                                                      len(slots))
        try:
            ledger.register_workers(job, [(s.worker, s.device) for s in slots])
            with Monitor(job, quiet=quiet) as mon:
                mon.update(ledger.progress(job))  # where this run starts from
                for s in slots:
                    if s.proc is None:
                        s.proc = _spawn(s, job, dsn, settings, threads)
                # Until each worker has exited or said its last word: a process's exit after that (a GPU
                # worker's driver freeing its memory) need not hold up the job's end.
                while live := [s.proc for s in slots if s.proc is not None and not s.finished]:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        live[0].wait(0.25)  # this one seen at once when it exits, the others within 0.25 s
                    for s in slots:
                        self._reap(s, ledger, job, dsn, settings, threads)
                    progress = ledger.progress(job)
                    said = {w["worker"] for w in progress["workers"] if w["state"] == "finished"}
                    for s in slots:
                        s.finished = s.worker in said
                    mon.update(progress)
                mon.update(ledger.progress(job), force=True)
        finally:
            _stop([s for s in slots if not s.finished])  # Ctrl-C: their chunks are re-queued on the next run

    def _reap(self, s: Slot, ledger: Ledger, job: str, dsn: str, settings: Settings, threads: int) -> None:
        """A worker that ended: fine, or dead (its chunks re-queued; restarted while work remains)."""
        if s.finished or s.proc is None or (code := s.proc.poll()) is None:
            return
        pid, s.proc = s.proc.pid, None
        if code == 0:
            return
        if code == NOT_REGISTERED:  # missed its registration by a hair (it came as it gave up): again, uncounted
            s.proc = _spawn(s, job, dsn, settings, threads)
            return
        # Exit code 2 is a worker's one-line EmbedfleetError (model or device it cannot use), which it
        # recorded itself: restarting cannot help. A crash is restarted.
        error = f"worker {s.worker} exited with code {code}"
        if code != EmbedfleetError.exit_code:
            ledger.worker_ended(job, s.worker, "exited", error)
        culprit, requeued = ledger.fail_dead_worker(job, pid, error)
        log.error("%s (%s): %s; %s", error, s.device,
                  f"chunk {culprit} (the one it was embedding) counts a failure" if culprit is not None
                  else "no chunk was being embedded",
                  f"chunks {requeued} re-queued" if requeued else "nothing else re-queued")
        left = ledger.counts(job)
        if code != EmbedfleetError.exit_code and (left["pending"] or left["running"]) and s.restarts < MAX_RESTARTS:
            s.restarts += 1
            ledger.register_workers(job, [(s.worker, s.device)])
            s.proc = _spawn(s, job, dsn, settings, threads)


def _stop(slots: list[Slot], wait: bool = True) -> None:
    """Terminate the slots' running processes; with `wait`, wait for each (killed after 10 s)."""
    for s in slots:
        if s.proc is not None and s.proc.poll() is None:
            s.proc.terminate()
    for s in slots if wait else []:
        if s.proc is not None:
            try:
                s.proc.wait(10)
            except subprocess.TimeoutExpired:
                s.proc.kill()


def _spawn(slot: Slot, job: str, dsn: str, settings: Settings, threads: int,
           wait: tuple[float, float] | None = None) -> subprocess.Popen:
    """The worker's process; `wait` (seconds, since): started early, it waits to be registered after `since`."""
    env = dict(os.environ)
    device = slot.device
    if device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.split(":")[1]
        device = "cuda:0"
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    cmd = [sys.executable, "-m", "embedfleet.runtime.worker", "--job", job, "--db", dsn,
           "--worker-id", slot.worker, "--device", device, "--settings", orjson.dumps(settings.to_json()).decode(),
           "--launcher-pid", str(os.getpid())]
    if wait:
        cmd += ["--wait-registered", str(wait[0]), "--registered-since", repr(wait[1])]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
