"""Text that lives in PostgreSQL: `ingest --from-table` (a backfill on the ledger) and `sync` (a trigger, a queue,
and a target kept equal to its source while another connection changes it). The real command, the real MiniLM,
a real PostgreSQL with real triggers and roles."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from decimal import Decimal

import numpy as np
import orjson
import psycopg
import pytest

from conftest import one_line_error, wait_for

WORDS = "naïve café 🙂 Straße 東京 charger cable battery screen fits broke returned love hate".split()


def _text(i: int, tag: str = "") -> str:
    rng = np.random.default_rng(i)
    return f"{tag}review {i}: " + " ".join(rng.choice(WORDS, size=3 + i % 40))


def _source(conn, name: str, n: int) -> None:
    conn.execute(f"CREATE TABLE {name} (review_id bigint PRIMARY KEY, title text, body text, stars int)")
    with conn.cursor() as cur, cur.copy(f"COPY {name} FROM STDIN") as copy:
        for i in range(n):
            copy.write_row((i, f"title {i}", _text(i), i % 5 + 1))


def _sync_args(dsn, source, *more):
    return [sys.executable, "-m", "embedfleet.cli", "sync", "--from-table", source, "--text-field", "body",
            "--db", dsn, "--devices", "cpu", "--quiet", *more]


def _start(args, tmp_path):
    env = dict(os.environ, EMBEDFLEET_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _status(cli, dsn, job):
    return orjson.loads(cli("status", "--job", job, "--db", dsn, "--json", check=True).stdout)["jobs"][0]


def _target(conn, table):
    return {i: (c, e) for i, c, e in conn.execute(f"SELECT id, content, embedding::text FROM {table}").fetchall()}


def _source_rows(conn, name):
    return {str(i): b for i, b in conn.execute(f"SELECT review_id, body FROM {name}").fetchall()}


def _assert_equal_to_source(conn, source, table, sample_ids=()):
    from embedfleet.encode.encoder import Encoder

    want, got = _source_rows(conn, source), _target(conn, table)
    assert set(got) == set(want)
    assert {i: c for i, (c, _) in got.items()} == want
    ids = sorted(set(sample_ids) | set(list(want)[:50]))
    vectors = Encoder(device="cpu").encode([want[i] for i in ids])
    stored = np.array([json.loads(got[i][1]) for i in ids])
    assert np.abs(stored - vectors).max() < 1e-5


def test_ingest_from_a_table_is_a_backfill_on_the_ledger(cli, dsn, conn, tmp_path):
    _source(conn, "papers", 700)
    conn.execute("UPDATE papers SET body = NULL WHERE review_id = 3")
    p = cli("ingest", "--from-table", "papers", "--text-template", "{title}\n\n{body}", "--columns", "stars",
            "--db", dsn, "--devices", "cpu", "--workers", "2", "--chunk-bytes", "16384", "--quiet", "--json")
    assert p.returncode == 0, p.stderr
    summary = orjson.loads(p.stdout)
    assert summary["table"] == "public.papers_embeddings" and summary["chunks_total"] > 4
    rows = dict(conn.execute("SELECT id, content FROM papers_embeddings").fetchall())
    assert len(rows) == 700 and rows["5"] == f"title 5\n\n{_text(5)}" and rows["3"] == "title 3"
    kinds = dict(conn.execute("SELECT column_name, data_type FROM information_schema.columns "
                              "WHERE table_name = 'papers_embeddings'").fetchall())
    assert kinds["stars"] == "integer" and kinds["id"] == "text"
    report = orjson.loads(cli("verify", "--table", "public.papers_embeddings", "--db", dsn, "--json").stdout)
    assert report["ok"] and report["rows"] == 700
    # a rerun resumes: nothing left, nothing written twice
    again = cli("ingest", "--from-table", "papers", "--text-template", "{title}\n\n{body}", "--columns", "stars",
                "--db", dsn, "--devices", "cpu", "--chunk-bytes", "16384", "--quiet", "--json", check=True)
    assert orjson.loads(again.stdout)["rows_written"] == 700


def test_bad_sources_get_one_line_each(cli, dsn, conn, tmp_path):
    conn.execute("CREATE TABLE nokey (a text, b text)")
    conn.execute("CREATE TABLE numbers (id int PRIMARY KEY, n int, note text)")
    conn.execute("CREATE MATERIALIZED VIEW numbers_mv AS SELECT id, note FROM numbers")
    cases = [
        (("--from-table", "numbers_mv", "--text-field", "note"), "is a materialized view"),
        (("--from-table", "missing"), "--from-table missing: no such table"),
        (("--from-table", "nokey", "--text-field", "a"), "no usable key"),
        (("--from-table", "numbers", "--text-field", "n"), "numbers.n is integer, not text"),
        (("--from-table", "numbers", "--text-field", "body"), "--text-field 'body': public.numbers has no such column"),
        (("--from-table", "numbers", "--text-field", "note", "--source-db", "postgresql://nobody@127.0.0.1:1/x"),
         "cannot connect to the --source-db database"),
        (("--from-table", "numbers", "--text-field", "note", "--columns", "n:bogus", "--table", "num_t"),
         "--columns 'n:bogus': give NAME:TYPE"),
    ]
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "a file"}\n')
    cases.append(((rows, "--source-db", dsn), "--source-db is the database a --from-table source is in"))
    for args, message in cases:
        p = cli("ingest", *args, "--db", dsn, "--devices", "cpu", "--quiet")
        one_line_error(p, message)
        assert p.returncode == 2, args
    # nothing was recorded: the corrected command runs as a new job would; a numeric column is copied exactly
    conn.execute("ALTER TABLE numbers ADD COLUMN amount numeric(30, 2)")
    conn.execute("INSERT INTO numbers VALUES (1, 5, 'a note', 12345678901234567.89)")
    # a filter that writes through a function is refused before any job or table exists
    one_line_error(cli("ingest", "--from-table", "numbers", "--text-field", "note", "--where", "lo_create(0) > 0",
                       "--table", "num_w", "--db", dsn, "--devices", "cpu", "--quiet"), "read-only transaction")
    assert conn.execute("SELECT to_regclass('num_w') IS NULL").fetchone()[0]
    cli("ingest", "--from-table", "numbers", "--text-field", "note", "--columns", "n:int,amount", "--table", "num_t",
        "--db", dsn, "--devices", "cpu", "--quiet", check=True)
    assert conn.execute("SELECT n, amount FROM num_t").fetchone() == (5, Decimal("12345678901234567.89"))
    assert conn.execute("SELECT count(*) FROM num_t WHERE amount > 100").fetchone()[0] == 1  # compares as a number


def test_sync_refuses_an_id_nothing_keeps_unique_and_a_template_reads_into_jsonb(cli, dsn, conn, tmp_path):
    conn.execute("CREATE TABLE cats (aid int PRIMARY KEY, cat text, body text, meta jsonb)")
    conn.execute("INSERT INTO cats SELECT g, 'xyz'::text || (g % 3), 'body ' || g, jsonb_build_object('tag', "
                 "'t' || g) FROM generate_series(1, 9) g")
    p = cli(*_sync_args(dsn, "cats", "--id-field", "cat", "--table", "cats_by_cat")[3:])
    one_line_error(p, "--id-field 'cat': sync keeps one target row per id")
    assert "CREATE UNIQUE INDEX ON public.cats (cat)" in p.stderr
    assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'cats'::regclass AND NOT tgisinternal"
                        ).fetchone()[0] == 0  # nothing installed, nothing recorded
    if conn.execute("SELECT to_regclass('embedfleet.jobs')").fetchone()[0]:
        assert conn.execute("SELECT count(*) FROM embedfleet.jobs WHERE job = 'cats_by_cat'").fetchone()[0] == 0
    conn.execute("CREATE TABLE tags (name text, body text)")
    conn.execute("INSERT INTO tags VALUES ('a', 'first'), ('b', 'second')")
    conn.execute("CREATE UNIQUE INDEX ON tags (name)")  # no primary key: a unique index is enough
    cli(*_sync_args(dsn, "tags", "--id-field", "name")[3:], check=True)
    assert dict(conn.execute("SELECT id, content FROM tags_embeddings").fetchall()) == {"a": "first", "b": "second"}
    cli("sync", "--from-table", "cats", "--text-template", "{body} [{meta.tag}]", "--db", dsn, "--devices", "cpu",
        "--quiet", check=True)
    assert conn.execute("SELECT content FROM cats_embeddings WHERE id = '4'").fetchone()[0] == "body 4 [t4]"


def test_sync_follows_inserts_updates_deletes_and_truncate_then_stops_on_sigterm(cli, dsn, conn, tmp_path):
    _source(conn, "reviews", 5000)
    _source(conn, "notes", 40)
    main = _start(_sync_args(dsn, "reviews", "--follow", "--json"), tmp_path)
    second = _start(_sync_args(dsn, "notes", "--follow", "--json"), tmp_path)
    try:
        for job in ("public.reviews_embeddings", "public.notes_embeddings"):
            wait_for(conn, "SELECT synced_at FROM embedfleet.syncs WHERE job = %s", [job], timeout=400)
        assert _status(cli, dsn, "public.reviews_embeddings")["pending"] == 0
        app = psycopg.connect(dsn, autocommit=True)  # the application, on a connection of its own
        with app.cursor() as cur:
            cur.executemany("INSERT INTO reviews VALUES (%s, %s, %s, %s)",
                            [(10_000 + i, "new", _text(10_000 + i, "new "), 3) for i in range(500)])
            cur.executemany("UPDATE reviews SET body = %s WHERE review_id = %s",
                            [(_text(i, "edited "), i) for i in range(200)])
            cur.executemany("UPDATE reviews SET body = body WHERE review_id = %s", [(i,) for i in range(200, 300)])
            cur.executemany("DELETE FROM reviews WHERE review_id = %s", [(i,) for i in range(4000, 4200)])
        app.execute("TRUNCATE notes")
        app.execute("INSERT INTO notes VALUES (1, 'n', 'a note after the truncate', 1)")
        wait_for(conn, "SELECT CASE WHEN count(*) = 5300 THEN 1 END FROM reviews_embeddings", timeout=400)
        wait_for(conn, "SELECT CASE WHEN count(*) = 1 THEN 1 END FROM notes_embeddings", timeout=200)
        state = wait_for(conn, "SELECT 1 FROM embedfleet.syncs WHERE job = 'public.reviews_embeddings' AND "
                         "synced_at > now() - interval '1 minute'")
        assert state == 1
    finally:
        for proc in (main, second):
            proc.send_signal(signal.SIGTERM)
    outs = [proc.communicate(timeout=120) for proc in (main, second)]
    assert [proc.returncode for proc in (main, second)] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    summary = orjson.loads(outs[0][0])
    # every change once: 500 inserts and 200 edits embedded; the 100 rewrites of the same text not even queued
    assert (summary["embedded"], summary["unchanged"], summary["deleted"]) == (700, 0, 200)
    assert summary["keys"] == 900
    _assert_equal_to_source(conn, "reviews", "reviews_embeddings", [str(i) for i in (0, 199, 10_000, 10_499)])
    _assert_equal_to_source(conn, "notes", "notes_embeddings")
    status = _status(cli, dsn, "public.reviews_embeddings")
    assert status["pending"] == 0 and status["synced_at"] and "lag_s" in status
    report = orjson.loads(cli("verify", "--table", "public.reviews_embeddings", "--db", dsn, "--json").stdout)
    assert report["ok"] and report["rows"] == 5300 and report["sync"]["pending"] == 0


def test_a_sync_killed_mid_batch_reruns_to_exactly_the_source(cli, dsn, conn, tmp_path):
    _source(conn, "kill_src", 300)
    cli(*_sync_args(dsn, "kill_src")[3:], check=True)
    with conn.cursor() as cur:
        cur.executemany("UPDATE kill_src SET body = %s WHERE review_id = %s", [(_text(i, "v2 "), i) for i in range(300)])
        cur.executemany("INSERT INTO kill_src VALUES (%s, 't', %s, 1)", [(1000 + i, _text(1000 + i)) for i in range(900)])
    queued = conn.execute("SELECT tag FROM embedfleet.syncs").fetchone()[0]
    proc = _start(_sync_args(dsn, "kill_src", "--batch", "200"), tmp_path)
    wait_for(conn, f"SELECT CASE WHEN count(*) < 1200 THEN 1 END FROM embedfleet.queue_{queued}", timeout=300)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    left = conn.execute(f"SELECT count(*) FROM embedfleet.queue_{queued}").fetchone()[0]
    assert 0 < left < 1200  # killed with work left
    cli(*_sync_args(dsn, "kill_src")[3:], check=True)
    assert conn.execute(f"SELECT count(*) FROM embedfleet.queue_{queued}").fetchone()[0] == 0
    _assert_equal_to_source(conn, "kill_src", "kill_src_embeddings", ["0", "299", "1000", "1899"])


def test_the_applications_writes_never_wait_for_or_fail_because_of_sync(cli, dsn, conn, tmp_path):
    _source(conn, "app_src", 20)
    cli(*_sync_args(dsn, "app_src")[3:], check=True)
    tag = conn.execute("SELECT tag FROM embedfleet.syncs").fetchone()[0]
    worker = psycopg.connect(dsn)  # a sync worker holding claimed keys in an open transaction
    worker.execute(f"SELECT key FROM embedfleet.queue_{tag} FOR UPDATE")
    conn.execute("UPDATE app_src SET body = 'x' WHERE review_id = 1")  # queues key 1
    held = worker.execute(f"SELECT key FROM embedfleet.queue_{tag} FOR UPDATE SKIP LOCKED").fetchall()
    app = psycopg.connect(dsn, autocommit=True)
    app.execute("SET statement_timeout = '2s'")
    app.execute("UPDATE app_src SET body = 'y' WHERE review_id = 1")  # the same key, while a worker holds it
    app.execute("INSERT INTO app_src VALUES (100, 't', 'while held', 1)")
    worker.rollback()
    assert held  # the worker did hold a queued key
    conn.execute(f"DROP TABLE embedfleet.queue_{tag}")  # the queue gone: the application's writes still succeed
    app.execute("INSERT INTO app_src VALUES (101, 't', 'after the queue went', 1)")
    app.execute("UPDATE app_src SET body = 'z' WHERE review_id = 2")
    app.execute("DELETE FROM app_src WHERE review_id = 3")
    assert conn.execute("SELECT count(*) FROM app_src").fetchone()[0] == 21
    shown = _status(cli, dsn, "public.app_src_embeddings")  # not "0 pending": nothing is queued at all now
    assert shown["queue_missing"] is True and shown["pending"] is None
    assert "its queue is gone" in cli("status", "--db", dsn, check=True).stdout
    p = cli("sync", "--from-table", "app_src", "--uninstall", "--db", dsn, "--json", check=True)
    assert orjson.loads(p.stdout)["uninstalled"] is True  # the queue was already gone; the triggers go now
    assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'app_src'::regclass AND NOT tgisinternal"
                        ).fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM app_src_embeddings").fetchone()[0] == 20  # the vectors stay


def test_uninstall_by_the_source_alone_finds_a_sync_made_with_its_own_table_name(cli, dsn, conn, tmp_path):
    _source(conn, "papers", 5)
    cli(*_sync_args(dsn, "papers", "--table", "papers_sync")[3:], check=True)
    p = cli(*_sync_args(dsn, "papers", "--uninstall", "--json")[3:], check=True)
    assert orjson.loads(p.stdout)["job"] == "papers_sync" and orjson.loads(p.stdout)["uninstalled"] is True
    assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'papers'::regclass AND NOT tgisinternal"
                        ).fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM papers_sync").fetchone()[0] == 5  # the vectors stay


def test_the_target_spelled_with_or_without_its_schema_is_one_sync(cli, dsn, conn, tmp_path):
    _source(conn, "notes", 6)
    first = orjson.loads(cli(*_sync_args(dsn, "notes", "--json")[3:], check=True).stdout)
    assert first["job"] == "public.notes_embeddings"
    conn.execute("UPDATE notes SET body = 'rewritten' WHERE review_id = 2")
    again = orjson.loads(cli(*_sync_args(dsn, "notes", "--table", "notes_embeddings", "--json")[3:],
                             check=True).stdout)
    assert again["job"] == first["job"] and again["installed"] is False and again["embedded"] == 1
    triggers = "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'notes'::regclass AND NOT tgisinternal"
    assert conn.execute(triggers).fetchone()[0] == 3  # a row, an UPDATE and a TRUNCATE trigger: one sync
    assert conn.execute("SELECT count(*) FROM embedfleet.jobs WHERE table_name LIKE '%%notes_embeddings'"
                        ).fetchone()[0] == 1
    _assert_equal_to_source(conn, "notes", "notes_embeddings")
    for spelled in ("notes_embeddings", "public.notes_embeddings"):  # verify and status find it either way
        report = orjson.loads(cli("verify", "--table", spelled, "--db", dsn, "--json", check=True).stdout)
        assert report["sync"]["source"] == "public.notes" and report["model"] and report["ok"], report
        assert _status(cli, dsn, spelled)["job"] == first["job"]
    gone = orjson.loads(cli(*_sync_args(dsn, "notes", "--table", "notes_embeddings", "--uninstall", "--json")[3:],
                            check=True).stdout)
    assert gone["job"] == first["job"] and gone["uninstalled"] is True
    assert conn.execute(triggers).fetchone()[0] == 0


def test_a_source_whose_schema_has_a_dot_gets_its_target_beside_it_and_a_quoted_target_is_the_same_sync(
        cli, dsn, conn):
    """The default target of "Sch.2"."Live ""Q"" Tab" went into a new schema "Sch"; and the same target spelled
    quoted (`"My Schema"."Odd Table_embeddings"`) was a second sync: a second set of triggers and queue."""
    conn.execute('CREATE SCHEMA "Sch.2"')
    conn.execute('CREATE TABLE "Sch.2"."Live ""Q"" Tab" (id int PRIMARY KEY, "Body" text)')
    conn.execute('INSERT INTO "Sch.2"."Live ""Q"" Tab" SELECT i, \'text \' || i FROM generate_series(1, 5) i')
    source = '"Sch.2"."Live ""Q"" Tab"'
    first = orjson.loads(cli("sync", "--from-table", source, "--text-field", "Body", "--db", dsn, "--devices", "cpu",
                             "--quiet", "--json", check=True).stdout)
    assert conn.execute("SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                        "WHERE c.relname = 'Live \"Q\" Tab_embeddings'").fetchall() == [("Sch.2",)]
    assert conn.execute('SELECT count(*) FROM "Sch.2"."Live ""Q"" Tab_embeddings"').fetchone()[0] == 5
    assert not conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = 'Sch'").fetchone()
    conn.execute('CREATE SCHEMA "My Schema"')
    conn.execute('CREATE TABLE "My Schema"."Odd Table" (id int PRIMARY KEY, body text)')
    conn.execute('INSERT INTO "My Schema"."Odd Table" SELECT i, \'odd \' || i FROM generate_series(1, 4) i')
    odd = ("sync", "--from-table", '"My Schema"."Odd Table"', "--text-field", "body", "--db", dsn, "--devices", "cpu",
           "--quiet", "--json")
    plain = orjson.loads(cli(*odd, check=True).stdout)
    quoted = orjson.loads(cli(*odd, "--table", '"My Schema"."Odd Table_embeddings"', check=True).stdout)
    assert quoted["job"] == plain["job"] == "My Schema.Odd Table_embeddings" and quoted["installed"] is False
    assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = '\"My Schema\".\"Odd Table\"'::regclass "
                        "AND NOT tgisinternal").fetchone()[0] == 3
    assert first["job"] == '"Sch.2"."Live ""Q"" Tab_embeddings"'


def test_a_template_field_naming_a_column_with_a_dot_reads_that_column_and_follows_it(cli, dsn, conn):
    """`--text-template '{a.b}'` of a column named "a.b" was refused: "no such column a"."""
    conn.execute('CREATE TABLE rdot (id int PRIMARY KEY, "a.b" text, a jsonb)')
    conn.execute("""INSERT INTO rdot VALUES (1, 'dotted one', '{"b": "nested"}'), (2, 'dotted two', NULL)""")
    common = ("--from-table", "rdot", "--text-template", "{a.b}!", "--db", dsn, "--devices", "cpu", "--quiet")
    cli("sync", *common, check=True)
    conn.execute("""UPDATE rdot SET "a.b" = 'changed' WHERE id = 2""")
    cli("sync", *common, check=True)
    assert _contents(conn, "rdot_embeddings") == {"1": "dotted one!", "2": "changed!"}


def test_a_role_without_trigger_privilege_is_told_the_grant(cli, dsn, conn, tmp_path):
    _source(conn, "guarded", 5)
    role = f"r_{os.getpid()}_{int(time.time())}"
    conn.execute(f"CREATE ROLE {role} LOGIN")
    conn.execute(f"GRANT SELECT ON guarded TO {role}")
    source_dsn = psycopg.conninfo.make_conninfo(dsn, user=role)
    conn.execute("CREATE SCHEMA IF NOT EXISTS embedfleet")  # as an admin may have made it for the role
    p = cli("sync", "--from-table", "guarded", "--text-field", "body", "--source-db", source_dsn, "--db", dsn,
            "--devices", "cpu", "--quiet")
    lines = [x for x in p.stderr.strip().splitlines() if x.startswith("error:")]
    assert p.returncode != 0 and len(lines) == 1
    # every grant it lacks, in one line
    assert f"GRANT TRIGGER ON public.guarded TO {role}; GRANT USAGE, CREATE ON SCHEMA embedfleet TO {role}" in lines[0]
    assert conn.execute("SELECT to_regclass('public.guarded_embeddings')").fetchone()[0] is None  # nothing made
    conn.execute(f"GRANT TRIGGER ON guarded TO {role}")
    conn.execute(f"GRANT USAGE, CREATE ON SCHEMA embedfleet TO {role}")  # without CREATE on the database
    p = cli("sync", "--from-table", "guarded", "--text-field", "body", "--source-db", source_dsn, "--db", dsn,
            "--devices", "cpu", "--quiet")
    assert p.returncode == 0, p.stderr
    assert conn.execute("SELECT count(*) FROM guarded_embeddings").fetchone()[0] == 5
    conn.execute("CREATE SCHEMA walled")  # a schema the role may not use: the GRANT, for the role --source-db names
    conn.execute("CREATE TABLE walled.notes (id int PRIMARY KEY, body text)")
    p = cli("ingest", "--from-table", "walled.notes", "--source-db", source_dsn, "--db", dsn, "--devices", "cpu",
            "--quiet")
    one_line_error(p, f"GRANT USAGE ON SCHEMA walled TO {role}, or name another role in --source-db")
    assert p.returncode == 2


@pytest.mark.parametrize("op", ["drop", "rename"])
def test_a_source_dropped_or_renamed_while_following_stops_with_one_line_and_keeps_the_queue(cli, dsn, conn,
                                                                                            tmp_path, op):
    _source(conn, "going", 30)
    proc = _start(_sync_args(dsn, "going", "--follow"), tmp_path)
    wait_for(conn, "SELECT synced_at FROM embedfleet.syncs WHERE job = 'public.going_embeddings'", timeout=300)
    tag = conn.execute("SELECT tag FROM embedfleet.syncs").fetchone()[0]
    conn.execute("UPDATE going SET body = 'changed' WHERE review_id = 1")
    conn.execute("DROP TABLE going" if op == "drop" else "ALTER TABLE going RENAME TO gone")
    _, err = proc.communicate(timeout=120)
    lines = [x for x in err.strip().splitlines() if x.startswith("error:")]
    assert proc.returncode != 0 and len(lines) == 1 and "was dropped or renamed while following" in lines[0], err
    assert conn.execute("SELECT to_regclass(%s)", [f"embedfleet.queue_{tag}"]).fetchone()[0] is not None
    # the sync is still removable by the name it was made with: queue, function and triggers (on the renamed table)
    cli(*_sync_args(dsn, "going", "--uninstall")[3:], check=True)
    assert conn.execute("SELECT to_regclass(%s)", [f"embedfleet.queue_{tag}"]).fetchone()[0] is None
    assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgname LIKE %s", [f"%{tag}"]).fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM pg_proc WHERE proname LIKE %s", [f"%{tag}"]).fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM embedfleet.syncs").fetchone()[0] == 0
    if op == "rename":
        conn.execute("INSERT INTO gone VALUES (1000, 't', 'after the uninstall', 1)")



def test_the_key_renamed_while_following_keeps_the_applications_writes_going(cli, dsn, conn, tmp_path):
    _source(conn, "rekey", 20)
    proc = _start(_sync_args(dsn, "rekey", "--follow"), tmp_path)
    wait_for(conn, "SELECT synced_at FROM embedfleet.syncs WHERE job = 'public.rekey_embeddings'", timeout=300)
    tag = conn.execute("SELECT tag FROM embedfleet.syncs").fetchone()[0]
    conn.execute("ALTER TABLE rekey RENAME COLUMN review_id TO rid")
    _, err = proc.communicate(timeout=120)
    lines = [x for x in err.strip().splitlines() if x.startswith("error:")]
    assert proc.returncode != 0 and len(lines) == 1 and "was renamed 'rid' while following" in lines[0], err
    # the trigger reads the key by its new name: the application's writes go through, and are queued
    conn.execute("INSERT INTO rekey VALUES (500, 't', 'after the rename', 1)")
    conn.execute("UPDATE rekey SET body = 'edited' WHERE rid = 2")
    conn.execute("DELETE FROM rekey WHERE rid = 3")
    queued = {k for (k,) in conn.execute(f"SELECT key FROM embedfleet.queue_{tag}")}
    assert {"500", "2", "3"} <= queued
    conn.execute("ALTER TABLE rekey RENAME COLUMN rid TO review_id")  # put back: a rerun catches up exactly
    cli(*_sync_args(dsn, "rekey")[3:], check=True)
    conn.execute("INSERT INTO rekey VALUES (501, 't', 'after the rename back', 1)")  # the trigger follows it back
    cli(*_sync_args(dsn, "rekey")[3:], check=True)
    _assert_equal_to_source(conn, "rekey", "rekey_embeddings", ["500", "501", "2"])

def test_lanes_side_by_side_write_a_key_changed_many_times_as_it_is_last(cli, dsn, conn, tmp_path):
    _source(conn, "busy", 60)
    cli(*_sync_args(dsn, "busy")[3:], check=True)
    for version in range(6):  # every key queued six times, in six transactions, each with other text
        with conn.transaction():
            conn.execute("UPDATE busy SET body = %s || body", [f"v{version} "])
    conn.execute("DELETE FROM busy WHERE review_id % 7 = 0")
    p = cli(*_sync_args(dsn, "busy", "--lanes", "4", "--batch", "9", "--json")[3:], check=True)
    summary = orjson.loads(p.stdout)
    # each of the 4 lanes took its ~92 entries in two batches or more (at most 8 × 9 keys each)
    assert summary["keys"] == 60 * 6 + 9 and summary["batches"] >= 8
    _assert_equal_to_source(conn, "busy", "busy_embeddings")


def test_sync_after_an_earlier_ingest_brings_the_rows_changed_in_between_up_to_date(cli, dsn, conn, tmp_path):
    _source(conn, "before", 60)
    cli("ingest", "--from-table", "before", "--text-field", "body", "--db", dsn, "--devices", "cpu", "--quiet",
        check=True)
    conn.execute("INSERT INTO before VALUES (100, 't', 'a review written before sync was installed', 2)")
    conn.execute("UPDATE before SET body = 'edited before sync' WHERE review_id = 2")
    conn.execute("DELETE FROM before WHERE review_id = 3")
    p = cli(*_sync_args(dsn, "before", "--json")[3:], check=True)
    summary = orjson.loads(p.stdout)
    assert (summary["embedded"], summary["deleted"]) == (2, 1) and summary["unchanged"] == 58
    _assert_equal_to_source(conn, "before", "before_embeddings", ["2", "100"])


def test_a_change_to_a_column_the_where_filter_reads_moves_the_row_in_or_out(cli, dsn, conn, tmp_path):
    conn.execute('CREATE TABLE filt (review_id int PRIMARY KEY, body text, "Lang" text, meta jsonb)')
    conn.execute("""INSERT INTO filt SELECT i, 'review number ' || i, CASE WHEN i % 2 = 0 THEN 'en' ELSE 'de' END,
                    jsonb_build_object('k', i) FROM generate_series(1, 20) i""")
    args = _sync_args(dsn, "filt", "--where", '"Lang" = \'en\'', "--columns", "meta")[3:]
    cli(*args, check=True)
    assert {r[0] for r in conn.execute("SELECT id FROM filt_embeddings")} == {str(i) for i in range(2, 21, 2)}
    conn.execute('UPDATE filt SET "Lang" = \'de\' WHERE review_id = 2')  # out of the filter
    conn.execute('UPDATE filt SET "Lang" = \'en\' WHERE review_id = 3')  # into it
    # a copied jsonb column changed with the text left alone: the row's column updated, nothing embedded again
    conn.execute("UPDATE filt SET meta = '{\"k\": \"changed\", \"list\": [1, 2]}' WHERE review_id = 4")
    summary = orjson.loads(cli(*args, "--json", check=True).stdout)
    assert (summary["embedded"], summary["deleted"], summary["unchanged"]) == (1, 1, 1)
    rows = dict(conn.execute("SELECT id, meta FROM filt_embeddings").fetchall())
    assert set(rows) == {str(i) for i in range(3, 21) if i % 2 == 0 or i == 3} - {"2"}
    assert rows["4"] == {"k": "changed", "list": [1, 2]}


def test_batches_grow_only_where_scanning_a_long_queue_is_the_slow_part():
    from embedfleet.ingest.sync import LONG_QUEUE_BATCHES, next_batch_size

    # the queue is short (the claim emptied the lane's share) or claims are quick beside the work: the set size
    assert next_batch_size(256, 100, 0.5, 0.1, 256) == 256
    assert next_batch_size(256, 256, 0.01, 1.6, 256) == 256
    assert next_batch_size(1024, 1024, 0.001, 0.05, 256) == 256  # back down once claims are quick again
    # a full claim whose scan took as long as the work: ten times the keys, so scans are a tenth; capped
    assert next_batch_size(256, 256, 0.02, 0.1, 256) == 512
    assert next_batch_size(256, 256, 0.3, 0.2, 256) == LONG_QUEUE_BATCHES * 256
    # never below the set size, whatever the timings; a user's small --batch grows the same way
    assert next_batch_size(9, 9, 0.02, 0.1, 9) == 18


def test_the_queue_is_unlogged_and_a_restarted_server_has_every_key_compared_once(cli, dsn, conn, tmp_path):
    _source(conn, "crashy", 80)
    cli(*_sync_args(dsn, "crashy")[3:], check=True)
    tag = conn.execute("SELECT tag FROM embedfleet.syncs").fetchone()[0]
    assert conn.execute("SELECT relpersistence FROM pg_class WHERE oid = %s::regclass",
                        [f"embedfleet.queue_{tag}"]).fetchone()[0] == "u"  # no WAL for the application to pay
    # what a crash leaves: changes made, the unlogged queue emptied, the server started anew
    conn.execute("UPDATE crashy SET body = 'changed before the crash' WHERE review_id < 5")
    conn.execute("DELETE FROM crashy WHERE review_id BETWEEN 10 AND 12")
    conn.execute(f"TRUNCATE embedfleet.queue_{tag}")
    conn.execute("UPDATE embedfleet.syncs SET source_started = '2000-01-01 00:00:00+00'")
    job = conn.execute("SELECT job FROM embedfleet.syncs").fetchone()[0]
    crashed = _status(cli, dsn, job)  # it said "0 pending" until the next sync
    assert crashed["restarted"] is True and crashed["pending"] is None and crashed["lag_s"] is None
    shown = cli("status", "--db", dsn).stdout  # piped: nothing wrapped
    assert "changes pending unknown: the source's server started again" in shown
    p = cli(*_sync_args(dsn, "crashy", "--json")[3:], check=True)
    summary = orjson.loads(p.stdout)
    assert summary["keys"] == 77 + 1 and (summary["embedded"], summary["deleted"]) == (5, 3)
    assert "started again since its queue was last seen" in p.stderr
    _assert_equal_to_source(conn, "crashy", "crashy_embeddings")
    after = _status(cli, dsn, job)
    assert (after["restarted"], after["pending"]) == (False, 0)
    assert (after["rows_written"], after["backfill_rows"]) == (77, 80)  # the rows the table holds now
    again = orjson.loads(cli(*_sync_args(dsn, "crashy", "--json")[3:], check=True).stdout)
    assert again["keys"] == 0  # the start time is the known one now: nothing queued again
    elsewhere = orjson.loads(cli(*_sync_args(dsn, "crashy", "--json")[3:], check=True,
                                 extra_env={"PGTZ": "Asia/Tokyo"}).stdout)
    assert elsewhere["keys"] == 0  # the same start, read in another time zone


def test_a_worker_from_another_host_joins_a_table_backfill(cli, dsn, conn, tmp_path):
    _source(conn, "joined", 2500)
    job = "public.joined_embeddings"
    first = _start([sys.executable, "-m", "embedfleet.cli", "ingest", "--from-table", "joined", "--text-field", "body",
                    "--db", dsn, "--devices", "cpu", "--workers", "1", "--chunk-bytes", "16384", "--quiet",
                    "--no-index"], tmp_path)
    wait_for(conn, "SELECT nullif(sum(rows_written), 0) FROM embedfleet.chunks WHERE job = %s", [job], timeout=300)
    p = cli("worker", "--job", job, "--db", dsn, "--devices", "cpu", "--worker-id", "otherhost", "--quiet",
            extra_env={"EMBEDFLEET_HOST_ID": "otherhost"})
    assert p.returncode == 0, p.stderr[-3000:]
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    rows = dict(conn.execute("SELECT worker, rows FROM embedfleet.workers WHERE job = %s", [job]).fetchall())
    assert len(rows) == 2 and all(n > 0 for n in rows.values()), rows
    assert conn.execute("SELECT count(*), count(DISTINCT id) FROM joined_embeddings").fetchone() == (2500, 2500)


def test_a_mixed_case_source_is_found_as_written_as_its_target_is(cli, dsn, conn):
    """`--table Name` takes the name as written; `--from-table Name` finds "Name" too where SQL's spelling (name)
    finds nothing, and a table that is name in SQL still wins."""
    conn.execute('CREATE TABLE "Opinions" (id int PRIMARY KEY, body text)')
    conn.execute("INSERT INTO \"Opinions\" SELECT g, 'avis n° ' || g FROM generate_series(1, 12) g")
    cli("ingest", "--from-table", "Opinions", "--db", dsn, "--devices", "cpu", "--quiet", check=True)
    assert conn.execute('SELECT count(*) FROM "Opinions_embeddings"').fetchone()[0] == 12
    conn.execute("CREATE TABLE opinions (id int PRIMARY KEY, body text)")
    conn.execute("INSERT INTO opinions VALUES (1, 'lower case wins, as in SQL')")
    cli("ingest", "--from-table", "Opinions", "--table", "folded", "--db", dsn, "--devices", "cpu", "--quiet",
        check=True)
    assert conn.execute("SELECT content FROM folded").fetchall() == [("lower case wins, as in SQL",)]
    for spelled in ("Opinions_embeddings", '"Opinions_embeddings"', 'public."Opinions_embeddings"'):  # as SQL quotes it
        p = cli("search", "avis", "--table", spelled, "--db", dsn, "--json", "-k", "2")
        assert p.returncode == 0 and len(orjson.loads(p.stdout)["results"]) == 2, (spelled, p.stderr)


def _contents(conn, table):
    return dict(conn.execute(f"SELECT id, content FROM {table}").fetchall())


def test_keys_whose_text_python_spells_otherwise_are_followed_exactly(cli, dsn, conn):
    """ids were Python's str() of the key, the queue PostgreSQL's key::text: a numeric `1E-10` and a char(8)'s
    padding never matched, so deletes and updates were lost (and char(n) keys were cut to one character)."""
    conn.execute("CREATE TABLE rch (code char(8) PRIMARY KEY, body text)")
    conn.execute("INSERT INTO rch VALUES ('AB', 'code ab'), ('X1', 'code x1'), ('K9', 'code k9')")
    conn.execute("CREATE TABLE rnum (k numeric PRIMARY KEY, body text)")
    conn.execute("INSERT INTO rnum VALUES (1e-10, 'tiny'), (2.50, 'two and a half'), (3, 'three')")
    for source in ("rch", "rnum"):
        p = cli("sync", "--from-table", source, "--db", dsn, "--devices", "cpu", "--quiet")
        assert p.returncode == 0, p.stderr
    conn.execute("DELETE FROM rch WHERE code = 'AB'")
    conn.execute("UPDATE rch SET body = 'x1 changed' WHERE code = 'X1'")
    conn.execute("INSERT INTO rch VALUES ('NEW', 'brand new row')")
    conn.execute("DELETE FROM rnum WHERE k = 1e-10")
    conn.execute("UPDATE rnum SET body = 'two, changed' WHERE k = 2.5")
    for source in ("rch", "rnum"):
        p = cli("sync", "--from-table", source, "--db", dsn, "--devices", "cpu", "--quiet")
        assert p.returncode == 0, p.stderr
        want = dict(conn.execute(f"SELECT {'code' if source == 'rch' else 'k'}::text, body FROM {source}").fetchall())
        assert _contents(conn, f"{source}_embeddings") == want
    assert set(_contents(conn, "rch_embeddings")) == {"X1", "K9", "NEW"}
    assert set(_contents(conn, "rnum_embeddings")) == {"2.50", "3"}
    # An enum's text and a domain's over an integer are the session's own no more than a text's: followed (they
    # were refused as keys "whose text depends on the session")
    conn.execute("CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')")
    conn.execute("CREATE DOMAIN posint AS int CHECK (VALUE > 0)")
    conn.execute("CREATE TABLE renum (k mood PRIMARY KEY, body text)")
    conn.execute("CREATE TABLE rdom (k posint PRIMARY KEY, body text)")
    conn.execute("INSERT INTO renum VALUES ('sad', 'a sad one'), ('happy', 'a happy one')")
    conn.execute("INSERT INTO rdom VALUES (1, 'one'), (7, 'seven')")
    for source in ("renum", "rdom"):
        cli("sync", "--from-table", source, "--db", dsn, "--devices", "cpu", "--quiet", check=True)
    conn.execute("UPDATE renum SET body = 'not so sad' WHERE k = 'sad'")
    conn.execute("INSERT INTO renum VALUES ('ok', 'fine')")
    conn.execute("DELETE FROM rdom WHERE k = 7")
    for source in ("renum", "rdom"):
        cli("sync", "--from-table", source, "--db", dsn, "--devices", "cpu", "--quiet", check=True)
        assert _contents(conn, f"{source}_embeddings") == dict(conn.execute(f"SELECT k::text, body FROM {source}"))
    # A key whose text depends on the session that writes it is refused for sync, before anything is installed.
    conn.execute("CREATE TABLE rts (k timestamptz PRIMARY KEY, body text)")
    conn.execute("INSERT INTO rts VALUES ('2024-01-01 01:30:30.5+00', 'x')")
    line = one_line_error(cli("sync", "--from-table", "rts", "--db", dsn, "--devices", "cpu", "--quiet"),
                          "public.rts's key k is timestamp with time zone, whose text depends on the session writing "
                          "it (its TimeZone and DateStyle)")
    assert "ingest --from-table" in line
    assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'rts'::regclass").fetchone()[0] == 0
    p = cli("ingest", "--from-table", "rts", "--db", dsn, "--devices", "cpu", "--quiet", check=True)
    assert list(_contents(conn, "rts_embeddings")) == [
        conn.execute("SELECT k::text FROM rts").fetchone()[0]]  # as PostgreSQL writes it


def test_a_partitioned_source_is_read_through_its_partitions(cli, dsn, conn):
    """The parent of a partitioned table has no pages: its backfill read nothing and said 0 rows."""
    conn.execute("CREATE TABLE rp (review_id int PRIMARY KEY, body text) PARTITION BY RANGE (review_id)")
    conn.execute("CREATE TABLE rp_a PARTITION OF rp FOR VALUES FROM (0) TO (300)")
    conn.execute("CREATE TABLE rp_b PARTITION OF rp FOR VALUES FROM (300) TO (100000)")
    conn.execute("INSERT INTO rp SELECT i, 'partitioned row ' || i FROM generate_series(1, 700) i")
    p = cli("sync", "--from-table", "rp", "--db", dsn, "--devices", "cpu", "--quiet", "--chunk-bytes", "8192",
            "--where", "rp.review_id % 7 <> 0")  # the table's own name in --where, as in any SQL about it
    assert p.returncode == 0, p.stderr
    want = {str(i): f"partitioned row {i}" for i in range(1, 701) if i % 7}
    assert _contents(conn, "rp_embeddings") == want
    chunks = conn.execute("SELECT DISTINCT source FROM embedfleet.chunks WHERE job = 'public.rp_embeddings'").fetchall()
    assert sorted(c for (c,) in chunks) == ["public.rp_a", "public.rp_b"]
    conn.execute("UPDATE rp SET body = 'moved on' WHERE review_id = 5")
    conn.execute("DELETE FROM rp WHERE review_id = 500")
    p = cli("sync", "--from-table", "rp", "--db", dsn, "--devices", "cpu", "--quiet", "--chunk-bytes", "8192",
            "--where", "rp.review_id % 7 <> 0")
    assert p.returncode == 0, p.stderr
    want["5"] = "moved on"
    del want["500"]
    assert _contents(conn, "rp_embeddings") == want


def test_a_value_python_cannot_hold_rejects_its_row_only_where_the_row_uses_it(cli, dsn, conn):
    """An `infinity` timestamp anywhere in a row failed the whole read: the backfill's chunk, or every drain."""
    conn.execute("CREATE TABLE rinf (review_id int PRIMARY KEY, body text, valid_until timestamptz DEFAULT now())")
    conn.execute("INSERT INTO rinf (review_id, body) SELECT i, 'row ' || i FROM generate_series(1, 20) i")
    conn.execute("UPDATE rinf SET valid_until = 'infinity' WHERE review_id = 3")
    common = ("--from-table", "rinf", "--text-field", "body", "--db", dsn, "--devices", "cpu", "--quiet")
    cli("sync", *common, check=True)  # the column is not copied: row 3 is like any other
    assert len(_contents(conn, "rinf_embeddings")) == 20
    p = cli("sync", *common, "--columns", "valid_until", "--table", "rinf_copied", "--json")
    assert p.returncode == 0, p.stderr
    assert set(_contents(conn, "rinf_copied")) == {str(i) for i in range(1, 21)} - {"3"}
    [(reason,)] = conn.execute("SELECT reason FROM embedfleet.rejects WHERE job = 'rinf_copied'").fetchall()
    assert reason == "cannot coerce valid_until='infinity' to timestamptz"
    conn.execute("UPDATE rinf SET body = 'changed two' WHERE review_id = 2")
    conn.execute("UPDATE rinf SET valid_until = '-infinity' WHERE review_id = 4")
    p = cli("sync", *common, "--columns", "valid_until", "--table", "rinf_copied", "--json")
    assert p.returncode == 0, p.stderr
    rows = _contents(conn, "rinf_copied")
    assert rows["2"] == "changed two" and "4" not in rows and len(rows) == 18



