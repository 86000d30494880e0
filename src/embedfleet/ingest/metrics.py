"""Prometheus metrics of a job, for people who already scrape their clusters: `--metrics-port N` on
`ingest` and `worker`. Every scrape reads the ledger (one query), so the numbers are the same ones
`embedfleet status` shows, for every worker of the job wherever it runs. prometheus-client is an
optional dependency (`pip install embedfleet[metrics]`)."""

from __future__ import annotations

from contextlib import contextmanager

from embedfleet.errors import InputError
from embedfleet.ledger import Ledger

__all__ = ["serve_metrics", "LedgerCollector"]

# (ledger field, metric name, help, scale): one gauge each per worker
_WORKER_GAUGES = (
    ("rows_s", "embedfleet_worker_rows_per_second", "Rows the worker embedded per second at its last heartbeat", 1),
    ("tokens_s", "embedfleet_worker_tokens_per_second", "Tokens per second at its last heartbeat", 1),
    ("gpu_util", "embedfleet_gpu_utilization_percent", "GPU utilisation (NVML)", 1),
    ("gpu_mem_used", "embedfleet_gpu_memory_used_bytes", "GPU memory in use (NVML)", 1 << 20),
    ("gpu_mem_total", "embedfleet_gpu_memory_total_bytes", "GPU memory in all (NVML)", 1 << 20),
    ("gpu_temp", "embedfleet_gpu_temperature_celsius", "GPU temperature (NVML)", 1),
    ("gpu_power", "embedfleet_gpu_power_watts", "GPU power draw (NVML)", 1),
)


class LedgerCollector:
    """A prometheus_client collector: the job's progress and each worker's last heartbeat."""

    def __init__(self, dsn: str, job: str):
        self.dsn, self.job = dsn, job

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        ledger = Ledger.connect(self.dsn)
        try:
            p = ledger.progress(self.job)
        finally:
            ledger.close()
        for name, key, what in (("embedfleet_rows", "rows_seen", "Records embedded"),
                                ("embedfleet_rows_written", "rows_written", "Rows newly inserted"),
                                ("embedfleet_rejected", "rejected", "Records rejected"),
                                ("embedfleet_tokens", "tokens", "Tokens embedded")):
            c = CounterMetricFamily(name, what, labels=["job"])
            c.add_metric([self.job], p[key])
            yield c
        chunks = GaugeMetricFamily("embedfleet_chunks", "Chunks of the job", labels=["job", "state"])
        chunks.add_metric([self.job, "total"], p["chunks_total"])
        chunks.add_metric([self.job, "done"], p["chunks_done"])
        chunks.add_metric([self.job, "failed"], p["chunks_failed"])
        yield chunks
        labels = ["job", "worker", "host", "device"]
        rows = CounterMetricFamily("embedfleet_worker_rows", "Rows this worker embedded", labels=labels)
        up = GaugeMetricFamily("embedfleet_worker_up", "1 while the worker runs (by its state)", labels=labels + ["state"])
        gauges = {key: GaugeMetricFamily(name, what, labels=labels) for key, name, what, _ in _WORKER_GAUGES}
        for w in p["workers"]:
            key = [self.job, w["worker"], w["host"] or "", w["device"] or ""]
            rows.add_metric(key, w["rows"])
            up.add_metric(key + [w["state"] or ""], 0 if w["state"] in ("finished", "exited", "failed") else 1)
            for field, _, _, scale in _WORKER_GAUGES:
                if w.get(field) is not None:
                    gauges[field].add_metric(key, float(w[field]) * scale)
        yield rows
        yield up
        yield from gauges.values()


@contextmanager
def serve_metrics(port: int, dsn: str, job: str, host: str = "0.0.0.0"):
    """Serve the job's metrics at http://HOST:PORT/metrics while the block runs."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise InputError("--metrics-port needs prometheus-client: pip install 'embedfleet[metrics]'") from None
    registry = CollectorRegistry()  # only the job's metrics, not this process's own
    registry.register(LedgerCollector(dsn, job))
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise InputError(f"--metrics-port {port}: cannot listen there ({e.strerror or e})") from None
    try:
        yield server
    finally:
        server.shutdown()
        thread.join(5)
