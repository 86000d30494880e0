"""Progress: a rich live table on a terminal, plain periodic log lines otherwise.

Everything shown is read from the ledger, so the display works the same for local workers and
for workers on other hosts that joined the job.
"""

from __future__ import annotations

import sys
import time
from collections import deque

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


def _fmt_eta(eta: float | None) -> str:
    if eta is None:
        return "–"
    m, s = divmod(int(eta), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Monitor:
    def __init__(self, job: str, quiet: bool = False, interval: float | None = None, stream=None):
        self.job = job
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.quiet = quiet
        self.interval = interval or (1.0 if self.tty else 10.0)
        self.history: deque = deque(maxlen=30)
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
        now = time.monotonic()
        self.history.append((now, p["rows_seen"], p["tokens"], p["chunks_done"]))
        rows_s, tok_s, eta = rate_and_eta(self.history, p["chunks_total"])
        if self._live:
            self._live.update(self._render(p, rows_s, tok_s, eta))
        elif not self.quiet and (force or now - self._last_print >= self.interval):
            self._last_print = now
            workers = " ".join(
                f"{w['worker']}={w['state']}" + (f"({w['gpu_util']:.0f}%)" if w["gpu_util"] is not None else "")
                for w in p["workers"]
            )
            print(
                f"[{self.job}] chunks {p['chunks_done']}/{p['chunks_total']} rows {p['rows_seen']:,} "
                f"({rows_s:,.0f}/s, {tok_s:,.0f} tok/s) rejects {p['rejected']} "
                f"failed {p['chunks_failed']} ETA {_fmt_eta(eta)} | {workers}",
                file=self.stream, flush=True,
            )

    def _render(self, p, rows_s, tok_s, eta):
        head = Text.assemble(
            (f"{self.job}  ", "bold"),
            f"chunks {p['chunks_done']}/{p['chunks_total']}  rows {p['rows_seen']:,}  ",
            (f"{rows_s:,.0f} rows/s  {tok_s:,.0f} tok/s  ", "green"),
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