def _fresh_database(conn, dsn: str, name: str) -> tuple[str, str]:
    """A new, empty database on the test server: (its name, its DSN)."""
    conn.execute(f"DROP DATABASE IF EXISTS {name}")
    conn.execute(f"CREATE DATABASE {name}")
    return name, psycopg.conninfo.make_conninfo(dsn, dbname=name)

def test_a_rerun_against_another_database_or_into_a_followed_table_is_refused_before_anything_is_installed(
        cli, dsn, conn):
    other_db, other = _fresh_database(conn, dsn, "sync_other_db")
    conn.execute("CREATE TABLE rsd (review_id int PRIMARY KEY, title text, body text)")
    conn.execute("INSERT INTO rsd SELECT i, 'title ' || i, 'local row ' || i FROM generate_series(1, 10) i")
    with psycopg.connect(other, autocommit=True) as o:
        o.execute("CREATE TABLE rsd (review_id int PRIMARY KEY, title text, body text)")
        o.execute("INSERT INTO rsd VALUES (1, 'other', 'OTHER DB row')")
    common = ("--from-table", "rsd", "--text-field", "body", "--db", dsn, "--devices", "cpu", "--quiet")
    cli("sync", *common, check=True)
    one_line_error(cli("sync", *common, "--source-db", other),
                   "sync job 'public.rsd_embeddings' follows public.rsd in another database than the one --source-db "
                   f"names now ({conn.info.dbname} then, {other_db} now)")
    with psycopg.connect(other, autocommit=True) as o:  # nothing installed there, nothing recorded here
        assert o.execute("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'embedfleet%'").fetchone()[0] == 0
    assert conn.execute("SELECT same_db FROM embedfleet.syncs WHERE job = 'public.rsd_embeddings'").fetchone()[0]
    assert len(_contents(conn, "rsd_embeddings")) == 10
    # Other settings are refused before the trigger is touched; the job's name alone does not make a second
    # sync into the same table, whose rows would mix two texts.
    one_line_error(cli("sync", *common[:2], "--text-field", "title", *common[4:]), "already exists with other settings")
    one_line_error(cli("sync", *common[:2], "--text-field", "title", "--job", "rsd_titles", *common[4:]),
                   "table public.rsd_embeddings is the target of sync job 'public.rsd_embeddings'")
    assert set(_contents(conn, "rsd_embeddings").values()) == {f"local row {i}" for i in range(1, 11)}
    triggers = conn.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'rsd'::regclass").fetchone()[0]
    p = cli("sync", *common[:2], "--text-field", "title", "--job", "rsd_titles", "--table", "rsd_titles", *common[4:])
    assert p.returncode == 0, p.stderr
    assert set(_contents(conn, "rsd_titles").values()) == {f"title {i}" for i in range(1, 11)}
    assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'rsd'::regclass").fetchone()[0] > triggers



