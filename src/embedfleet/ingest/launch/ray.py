"""The Ray launcher: the job's workers as Ray actors, one per GPU of the cluster (or N on CPUs).

Ray places, starts and restarts them (a dead actor comes back, and its new process takes over what the
old one held: only the chunk it was embedding counts a failure); the data never goes through Ray's
object store — each actor runs the same `Worker` as the local launcher, reads its claimed byte ranges
itself and writes to PostgreSQL itself. The driver only plans, watches the ledger and finishes the
job. Ray is optional: `pip install embedfleet[ray]`.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import replace

from embedfleet.errors import EmbedfleetError, InputError
from embedfleet.ingest.launch import MAX_RESTARTS, Launcher, worker_count
from embedfleet.ingest.monitor import Monitor
from embedfleet.ledger import Ledger
from embedfleet.settings import Settings

__all__ = ["RayLauncher", "WorkerActor"]

log = logging.getLogger("embedfleet")

IDLE_GRACE_S = 10.0  # no chunk left, yet an actor has not come back (no free GPU to restart on): stop waiting


def _ray():
    try:
        import ray
    except ImportError:
        raise InputError("--ray needs Ray: pip install 'embedfleet[ray]'") from None
    return ray


class WorkerActor:
    """Runs one Worker in a Ray actor's process, on the device Ray gave it."""

    def __init__(self, job: str, dsn: str, worker_id: str, device: str, settings: dict):
        self.job, self.dsn, self.worker_id, self.device = job, dsn, worker_id, device
        # This host's name, not the driver's: the ledger tells hosts apart by it.
        self.settings = replace(Settings.from_json(settings), host_id=socket.gethostname())

    def run(self) -> dict:
        from embedfleet.platform.bytecode import keep_bytecode

        keep_bytecode(self.settings)  # before torch's imports in this actor's process
        from embedfleet.ingest.worker import Worker, _record_failure

        device = self.device
        if device == "cuda":  # Ray set CUDA_VISIBLE_DEVICES to this actor's GPU; a GPU Ray only declared is a CPU
            import torch

            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        try:
            return Worker(self.job, self.dsn, self.worker_id, device, self.settings).run()
        except EmbedfleetError as e:  # a model or device it cannot use: restarting cannot help
            _record_failure(self.dsn, self.job, self.worker_id, str(e))
            return {"worker": self.worker_id, "error": str(e)}


class RayLauncher(Launcher):
    """`--ray auto` joins the cluster RAY_ADDRESS names (or the one `ray start` runs here), else starts a
    local one; `--ray ADDRESS` joins that cluster."""

    def __init__(self, address: str, devices: str, workers: int | None, settings: Settings):
        ray = _ray()
        self.settings = settings
        if not ray.is_initialized():
            kw = dict(logging_level=logging.WARNING, log_to_driver=False, include_dashboard=False)
            try:
                ray.init(address="auto" if address == "auto" else address, **kw)
            except ConnectionError:
                if address != "auto":
                    raise InputError(f"--ray {address}: no Ray cluster answers there") from None
                ray.init(**kw)  # nothing running: a cluster of this machine alone
        gpus = int(ray.cluster_resources().get("GPU", 0))
        if devices == "cpu" or (devices == "auto" and gpus == 0):
            self.device_kind, self.count, self.resources = "cpu", workers or 1, {"num_cpus": 1}
        else:
            if gpus == 0:
                raise InputError(f"--devices {devices}: the Ray cluster has no GPUs; use --devices cpu --workers N")
            self.device_kind, self.count, self.resources = "cuda", workers or gpus, {"num_gpus": 1}
        self.prefix = f"{settings.host_id}-{os.getpid()}-ray"
        self._ids: list[str] = []
        self._actors: list = []

    def start(self, ledger: Ledger, job: str, dsn: str) -> None:
        ray = _ray()
        actor = ray.remote(WorkerActor).options(max_restarts=MAX_RESTARTS, max_task_retries=MAX_RESTARTS,
                                                **self.resources)
        self._ids = [f"{self.prefix}{i}" for i in range(worker_count(self.count, ledger.counts(job)))]
        # The server's connections budgeted as the local launcher does; helpers are each actor's host's to size.
        budgeted, _ = self.budget(ledger.conn, bool((ledger.job(job) or {}).get("meta_id")), len(self._ids))
        settings = replace(budgeted, helpers=self.settings.helpers)
        ledger.register_workers(job, [(w, self.device_kind) for w in self._ids])
        self._actors = [actor.remote(job, dsn, w, self.device_kind, settings.to_json()) for w in self._ids]

    def wait(self, ledger: Ledger, job: str, quiet: bool) -> None:
        ray = _ray()
        ids, actors = self._ids, self._actors
        by_id = dict(zip(ids, actors))
        running = {a.run.remote(): w for a, w in zip(actors, ids)}
        finished, idle_since = False, None
        try:
            with Monitor(job, quiet=quiet) as mon:
                mon.update(ledger.progress(job))
                while running:
                    done, _ = ray.wait(list(running), num_returns=len(running), timeout=0.5)
                    for ref in done:
                        worker = running.pop(ref)
                        self._ended(ray, ledger, job, worker, ref)
                        # An actor holds its GPU until killed: free it for one waiting to restart elsewhere.
                        ray.kill(by_id[worker], no_restart=True)
                    mon.update(ledger.progress(job))
                    left = ledger.counts(job)
                    if left["pending"] or left["running"]:
                        idle_since = None
                    elif running:  # nothing left to do: actors still waiting to (re)start have no work
                        idle_since = idle_since or time.monotonic()
                        if time.monotonic() - idle_since > IDLE_GRACE_S:
                            for w in running.values():
                                ray.kill(by_id[w], no_restart=True)
                            running.clear()
                mon.update(ledger.progress(job), force=True)
            finished = True
        finally:
            if not finished:  # Ctrl-C or an error here: stop the actors; their chunks are pending again
                for a in actors:
                    ray.kill(a, no_restart=True)
                time.sleep(0.5)
                ledger.release_workers(job, ids)

    @staticmethod
    def _ended(ray, ledger: Ledger, job: str, worker: str, ref) -> None:
        """An actor's run returned: its summary, its error, or Ray's word that it is gone for good."""
        try:
            out = ray.get(ref)
            if "error" in out:
                log.error("worker %s stopped: %s", worker, out["error"])
        except ray.exceptions.RayError as e:  # it died more often than Ray restarts it
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log.error("worker %s is gone: %s", worker, first)
            ledger.worker_ended(job, worker, "exited", first[:2000])
            ledger.take_over(job, worker)
