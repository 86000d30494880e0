"""Launchers: what runs a job's workers. Both kinds share one interface, and budget the server's connections
and the host's cores for their workers the same way.

    LocalLauncher   one worker process per device of this machine, watched and restarted   (launch/local.py)
    RayLauncher     one Ray actor per GPU of a cluster, placed and restarted by Ray          (launch/ray.py)
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import replace

from embedfleet.ingest.commit import default_writers
from embedfleet.ingest.prepare import helper_count
from embedfleet.ledger import Ledger
from embedfleet.pg.ddl import free_connections
from embedfleet.settings import Settings

__all__ = ["Launcher", "MAX_RESTARTS", "worker_count", "writers_each"]

MAX_RESTARTS = 3  # a worker (slot or actor) restarted after a crash at most this often


def worker_count(available: int, chunks: dict[str, int]) -> int:
    """Workers to keep: one a device, but no more than the chunks left to claim (`chunks`: the ledger's
    counts) — an extra one would load the model and warm up for nothing; at least one, which reports a
    job with nothing left."""
    return max(1, min(available, chunks.get("pending", 0) + chunks.get("running", 0)))


def writers_each(wanted: int, workers: int, free: int, others_each: int) -> int:
    """Writer connections for each of `workers` workers: `wanted`, or as many as the server's `free`
    connections leave once each worker has its `others_each` other connections; never under one."""
    return max(1, min(wanted, free // workers - others_each))


class Launcher(ABC):
    """Runs a job's workers until no chunk of it is left (or none can run)."""

    device_kind: str  # "cpu" or "cuda": sizes the job's chunks when --chunk-bytes is not given
    settings: Settings

    def prestart(self, job: str, dsn: str, conn, uses_meta: bool) -> None:
        """Start workers before the job is planned, where that saves time (GPU workers import torch and start
        their devices meanwhile). By default, nothing."""

    @abstractmethod
    def start(self, ledger: Ledger, job: str, dsn: str) -> None:
        """Register and start the workers the job needs (taking over those started early where they fit)."""

    @abstractmethod
    def wait(self, ledger: Ledger, job: str, quiet: bool) -> None:
        """Watch the workers until each has ended, showing progress; restart those that crash while work is
        left. On an interrupt, stop them (their chunks go back to pending)."""

    def discard(self) -> None:
        """Stop the workers started early that the job did not take. By default, nothing."""

    def run(self, ledger: Ledger, job: str, dsn: str, quiet: bool) -> None:
        self.start(ledger, job, dsn)
        self.wait(ledger, job, quiet)

    def budget(self, conn, uses_meta: bool, workers: int, cores: int | None = None) -> tuple[Settings, int]:
        """Each of `workers` workers' Settings: helpers for its share of `cores` (this host's, by default), and
        writers that fit the server's free connections (unless the user set them); and the threads each may use.
        A worker also holds its ledger, claims and heartbeat connections, and with --meta one per helper; two
        connections are left spare (a psql, `embedfleet status`)."""
        threads = max(1, (cores or os.cpu_count() or 1) // workers)
        helpers = self.settings.helpers if self.settings.helpers is not None else helper_count(threads)
        writers = self.settings.writers or writers_each(default_writers(self.device_kind)[0], workers,
                                                        free_connections(conn) - 2, 3 + (helpers if uses_meta else 0))
        return replace(self.settings, helpers=helpers, writers=writers), threads