def test_a_source_in_another_databases_schema_lands_in_that_schema_and_status_and_uninstall_reach_its_queue(
        cli, dsn, conn):
    other_db, other = _fresh_database(conn, dsn, "sync_schema_db")
    with psycopg.connect(other, autocommit=True) as o:
        o.execute("CREATE SCHEMA app")
        o.execute("CREATE TABLE app.notes (note_id int PRIMARY KEY, body text)")
        o.execute("INSERT INTO app.notes SELECT i, 'note number ' || i FROM generate_series(1, 12) i")
    common = ("--from-table", "app.notes", "--db", dsn, "--devices", "cpu", "--quiet")
    # a job refused after its schema was made leaves no schema behind
    one_line_error(cli("ingest", *common, "--source-db", other, "--fts", "--fts-config", "klingon"), "--fts-config")
    assert conn.execute("SELECT to_regnamespace('app') IS NULL").fetchone()[0]
    cli("sync", *common, "--source-db", other, check=True)
    # NAME_embeddings in the source's schema, made in the target's database (not a table named "app.notes_…")
    assert conn.execute("SELECT to_regclass('app.notes_embeddings') IS NOT NULL").fetchone()[0]
    assert conn.execute("SELECT count(*) FROM app.notes_embeddings").fetchone()[0] == 12
    with psycopg.connect(other, autocommit=True) as o:
        o.execute("INSERT INTO app.notes VALUES (13, 'a late note')")
    seen = orjson.loads(cli("status", "--db", dsn, "--json", "--source-db", other, check=True).stdout)["jobs"]
    (job,) = [j for j in seen if j["job"] == "app.notes_embeddings"]
    assert job["pending"] == 1 and job["lag_s"] is not None
    one_line_error(cli("sync", *common, "--uninstall"), f"in database {other_db}, whose trigger and queue are there")
    cli("sync", *common, "--uninstall", "--source-db", other, check=True)
    with psycopg.connect(other, autocommit=True) as o:
        assert o.execute("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'embedfleet%'").fetchone()[0] == 0

