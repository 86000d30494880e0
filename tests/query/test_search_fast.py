"""`embedfleet search` as a user meets it: one query embeds without compiling, helper processes or
torch; `--queries FILE` gives the same top results as one call per query; `serve` answers /search
with the CLI's results, refuses a filter that writes, and listens on 127.0.0.1 unless told otherwise.
(Real PostgreSQL, the real bundled MiniLM, the real command in subprocesses.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

import psutil
import pytest
from conftest import EXAMPLES

TABLE = "phones"
QUERIES = ["battery dies after a week", "case cracked when dropped", "Café crème — naïve 東京 🚀 “great”",
           "fast charging"]


@pytest.fixture(scope="module")
def table_dsn(pg_server, tmp_path_factory):
    """A database holding the example reviews in table `phones`, ingested once for this module."""
    import psycopg

    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg_server.get_uri(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    dsn = pg_server.get_uri(database=name)
    home = tmp_path_factory.mktemp("home")
    p = subprocess.run(
        [sys.executable, "-m", "embedfleet.cli", "ingest", str(EXAMPLES / "Cell_Phones_and_Accessories.jsonl"),
         "--meta", str(EXAMPLES / "meta_Cell_Phones_and_Accessories.jsonl"), "--preset", "amazon-reviews",
         "--table", TABLE, "--db", dsn, "--devices", "cpu", "--quiet"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, EMBEDFLEET_HOME=str(home)),
        stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-3000:]
    return dsn


def _search_json(cli, dsn, query, *extra):
    p = cli("search", query, "--table", TABLE, "--db", dsn, "--json", *extra)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["results"]


def _same(a: list[dict], b: list[dict]) -> None:
    assert [r["id"] for r in a] == [r["id"] for r in b]
    assert all(abs(x["distance"] - y["distance"]) < 1e-5 for x, y in zip(a, b))
    assert [r["content"] for r in a] == [r["content"] for r in b]


def test_one_query_on_the_cpu_compiles_nothing_and_starts_no_process(table_dsn, tmp_path):
    """Asserted from what the process did: every process start goes through fork_exec (subprocess,
    multiprocessing's spawn, our helpers) or os.fork; torch is never imported, so nothing compiles."""
    report = tmp_path / "report.json"
    code = textwrap.dedent(f"""
        import json, os, sys, _posixsubprocess
        started = []
        real_fork_exec, real_fork = _posixsubprocess.fork_exec, os.fork
        def fork_exec(*a, **kw):
            started.append("fork_exec")
            return real_fork_exec(*a, **kw)
        def fork():
            started.append("fork")
            return real_fork()
        _posixsubprocess.fork_exec, os.fork = fork_exec, fork
        sys.argv = ["embedfleet", "search", {QUERIES[0]!r}, "--table", {TABLE!r}, "--db", {table_dsn!r}, "--json"]
        from embedfleet import cli
        try:
            cli.main()
        except SystemExit as e:
            code = e.code
        from embedfleet.platform.helpers import started_count
        graphs = None
        if "torch._dynamo" in sys.modules:
            from torch._dynamo.utils import counters
            graphs = counters["stats"]["unique_graphs"]
        with open({str(report)!r}, "w") as f:
            json.dump({{"exit": code, "started": started, "helpers": started_count(),
                       "torch": "torch" in sys.modules, "dynamo": "torch._dynamo" in sys.modules,
                       "graphs": graphs}}, f)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, EMBEDFLEET_HOME=str(tmp_path / "home")), stdin=subprocess.DEVNULL)
    got = json.loads(report.read_text())
    assert got["exit"] == 0, p.stderr
    assert len(json.loads(p.stdout)["results"]) == 10
    assert got["started"] == [] and got["helpers"] == 0  # no helper, no process of any kind
    assert not got["dynamo"] and got["graphs"] is None  # nothing could compile
    assert not got["torch"]  # a BERT-family model's query never needs torch


def test_a_queries_file_gives_what_one_call_per_query_gives(cli, table_dsn, tmp_path):
    qfile = tmp_path / "queries.txt"
    qfile.write_text("\n".join(QUERIES[:2] + [""] + QUERIES[2:]) + "\n", encoding="utf-8")  # a blank line is skipped
    for extra in ([], ["--where", "rating <= 2"]):
        p = cli("search", "--queries", qfile, "--table", TABLE, "--db", table_dsn, "-k", "5", *extra)
        assert p.returncode == 0, p.stderr
        lines = [json.loads(line) for line in p.stdout.splitlines()]
        assert [d["query"] for d in lines] == QUERIES
        for d in lines:
            _same(d["results"], _search_json(cli, table_dsn, d["query"], "-k", "5", *extra))
            assert len(d["results"]) == 5 and (not extra or all(r["rating"] <= 2 for r in d["results"]))
    missing = cli("search", "--queries", tmp_path / "nope.txt", "--table", TABLE, "--db", table_dsn)
    assert missing.returncode == 2 and missing.stderr.strip().startswith("error: --queries")
    none = cli("search", QUERIES[0], "--table", TABLE, "--db", table_dsn, "--where", "false", "--json")
    assert none.returncode == 0 and json.loads(none.stdout)["results"] == []
    assert "pass the filter" in none.stderr  # said, as without --json
    for args, why in ((["-k", "0"], "ask for at least one result"),
                      (["-k", "99999999999999999999"], "at most 100,000,000 rows"),
                      (["--where", ""], "--where '': it is empty")):  # it was read as no filter
        bad = cli("search", QUERIES[0], "--table", TABLE, "--db", table_dsn, *args)
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and len(lines) == 1 and why in lines[0], bad.stderr  # not the server's bigint error


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_serve_answers_like_the_cli_refuses_writes_and_listens_on_loopback(cli, table_dsn, tmp_path):
    import psycopg

    with psycopg.connect(table_dsn, autocommit=True) as admin:  # filters run as a role that reads the table only
        admin.execute("DO $$BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'phones_reader') THEN "
                      "CREATE ROLE phones_reader LOGIN; END IF; END$$")
        admin.execute(f'GRANT SELECT ON "{TABLE}" TO phones_reader')
    reader = table_dsn.replace("postgres:@", "phones_reader:@", 1)
    proc = subprocess.Popen([sys.executable, "-m", "embedfleet.cli", "serve", "--table", TABLE, "--db", table_dsn,
                             "--port", "0", "--device", "cpu", "--allow-where", "--where-db", reader],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, EMBEDFLEET_HOME=str(tmp_path / "home")))
    try:
        line = proc.stderr.readline()
        assert "serving" in line, line + proc.stderr.read()
        base = line.split(" on ", 1)[1].split("/search", 1)[0]
        assert base.startswith("http://127.0.0.1:")
        listening = [c for c in psutil.Process(proc.pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
        assert [c.laddr.ip for c in listening] == ["127.0.0.1"]

        for q in QUERIES:
            status, doc = _get(f"{base}/search?" + urllib.parse.urlencode({"q": q, "k": 5}))
            assert status == 200
            _same(doc["results"], _search_json(cli, table_dsn, q, "-k", "5"))
        status, doc = _get(f"{base}/search?" + urllib.parse.urlencode({"q": QUERIES[0], "where": "rating <= 2"}))
        assert status == 200
        _same(doc["results"], _search_json(cli, table_dsn, QUERIES[0], "--where", "rating <= 2"))

        writes = [f'id IN (SELECT id FROM "{TABLE}" FOR UPDATE)', f'1=1; DELETE FROM "{TABLE}"',
                  "nextval('embedfleet.nope') > 0"]
        for where in writes:
            status, doc = _get(f"{base}/search?" + urllib.parse.urlencode({"q": "x", "where": where}))
            assert status == 400 and doc["error"].startswith("where=") and "\n" not in doc["error"], doc
        status, doc = _get(f"{base}/search?q=")
        assert status == 400
        status, doc = _get(f"{base}/search?" + urllib.parse.urlencode({"q": QUERIES[1], "k": 3}))
        assert status == 200 and len(doc["results"]) == 3  # still serving after the refusals
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    with psycopg.connect(table_dsn) as conn:
        assert conn.execute(f'SELECT count(*) FROM "{TABLE}"').fetchone()[0] == 200


def test_serve_listens_where_host_says(table_dsn, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "embedfleet.cli", "serve", "--table", TABLE, "--db", table_dsn,
                             "--port", "0", "--device", "cpu", "--host", "0.0.0.0", "--api-key", "k"],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, EMBEDFLEET_HOME=str(tmp_path)))
    try:
        assert "serving" in proc.stderr.readline()
        deadline = time.time() + 10
        while time.time() < deadline:
            listening = [c.laddr.ip for c in psutil.Process(proc.pid).net_connections(kind="tcp")
                         if c.status == psutil.CONN_LISTEN]
            if listening:
                break
        assert listening == ["0.0.0.0"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_cache_clear_removes_the_compile_cache(cli, tmp_path):
    home = tmp_path / "home"  # the cli fixture's EMBEDFLEET_HOME
    no_bytecode = {"EMBEDFLEET_PYCACHE": "0"}  # where the image keeps no bytecode, ours would be counted too
    p = cli("cache", "path", extra_env=no_bytecode)
    assert p.returncode == 0 and p.stdout.strip() == str(home / "cache")
    for name in ("inductor/fxgraph/ab/graph", "triton/k/kernel.cubin", "compiled.json"):
        f = home / "cache" / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x" * 10)
    p = cli("cache", "clear", "--json", extra_env=no_bytecode)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"path": str(home / "cache"), "files": 3, "bytes": 30}
    assert not (home / "cache").exists()
    assert cli("cache", "clear").returncode == 0  # nothing there: still fine


def test_query_bytes_that_are_not_utf8_search_as_the_replacement_character(table_dsn, tmp_path):
    """A query argument or a --queries line from stdin with a byte that is not UTF-8 searches as U+FFFD, as
    ingest stores such text (it stopped in a TypeError from the tokenizer, or from the JSON output)."""
    env = dict(os.environ, EMBEDFLEET_HOME=str(tmp_path / "home"))
    base = [sys.executable, "-m", "embedfleet.cli", "search", "--table", TABLE, "--db", table_dsn, "-k", "3"]
    one = subprocess.run(base + [b"battery \xff dies", "--json"], capture_output=True, env=env, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert one.returncode == 0, one.stderr.decode()
    replaced = subprocess.run(base + ["battery \ufffd dies", "--json"], capture_output=True, env=env, timeout=300,
                              stdin=subprocess.DEVNULL)
    assert json.loads(one.stdout)["results"] == json.loads(replaced.stdout)["results"]
    piped = subprocess.run(base + ["--queries", "-"], input=b"cable \xfe\xff broke\nscreen\n", capture_output=True,
                           env=env, timeout=300)
    assert piped.returncode == 0, piped.stderr.decode()
    lines = [json.loads(line) for line in piped.stdout.decode().splitlines()]
    assert [d["query"] for d in lines] == ["cable \ufffd\ufffd broke", "screen"]
    assert all(len(d["results"]) == 3 for d in lines)


def test_rows_without_a_vector_are_not_results_and_do_not_stop_a_search(cli, dsn, conn, tmp_path):
    """A row without a vector (a hand-made row, a column cleared) stopped every search that would have reached it:
    `float(None)` as its distance, a TypeError in one line."""
    src = tmp_path / "two.jsonl"
    src.write_text('{"id": "a", "text": "hello world"}\n{"id": "b", "text": "goodbye moon"}\n')
    cli("ingest", src, "--table", "novec", "--id-field", "id", "--fts", "--db", dsn, "--devices", "cpu", "--quiet",
        check=True)
    conn.execute("UPDATE novec SET embedding = NULL WHERE id = 'b'")
    for extra in ((), ("-k", "5"), ("--where", "id <> 'x'"), ("--hybrid",)):
        p = cli("search", "goodbye moon", "--table", "novec", "--db", dsn, "--json", *extra)
        assert p.returncode == 0, p.stderr
        assert [r["id"] for r in json.loads(p.stdout)["results"]] == ["a"], extra
    conn.execute("UPDATE novec SET embedding = NULL")
    p = cli("search", "hello", "--table", "novec", "--db", dsn, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["results"] == [] and "none has a vector" in p.stderr
