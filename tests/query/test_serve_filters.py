"""`serve` with strangers' filters: off unless --allow-where, then run as a role that reads the served table
only, under a statement timeout, and cancelled when the client goes away. Real embedded server, real HTTP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import psycopg
import pytest
from conftest import wait_for


def _rows(path, n=40):
    path.write_text("".join(json.dumps({"text": f"cable number {i} — naïve 東京", "n": i}) + "\n" for i in range(n)))
    return path


def _serve(tmp_path, *args):
    proc = subprocess.Popen([sys.executable, "-m", "embedfleet.cli", "serve", "--port", "0", "--device", "cpu", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, EMBEDFLEET_HOME=str(tmp_path / "home")))
    line = proc.stderr.readline()
    assert "serving" in line, line + proc.stderr.read()
    return proc, line.split(" on ", 1)[1].split("/search", 1)[0]


def _get(base, **params):
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(f"{base}/search?" + urllib.parse.urlencode(params), timeout=60) as r:
            return r.status, json.loads(r.read()), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), time.monotonic() - t0


@pytest.fixture
def embedded_table(cli, tmp_path):
    """A table in this test's own embedded server (no --db), its DSN; the server stopped afterwards."""
    cli("ingest", _rows(tmp_path / "docs.jsonl"), "--table", "docs", "--devices", "cpu", "--quiet", check=True)
    yield cli("db", "uri", check=True).stdout.strip()
    cli("db", "stop")