def test_rows_the_drain_cannot_write_are_kept_as_rejects_until_they_can(cli, dsn, conn):
    conn.execute("CREATE TABLE rj (review_id int PRIMARY KEY, body text)")
    conn.execute("INSERT INTO rj VALUES (1, 'one'), (2, 'two'), (77, NULL)")
    common = ("--from-table", "rj", "--db", dsn, "--devices", "cpu", "--quiet")
    cli("sync", *common, check=True)
    # the backfill's reject is named by the row's key (it was its place in the heap, 1 × 65536 + 3)
    listed = orjson.loads(cli("jobs", "rejects", "public.rj_embeddings", "--db", dsn, "--json", check=True).stdout)
    assert [(r["line"], r["key"]) for r in listed["rejects"]] == [(77, "77")]
    shown = cli("jobs", "rejects", "public.rj_embeddings", "--db", dsn, check=True).stdout
    assert shown.strip() == "public.rj key 77: field 'body' has no text"
    conn.execute("UPDATE rj SET body = 'seventy-seven' WHERE review_id = 77")
    cli("sync", *common, check=True)  # and a sync that writes the row now clears it
    assert orjson.loads(cli("jobs", "rejects", "public.rj_embeddings", "--db", dsn, "--json",
                            check=True).stdout)["rejected"] == 0
    conn.execute("DELETE FROM rj WHERE review_id = 77")
    cli("sync", *common, check=True)
    conn.execute("INSERT INTO rj VALUES (30, NULL), (40, '')")
    conn.execute("UPDATE rj SET body = NULL WHERE review_id = 1")
    p = cli("sync", *common, "--json", check=True)
    assert orjson.loads(p.stdout)["rejected"] == 3
    listed = orjson.loads(cli("jobs", "rejects", "public.rj_embeddings", "--db", dsn, "--json", check=True).stdout)
    assert listed["rejected"] == 3
    assert [(r["line"], r["reason"]) for r in listed["rejects"]] == [
        (1, "field 'body' has no text"), (30, "field 'body' has no text"), (40, "field 'body' has no text")]
    assert orjson.loads(listed["rejects"][1]["raw"]) == {"review_id": "30", "body": None}
    assert set(_contents(conn, "rj_embeddings")) == {"2"}  # row 1's old text is gone with it
    conn.execute("UPDATE rj SET body = 'fixed' WHERE review_id IN (1, 30)")
    cli("sync", *common, check=True)
    listed = orjson.loads(cli("jobs", "rejects", "public.rj_embeddings", "--db", dsn, "--json", check=True).stdout)
    assert [r["line"] for r in listed["rejects"]] == [40] and listed["rejected"] == 1
    assert _contents(conn, "rj_embeddings") == {"1": "fixed", "2": "two", "30": "fixed"}
    # status counts the rejects kept now and the table's rows, not the backfill's (it said 1 and 2 rows)
    status = _status(cli, dsn, "public.rj_embeddings")
    assert status["rejected"] == 1 and status["rows_written"] == 3 and status["backfill_rows"] == 2
    # and after an uninstall, as before it: verify compared the table with the backfill's count, a problem found
    cli("sync", "--from-table", "rj", "--uninstall", "--db", dsn, check=True)
    status = _status(cli, dsn, "public.rj_embeddings")
    assert status["rejected"] == 1 and status["rows_written"] == 3 and "pending" not in status
    report = orjson.loads(cli("verify", "--table", "rj_embeddings", "--db", dsn, "--json", check=True).stdout)
    assert report["ok"] and report["count_matches_ledger"] is None and report["rows"] == 3, report


