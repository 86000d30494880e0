"""What bound a job: where its workers' loops spent their time, from their summaries, and one line for the user.

A device's loop either embeds, waits for input (its helpers reading, templating and tokenizing units),
or waits for the database (its writers' queues full, and at the end its own last commits). A user
wondering whether more GPUs would help is told which of these held them: with four H100s on MiniLM
it is PostgreSQL, its disk or in memory its write path (bench/NOTES.md, runs 112-121), with a large model the
GPUs themselves.
"""

from __future__ import annotations

SHOWN_AFTER_S = 5.0  # loops shorter than this (summed over workers) are mostly start-up: nothing said
DATABASE_BOUND = 0.10  # shares of the loops past which that wait is named the job's bound
INPUT_BOUND = 0.25


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


def bound_line(shares: dict) -> str:
    """One line: the shares, and the bound where one stands out."""
    line = (f"devices' time: {shares['embedding']:.0%} embedding, {shares['input']:.0%} waiting for input, "
            f"{shares['database']:.0%} waiting for the database")
    if shares["database"] >= DATABASE_BOUND and shares["database"] >= shares["input"]:
        return line + (" — the database is this job's bound: more devices will not help; "
                       "--dtype half writes 30% less, a faster disk more")
    if shares["input"] >= INPUT_BOUND:
        return line + " — input is this job's bound: the host's CPUs read, template and tokenize"
    return line
