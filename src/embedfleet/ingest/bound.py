"""What bound a job: where its workers' loops spent their time, from their summaries, and one line for the user.

A device's loop either embeds, waits for input (its helpers reading, templating and tokenizing units),
or waits for the database (its writers' queues full, and at the end its own last commits). A user
wondering whether more GPUs would help is told which of these held them: with four H100s on MiniLM
it is PostgreSQL, its disk, or in memory the CPU it shares with the workers once the machine's hypervisor
takes a few percent of it (docs/decisions/job-bound-line.md); with a large model the GPUs themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

SHOWN_AFTER_S = 5.0  # loops shorter than this (summed over workers) are mostly start-up: nothing said
DATABASE_BOUND = 0.10  # shares of the loops past which that wait is named the job's bound
INPUT_BOUND = 0.25
STOLEN_SHOWN = 0.05  # the host's CPU taken by its hypervisor from which PostgreSQL fell behind several GPUs


def time_shares(summaries: list[dict], since: float = 0.0) -> dict | None:
    """{"embedding", "input", "database"}: shares of the loop time of the workers whose loops started at
    or after `since` (epoch seconds: this run's, not an earlier run's of the same job), summed over them;
    None when they ran too briefly to say. A loop's last wait is not input: a worker's input ends only
    once its own chunks are committed (that part is the database's) and no other worker's chunk could
    still come back (that part, the job's tail, is neither)."""
    summaries = [s for s in summaries if s.get("started_at", 0.0) >= since]
    wall = sum(s.get("wall_s", 0.0) for s in summaries)
    if wall < SHOWN_AFTER_S:
        return None
    end = sum(s.get("end_wait_s", 0.0) for s in summaries)
    tail = sum(s.get("tail_wait_s", 0.0) for s in summaries)
    embedding = sum(s.get("embed_s", 0.0) for s in summaries)
    database = sum(s.get("sink_wait_s", 0.0) for s in summaries) + end
    waited = max(0.0, sum(s.get("input_wait_s", 0.0) for s in summaries) - end - tail)
    return {"embedding": round(embedding / wall, 3), "input": round(waited / wall, 3),
            "database": round(database / wall, 3)}


class HostTicks(NamedTuple):
    """CPU ticks of this host since boot: busy, all, and stolen (taken by the hypervisor of a virtual machine)."""
    busy: int
    total: int
    stolen: int


def host_ticks(stat_line: str | None = None) -> HostTicks | None:
    """This host's CPU ticks from /proc/stat's first line; None where there is no /proc/stat."""
    if stat_line is None:
        try:
            stat_line = Path("/proc/stat").read_text().split("\n", 1)[0]
        except OSError:
            return None
    # user nice system idle iowait irq softirq steal; the guest fields after them are counted in user already
    v = [int(x) for x in stat_line.split()[1:9]]
    return HostTicks(busy=sum(v) - v[3] - v[4], total=sum(v), stolen=v[7])


def run_queue_seconds(thread: int | None = None) -> float | None:
    """Seconds this process's threads (or its thread `thread`, a native id) have spent ready to run but
    waiting for a CPU, from /proc's schedstat (its second field); None without it. A hypervisor's steal
    is not in it: the guest counts stolen time as running."""
    tasks = [Path(f"/proc/self/task/{thread}")] if thread is not None else Path("/proc/self/task").glob("*")
    total, seen = 0, False
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[1])
            seen = True
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile, or no schedstats
            continue
    return total / 1e9 if seen else None


def host_shares(before: HostTicks | None, after: HostTicks | None) -> dict | None:
    """{"busy", "stolen"}: shares of the host's CPU time between two `host_ticks` readings."""
    if before is None or after is None or after.total <= before.total:
        return None
    total = after.total - before.total
    return {"busy": round((after.busy - before.busy) / total, 3),
            "stolen": round((after.stolen - before.stolen) / total, 3)}


def bound_line(shares: dict, host: dict | None = None, one_table_many_writers: bool = False,
               stores_half: bool = False) -> str:
    """One line: the shares, the bound where one stands out, and the hypervisor where it took enough of the
    host's CPU (`host`, from `host_shares`) to slow what runs there. Several workers writing one relation
    are told of --partitions: they queue on the lock that grows it (docs/decisions/partitions.md). A job
    storing `vector` is told of --dtype half: less WAL a row (docs/decisions/halfvec.md)."""
    line = (f"devices' time: {shares['embedding']:.0%} embedding, {shares['input']:.0%} waiting for input, "
            f"{shares['database']:.0%} waiting for the database")
    if shares["database"] >= DATABASE_BOUND and shares["database"] >= shares["input"]:
        hints = (["a new table made with --partitions 8 grows under 8 locks"] if one_table_many_writers else []) \
            + ([] if stores_half else ["a new table made with --dtype half writes 30% less WAL"]) + ["a faster disk helps"]
        line += " — the database is this job's bound: more devices will not help; " + ", ".join(hints)
    elif shares["input"] >= INPUT_BOUND:
        line += " — input is this job's bound: the host's CPUs read, template and tokenize"
    if host and host["stolen"] >= STOLEN_SHOWN:
        line += (f"; this machine's hypervisor took {host['stolen']:.0%} of its CPU meanwhile, "
                 "which slows the helpers and a database on it")
    return line