def test_a_watched_column_changes_type_or_is_dropped_under_the_follower_and_the_applications_ddl_goes_through(
        cli, dsn, conn, tmp_path):
    """The trigger named the text's columns in its definition: `ALTER COLUMN body TYPE` failed ("used in a trigger
    definition"), and dropping a copied column needed CASCADE, which took the trigger with it."""
    _source(conn, "casc", 30)
    conn.execute("ALTER TABLE casc ADD COLUMN views int DEFAULT 0")
    proc = _start(_sync_args(dsn, "casc", "--columns", "stars", "--follow"), tmp_path)
    try:
        wait_for(conn, "SELECT synced_at FROM embedfleet.syncs WHERE job = 'public.casc_embeddings'", timeout=300)
        tag = conn.execute("SELECT tag FROM embedfleet.syncs WHERE job = 'public.casc_embeddings'").fetchone()[0]
        conn.execute("ALTER TABLE casc ALTER COLUMN body TYPE varchar(500)")  # the application's migration
        conn.execute("UPDATE casc SET body = 'changed after the new type — ünï' WHERE review_id = 1")
        wait_for(conn, "SELECT 1 FROM casc_embeddings WHERE id = '1' AND content = 'changed after the new type — ünï'",
                 timeout=120)
        with conn.transaction():  # counted before the commit, where no follower can have taken it yet
            conn.execute("UPDATE casc SET views = views + 1")  # a column sync does not read: nothing queued
            assert conn.execute(f"SELECT count(*) FROM embedfleet.queue_{tag}").fetchone()[0] == 0
            conn.execute("UPDATE casc SET stars = 5 WHERE review_id = 3")  # one it copies: queued
            assert conn.execute(f"SELECT count(*) FROM embedfleet.queue_{tag}").fetchone()[0] == 1
        conn.execute("ALTER TABLE casc DROP COLUMN stars")  # no CASCADE needed, no trigger lost
        conn.execute("UPDATE casc SET body = 'changed after the drop' WHERE review_id = 2")
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines = [x for x in err.strip().splitlines() if x.startswith("error:")]
    assert proc.returncode != 0 and len(lines) == 1, err
    assert "column 'stars' of public.casc, which sync reads, was dropped or renamed while following" in lines[0]
    assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgname LIKE %s", [f"embedfleet_%_{tag}"]).fetchone()[0] == 3
    one_line_error(cli(*_sync_args(dsn, "casc", "--columns", "stars")[3:]), "--columns 'stars'")
    cli("sync", "--from-table", "casc", "--uninstall", "--db", dsn, check=True)
    assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgname LIKE %s", [f"embedfleet_%_{tag}"]).fetchone()[0] == 0
    # A trigger dropped by hand: the next sync makes them all again and compares every row once.
    _source(conn, "manual", 20)
    cli(*_sync_args(dsn, "manual")[3:], check=True)
    tag = conn.execute("SELECT tag FROM embedfleet.syncs WHERE job = 'public.manual_embeddings'").fetchone()[0]
    conn.execute(f"DROP TRIGGER embedfleet_row_{tag} ON manual")
    conn.execute("UPDATE manual SET body = 'changed while no trigger' WHERE review_id = 1")
    p = cli(*_sync_args(dsn, "manual")[3:])
    assert p.returncode == 0, p.stderr
    assert _contents(conn, "manual_embeddings")["1"] == "changed while no trigger"
    conn.execute("UPDATE manual SET body = 'queued again' WHERE review_id = 2")
    cli(*_sync_args(dsn, "manual")[3:], check=True)
    assert _contents(conn, "manual_embeddings")["2"] == "queued again"


