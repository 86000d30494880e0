"""PostgreSQL as the input: what the trigger costs the application's INSERTs, how a `--from-table` backfill
compares with ingesting the same rows from a file, and how far `sync --follow` lags behind a source that keeps
changing.

    python bench/sync.py --rows 1000000 --rates 1000,10000 --seconds 30 [--model DIR] [--devices cuda]
                         [--parts trigger,backfill,lag] [--db DSN] [--out sync.json]

- trigger: pgbench (the server's own), single-row INSERTs (or --trigger-statement update-text|update-other: UPDATEs
  of random rows' text, or of a column sync does not read) from --clients connections for --pgbench-seconds,
  alternating no trigger / sync's trigger (`pg.queue.install`, nobody draining) --rounds times; the overhead is
  1 - median(with) / median(without), and `overhead_paired` 1 - the median of each round's with / without.
- backfill: --rows rows written both as a table and as a JSONL file of the same records; `ingest FILE` and
  `ingest --from-table` each into a new table (no index), alternated, rows/s over the wall and over the workers'
  loops (steady).
- lag: `sync --follow` on a source of --rows rows; then --writers processes change it at each --rates changes/s
  (inserts, updates of the text, deletes: 5:3:2, in transactions of a 20 ms tick's changes) for --seconds; `lag_s`
  (the oldest queued change's age) sampled every 0.25 s: median, p95, max, and the seconds to drain at the end;
  then the target's recall@10 against exact search. `--live-efc N`: the target index's ef_construction for the
  rows that arrive after the backfill.
One JSON document on stdout (the environment stamp first); progress on stderr.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson
import psycopg

import harness
from _cli import loop_span, run_json

WORDS = ("the phone charger cable broke after a week but the battery and screen are fine great value would buy "
         "again naïve café Straße 東京 🙂").split()


def say(*parts) -> None:
    print("[sync]", *parts, file=sys.stderr, flush=True)


def _text(rng: np.random.Generator) -> str:
    return " ".join(rng.choice(WORDS, size=int(rng.integers(8, 120))))


def _write_source(conn: psycopg.Connection, name: str, n: int, jsonl: Path | None = None, seed: int = 0) -> None:
    conn.execute(f"DROP TABLE IF EXISTS {name} CASCADE")
    conn.execute(f"CREATE TABLE {name} (id bigint PRIMARY KEY, title text, body text, stars int)")
    rng = np.random.default_rng(seed)
    out = jsonl.open("wb") if jsonl else None
    with conn.cursor() as cur, cur.copy(f"COPY {name} FROM STDIN") as copy:
        for i in range(n):
            row = (i, f"title {i}", _text(rng), int(rng.integers(1, 6)))
            copy.write_row(row)
            if out:
                out.write(orjson.dumps({"id": i, "title": row[1], "body": row[2], "stars": row[3]}) + b"\n")
    if out:
        out.close()
    conn.execute(f"ANALYZE {name}")


def _pgbench() -> str:
    import pgserver

    return str(Path(pgserver.__file__).parent / "pginstall" / "bin" / "pgbench")


TRIGGER_STATEMENTS = {
    "insert": "INSERT INTO bench_trig (body, stars) VALUES ('a review of a phone charger that broke after a week, "
              "but the seller replaced it', 3);",
    # UPDATEs of random rows of a 20,000-row table: of the text sync reads, and of a column it does not
    "update-text": "\\set id random(1, 20000)\nUPDATE bench_trig SET body = 'edited ' || :id || random() WHERE id = :id;",
    "update-other": "\\set id random(1, 20000)\nUPDATE bench_trig SET views = views + 1 WHERE id = :id;",
}


def trigger_cost(conn, dsn: str, clients: int, seconds: int, rounds: int, statement: str = "insert") -> dict:
    from embedfleet.pg import queue

    conn.execute("DROP TABLE IF EXISTS bench_trig CASCADE")
    conn.execute("CREATE TABLE bench_trig (id bigserial PRIMARY KEY, body text, stars int, views int DEFAULT 0)")
    q = queue.queue_for("public.bench_trig", "id", "bench_trig")
    script = Path(tempfile.mkdtemp()) / f"{statement}.sql"
    script.write_text(TRIGGER_STATEMENTS[statement] + "\n")

    def fill() -> None:
        if statement != "insert":
            conn.execute("INSERT INTO bench_trig (id, body, stars) SELECT i, 'a review of a phone charger ' || i, 3 "
                         "FROM generate_series(1, 20000) i")
    fill()
    tps: dict[str, list[float]] = {"without": [], "with": []}
    for r in range(rounds):
        for mode in (("without", "with") if r % 2 == 0 else ("with", "without")):
            if mode == "with":
                queue.install(conn, q, ["body"])
            conn.execute("CHECKPOINT")  # each round from a clean start: no full-page images left to a round's luck
            p = subprocess.run([_pgbench(), "-n", "-c", str(clients), "-j", str(clients), "-T", str(seconds),
                                "-f", str(script), dsn], capture_output=True, text=True)
            if p.returncode:
                raise SystemExit(f"pgbench failed: {p.stderr[-2000:]}")
            value = next(float(line.split("=")[1].split()[0]) for line in p.stdout.splitlines()
                         if line.startswith("tps ="))
            tps[mode].append(value)
            queue.uninstall(conn, q)
            conn.execute("TRUNCATE bench_trig")
            fill()
            say(f"trigger round {r}: {mode} {value:,.0f} {statement}s/s")
    without, with_ = statistics.median(tps["without"]), statistics.median(tps["with"])
    # each round's two runs side by side: a host's drift between rounds (its disk, its neighbours) cancels
    paired = statistics.median(w / wo for w, wo in zip(tps["with"], tps["without"]))
    return {"statement": statement, "clients": clients, "seconds": seconds, "per_s": tps, "median_without": without,
            "median_with": with_, "overhead": round(1 - with_ / without, 4), "overhead_paired": round(1 - paired, 4)}


def backfill(conn, n: int, common: list[str], work: Path, rounds: int) -> dict:
    jsonl = work / "bench_src.jsonl"
    _write_source(conn, "bench_src", n, jsonl)
    runs: dict[str, list[dict]] = {"file": [], "table": []}
    for r in range(rounds):
        for kind in (("file", "table") if r % 2 == 0 else ("table", "file")):
            table = f"bench_{kind}_{r}"
            conn.execute(f"DROP TABLE IF EXISTS {table}")
            args = ([str(jsonl), "--id-field", "id"] if kind == "file" else ["--from-table", "bench_src"])
            _, wall, doc = run_json(["ingest", *args, "--text-field", "body", "--table", table, "--job", table,
                                     "--no-index", "--quiet", "--json", *common])
            _, span = loop_span(doc["workers"])
            runs[kind].append({"rows": doc["rows_written"], "wall_s": round(wall, 2),
                               "rows_s_wall": round(doc["rows_written"] / wall), "loop_s": round(span, 2),
                               "rows_s_steady": round(doc["rows_written"] / span)})
            say(f"backfill round {r}: {kind} {runs[kind][-1]}")
            conn.execute(f"DROP TABLE IF EXISTS {table}")
            conn.execute("DELETE FROM embedfleet.jobs WHERE job = %s", [table])
    best = {k: max(x["rows_s_steady"] for x in v) for k, v in runs.items()}
    walls = {k: max(x["rows_s_wall"] for x in v) for k, v in runs.items()}
    return {"rows": n, "runs": runs, "table_over_file_steady": round(best["table"] / best["file"], 3),
            "table_over_file_wall": round(walls["table"] / walls["file"], 3)}


def _writer(dsn: str, rate: float, seconds: float, first_id: int, stop, changes, seed: int):
    """One application connection, in a process of its own (threads sharing one GIL fell short of the rates asked)."""
    rng = np.random.default_rng(seed)
    tick = 0.02
    per_tick = rate * tick
    carry, next_id, live = 0.0, first_id, []
    with psycopg.connect(dsn, autocommit=True) as app:
        t_end = time.perf_counter() + seconds
        t_next = time.perf_counter()
        while time.perf_counter() < t_end and not stop.is_set():
            carry += per_tick
            k, carry = int(carry), carry - int(carry)
            inserts = updates = deletes = 0
            with app.pipeline(), app.transaction(), app.cursor() as cur:  # one round trip a tick, as a busy app
                for _ in range(k):
                    u = rng.random()
                    if u < 0.5 or not live:
                        cur.execute("INSERT INTO bench_lag VALUES (%s, 't', %s, 3)", [next_id, _text(rng)])
                        live.append(next_id)
                        next_id += 1
                        inserts += 1
                    elif u < 0.8:
                        cur.execute("UPDATE bench_lag SET body = %s WHERE id = %s",
                                    [_text(rng), live[int(rng.integers(len(live)))]])
                        updates += 1
                    else:
                        cur.execute("DELETE FROM bench_lag WHERE id = %s", [live.pop(int(rng.integers(len(live))))])
                        deletes += 1
            with changes.get_lock():
                changes.value += inserts + updates + deletes
            t_next += tick
            time.sleep(max(0.0, t_next - time.perf_counter()))


def _forget_sync(conn, job: str, db: list[str]) -> None:
    from embedfleet.ledger import ledger_exists, remove_job

    if not ledger_exists(conn) or not conn.execute("SELECT 1 FROM embedfleet.jobs WHERE job = %s", [job]).fetchone():
        return
    if conn.execute("SELECT 1 FROM embedfleet.syncs WHERE job = %s", [job]).fetchone():
        run_json(["sync", "--from-table", "bench_lag", "--job", job, "--uninstall", "--quiet", "--json", *db])
    remove_job(conn, job, drop_table=True)


def recall_at_10(conn, table: str, queries: int = 100, ef_search: int = 200, seed: int = 7) -> dict:
    """Recall@10 of the table's HNSW index against the exact top 10 (no index), for queries midway between two
    random rows' vectors, at `ef_search`; and the index's ef_construction as it stands."""
    from pgvector.psycopg import register_vector

    register_vector(conn)
    ids = [i for (i,) in conn.execute(f"SELECT id FROM {table}")]
    rng = np.random.default_rng(seed)
    pairs = rng.choice(len(ids), size=(queries, 2), replace=False if len(ids) >= 2 * queries else True)
    vec = {i: v for i, v in conn.execute(f"SELECT id, embedding FROM {table} WHERE id = ANY(%s)",
                                         [[ids[j] for j in pairs.ravel()]])}
    hits = 0
    for a, b in pairs:
        q = vec[ids[a]].to_numpy() + vec[ids[b]].to_numpy()
        q = q / np.linalg.norm(q)
        top = {}
        for scan in ("exact", "index"):
            with conn.transaction():
                conn.execute(f"SET LOCAL hnsw.ef_search = {ef_search}")
                if scan == "exact":
                    conn.execute("SET LOCAL enable_indexscan = off")
                top[scan] = {i for (i,) in conn.execute(f"SELECT id FROM {table} ORDER BY embedding <=> %s LIMIT 10",
                                                        [q])}
        hits += len(top["exact"] & top["index"])
    efc = conn.execute("SELECT reloptions FROM pg_class WHERE relname = %s",
                       [f"{table}_embedding_idx"]).fetchone()
    return {"recall_at_10": round(hits / (10 * queries), 4), "ef_search": ef_search, "queries": queries,
            "index_options": efc[0] if efc else None}


def lag(conn, dsn: str, n: int, rates: list[float], seconds: float, common: list[str], writers: int,
        extra: list[str] = (), live_efc: int | None = None) -> dict:
    job = "public.bench_lag_embeddings"
    _forget_sync(conn, job, common[:2] if common[:1] == ["--db"] else [])  # each run from nothing: no queue, job or target left by an earlier one
    _write_source(conn, "bench_lag", n, seed=1)
    args = [sys.executable, "-m", "embedfleet.cli", "sync", "--from-table", "bench_lag", "--text-field", "body",
            "--follow", "--quiet", "--json", *common, *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"sync --follow ended: {proc.stderr.read()[-3000:]}")
        try:
            if conn.execute("SELECT synced_at FROM embedfleet.syncs WHERE job = %s", [job]).fetchone()[0]:
                break
        except (psycopg.Error, TypeError):
            pass
        time.sleep(0.5)
    backfill_s = time.perf_counter() - t0
    tag = conn.execute("SELECT tag FROM embedfleet.syncs WHERE job = %s", [job]).fetchone()[0]
    if live_efc:  # the rows that arrive from now on are linked into the graph with a shorter candidate list
        conn.execute(f"ALTER INDEX bench_lag_embeddings_embedding_idx SET (ef_construction = {int(live_efc)})")
    say(f"lag: backfill and first drain took {backfill_s:.1f} s")
    out = {"rows": n, "backfill_and_start_s": round(backfill_s, 2), "rates": []}
    next_first = 10 * n
    for rate in rates:
        ctx = multiprocessing.get_context("spawn")
        stop, changes, samples = ctx.Event(), ctx.Value("q", 0), []
        procs = [ctx.Process(target=_writer, args=(dsn, rate / writers, seconds, next_first + w * 10**8, stop,
                                                     changes, w)) for w in range(writers)]
        next_first += writers * 10**8
        t_start = time.perf_counter()
        for p in procs:
            p.start()
        while any(p.is_alive() for p in procs):
            row = conn.execute(f"SELECT count(*), extract(epoch FROM clock_timestamp() - min(queued)) "
                               f"FROM embedfleet.queue_{tag}").fetchone()
            samples.append((time.perf_counter() - t_start, int(row[0]), float(row[1] or 0.0)))
            time.sleep(0.25)
        wrote_s = time.perf_counter() - t_start
        t_drain = time.perf_counter()
        while conn.execute(f"SELECT count(*) FROM embedfleet.queue_{tag}").fetchone()[0]:
            time.sleep(0.1)
        drain_s = time.perf_counter() - t_drain
        steady = [s for s in samples if s[0] > min(5.0, seconds / 4)]  # past the writers' start
        lags = sorted(s[2] for s in steady) or [0.0]
        result = {"rate_asked": rate, "rate_done": round(changes.value / wrote_s), "seconds": round(wrote_s, 1),
                  "lag_s_median": round(statistics.median(lags), 3), "lag_s_p95": round(lags[int(0.95 * (len(lags) - 1))], 3),
                  "lag_s_max": round(max(lags), 3), "pending_max": max((s[1] for s in steady), default=0),
                  "drain_after_s": round(drain_s, 2)}
        out["rates"].append(result)
        say(f"lag at {rate:,.0f}/s: {result}")
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    if proc.returncode:
        raise SystemExit(f"sync --follow exited {proc.returncode}: {stderr[-3000:]}")
    out["sync_summary"] = orjson.loads(stdout)
    counts = conn.execute("SELECT (SELECT count(*) FROM bench_lag), (SELECT count(*) FROM bench_lag_embeddings)"
                          ).fetchone()
    out["source_rows"], out["target_rows"] = counts
    out["search"] = recall_at_10(conn, "bench_lag_embeddings")
    say(f"lag: search {out['search']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--rates", default="1000,10000", help="changes/s for the lag part")
    ap.add_argument("--seconds", type=float, default=30, help="seconds of changes at each rate")
    ap.add_argument("--writers", type=int, default=4, help="connections changing the source")
    ap.add_argument("--clients", type=int, default=os.cpu_count() or 2, help="pgbench clients")
    ap.add_argument("--pgbench-seconds", type=int, default=10)
    ap.add_argument("--trigger-statement", default="insert", choices=sorted(TRIGGER_STATEMENTS),
                    help="the trigger part's statement: single-row INSERTs, or UPDATEs of the text or of another column")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the trigger and backfill parts")
    ap.add_argument("--parts", default="trigger,backfill,lag")
    ap.add_argument("--model", default=None)
    ap.add_argument("--lanes", type=int, default=None, help="sync --lanes for the lag part (default: sync's)")
    ap.add_argument("--batch", type=int, default=None, help="sync --batch for the lag part (default: sync's)")
    ap.add_argument("--live-efc", type=int, default=None, help="the lag part: the target index's ef_construction "
                    "for the rows that arrive after its backfill (default: as built)")
    ap.add_argument("--devices", default=None)
    ap.add_argument("--db", default=None)
    ap.add_argument("--work", default=None, help="folder for the JSONL file (default: a temporary one)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from embedfleet.pg.embedded import resolve_dsn
    from embedfleet.settings import Settings

    dsn = resolve_dsn(a.db, Settings.from_env())
    common = (["--db", a.db] if a.db else []) + (["--model", a.model] if a.model else []) + \
        (["--devices", a.devices] if a.devices else [])
    parts = set(a.parts.split(","))
    work = Path(a.work or tempfile.mkdtemp(prefix="efsync-"))
    work.mkdir(parents=True, exist_ok=True)
    doc: dict = {"command": sys.argv}
    with psycopg.connect(dsn, autocommit=True) as conn:
        if "trigger" in parts:
            doc["trigger"] = trigger_cost(conn, dsn, a.clients, a.pgbench_seconds, a.rounds, a.trigger_statement)
        if "backfill" in parts:
            doc["backfill"] = backfill(conn, a.rows, common, work, min(a.rounds, 2))
        if "lag" in parts:
            extra = (["--lanes", str(a.lanes)] if a.lanes else []) + (["--batch", str(a.batch)] if a.batch else [])
            doc["lag"] = lag(conn, dsn, a.rows, [float(r) for r in a.rates.split(",")], a.seconds, common, a.writers,
                             extra, a.live_efc)
    print(harness.record(doc, a.out, dsn))


if __name__ == "__main__":
    main()