def test_filters_over_http_run_as_a_role_that_reads_the_table_only(embedded_table, tmp_path):
    proc, base = _serve(tmp_path, "--table", "docs", "--allow-where", "--statement-timeout", "2")
    try:
        with psycopg.connect(embedded_table, autocommit=True) as admin:
            me = admin.execute("SELECT pg_backend_pid()").fetchone()[0]
            for where in ("length(pg_read_file('/etc/passwd')) > 0", "(SELECT count(*) FROM pg_ls_dir('.')) > 0",
                          f"pg_terminate_backend({me})", "(SELECT count(*) FROM embedfleet.jobs) > 0",
                          "set_config('role', 'postgres', true) IS NOT NULL"):
                status, doc, _ = _get(base, q="cable", where=where)
                assert 400 <= status < 500 and "\n" not in doc["error"], (where, status, doc)
            assert admin.execute("SELECT 1").fetchone() == (1,)  # the superuser's backend was not terminated
            status, doc, _ = _get(base, q="cable", where="current_setting('is_superuser') = 'on'")
            assert status == 200 and doc["results"] == []
            status, doc, _ = _get(base, q="cable", k=3, where="content ilike '%number 1%'")  # a % is the user's own
            assert status == 200 and len(doc["results"]) == 3
            assert all("number 1" in r["content"] for r in doc["results"])
            status, doc, seconds = _get(base, q="cable", where="pg_sleep(30) IS NOT NULL")
            assert status == 400 and "statement timeout" in doc["error"] and seconds < 10
            assert admin.execute("SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%%pg_sleep(30)%%' "
                                 "AND state = 'active' AND pid <> pg_backend_pid()").fetchone()[0] == 0
        # errors in the client's words (`where=`, not the CLI's `--where`), and a parameter given twice refused
        status, doc, _ = _get(base, q="cable", where="no_such_column > 1")
        assert status == 400 and doc["error"].startswith("where='no_such_column > 1': "), doc
        status, doc, _ = _get(base, q="cable", hybrid="true")
        assert status == 400 and doc["error"].startswith("hybrid=true: table 'docs' has no full-text index"), doc
        with pytest.raises(urllib.error.HTTPError) as twice:
            urllib.request.urlopen(f"{base}/search?q=cable&k=2&k=50", timeout=60)
        assert twice.value.code == 400 and json.loads(twice.value.read())["error"] == \
            "k: given 2 times; give each parameter once"
        body = json.dumps({"q": "cable", "k": 3}).encode()
        request = urllib.request.Request(f"{base}/search?k=5", data=body, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as both:
            urllib.request.urlopen(request, timeout=60)
        assert both.value.code == 400 and "k: given both in the URL and in the body" in json.loads(both.value.read())["error"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_filter_that_would_end_the_statement_or_cut_off_its_limit_is_refused_and_writes_nothing(
        cli, embedded_table, tmp_path):
    escapes = ("true); commit; delete from docs; select 1 where (true", "true) --", "true /* */",
               "true); select pg_sleep(12); select 1 where (true", "(true", "content = 'x")
    for where in escapes:  # the CLI, as the table's owner
        p = cli("search", "cable", "--table", "docs", "--device", "cpu", "--where", where)
        assert p.returncode == 2 and "give one condition" in p.stderr and p.stderr.count("\n") == 1, p.stderr
    proc, base = _serve(tmp_path, "--table", "docs", "--allow-where", "--statement-timeout", "2")
    try:
        for where in escapes:
            status, doc, seconds = _get(base, q="cable", k=2, where=where)
            assert status == 400 and "give one condition" in doc["error"] and seconds < 10, (where, status, doc)
        # ';', '--' and parentheses inside literals and quoted names are the user's own
        status, doc, _ = _get(base, q="cable", k=3, where="\"content\" <> 'a; b -- (c' AND id <> $$)$$")
        assert status == 200 and len(doc["results"]) == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    with psycopg.connect(embedded_table, autocommit=True) as admin:
        assert admin.execute("SELECT count(*) FROM docs").fetchone()[0] == 40


def test_a_client_that_goes_away_cancels_its_statement(embedded_table, tmp_path):
    proc, base = _serve(tmp_path, "--table", "docs", "--allow-where", "--statement-timeout", "60")
    try:
        host, port = base.removeprefix("http://").split(":")
        where = urllib.parse.quote("pg_sleep(45) IS NOT NULL")
        with psycopg.connect(embedded_table, autocommit=True) as admin:
            sleeping = ("SELECT nullif(count(*), 0) FROM pg_stat_activity WHERE query LIKE '%%pg_sleep(45)%%' "
                        "AND state = 'active' AND pid <> pg_backend_pid()")
            client = socket.create_connection((host, int(port)))
            client.sendall(f"GET /search?q=cable&where={where} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            wait_for(admin, sleeping, timeout=30)  # the statement runs on the server
            client.close()
            t0 = time.monotonic()
            while admin.execute(sleeping).fetchone()[0] and time.monotonic() - t0 < 10:
                time.sleep(0.1)
            assert admin.execute(sleeping).fetchone()[0] is None, "the statement outlived its client"
        status, doc, _ = _get(base, q="cable", k=2)
        assert status == 200 and len(doc["results"]) == 2  # still serving
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    log = proc.stderr.read()  # a client leaving is no failure of the server's: nothing logged as one
    assert "Traceback" not in log and "never retrieved" not in log and "statement timeout" not in log, log


def test_without_allow_where_a_filter_is_refused(embedded_table, tmp_path):
    proc, base = _serve(tmp_path, "--table", "docs")
    try:
        status, doc, _ = _get(base, q="cable", where="n < 3")
        assert status == 400 and "--allow-where" in doc["error"]
        status, doc, _ = _get(base, q="cable", k=4)
        assert status == 200 and len(doc["results"]) == 4 and doc["scan"] == "index"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_with_db_a_superuser_is_refused_for_filters_and_a_reading_role_is_used(cli, dsn, tmp_path):
    cli("ingest", _rows(tmp_path / "docs.jsonl"), "--table", "docs", "--db", dsn, "--devices", "cpu", "--quiet",
        check=True)
    p = cli("serve", "--table", "docs", "--db", dsn, "--allow-where", "--port", "0")
    lines = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr
    assert "superuser" in lines[0] and "CREATE ROLE" in lines[0] and "--where-db" in lines[0]
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("DROP ROLE IF EXISTS docs_reader")
        admin.execute("CREATE ROLE docs_reader LOGIN")
        admin.execute("GRANT SELECT ON docs TO docs_reader")
    reader = dsn.replace("postgres:@", "docs_reader:@", 1)
    proc, base = _serve(tmp_path, "--table", "docs", "--db", dsn, "--allow-where", "--where-db", reader)
    try:
        status, doc, _ = _get(base, q="cable", k=5, where="(record->>'n')::int < 3")
        assert status == 200 and sorted(r["id"] for r in doc["results"]) == ["docs.jsonl:1", "docs.jsonl:2",
                                                                            "docs.jsonl:3"]
        status, doc, _ = _get(base, q="cable", where="(SELECT count(*) FROM embedfleet.jobs) > 0")
        assert status == 400
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_filters_queued_for_their_connections_hold_up_no_search_without_one_nor_change_the_session(
        embedded_table, tmp_path):
    """Sixty filtered searches waiting for the filter's connections held every thread that a search without a
    filter needed; and U&"set\\005fconfig"(...) passed the filter's scan and changed the reading role's session,
    so that every later filtered search failed."""
    import threading

    proc, base = _serve(tmp_path, "--table", "docs", "--allow-where", "--statement-timeout", "30")
    try:
        status, doc, _ = _get(base, q="cable", where="U&\"set\\005fconfig\"('search_path', 'pg_catalog', false) "
                                                     "IS NOT NULL")
        assert status == 400 and "Unicode escapes" in doc["error"], doc
        status, doc, _ = _get(base, q="cable", k=2, where="content ilike '%cable%'")
        assert status == 200 and len(doc["results"]) == 2
        done: list = []
        slow = "pg_sleep(0.01) IS NOT NULL"  # a hundredth of a second a row: about half a second a search
        threads = [threading.Thread(target=lambda: done.append(_get(base, q="cable", where=slow)[0]))
                   for _ in range(60)]
        for t in threads:
            t.start()
        with psycopg.connect(embedded_table, autocommit=True) as admin:
            wait_for(admin, "SELECT nullif(count(*), 0) FROM pg_stat_activity WHERE query LIKE '%%pg_sleep(0.01)%%' "
                            "AND state = 'active' AND pid <> pg_backend_pid()", timeout=60)
        status, doc, _ = _get(base, q="cable", k=2)
        answered_before = len(done)
        for t in threads:
            t.join(180)
        assert status == 200 and len(doc["results"]) == 2
        # before: it waited for a thread behind the twenty that had none, each freed by a filtered search's end
        assert answered_before < 12, answered_before
        assert done == [200] * 60
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_search_leaves_no_session_setting_behind(embedded_table):
    """The search's transaction is rolled back, not committed: a setting a filter made slips no further."""
    from embedfleet.query.search import Searcher

    with psycopg.connect(embedded_table, autocommit=True) as conn:
        searcher = Searcher(conn, "docs", 5.0)
        with searcher._guarded(None) as cur:
            cur.execute("SELECT set_config('application_name', 'changed by a filter', false)")
        assert conn.execute("SHOW application_name").fetchone()[0] != "changed by a filter"