def test_a_column_the_target_has_already_is_refused_before_anything_is_installed(cli, dsn, conn):
    """It was refused after the trigger and the job were made, so every later command met "other settings"."""
    conn.execute("CREATE TABLE rco (pk int PRIMARY KEY, body text, content text)")
    conn.execute("INSERT INTO rco SELECT i, 'body ' || i, 'c ' || i FROM generate_series(1, 5) i")
    common = ("--from-table", "rco", "--text-field", "body", "--db", dsn, "--devices", "cpu", "--quiet")
    one_line_error(cli("sync", *common, "--columns", "content"),
                   "--columns 'content': the table embedfleet writes (id, content, embedding")
    assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'rco'::regclass").fetchone()[0] == 0
    cli("sync", *common, check=True)
    assert _contents(conn, "rco_embeddings") == {str(i): f"body {i}" for i in range(1, 6)}
    p = cli("sync", *common, "--follow", "--uninstall")  # it uninstalled without a word about --follow
    assert p.returncode == 2 and "give one of them" in p.stderr
    assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'rco'::regclass").fetchone()[0] == 3


def test_a_row_sync_embeds_again_loses_the_map_coordinates_of_its_old_vector(cli, dsn, conn):
    from embedfleet.map import store_coords

    _source(conn, "mapped", 10)
    cli(*_sync_args(dsn, "mapped")[3:], check=True)
    ids = [str(i) for i in range(10)]
    store_coords(conn, "mapped_embeddings", ids, np.arange(20, dtype=np.float32).reshape(10, 2), "umap")
    conn.execute("UPDATE mapped SET body = 'a new text, so a new vector' WHERE review_id = 3")
    conn.execute("UPDATE mapped SET stars = 5 WHERE review_id = 4")  # not a watched column: nothing to do
    cli(*_sync_args(dsn, "mapped")[3:], check=True)
    coords = dict(conn.execute("SELECT id, map_x FROM mapped_embeddings").fetchall())
    assert coords["3"] is None and coords["4"] == 8.0 and coords["0"] == 0.0


