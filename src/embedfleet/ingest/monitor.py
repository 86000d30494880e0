"""Progress: a rich live table on a terminal, plain periodic log lines otherwise.

Everything shown is read from the ledger, so the display works the same for local workers and
for workers on other hosts that joined the job.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text


def rate_and_eta(history: deque, total_chunks: int) -> tuple[float, float, float | None]:
    """(rows/s, tokens/s, ETA seconds) over the sliding window of (t, rows, tokens, chunks_done) samples."""
    if len(history) < 2:
        return 0.0, 0.0, None
    t0, r0, k0, c0 = history[0]
    t1, r1, k1, c1 = history[-1]
    dt = max(t1 - t0, 1e-9)
    chunk_rate = (c1 - c0) / dt
    eta = (total_chunks - c1) / chunk_rate if chunk_rate > 0 else None
    return (r1 - r0) / dt, (k1 - k0) / dt, eta


def run_rates(first: tuple, last: tuple) -> tuple[float, float]:
    """(rows/s, tokens/s) over the whole run, from (t, rows, tokens, …) samples at its start and end: what
    this run added over the time it took (the sliding window's rate at the end of a run can be far off it)."""
    dt = max(last[0] - first[0], 1e-9)
    return (last[1] - first[1]) / dt, (last[2] - first[2]) / dt


def _fmt_eta(eta: float | None) -> str:
    if eta is None:
        return "–"
    m, s = divmod(int(eta), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Monitor:
    def __init__(self, job: str, quiet: bool = False, interval: float | None = None, stream=None,
                 clock=time.monotonic):
        self.job, self.clock = job, clock
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.quiet = quiet
        self.interval = interval or (1.0 if self.tty else 10.0)
        self.history: deque = deque(maxlen=30)
        self.first: tuple | None = None  # (t, rows, tokens, chunks) when the run started
        self._last_print = 0.0
        self._live: Live | None = None

    def __enter__(self):
        if self.tty and not self.quiet:
            self._live = Live(console=Console(file=self.stream), refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc):
        if self._live:
            self._live.__exit__(*exc)

    def update(self, p: dict, force: bool = False) -> None:
        """A new reading of the ledger; `force` for the run's last one, which shows the whole run's rates."""
        now = self.clock()
        sample = (now, p["rows_seen"], p["tokens"], p["chunks_done"])
        if self.first is None:  # the launcher's reading as it starts the workers: rows already there are not this run's
            self.first = sample
        self.history.append(sample)
        rows_s, tok_s, eta = rate_and_eta(self.history, p["chunks_total"])
        span = ""
        if force:
            rows_s, tok_s = run_rates(self.first, sample)
            span = f" over {now - self.first[0]:,.0f} s"
        if self._live:
            self._live.update(self._render(p, rows_s, tok_s, eta, span))
        elif not self.quiet and (force or now - self._last_print >= self.interval):
            self._last_print = now
            workers = " ".join(
                f"{w['worker']}={w['state']}" + (f"({w['gpu_util']:.0f}%)" if w["gpu_util"] is not None else "")
                for w in p["workers"]
            )
            print(
                f"[{self.job}] chunks {p['chunks_done']}/{p['chunks_total']} rows {p['rows_seen']:,} "
                f"({rows_s:,.0f}/s, {tok_s:,.0f} tok/s{span}) rejects {p['rejected']} "
                f"failed {p['chunks_failed']} ETA {_fmt_eta(eta)} | {workers}",
                file=self.stream, flush=True,
            )

    def _render(self, p, rows_s, tok_s, eta, span=""):
        head = Text.assemble(
            (f"{self.job}  ", "bold"),
            f"chunks {p['chunks_done']}/{p['chunks_total']}  rows {p['rows_seen']:,}  ",
            (f"{rows_s:,.0f} rows/s  {tok_s:,.0f} tok/s{span}  ", "green"),
            f"rejects {p['rejected']}  ",
            (f"failed {p['chunks_failed']}  ", "red" if p["chunks_failed"] else ""),
            f"ETA {_fmt_eta(eta)}",
        )
        t = Table(box=None, pad_edge=False)
        for col in ("worker", "host", "device", "state", "rows", "tokens", "GPU %"):
            t.add_column(col)
        for w in p["workers"]:
            util = "–" if w["gpu_util"] is None else f"{w['gpu_util']:.0f}"
            t.add_row(w["worker"], w["host"] or "", w["device"] or "", w["state"] or "",
                      f"{w['rows']:,}", f"{w['tokens']:,}", util)
        return Group(head, t)


def _when(iso: str | None) -> str:
    """"2026-11-26T20:17:05.123+00:00" → "11-26 20:17": the part of a date that tells runs apart."""
    return f"{iso[5:10]} {iso[11:16]}" if iso else ""


def _span(started: str | None, finished: str | None) -> str:
    """"11-29 06:25–06:39": when a job started and finished, the second date left out on the same day."""
    begin, end = _when(started), _when(finished)
    if not begin:
        return ""
    return f"{begin}–{end[6:] if end[:5] == begin[:5] else end}"


def status_table(jobs: list[dict]) -> Group:
    """`embedfleet status`: one row per job, readable at 80 columns (long names wrap rather than vanish),
    then why each failed chunk failed."""
    t = Table(box=None, pad_edge=False, collapse_padding=True)  # one space between columns
    t.add_column("job", overflow="fold")
    tables = any(j["table"] != j["job"] for j in jobs)  # a job is usually named after its table: say it once
    if tables:
        t.add_column("table", overflow="fold")
    for name in ("state", "chunks", "rows", "rejected", "ran"):
        t.add_column(name, no_wrap=True, justify="right" if name in ("chunks", "rows", "rejected") else "left")
    notes = []
    for j in jobs:
        state = j["state"] if j.get("table_exists", True) or j["state"] != "done" else "done, table gone"
        t.add_row(j["job"], *([j["table"]] if tables else []), state, f"{j['chunks_done']}/{j['chunks_total']}",
                  f"{j['rows_written']:,}", str(j["rejected"]), _span(j["started"], j["finished"]))
        for f in j.get("failures") or []:
            notes.append(Text(f"{j['job']}: chunk {f['chunk']} ({f['source'].rsplit('/', 1)[-1]}) failed: {f['error']}",
                              style="red"))
        if j["state"] in ("failed", "planned") and not j.get("failures") and j.get("error"):
            notes.append(Text(f"{j['job']}: {j['error']}", style="red"))
        if "pending" in j:
            lag = "" if j["lag_s"] is None else f", the oldest {j['lag_s']:.1f} s old"
            if j.get("restarted"):
                pending = ("changes pending unknown: the source's server started again since sync last looked, which "
                           "may have emptied its queue; the next sync compares every row")
            elif j.get("queue_missing"):
                pending = ("its queue is gone (dropped?): changes are not queued until the next sync installs it "
                           "again and compares every row")
            elif j["pending"] is None:
                pending = "? pending (its queue is in another database: status --source-db DSN)"
            else:
                pending = f"{j['pending']:,} {'change' if j['pending'] == 1 else 'changes'} pending{lag}"
            notes.append(Text(f"{j['job']}: follows {j['source']}: {pending}; last in sync "
                              f"{(j['synced_at'] or 'never')[:19].replace('T', ' ')}"))
    return Group(t, *notes)


def _num(value, fmt: str = "{:,.0f}") -> str:
    return "–" if value is None else fmt.format(value)


def fleet_table(jobs: list[dict]) -> Table:
    """The fleet: a row per (host, device) working on a running job — its rates and, for a GPU, what
    NVML says — read from the workers' heartbeats in the ledger, so it shows every host from anywhere."""
    t = Table(box=None, pad_edge=False, title="workers", title_justify="left")
    for name in ("host", "device", "worker", "job", "state", "rows", "rows/s", "tok/s", "GPU %", "mem GiB", "°C", "W",
                 "beat"):
        t.add_column(name, overflow="fold" if name in ("host", "worker", "job", "state") else "ellipsis",
                     justify="left" if name in ("host", "device", "worker", "job", "state") else "right")
    for j in jobs:
        if j["state"] not in ("running", "interrupted"):
            continue
        for w in j.get("workers") or []:
            mem = (f"{w['gpu_mem_used'] / 1024:.1f}/{w['gpu_mem_total'] / 1024:.0f}"
                   if w.get("gpu_mem_used") is not None and w.get("gpu_mem_total") else "–")
            t.add_row(w.get("host") or "", w.get("device") or "", w["worker"], j["job"], w.get("state") or "",
                      _num(w.get("rows")), _num(w.get("rows_s")), _num(w.get("tokens_s")), _num(w.get("gpu_util")),
                      mem, _num(w.get("gpu_temp")), _num(w.get("gpu_power")),
                      _num(w.get("beat_age_s"), "{:.0f}s"))
    return t


def counted_every(seconds: float, count: Callable[..., int]) -> Callable[..., int]:
    """`count`, its answer for the same arguments reused for `seconds`: a table's count(*) reads the whole table,
    and a redraw a second would keep the server reading it."""
    seen: dict[tuple, tuple[float, int]] = {}

    def counted(*args) -> int:
        at, n = seen.get(args[1:], (float("-inf"), 0))  # (the connection is the same one each redraw)
        if time.monotonic() - at > seconds:
            n = count(*args)
            seen[args[1:]] = (time.monotonic(), n)
        return n

    return counted


def watch(read, interval: float = 1.0, console: Console | None = None) -> None:
    """`embedfleet status --watch`: jobs and the fleet, redrawn every `interval` seconds until Ctrl-C."""
    console = console or Console()

    def view():
        jobs = read()
        return Group(status_table(jobs) if jobs else Text("no jobs yet"), Text(""), fleet_table(jobs))

    try:
        with Live(view(), console=console, refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(interval)
                live.update(view())
    except KeyboardInterrupt:
        pass
