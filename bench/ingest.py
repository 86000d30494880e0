"""Ingest throughput on 1..N GPUs: synthetic Amazon reviews → `embedfleet ingest` → embedded PostgreSQL.

    python bench/ingest.py --n 200000 --gpus 1,2 [--model DIR | --shape qwen3-0.6b] [--shards K] [--out results.json]
        [--workers-per-gpu 1,1,2,2] [--dtype float,half] [--compile on,off,wait] [--helpers 8,16] [--helper-nice 0,10] [--gil START:SECONDS:PY_SPY] [--pg-set NAME=VALUE,…]
        [--pg-reload "default;NAME=VALUE,…"] [--warmup N] [--partitions 0,8] [--per-gpu] [--home DIR]

For each GPU count it runs the real CLI once (fresh table, --no-index so the rate is the pipeline's,
then times ANALYZE and the HNSW build separately), samples every GPU's utilisation with NVML, and reads each
worker's summary from `ingest --json` (rows, forward-pass seconds, DB seconds, seconds the GPU loop waited on the
sink or on input). Steady-state rate = rows / the span of the workers' loops, first start to last
end (model load excluded, a worker that starts late counts); workers' sum = each worker's rows / its
own loop, summed; middle = each worker's tenths 4-9 of its loop, summed (no start, no end); all running = rows of the chunks that committed while every worker's loop ran
(later start to earlier end, from the ledger's commit times) over that time — the steady state of a
long job, without one worker's start-up or last chunk alone; wall rate = rows / the whole command's wall time. `--gpus 1,2,1,2` repeats counts:
scaling is against the first count's mean rate, and pair by pair against the run just before;
`--warmup N` first runs an untimed N-row ingest, so a fresh machine's cold caches count in no result (MiniLM
compiles only in a job past 1 GiB: N ≥ ~1.8M reviews, or the first timed run compiles cold).
Each run's table is dropped once measured, so no run pays for vacuuming an earlier one's. `--partitions P`
passes ingest `--partitions P`: P tables that each grow under their own extension lock, against one (runs
146-149: the lock the GPUs waited on).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import orjson
import psycopg
from psycopg import sql

import harness
from _cli import name_values
from embedfleet.ingest.bound import HostTicks, host_shares, host_ticks
from embedfleet.ingest.flow import by_tenth
from embedfleet.pg.embedded import alter_system


class GpuSampler(threading.Thread):
    """Mean NVML utilisation per GPU while a run is going, over samples where any GPU was busy."""

    def __init__(self, indices: list[int], period: float = 0.2):
        super().__init__(daemon=True)
        self.indices, self.period, self.samples = indices, period, []
        self._halt = threading.Event()

    def run(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in self.indices]
        except Exception:
            return
        while not self._halt.wait(self.period):
            self.samples.append([pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in handles])

    def stop(self) -> list[float | None]:
        self._halt.set()
        self.join()
        busy = [s for s in self.samples if any(s)]
        if not busy:
            return [None] * len(self.indices)
        # from the first to the last busy sample: the window where embedding happened
        first = self.samples.index(busy[0])
        last = len(self.samples) - 1 - self.samples[::-1].index(busy[-1])
        window = self.samples[first : last + 1]
        return [round(sum(s[i] for s in window) / len(window), 1) for i in range(len(self.indices))]


class PgSample(NamedTuple):
    """One look at pg_stat_activity, for `PgWaitSampler.tenths`."""
    at: float                      # time.time()
    host: HostTicks | None
    clients: int                   # client connections running a statement
    tracked: tuple[int, ...]       # of them, on each of PgWaitSampler.TRACKED
    other_waits: int               # of them, on any other wait on the server
    checkpointing: bool
    wal_writing: bool


class PgWaitSampler(threading.Thread):
    """What the server's busy connections are doing (pg_stat_activity's wait event, or CPU when none),
    sampled every `period` s: the share of samples per state tells whether the database waits on its
    disk, on a lock (WAL insertion, the ledger's rows) or computes."""

    # For `tenths`: the clients' samples on these waits apart from any other wait.
    TRACKED = ("LWLock:WALInsert", "LWLock:WALWrite")

    def __init__(self, dsn: str, period: float = 0.05):
        super().__init__(daemon=True)
        self.dsn, self.period, self.counts, self.extend = dsn, period, {}, {}
        self.samples: list[PgSample] = []
        self._halt = threading.Event()

    def run(self):
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._halt.wait(self.period):
                clients, tracked, other, checkpointing, wal_writing = 0, [0] * len(self.TRACKED), 0, False, False
                for kind, event, backend in conn.execute(
                        "SELECT wait_event_type, wait_event, backend_type FROM pg_stat_activity "
                        "WHERE pid <> pg_backend_pid() AND (state = 'active' OR backend_type <> 'client backend')"):
                    who = "client" if backend == "client backend" else backend
                    # out of its main loop's sleep the checkpointer is checkpointing (writing, or pacing itself)
                    checkpointing |= who == "checkpointer" and kind != "Activity"
                    wal_writing |= who == "walwriter" and kind == "IO"
                    if who == "client" or kind not in (None, "Activity"):
                        key = f"{who}: {kind}:{event}" if kind else f"{who}: CPU"
                        self.counts[key] = self.counts.get(key, 0) + 1
                    if who == "client":
                        clients += 1
                        wait = f"{kind}:{event}"
                        if wait in self.TRACKED:
                            tracked[self.TRACKED.index(wait)] += 1
                        elif kind not in (None, "Client"):  # waiting on the server, not computing or reading input
                            other += 1
                self.samples.append(PgSample(time.time(), host_ticks(), clients, tuple(tracked), other,
                                             checkpointing, wal_writing))
                # whose extension lock the waiters queue on: the table's heap, its primary key, or TOAST
                for (rel,) in conn.execute("SELECT relation::regclass::text FROM pg_locks "
                                           "WHERE locktype = 'extend' AND NOT granted"):
                    key = "extend waiter: " + re.sub(r"bench_\d+gpu_\d+(_p\d+)?", "T", rel)
                    self.extend[key] = self.extend.get(key, 0) + 1

    def stop(self) -> dict:
        self._halt.set()
        self.join()
        total = sum(v for k, v in self.counts.items() if k.startswith("client")) or 1
        # client connections' states as shares of their samples; background processes' as counts
        shares = {k: round(v / total, 3) if k.startswith("client") else v
                  for k, v in sorted(self.counts.items(), key=lambda kv: -kv[1]) if v / total >= 0.005}
        # extension-lock waiters per relation, as shares of the client connections' samples
        return shares | {k: round(v / total, 3) for k, v in sorted(self.extend.items(), key=lambda kv: -kv[1])}

    def tenths(self, start: float, end: float) -> dict[str, list]:
        """Over the tenths of [start, end] (epoch seconds, the loops' span): the share of the host's CPU the
        hypervisor took, the clients' samples on each tracked wait and on any other, and the samples in which a
        checkpoint ran and the WAL writer was writing: whether the GPUs' waits on the database
        (`sink_wait_by_tenth_s`) line up with steal, with a lock or with a checkpoint."""
        span = end - start
        inside = [(s.at - start, s) for s in self.samples if 0 <= s.at - start < span]
        # host ticks between one sample and the next, counted at the later one
        steps = [(t, b.host, a.host) for (_, a), (t, b) in zip(inside, inside[1:]) if a.host and b.host]
        stolen = by_tenth([(t, now.stolen - before.stolen) for t, now, before in steps], span)
        ticks = by_tenth([(t, now.total - before.total) for t, now, before in steps], span)
        clients = by_tenth([(t, s.clients) for t, s in inside], span)
        out = {"stolen": _shares(stolen, ticks)}
        for k, name in enumerate(self.TRACKED):
            out[name] = _shares(by_tenth([(t, s.tracked[k]) for t, s in inside], span), clients)
        out["other waits"] = _shares(by_tenth([(t, s.other_waits) for t, s in inside], span), clients)
        samples = by_tenth([(t, 1) for t, _ in inside], span)
        out["checkpoint running"] = _shares(by_tenth([(t, s.checkpointing) for t, s in inside], span), samples)
        out["WAL writer writing"] = _shares(by_tenth([(t, s.wal_writing) for t, s in inside], span), samples)
        return out


def _shares(parts: list[float], wholes: list[float]) -> list[float | None]:
    return [round(p / w, 3) if w else None for p, w in zip(parts, wholes)]


class GilSampler(threading.Thread):
    """Which threads of each worker process hold the GIL, from `start` s after the ingest begins for
    `seconds` s: `py-spy record --gil --threads --nonblocking` (samples only threads holding it).
    A thread's share = its GIL-holding samples over rate x seconds; the process's sum is how busy its
    one GIL was — near 1.0, the worker's own Python, not the GPU or the helpers, sets the pace."""

    def __init__(self, parent: int, start: float, seconds: float, py_spy: str, rate: int = 200):
        super().__init__(daemon=True)
        self.parent, self.start_s, self.seconds, self.py_spy, self.rate = parent, start, seconds, py_spy, rate
        self.result: dict = {}

    def run(self):
        import psutil

        time.sleep(self.start_s)
        try:
            workers = [c for c in psutil.Process(self.parent).children(recursive=True)
                       if "embedfleet.ingest.worker" in " ".join(c.cmdline())]
        except psutil.Error:
            return
        procs = {w.pid: subprocess.Popen([self.py_spy, "record", "--gil", "--threads", "--nonblocking", "-r",
                                          str(self.rate), "-d", str(int(self.seconds)), "-f", "raw", "-o",
                                          f"/tmp/gil-{w.pid}.txt", "-p", str(w.pid)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for w in workers}
        for pid, proc in procs.items():
            err = proc.communicate()[1].decode(errors="replace")
            try:
                lines = Path(f"/tmp/gil-{pid}.txt").read_text().splitlines()
            except OSError:
                self.result[pid] = {"error": err[-300:]}
                continue
            self.result[pid] = _gil_shares(lines, self.rate * int(self.seconds))


def _gil_shares(lines: list[str], possible: int) -> dict:
    """py-spy raw lines ("thread (tid): name;frame;…;frame count") → GIL share per thread name, and
    the innermost frames that held it most."""
    threads: dict[str, int] = {}
    leaves: dict[str, int] = {}
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        thread = frames[0].rpartition("): ")[2]
        threads[thread] = threads.get(thread, 0) + int(count)
        leaf = f"{thread}: {frames[-1]}"
        leaves[leaf] = leaves.get(leaf, 0) + int(count)
    top = sorted(leaves.items(), key=lambda kv: -kv[1])[:25]
    return {"gil_busy": round(sum(threads.values()) / possible, 3),
            "threads": {k: round(v / possible, 3) for k, v in sorted(threads.items(), key=lambda kv: -kv[1])},
            "top_leaves": {k: round(v / possible, 4) for k, v in top}}


def _postgres_cpu_s() -> dict[int, float]:
    """CPU seconds used so far by each postgres process on this host (with, for the postmaster, its
    children that have exited)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        if stat[stat.index("(") + 1 : stat.rindex(")")] == "postgres":
            fields = stat[stat.rindex(")") + 2 :].split()
            # utime, stime, and cutime, cstime: the postmaster's reaped children (connections that closed)
            out[int(pid)] = sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return out


def _cpu_used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds between two `_postgres_cpu_s` readings: per process, so that a server restarted
    before the run (its old processes gone) does not count against it (a connection that closes
    during the run counts whole, through the postmaster's children's time: milliseconds)."""
    return sum(max(0.0, t - before.get(pid, 0.0)) for pid, t in after.items())


def _disk_written_bytes(path: str) -> int | None:
    """Bytes written so far to the block device holding `path` (/sys/dev/block/…/stat, field 7: 512-byte
    sectors); None where the path's device is not a block device (overlay, tmpfs)."""
    dev = os.stat(path).st_dev
    try:
        return int(Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat").read_text().split()[6]) * 512
    except (OSError, IndexError):
        return None


def _wal_counters(conn) -> dict:
    """The server's WAL position and cumulative WAL/checkpoint counters, to difference over a run."""
    lsn, = conn.execute("SELECT pg_current_wal_lsn()").fetchone()
    wal = conn.execute("SELECT wal_fpi, wal_buffers_full FROM pg_stat_wal").fetchone()
    ckpt = conn.execute("SELECT num_timed + num_requested FROM pg_stat_checkpointer").fetchone()
    return {"lsn": lsn, "fpi": int(wal[0]), "buffers_full": int(wal[1]), "checkpoints": int(ckpt[0])}


def _buffer_writes(conn) -> dict:
    """Table and index pages written out of shared buffers so far, by who wrote them (pg_stat_io): a client
    backend writing a dirty page before it can reuse the buffer is time a COPY waits; the background writer
    and the checkpointer write off every COPY's path."""
    return {who: int(n) for who, n in conn.execute(
        "SELECT backend_type, sum(writes) FROM pg_stat_io WHERE object = 'relation' GROUP BY 1 HAVING sum(writes) > 0")}


def _wal_used(conn, before: dict, rows: int, wall: float, disk0: int | None, data_dir: str) -> dict:
    """WAL bytes per row, WAL buffers found full, checkpoints and the disk's write rate over a run."""
    after = _wal_counters(conn)
    wal_bytes = conn.execute("SELECT pg_wal_lsn_diff(%s, %s)", [after["lsn"], before["lsn"]]).fetchone()[0]
    disk1 = _disk_written_bytes(data_dir)
    return {"wal_bytes_per_row": round(float(wal_bytes) / max(1, rows), 1),
            "wal_mb_per_s": round(float(wal_bytes) / wall / 1e6, 1),
            "wal_fpi": after["fpi"] - before["fpi"], "wal_buffers_full": after["buffers_full"] - before["buffers_full"],
            "checkpoints": after["checkpoints"] - before["checkpoints"],
            "disk_write_mb_per_s": None if disk0 is None or disk1 is None else round((disk1 - disk0) / wall / 1e6, 1)}


def _db(env: dict, command: str) -> str:
    """`embedfleet db COMMAND` for the bench's embedded server; its output (the DSN for `uri`)."""
    return subprocess.run([sys.executable, "-m", "embedfleet.cli", "db", command], capture_output=True, text=True,
                          env=env, check=True).stdout.strip()


def set_server(env: dict, settings: list[str]) -> None:
    """ALTER SYSTEM SET each NAME=VALUE on the embedded server, then restart it (a measuring knob:
    e.g. --pg-set wal_init_zero=off,wal_buffers=256MB)."""
    with psycopg.connect(_db(env, "uri"), autocommit=True) as conn:
        alter_system(conn, name_values(settings))
    _db(env, "stop")
    _db(env, "start")


def reload_server(env: dict, settings: list[str], names: set[str]) -> None:
    """Per run: RESET every setting in `names`, ALTER SYSTEM SET this run's NAME=VALUEs, and reload (no
    restart, so only settings a reload applies: e.g. the background writer's)."""
    with psycopg.connect(_db(env, "uri"), autocommit=True) as conn:
        for name in sorted(names):
            conn.execute(sql.SQL("ALTER SYSTEM RESET {}").format(sql.Identifier(name)))
        alter_system(conn, name_values(settings), reload=True)
        time.sleep(0.5)  # the postmaster signals its children; they read the file at their next loop
        stuck = conn.execute("SELECT name FROM pg_settings WHERE name = ANY(%s) AND pending_restart",
                             [sorted(names)]).fetchall()
        if stuck:
            raise SystemExit(f"--pg-reload: {', '.join(n for n, in stuck)} need a restart: use --pg-set")


def middle_rate(workers: list[dict]) -> float | None:
    """Rows a second over each worker's tenths 4-9 (`rows_by_tenth`), summed over the workers. Rows count when
    their unit commits: only a loop of many units a tenth gives a steady figure."""
    if any(len(w.get("rows_by_tenth") or []) != 10 or not w["wall_s"] for w in workers):
        return None
    return round(sum(sum(w["rows_by_tenth"][3:9]) / (0.6 * w["wall_s"]) for w in workers), 1)


_VMSTAT = ("pgfault", "pgmajfault", "pgscan_kswapd", "pgscan_direct", "pgsteal_kswapd", "pgsteal_direct",
           "allocstall_normal", "allocstall_movable", "compact_stall", "thp_fault_alloc", "numa_hint_faults")


def _memory_counters() -> dict:
    """The host's memory counters: /proc/vmstat's (reclaim, faults), the CPU and memory pressure stall
    totals (µs), and /proc/meminfo's free, available and shared (tmpfs) memory (kB)."""
    out: dict = {}
    try:
        vm = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
        out.update({k: int(vm[k]) for k in _VMSTAT if k in vm})
        info = {line.split(":")[0]: int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()}
        out.update({k: info[k] for k in ("MemFree", "MemAvailable", "Shmem", "Cached") if k in info})
    except OSError:
        return out
    for what in ("cpu", "memory"):
        try:
            some = Path(f"/proc/pressure/{what}").read_text().splitlines()[0]
            out[f"psi_{what}_some_us"] = int(some.rsplit("total=", 1)[1])
        except (OSError, IndexError, ValueError):
            pass
    return out


def _memory_used(before: dict, after: dict, wall: float) -> dict:
    """Counters' growth over the run; meminfo as it was before and after (GB); stall totals as shares of the wall."""
    out = {k: after[k] - before[k] for k in _VMSTAT if k in before and k in after}
    out.update({f"{k}_gb": [round(before[k] / 2**20, 1), round(after[k] / 2**20, 1)]
                for k in ("MemFree", "MemAvailable", "Shmem", "Cached") if k in before and k in after})
    out.update({f"{k[:-3]}_share": round((after[k] - before[k]) / 1e6 / wall, 4)
                for k in ("psi_cpu_some_us", "psi_memory_some_us") if k in before and k in after})
    return out


def run_once(data: list[Path], gpus: int, model: str | None, env: dict, preset: str, extra: list[str],
             cpu: bool = False, index: bool = True, per_gpu: int = 1, gil: tuple | None = None,
             partitions: int = 0) -> dict:
    table = f"bench_{gpus}gpu_{int(time.time())}"
    devices = f"cpu --workers {gpus}" if cpu else "cuda:" + ",".join(str(i) for i in range(gpus))
    if per_gpu > 1 and not cpu:
        devices += f" --workers {gpus * per_gpu}"
    cmd = [sys.executable, "-m", "embedfleet.cli", "ingest", *map(str, data), "--preset", preset, "--table", table,
           "--devices", *devices.split(), "--no-index", "--json", *extra]
    if model:
        cmd += ["--model", model]
    sampler = GpuSampler(list(range(gpus)))
    sampler.start()
    dsn = _db(env, "uri")
    if partitions:
        cmd += ["--partitions", str(partitions)]
    pg_waits = PgWaitSampler(dsn)
    pg_waits.start()
    with psycopg.connect(dsn, autocommit=True) as conn:
        wal0, writes0 = _wal_counters(conn), _buffer_writes(conn)
        data_dir = conn.execute("SHOW data_directory").fetchone()[0]
    disk0 = _disk_written_bytes(data_dir)
    t0, host0, pg0, mem0 = time.perf_counter(), host_ticks(), _postgres_cpu_s(), _memory_counters()
    t0_wall = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    gil_sampler = GilSampler(proc.pid, *gil) if gil else None
    if gil_sampler:
        gil_sampler.start()
    stdout, stderr = proc.communicate()
    p = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    wall = time.perf_counter() - t0
    if gil_sampler:
        gil_sampler.join()
    host, pg1 = host_shares(host0, host_ticks()) or {}, _postgres_cpu_s()
    memory = _memory_used(mem0, _memory_counters(), wall)
    util = sampler.stop()
    waits = pg_waits.stop()
    sys.stderr.write(p.stderr[-4000:])
    if p.returncode != 0:
        raise SystemExit(f"ingest failed ({p.returncode})")
    summary = orjson.loads(p.stdout)
    workers = summary["workers"]
    rows = summary["rows_written"]
    conn = psycopg.connect(dsn, autocommit=True)  # for what is read and dropped once the run is over
    wal = _wal_used(conn, wal0, rows, wall, disk0, data_dir)
    writes1 = _buffer_writes(conn)
    buffer_writes = {who: n - writes0.get(who, 0) for who, n in writes1.items() if n > writes0.get(who, 0)}
    # The loops' span, from the first worker's start to the last one's end (start-up excluded, but a
    # worker that starts late counts against the rate).
    loop = round(max(w["started_at"] + w["wall_s"] for w in workers) - min(w["started_at"] for w in workers), 3)
    # While every worker ran (the later start to the earlier end): the steady state of a long job,
    # without the seconds where one worker starts up or finishes its last chunk alone.
    together = (max(w["started_at"] for w in workers), min(w["started_at"] + w["wall_s"] for w in workers))
    rows_together = _rows_finished(conn, table, *together)
    timeline = _timeline(conn, table, t0_wall, wall, workers, summary.get("finalize"))
    first_start = min(w["started_at"] for w in workers)
    tenths = pg_waits.tenths(first_start, first_start + loop)
    from embedfleet.pg.ddl import analyze, finish_table

    t0 = time.perf_counter()  # the job's ANALYZE again: what a table's statistics cost once its pages are warm
    analyze(conn, sql.Identifier(table), dsn)
    analyze_again_s = round(time.perf_counter() - t0, 3)
    index_s = None
    if index:
        t_idx = time.perf_counter()
        finish_table(conn, table, index=True, dsn=dsn)  # on this connection: the time is the build's, no interpreter start
        index_s = round(time.perf_counter() - t_idx, 2)
    # Drop the table: once its job ends autovacuum would visit all of it, during the next run (with
    # data checksums, full page copies into the WAL) — seen in runs 39-43, docs/archive/NOTES.md.
    with conn:
        conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))
    return {
        "gpus": gpus, "rows": rows, "wall_s": round(wall, 2), "rows_per_s_wall": round(rows / wall, 1),
        "loop_s": loop, "rows_per_s_steady": round(rows / loop, 1), "gpu_util_pct": util,
        "all_running_s": round(together[1] - together[0], 3),
        "rows_per_s_all_running": round(rows_together / (together[1] - together[0]), 1) if together[1] > together[0] else None,
        # each worker's own rows / its own loop, summed
        "rows_per_s_workers_sum": round(sum(w["rows"] / w["wall_s"] for w in workers), 1),
        # each worker's tenths 4-9 of its loop, summed: the steady state without the start (the compile
        # loading beside the loop) and the end (the last units)
        "rows_per_s_middle": middle_rate(workers),
        "start_stagger_s": round(max(w["started_at"] for w in workers) - min(w["started_at"] for w in workers), 3),
        "helpers_busy": [round(w["helper_busy_s"] / (w["helpers"] * w["wall_s"]), 3) for w in workers if w["helpers"]],
        # the workers' loop threads' time ready but without a CPU, a share of their loops; and the share of
        # the helpers' preparing time off the CPU (a run queue, or the hypervisor's steal)
        "loop_run_queue_share": [round(w["run_queue_s"]["loop"] / w["wall_s"], 4) for w in workers
                                 if "loop" in w.get("run_queue_s", {})],
        # the loops' share queuing work on the device (the rest of embedding waits for it), and per row the
        # worker processes' page faults and context switches
        "loop_launch_share": [round(w["launch_s"] / w["wall_s"], 3) for w in workers if "launch_s" in w],
        "worker_rusage_per_krow": {k: round(sum(w["rusage"][k] for w in workers) / max(1, rows) * 1000, 2)
                                   for k in ("minflt", "nvcsw", "nivcsw")} if all("rusage" in w for w in workers) else None,
        "helpers_off_cpu": round(1 - sum(w["helper_cpu_s"] for w in workers) / max(1e-9, sum(w["helper_busy_s"] for w in workers)), 3),
        "db_share_of_loop": round(max(w["db_s"] / w["wall_s"] for w in workers), 3),
        "gpu_waited_on_db_s": round(max(w["sink_wait_s"] for w in workers), 3),
        "gpu_waited_on_input_s": round(max(w["input_wait_s"] for w in workers), 3),
        "tokens_per_s_steady": round(sum(w["tokens"] for w in workers) / loop, 1),
        # Where the host's CPU went over the whole command (start-up included): all cores' busy
        # share, and CPU µs per row in the workers' processes, their helpers and PostgreSQL.
        "host_cpu_busy": host.get("busy"), "host_cpu_stolen": host.get("stolen"),
        "cpu_us_per_row": {"workers": round(sum(w["cpu_s"] for w in workers) / rows * 1e6, 1),
                           "helpers": round(sum(w["helper_cpu_s"] for w in workers) / rows * 1e6, 1),
                           "postgres": round(_cpu_used(pg0, pg1) / rows * 1e6, 1)} if rows else None,
        "pg_waits": waits,  # client connections: share of samples per wait event (CPU: none)
        "host_and_pg_by_tenth": tenths,  # the loops' tenths: stolen, the clients' waits, checkpoint and WAL writer
        "wal": wal,  # over the whole command: WAL volume, WAL buffers found full, checkpoints, disk writes
        "memory": memory,  # the host's reclaim, faults, pressure stalls and free memory over the command
        "buffer_writes": buffer_writes,  # pages written out of shared buffers over the command, by backend type
        "records_thread_s": {k: round(max(w.get(k, 0) for w in workers), 3)
                             for k in ("read_s", "claim_s", "collect_s", "records_blocked_s")},
        "timeline_s": timeline, "finalize": summary.get("finalize"), "analyze_again_s": analyze_again_s,
        "hnsw_index_s": index_s, "workers_per_gpu": 1 if cpu else per_gpu,
        "gil": gil_sampler.result if gil_sampler else None, "workers": workers,
        "time_shares": summary.get("time_shares"),  # what ingest itself says held the devices
    }


def _timeline(conn, job: str, t0: float, wall: float, workers: list[dict], finalize: dict | None = None) -> dict:
    """Where the command's wall time went (issue 17's wall rate): seconds from its start to the job's row,
    to the job running (planned), to the first worker's loop (a worker's start-up), the loops' span, to
    the workers' last word (their summaries), to the launcher's end (seeing them end), to the job marked
    done (the table's statistics, its index), and to the exit."""
    created, started, finished = conn.execute(
        "SELECT extract(epoch FROM created), extract(epoch FROM started), extract(epoch FROM finished) "
        "FROM embedfleet.jobs WHERE job = %s", [job]).fetchone()
    ended = conn.execute("SELECT extract(epoch FROM max(heartbeat)) FROM embedfleet.workers WHERE job = %s "
                         "AND state = 'finished'", [job]).fetchone()[0]  # a worker's last word sets its heartbeat
    first = min(w["started_at"] for w in workers)
    last = max(w["started_at"] + w["wall_s"] for w in workers)
    marks = [("to_job_created", float(created)), ("to_job_running", float(started or created)),
             ("to_first_loop", first), ("loops", last), ("to_workers_ended", float(ended or last)),
             ("to_launcher_done", float(finalize["started_at"]) if finalize else float(ended or last)),
             ("to_job_done", float(finished or last)), ("to_exit", t0 + wall)]
    out, prev = {}, t0
    for name, t in marks:
        out[name] = round(t - prev, 2)
        prev = t
    return out


def _rows_finished(conn, job: str, t0: float, t1: float) -> int:
    """Rows of the job's chunks that committed between epoch seconds t0 and t1 (the ledger's clock)."""
    return conn.execute("SELECT coalesce(sum(rows_written), 0)::bigint FROM embedfleet.chunks WHERE job = %s "
                        "AND finished >= to_timestamp(%s) AND finished < to_timestamp(%s)", [job, t0, t1]).fetchone()[0]


def encoder_alone(data: Path, model: str | None, n: int) -> dict:
    """`embedfleet bench`'s timing (tokenisation included, no sentence-transformers) on exactly the
    texts the ingest embedded: the first `n` records' contents, as the preset renders them."""
    from itertools import islice

    from embedfleet.encode.bench import run_bench
    from embedfleet.sources.records import to_records
    from embedfleet.sources import read_chunk
    from embedfleet.sources.plan import ChunkSpec
    from embedfleet.sources.presets import get_preset

    raws = list(islice(read_chunk(ChunkSpec(str(data), "jsonl", 0, data.stat().st_size, 1)), n))
    records, _ = to_records(raws, get_preset("amazon-reviews"))
    from embedfleet.encode.models import resolve_model

    result = run_bench(model=str(resolve_model(model)), st=False, texts=[r.content for r in records])
    row = result["results"][0]
    return {"gpu": result["gpu"], **{k: row[k] for k in ("n", "texts_s", "tokens_s", "mfu", "mean_tokens")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--gpus", default="1,2")
    ap.add_argument("--model", default=None)
    ap.add_argument("--shape", default=None, help="random-weight shape (e.g. qwen3-0.6b) instead of --model")
    ap.add_argument("--work", default="/tmp/efbench")
    ap.add_argument("--out", default=None)
    ap.add_argument("--chunk-bytes", default=None)
    ap.add_argument("--batch-tokens", default=None, help="passed to ingest (default: its auto)")
    ap.add_argument("--cpu", action="store_true", help="smoke-test the script without GPUs")
    ap.add_argument("--no-index", action="store_true", help="skip timing the HNSW build")
    ap.add_argument("--vs-bench", type=int, default=0, metavar="N",
                    help="also time the encoder alone (embedfleet bench's code) on the first N texts of this corpus")
    ap.add_argument("--per-gpu", action="store_true",
                    help="--n rows for each GPU: a run on g GPUs ingests g×n (--limit), so every run's loops last as long "
                         "and its start (the graph loading while the loop runs eager) weighs as much")
    ap.add_argument("--warmup", type=int, default=0, metavar="N",
                    help="first an untimed ingest of N rows on the most GPUs (a fresh machine's caches: files, compiled kernels)")
    ap.add_argument("--shards", type=int, default=1, metavar="K",
                    help="the N reviews as K files written in parallel (other texts than one file's): for long runs")
    ap.add_argument("--workers-per-gpu", default="1", metavar="K[,K…]",
                    help="worker processes on each GPU, per run in --gpus order (cycled): e.g. 1,1,2,2")
    ap.add_argument("--dtype", default="float", metavar="D[,D…]",
                    help="ingest's --dtype per run in --gpus order (cycled): e.g. float,half with --gpus 4,4")
    ap.add_argument("--helpers", default=None, metavar="K[,K…]",
                    help="helper processes a worker per run in --gpus order (cycled; EMBEDFLEET_PREP_WORKERS): default, ingest's own")
    ap.add_argument("--helper-nice", default=None, metavar="K[,K…]",
                    help="EMBEDFLEET_HELPER_NICE per run, in turn (default: the environment's)")
    ap.add_argument("--compile", default="on", metavar="on|off|wait[,…]",
                    help="per run in --gpus order (cycled): off runs it with EMBEDFLEET_COMPILE=0 (the loop eager throughout), "
                         "wait with EMBEDFLEET_COMPILE_WAIT=1 (the loop starts once compiled)")
    ap.add_argument("--gil", default=None, metavar="START:SECONDS:PY_SPY",
                    help="sample which worker threads hold the GIL (py-spy at this path), START s into each run")
    ap.add_argument("--partitions", default="0", metavar="P[,P…]",
                    help="per run in --gpus order (cycled): ingest --partitions P, the table as P hash partitions of its id (0: one relation)")
    ap.add_argument("--pg-set", default=None, metavar="NAME=VALUE,…",
                    help="ALTER SYSTEM these settings on the embedded server and restart it before the runs")
    ap.add_argument("--pg-reload", default=None, metavar="SETTINGS[;…]",
                    help="per run in --gpus order (cycled), settings a reload applies: NAME=VALUE,… or default for the "
                         "server's own; e.g. 'default;bgwriter_delay=10ms,bgwriter_lru_maxpages=10000'")
    ap.add_argument("--home", default=None, metavar="DIR",
                    help="EMBEDFLEET_HOME of the runs (server, caches; default WORK/home): a fresh DIR, a fresh server")
    args = ap.parse_args()
    from embedfleet.synth import cached_review_shards, cached_reviews

    work = Path(args.work)
    counts = [int(g) for g in args.gpus.split(",")]
    total = args.n * max(counts) if args.per_gpu else args.n
    data = [cached_reviews(work, total)] if args.shards == 1 else cached_review_shards(work, total, args.shards)
    model = args.model
    if args.shape:
        from embedfleet.encode.shapes import build_random_model

        model = str(build_random_model(args.shape, work / args.shape))
    env = dict(os.environ, EMBEDFLEET_HOME=args.home or str(work / "home"))
    extra = ["--chunk-bytes", args.chunk_bytes] if args.chunk_bytes else []
    extra += ["--batch-tokens", args.batch_tokens] if args.batch_tokens else []
    if args.pg_set or args.pg_reload:
        # tuned at its first start, then left as the knobs set it: the tuning would set its own (wal_init_zero) back
        _db(env, "uri")
        env["EMBEDFLEET_PG_TUNE"] = "0"
    if args.pg_set:
        set_server(env, args.pg_set.split(","))
    warmup = None
    if args.warmup:  # kept: whether its compile reached the cache that the timed runs load from
        w = run_once(data, max(counts), model, env, "amazon-reviews", extra + ["--limit", str(args.warmup)],
                     args.cpu, False)
        warmup = {"rows_per_s_steady": w["rows_per_s_steady"],
                  "compile": [x["startup"].get("compile") for x in w["workers"]],
                  "compile_first": w["workers"][0]["startup"].get("compile_first")}
        if not any(c and c.get("state") == "compiled" for c in warmup["compile"]):
            # a small model compiles only for jobs past 1 GiB (runtime.worker.compile_pays): ~1.8M reviews
            print("[ingest] the warm-up did not compile (too small to pay for it): the first timed run compiles cold",
                  file=sys.stderr, flush=True)
    per = [int(k) for k in args.workers_per_gpu.split(",")]
    dtypes = args.dtype.split(",")
    compiles = args.compile.split(",")
    helpers = args.helpers.split(",") if args.helpers else [None]
    nices = args.helper_nice.split(",") if args.helper_nice else [None]
    partitions = [int(k) for k in args.partitions.split(",")]
    reloads = [[] if v.strip() in ("", "default") else v.split(",") for v in args.pg_reload.split(";")] if args.pg_reload else None
    reloaded = {name for v in reloads or [] for name in name_values(v)}
    gil = None
    if args.gil:
        start, seconds, py_spy = args.gil.split(":", 2)
        gil = (float(start), float(seconds), py_spy)
    results = []
    for i, g in enumerate(counts):
        dtype, compiled = dtypes[i % len(dtypes)], compiles[i % len(compiles)]
        run_env = {"on": env, "off": dict(env, EMBEDFLEET_COMPILE="0"), "wait": dict(env, EMBEDFLEET_COMPILE_WAIT="1")}[compiled]
        if helpers[i % len(helpers)]:
            run_env = dict(run_env, EMBEDFLEET_PREP_WORKERS=helpers[i % len(helpers)])
        if nices[i % len(nices)]:
            run_env = dict(run_env, EMBEDFLEET_HELPER_NICE=nices[i % len(nices)])
        if reloads:
            reload_server(env, reloads[i % len(reloads)], reloaded)
        limit = ["--limit", str(args.n * g)] if args.per_gpu else []
        results.append(run_once(data, g, model, run_env, "amazon-reviews", extra + limit + ["--dtype", dtype], args.cpu,
                                not args.no_index, per[i % len(per)], gil, partitions[i % len(partitions)]))
        results[-1]["dtype"], results[-1]["compile"] = dtype, compiled
        results[-1]["partitions"] = partitions[i % len(partitions)]
        results[-1]["helpers"] = results[-1]["workers"][0]["helpers"]
        results[-1]["helper_nice"] = int(run_env.get("EMBEDFLEET_HELPER_NICE") or 0)
        results[-1]["pg_reload"] = (",".join(reloads[i % len(reloads)]) or "default") if reloads else None
        if args.out:  # each run as it ends: a command cut short by its timeout keeps the runs before
            Path(args.out).write_text(json.dumps(harness.stamp({"partial": True, "results": results}), indent=2))
        r = results[-1]
        print(f"[ingest] {g} GPU, {dtype}, compile {compiled}, {r['helpers']} helpers (nice {r['helper_nice']}), {r['partitions']} partitions, server {r['pg_reload'] or 'as set'}: {r['rows_per_s_steady']:,.0f} rows/s steady, {r['rows_per_s_all_running']} while all "
              f"ran, {r['rows_per_s_workers_sum']:,.0f} workers' sum, {r['rows_per_s_middle'] or 0:,.0f} middle tenths, wall {r['wall_s']} s {r['timeline_s']}",
              file=sys.stderr, flush=True)
    # Against the first GPU count's rate per GPU, averaged over its runs (--gpus 1,2,1,2 repeats them).
    first = [r for r in results if r["gpus"] == results[0]["gpus"]]

    def per_gpu(key):
        return None if any(r[key] is None for r in first) else sum(r[key] / r["gpus"] for r in first) / len(first)

    def ratio(value, base, gpus):  # value against `gpus` × base; None when either is unknown
        return None if value is None or not base else round(value / (base * gpus), 3)

    for r in results:
        for key, name in (("rows_per_s_steady", "steady"), ("rows_per_s_all_running", "all_running"),
                          ("rows_per_s_workers_sum", "workers_sum"), ("rows_per_s_middle", "middle"),
                          ("rows_per_s_wall", "wall")):
            r[f"scaling_vs_linear_{name}"] = ratio(r[key], per_gpu(key), r["gpus"])
    for i, r in enumerate(results):  # pair by pair: against the latest run of the first GPU count before it
        base = next((b for b in reversed(results[:i]) if b["gpus"] == results[0]["gpus"]), None)
        if base is not None and r["gpus"] != base["gpus"]:
            for key, name in (("rows_per_s_steady", ""), ("rows_per_s_all_running", "_all_running")):
                r[f"scaling_vs_previous{name}"] = ratio(r[key], base[key] and base[key] / base["gpus"], r["gpus"])
    doc = harness.stamp({"n": args.n, "per_gpu": args.per_gpu, "shards": args.shards, "model": model or "bundled all-MiniLM-L6-v2", "pg_set": args.pg_set,
           "warmup": warmup, "results": results})
    if args.vs_bench:
        alone = encoder_alone(data[0], model, args.vs_bench)
        doc["encoder_alone"] = alone
        for r in results:  # per GPU: the pipeline's steady rate against the encoder by itself
            r["vs_encoder_alone_texts"] = round(r["rows_per_s_steady"] / r["gpus"] / alone["texts_s"], 3)
            r["vs_encoder_alone_tokens"] = round(r["tokens_per_s_steady"] / r["gpus"] / alone["tokens_s"], 3)
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    for r in results:
        gil = {pid: (g.get("gil_busy"), g.get("threads")) for pid, g in (r["gil"] or {}).items()}
        print(f"{r['gpus']} GPU ({r['workers_per_gpu']} worker(s) each, {r['dtype']}): {r['rows_per_s_steady']:,.0f} rows/s steady, "
              f"{r['rows_per_s_wall']:,.0f} wall, "
              f"util {r['gpu_util_pct']}, db share {r['db_share_of_loop']}, "
              f"GPU waited on DB {r['gpu_waited_on_db_s']}s, scaling {r['scaling_vs_linear_steady']} "
              f"(pair by pair {r.get('scaling_vs_previous', '-')}); while all ran: {r['rows_per_s_all_running']} "
              f"rows/s over {r['all_running_s']} s, scaling {r['scaling_vs_linear_all_running']} "
              f"(pair by pair {r.get('scaling_vs_previous_all_running', '-')}) "
              f"(sum of workers' rates {r['scaling_vs_linear_workers_sum']}, start stagger {r['start_stagger_s']} s), "
              f"helpers busy {r['helpers_busy']} (off CPU {r['helpers_off_cpu']}), loops' run queue {r['loop_run_queue_share']}, launching {r['loop_launch_share']}, per 1k rows {r['worker_rusage_per_krow']}, host CPU busy {r['host_cpu_busy']} (stolen {r['host_cpu_stolen']}), CPU µs/row {r['cpu_us_per_row']}, "
              f"records thread (max of workers) {r['records_thread_s']}, GIL {gil}, pg waits {r['pg_waits']}, "
              f"wal {r['wal']}, pages written {r['buffer_writes']}, time shares {r['time_shares']}"
              + (f", vs encoder alone {r['vs_encoder_alone_texts']} (texts) {r['vs_encoder_alone_tokens']} (tokens)"
                 if "vs_encoder_alone_texts" in r else ""))


if __name__ == "__main__":
    main()