def test_a_numeric_column_holding_nan_or_infinity_is_copied_as_the_source_holds_it(cli, dsn, conn):
    """A source row whose numeric column held 'NaN' was rejected ("cannot coerce"): PostgreSQL holds it, and so
    does the target's column of the same type."""
    conn.execute("CREATE TABLE rnan (review_id int PRIMARY KEY, body text, price numeric)")
    conn.execute("INSERT INTO rnan SELECT i, 'review ' || i || ' — café', i * 1.25 FROM generate_series(1, 12) i")
    conn.execute("UPDATE rnan SET price = 'NaN' WHERE review_id = 3")
    conn.execute("UPDATE rnan SET price = 'Infinity' WHERE review_id = 4")
    conn.execute("UPDATE rnan SET price = '-Infinity' WHERE review_id = 5")
    conn.execute("UPDATE rnan SET price = 12345678901234567890.123456789 WHERE review_id = 6")
    common = ("--from-table", "rnan", "--text-field", "body", "--columns", "price", "--db", dsn, "--devices", "cpu",
              "--quiet")
    cli("sync", *common, check=True)
    want = dict(conn.execute("SELECT review_id::text, price::text FROM rnan").fetchall())
    assert dict(conn.execute("SELECT id, price::text FROM rnan_embeddings").fetchall()) == want
    assert conn.execute("SELECT count(*) FROM embedfleet.rejects WHERE job LIKE '%rnan%'").fetchone()[0] == 0
    conn.execute("UPDATE rnan SET price = 'NaN', body = 'now NaN' WHERE review_id = 7")
    cli("sync", *common, check=True)
    assert conn.execute("SELECT price::text FROM rnan_embeddings WHERE id = '7'").fetchone()[0] == "NaN"


def test_columns_of_other_types_are_copied_as_postgresql_writes_them(cli, dsn, conn):
    """--columns copies a type the target has no column type for as text: it was Python's text of the value, so an
    int[] rejected its row ("cannot coerce ia=[1, 2, 3] to text"), a bytea came out decoded as UTF-8 and an interval
    of '-1 mon' as '-30 days, 0:00:00'. A column name with a space or a non-ASCII letter was refused."""
    conn.execute('CREATE TABLE rtyped (id int PRIMARY KEY, body text, ia int[], "by" bytea, iv interval, '
                 'rg int4range, u uuid, "Naïve Col" int)')
    conn.execute("INSERT INTO rtyped VALUES (1, 'one — ü', '{1,2,3}', '\\xdeadbeef', '-1 mon', '[1,5)', "
                 "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', 5), (2, 'two', '{}', '\\x00', '1 day', NULL, NULL, NULL)")
    copied = ("ia", "by", "iv", "rg", "u", "Naïve Col")
    common = ("--from-table", "rtyped", "--text-field", "body", "--columns", ",".join(copied), "--db", dsn,
              "--devices", "cpu", "--quiet")
    cols = ", ".join(f'"{c}"::text' for c in copied)
    cli("sync", *common, check=True)
    want = {r[0]: r[1:] for r in conn.execute(f"SELECT id::text, {cols} FROM rtyped")}
    assert {r[0]: r[1:] for r in conn.execute(f"SELECT id, {cols} FROM rtyped_embeddings")} == want
    assert conn.execute("SELECT count(*) FROM embedfleet.rejects WHERE job LIKE '%%rtyped%%'").fetchone()[0] == 0
    conn.execute("UPDATE rtyped SET ia = '{7,8}', iv = '2 years' WHERE id = 2")  # the drain reads them the same way
    conn.execute("INSERT INTO rtyped (id, body, ia) VALUES (3, 'three', '{9}')")
    cli("sync", *common, check=True)
    want = {r[0]: r[1:] for r in conn.execute(f"SELECT id::text, {cols} FROM rtyped")}
    assert {r[0]: r[1:] for r in conn.execute(f"SELECT id, {cols} FROM rtyped_embeddings")} == want
    assert want["1"][:3] == ("{1,2,3}", "\\xdeadbeef", "-1 mons") and want["2"][:3] == ("{7,8}", "\\x00", "2 years")
    # a template still joins an array's items, and writes an interval as PostgreSQL does
    cli("ingest", "--from-table", "rtyped", "--text-template", "{body}: {ia} / {iv}", "--table", "rtyped_t", "--db",
        dsn, "--devices", "cpu", "--quiet", check=True)
    assert _contents(conn, "rtyped_t")["1"] == "one — ü: 1, 2, 3 / -1 mons"


def test_an_update_of_a_copied_json_or_point_column_goes_through_and_is_followed(cli, dsn, conn):
    """json and point have no equality operator: a trigger comparing them as they are failed the application's
    UPDATE ("operator does not exist: json = json")."""
    conn.execute("CREATE TABLE rjs (id int PRIMARY KEY, body text, attrs json, spot point)")
    conn.execute("""INSERT INTO rjs SELECT i, 'body ' || i || ' — ü', '{"x": 1}', '(1,2)' FROM generate_series(1, 6) i""")
    common = ("--from-table", "rjs", "--text-template", "{body} {spot}", "--columns", "attrs", "--db", dsn,
              "--devices", "cpu", "--quiet")
    cli("sync", *common, check=True)
    conn.execute("""UPDATE rjs SET attrs = '{"x": 2}' WHERE id = 1""")  # it failed here
    conn.execute("UPDATE rjs SET spot = '(3,4)' WHERE id = 2")
    conn.execute("UPDATE rjs SET attrs = attrs, spot = spot WHERE id = 3")  # nothing changed: nothing queued
    tag = conn.execute("SELECT tag FROM embedfleet.syncs WHERE job = 'public.rjs_embeddings'").fetchone()[0]
    assert sorted(k for (k,) in conn.execute(f"SELECT key FROM embedfleet.queue_{tag}")) == ["1", "2"]
    cli("sync", *common, check=True)
    rows = {i: (c, a) for i, c, a in conn.execute("SELECT id, content, attrs::text FROM rjs_embeddings")}
    assert rows["1"][1] == '{"x": 2}' and rows["2"][0] == "body 2 — ü (3,4)" and len(rows) == 6


def test_a_text_column_renamed_under_the_follower_keeps_its_queued_changes_for_the_next_sync(cli, dsn, conn,
                                                                                              tmp_path):
    """The drain read the rows without the column and took them for rows with no text: the changes were kept
    as rejects, the edited row deleted from the target, and their queue entries gone."""
    _source(conn, "ren", 20)
    proc = _start(_sync_args(dsn, "ren", "--follow"), tmp_path)
    try:
        wait_for(conn, "SELECT synced_at FROM embedfleet.syncs WHERE job = 'public.ren_embeddings'", timeout=300)
        with conn.transaction():  # the follower finds the changes and the rename together
            conn.execute("ALTER TABLE ren RENAME COLUMN body TO body_text")
            conn.execute("INSERT INTO ren VALUES (1002, 't', 'after the rename', 1)")
            conn.execute("UPDATE ren SET body_text = 'edited after the rename' WHERE review_id = 3")
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines = [x for x in err.strip().splitlines() if x.startswith("error:")]
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in err, err
    assert "column 'body' of public.ren, which sync reads, was dropped or renamed while following" in lines[0]
    assert "its queue is kept" in lines[0]
    assert _contents(conn, "ren_embeddings")["3"] == _text(3)  # nothing of the batch was written
    conn.execute("ALTER TABLE ren RENAME COLUMN body_text TO body")
    cli(*_sync_args(dsn, "ren")[3:], check=True)
    got = _contents(conn, "ren_embeddings")
    assert got["3"] == "edited after the rename" and got["1002"] == "after the rename" and len(got) == 21
    assert orjson.loads(cli("jobs", "rejects", "public.ren_embeddings", "--db", dsn, "--json",
                            check=True).stdout)["rejected"] == 0


def test_a_key_rewritten_at_another_scale_or_dropped_with_cascade_leaves_no_stale_row_and_no_failing_write(
        cli, dsn, conn):
    """`2` and `2.0` are equal numerics and two target ids: the old one stayed. The key dropped with CASCADE (the
    server's own hint) made every UPDATE of the application fail inside the UPDATE trigger."""
    conn.execute("CREATE TABLE nsc (k numeric PRIMARY KEY, body text)")
    conn.execute("INSERT INTO nsc VALUES (2, 'two'), (3, 'three')")
    common = ("--from-table", "nsc", "--text-field", "body", "--db", dsn, "--devices", "cpu", "--quiet")
    cli("sync", *common, check=True)
    conn.execute("UPDATE nsc SET k = 2.0, body = 'two again' WHERE k = 2")
    cli("sync", *common, check=True)
    assert _contents(conn, "nsc_embeddings") == {"2.0": "two again", "3": "three"}
    conn.execute("ALTER TABLE nsc ADD COLUMN k2 int GENERATED ALWAYS AS IDENTITY")
    conn.execute("ALTER TABLE nsc DROP COLUMN k CASCADE")
    conn.execute("UPDATE nsc SET body = 'the application goes on'")  # failed: record "new" has no field "k"
    line = one_line_error(cli("sync", *common), "no usable key")
    assert "sync's triggers are still on public.nsc" in line and "--uninstall" in line
    cli("sync", "--from-table", "nsc", "--uninstall", "--db", dsn, check=True)
    assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'nsc'::regclass AND NOT tgisinternal"
                        ).fetchone()[0] == 0


