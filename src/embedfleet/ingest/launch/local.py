"""The local launcher: one worker process per device of this machine, watched and restarted.

Workers are separate processes pinned with CUDA_VISIBLE_DEVICES, not threads or forks: each owns its GPU, and
a crash of one (CUDA error, OOM-killer) cannot take the others down. A dead worker's chunks are re-queued at
once (only the one it was embedding counts a failure) and the worker is restarted while work remains. Each
worker gets the launcher's Settings as an argument, never through the environment, and dies with its launcher.
`embedfleet ingest` runs it through `job.run_job`; `embedfleet worker` runs it alone to join a job planned
elsewhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from dataclasses import dataclass

import orjson

from embedfleet.errors import EmbedfleetError
from embedfleet.ingest.launch import MAX_RESTARTS, Launcher, worker_count
from embedfleet.ingest.monitor import Monitor
from embedfleet.ledger import Ledger
from embedfleet.platform.processes import NOT_REGISTERED, spawn, stop
from embedfleet.settings import Settings

__all__ = ["LocalLauncher"]

log = logging.getLogger("embedfleet")

# A worker started before its job is planned waits this long to be registered, then exits unneeded.
PRESTART_WAIT_S = 600.0


@dataclass
class Slot:
    worker: str
    device: str
    proc: subprocess.Popen | None = None
    restarts: int = 0
    finished: bool = False  # its last word is in the ledger: its process's exit is not waited for


class LocalLauncher(Launcher):
    """Workers on this machine's `devices` (one process each), named `<prefix>-w<i>`."""

    def __init__(self, devices: list[str], settings: Settings, prefix: str | None = None):
        self.devices, self.settings = devices, settings
        # Unique across launchers and hosts: two runs of one job at once must not share a worker's row.
        self.prefix = prefix or f"{settings.host_id}-{os.getpid()}"
        self.device_kind = "cpu" if devices[0] == "cpu" else "cuda"
        self._early: list[Slot] = []  # workers started before the job was planned (prestart)
        self._early_settings: tuple[Settings, int] | None = None
        self._slots: list[Slot] = []
        self._running: tuple[Settings, int] | None = None  # the started workers' settings and threads
        self._dsn: str | None = None

    def worker_names(self) -> set[str]:
        """The names of the workers `start` ran."""
        return {s.worker for s in self._slots}

    def _new_slots(self, count: int, suffix: str = "") -> list[Slot]:
        return [Slot(f"{self.prefix}-w{i}{suffix}", d) for i, d in enumerate(self.devices[:count])]

    def prestart(self, job: str, dsn: str, conn, uses_meta: bool) -> None:
        """Start a worker for every device now, while the job is planned (reading a large input's lines
        takes seconds): each imports torch and starts its device meanwhile, and waits until `start`
        registers it (a registration newer than now: a row left by an earlier run does not count).
        `start` keeps them when the job needs them all, else starts afresh those it needs with their own
        settings; `discard` stops the rest."""
        since = float(conn.execute("SELECT extract(epoch FROM now())").fetchone()[0])
        self._early_settings = self.budget(conn, uses_meta, len(self.devices))
        settings, threads = self._early_settings
        for s in self._new_slots(len(self.devices)):
            self._early.append(s)  # before it starts: whatever happens next, discard finds it
            s.proc = _spawn(s, job, dsn, settings, threads, wait=(PRESTART_WAIT_S, since))

    def discard(self, wait: bool = True) -> None:
        """Stop the early workers not taken by `start` (unneeded, or the job never ran); `wait` for them."""
        stop([s.proc for s in self._early if s.proc is not None], wait)
        if wait:
            self._early = []

    def start(self, ledger: Ledger, job: str, dsn: str) -> None:
        count = worker_count(len(self.devices), ledger.counts(job))
        if len(self._early) == count and all(s.proc.poll() is None for s in self._early):
            # started early, for this many workers: their go is the registration below
            self._slots, self._early = self._early, []
            self._running = self._early_settings
        else:  # none started early, or a job that needs fewer (their settings are for a fuller fleet)
            # names of their own: an early worker being stopped must not take their registration for its go
            suffix = "b" if self._early else ""
            self.discard(wait=False)  # waited for at the end (run_job's discard): a GPU's teardown is slow
            self._slots = self._new_slots(count, suffix)
            self._running = self.budget(ledger.conn, bool((ledger.job(job) or {}).get("meta_id")), len(self._slots))
        self._dsn = dsn
        ledger.register_workers(job, [(s.worker, s.device) for s in self._slots])
        settings, threads = self._running
        for s in self._slots:
            if s.proc is None:
                s.proc = _spawn(s, job, dsn, settings, threads)

    def wait(self, ledger: Ledger, job: str, quiet: bool) -> None:
        slots, dsn = self._slots, self._dsn
        settings, threads = self._running
        try:
            with Monitor(job, quiet=quiet) as mon:
                mon.update(ledger.progress(job))  # where this run starts from
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
            stop([s.proc for s in slots if not s.finished and s.proc is not None])  # Ctrl-C: chunks re-queued

    def run(self, ledger: Ledger, job: str, dsn: str, quiet: bool) -> None:
        try:
            self.start(ledger, job, dsn)
        except BaseException:
            stop([s.proc for s in self._slots if s.proc is not None])
            raise
        self.wait(ledger, job, quiet)

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
    cmd = [sys.executable, "-m", "embedfleet.ingest.worker", "--job", job, "--db", dsn,
           "--worker-id", slot.worker, "--device", device, "--settings", orjson.dumps(settings.to_json()).decode(),
           "--launcher-pid", str(os.getpid())]
    if wait:
        cmd += ["--wait-registered", str(wait[0]), "--registered-since", repr(wait[1])]
    return spawn(cmd, env)