def test_an_earlier_installs_trigger_functions_are_remade_by_the_next_sync(cli, dsn, conn):
    _source(conn, "oldfn", 3)
    cli(*_sync_args(dsn, "oldfn")[3:], check=True)
    tag = conn.execute("SELECT tag FROM embedfleet.syncs WHERE job = 'public.oldfn_embeddings'").fetchone()[0]
    conn.execute(f"CREATE OR REPLACE FUNCTION embedfleet.changed_{tag}() RETURNS trigger LANGUAGE plpgsql AS "
                 "$$ BEGIN RETURN NULL; END $$")  # as an earlier version made it: queues nothing
    cli(*_sync_args(dsn, "oldfn")[3:], check=True)
    conn.execute("UPDATE oldfn SET body = 'queued by the remade function' WHERE review_id = 1")
    cli(*_sync_args(dsn, "oldfn")[3:], check=True)
    assert _contents(conn, "oldfn_embeddings")["1"] == "queued by the remade function"


def test_a_key_that_may_be_null_rejects_its_null_rows_and_queues_no_truncate_for_them(cli, dsn, conn):
    """A unique key allows NULLs: the backfill failed whole on the first (`key_line(None)`), and the trigger
    queued a NULL key for such a row, which the drain reads as a TRUNCATE."""
    conn.execute("CREATE TABLE nulk (id serial PRIMARY KEY, ext text UNIQUE, body text)")
    conn.execute("INSERT INTO nulk (ext, body) VALUES ('e1', 'one'), (NULL, 'no key'), ('e3', 'three')")
    common = ("--from-table", "nulk", "--id-field", "ext", "--text-field", "body", "--db", dsn, "--devices", "cpu",
              "--quiet")
    cli("sync", *common, check=True)
    assert _contents(conn, "nulk_embeddings") == {"e1": "one", "e3": "three"}
    listed = orjson.loads(cli("jobs", "rejects", "public.nulk_embeddings", "--db", dsn, "--json", check=True).stdout)
    assert listed["rejected"] == 1 and "'ext'" in listed["rejects"][0]["reason"]
    tag = conn.execute("SELECT tag FROM embedfleet.syncs WHERE job = 'public.nulk_embeddings'").fetchone()[0]
    conn.execute("INSERT INTO nulk (ext, body) VALUES (NULL, 'another without a key')")
    conn.execute("UPDATE nulk SET body = 'edited, still no key' WHERE ext IS NULL")
    conn.execute("DELETE FROM nulk WHERE body = 'edited, still no key' AND id = 2")
    assert conn.execute(f"SELECT count(*) FROM embedfleet.queue_{tag}").fetchone()[0] == 0
    conn.execute("UPDATE nulk SET ext = NULL WHERE ext = 'e3'")  # the row leaves the target
    assert conn.execute(f"SELECT array_agg(key) FROM embedfleet.queue_{tag}").fetchone()[0] == ["e3"]
    cli("sync", *common, check=True)
    assert _contents(conn, "nulk_embeddings") == {"e1": "one"}


def test_install_and_uninstall_wait_for_a_busy_source_in_short_tries_that_never_hold_the_applications_writes(
        cli, dsn, conn, monkeypatch):
    """Each waited 5 s for the source's lock while the application's writes queued behind it, and uninstall then
    failed as "the database refused a statement"."""
    import threading

    from embedfleet.errors import DatabaseError
    from embedfleet.pg import queue

    _source(conn, "busy", 5)
    q = queue.Queue("public.busy", "review_id", "busytest")
    monkeypatch.setattr(queue, "LOCK_PATIENCE", 1.5)
    holder = psycopg.connect(dsn)  # a long transaction that wrote to the source: its lock stays until it ends
    holder.execute("INSERT INTO busy VALUES (100, 't', 'held', 1)")
    waits, stop = [], threading.Event()

    def application() -> None:
        with psycopg.connect(dsn, autocommit=True) as app:
            i = 0
            while not stop.is_set():
                t0 = time.monotonic()
                app.execute("INSERT INTO busy VALUES (%s, 't', 'app', 1)", [1000 + i])
                waits.append(time.monotonic() - t0)
                i += 1
                time.sleep(0.02)

    writer = threading.Thread(target=application)
    writer.start()
    try:
        with psycopg.connect(dsn, autocommit=True) as admin:
            with pytest.raises(DatabaseError, match="public.busy is busy: its writers held it for 1.5 s; the trigger "
                                                    "was not installed"):
                queue.install(admin, q, ["body"])
            assert not queue.installed(admin, q)
            holder.commit()
            assert queue.install(admin, q, ["body"])
            holder.execute("INSERT INTO busy VALUES (101, 't', 'held again', 1)")
            with pytest.raises(DatabaseError, match="nothing was removed; rerun sync --uninstall"):
                queue.uninstall(admin, q)
            holder.commit()
            assert queue.uninstall(admin, q)
    finally:
        stop.set()
        writer.join()
        holder.close()
    assert len(waits) > 20 and max(waits) < 1.0  # each try held them a tenth of a second at most


def test_a_follower_stopped_during_its_backfill_exits_0_and_the_next_sync_resumes_it(cli, dsn, conn, tmp_path):
    """SIGTERM is how a service manager stops `sync --follow`: it exited 143 when it came before the drain."""
    _source(conn, "early", 3000)
    proc = _start(_sync_args(dsn, "early", "--follow", "--chunk-bytes", "16384"), tmp_path)
    try:
        wait_for(conn, "SELECT 1 FROM embedfleet.chunks c JOIN embedfleet.jobs j USING (job) WHERE "
                 "j.job = 'public.early_embeddings' AND c.state = 'done'", timeout=300)
        assert conn.execute("SELECT synced_at FROM embedfleet.syncs WHERE job = 'public.early_embeddings'"
                            ).fetchone()[0] is None  # still in the backfill
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "interrupted: rerun the same command to resume" in err and "Traceback" not in err
    cli(*_sync_args(dsn, "early", "--chunk-bytes", "16384")[3:], check=True)
    _assert_equal_to_source(conn, "early", "early_embeddings")


def test_a_rerun_with_other_columns_is_refused_as_other_settings_not_sent_to_alter_the_table(cli, dsn, conn):
    """It said to ALTER TABLE … ADD COLUMN; done, the next run refused the job's other settings anyway."""
    _source(conn, "recol", 5)
    common = ("ingest", "--from-table", "recol", "--text-field", "body", "--db", dsn, "--devices", "cpu", "--quiet")
    cli(*common, check=True)
    line = one_line_error(cli(*common, "--columns", "stars"), "already exists with other settings (--columns")
    assert "ALTER TABLE" not in line
    cli(*common, check=True)  # the same command as before still resumes


def test_a_target_dropped_by_hand_is_backfilled_again_and_counted_so(cli, dsn, conn):
    _source(conn, "dropt", 6)
    cli(*_sync_args(dsn, "dropt")[3:], check=True)
    conn.execute("DROP TABLE dropt_embeddings")
    conn.execute("DELETE FROM dropt WHERE review_id < 2")
    again = orjson.loads(cli(*_sync_args(dsn, "dropt", "--json")[3:], check=True).stdout)
    assert again["backfill_rows"] == 4  # was -2: the count before the drop taken from the count after
    assert set(_contents(conn, "dropt_embeddings")) == {"2", "3", "4", "5"}


def test_a_truncated_partition_of_a_partitioned_source_is_followed(cli, dsn, conn):
    """The TRUNCATE trigger was on the parent alone, which a partition's own TRUNCATE does not fire."""
    conn.execute("CREATE TABLE ev (id bigint PRIMARY KEY, body text) PARTITION BY RANGE (id)")
    conn.execute("CREATE TABLE ev_1 PARTITION OF ev FOR VALUES FROM (0) TO (100)")
    conn.execute("CREATE TABLE ev_2 PARTITION OF ev FOR VALUES FROM (100) TO (200)")
    conn.execute("INSERT INTO ev SELECT i, 'event ' || i FROM generate_series(1, 199) i")
    common = ("sync", "--from-table", "ev", "--text-field", "body", "--db", dsn, "--devices", "cpu", "--quiet")
    cli(*common, check=True)
    conn.execute("TRUNCATE ev_1")
    cli(*common, check=True)
    assert set(_contents(conn, "ev_embeddings")) == {str(i) for i in range(100, 200)}
    conn.execute("CREATE TABLE ev_3 PARTITION OF ev FOR VALUES FROM (200) TO (300)")  # attached after the install
    cli(*common, check=True)
    conn.execute("INSERT INTO ev VALUES (250, 'in the new partition')")
    cli(*common, check=True)
    assert _contents(conn, "ev_embeddings")["250"] == "in the new partition"
    conn.execute("TRUNCATE ev_3")
    cli(*common, check=True)
    assert "250" not in _contents(conn, "ev_embeddings")
    cli("sync", "--from-table", "ev", "--uninstall", "--db", dsn, check=True)
    assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'embedfleet%'").fetchone()[0] == 0
