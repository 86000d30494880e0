"""A user's own server and a hostile run (issue 18): restricted roles, two runs at once, kills, long
names, small files with several workers. Real processes, a real PostgreSQL, real MiniLM on CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import orjson
import pytest
from conftest import EXAMPLES, one_line_error, wait_for

from embedfleet.synth import write_amazon_reviews

REVIEWS = EXAMPLES / "Cell_Phones_and_Accessories.jsonl"


def _ingest_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "embedfleet.cli", "ingest", *map(str, args)]


def _as_role(dsn: str, role: str) -> str:
    return dsn.replace("postgres:@", f"{role}:@", 1)


def test_tables_whose_names_share_40_characters_each_get_their_own_index(cli, dsn, conn):
    from embedfleet.pg.ddl import vector_index

    names = [f"amazon_reviews_2023_cell_phones_accessories_part{i}" for i in (1, 2)]
    for name in names:
        cli("ingest", REVIEWS, "--preset", "amazon-reviews", "--db", dsn, "--table", name, "--limit", "20", "--quiet",
            check=True)
    indexes = [vector_index(conn, name) for name in names]
    assert None not in indexes and indexes[0] != indexes[1]
    for name, index in zip(names, indexes):  # each index is on the table it was meant for
        assert conn.execute("SELECT indrelid::regclass::text FROM pg_index WHERE indexrelid = %s::regclass",
                            [index]).fetchone()[0] == name


def test_the_same_command_twice_at_once_both_exit_0_with_exact_rows(cli, dsn, conn, tmp_path):
    src = write_amazon_reviews(tmp_path / "twice.jsonl", 400, seed=2)
    args = _ingest_cmd(src, "--preset", "amazon-reviews", "--db", dsn, "--devices", "cpu", "--chunk-bytes", "20000",
                       "--quiet")
    env = dict(os.environ, EMBEDFLEET_HOME=str(tmp_path / "home"))
    runs = [subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    errs = [r.communicate(timeout=600)[1] for r in runs]
    assert [r.returncode for r in runs] == [0, 0], [e[-2000:] for e in errs]
    assert conn.execute("SELECT count(*), count(DISTINCT id) FROM twice").fetchone() == (400, 400)
    workers = [w for (w,) in conn.execute("SELECT worker FROM embedfleet.workers WHERE job = 'twice'")]
    assert len(workers) == 2 == len(set(workers))  # one per launcher, never the same id
    assert conn.execute("SELECT sum(rows) FROM embedfleet.workers WHERE job = 'twice'").fetchone()[0] == 400
    assert orjson.loads(cli("verify", "--table", "twice", "--db", dsn, "--json").stdout)["ok"]
    hnsw = conn.execute("SELECT count(*) FROM pg_indexes WHERE tablename = 'twice' AND indexdef LIKE '%hnsw%'")
    assert hnsw.fetchone()[0] == 1


def test_three_kills_of_one_worker_fail_no_chunk_that_was_not_being_embedded(dsn, conn, tmp_path):
    src = write_amazon_reviews(tmp_path / "kills.jsonl", 3000, seed=4)
    run = subprocess.Popen(_ingest_cmd(src, "--preset", "amazon-reviews", "--db", dsn, "--devices", "cpu",
                                       "--workers", "2", "--chunk-bytes", "20000", "--no-index"),
                           env=dict(os.environ, EMBEDFLEET_HOME=str(tmp_path / "home")),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    killed = []
    for _ in range(3):
        # the worker w1 of this launcher, once it embeds a chunk (a new process after each kill)
        pid = wait_for(conn, "SELECT pid FROM embedfleet.chunks WHERE job = 'kills' AND worker LIKE '%%-w1' "
                              "AND state = 'running' AND started IS NOT NULL AND NOT pid = ANY(%s) LIMIT 1",
                        [killed])
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    _, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-3000:]
    assert err.count("exited with code -9") == 3
    assert conn.execute("SELECT count(*), count(DISTINCT id) FROM kills").fetchone() == (3000, 3000)
    states, failures = conn.execute("SELECT array_agg(DISTINCT state), sum(failures) FROM embedfleet.chunks").fetchone()
    assert states == ["done"]
    assert failures <= 3  # at most the chunk each killed worker was embedding, never the ones it held ahead


def test_two_workers_share_a_file_of_four_chunks(cli, dsn, conn, tmp_path):
    src = write_amazon_reviews(tmp_path / "four.jsonl", 600, seed=9)
    chunk = src.stat().st_size // 4 + 1
    p = cli("ingest", src, "--preset", "amazon-reviews", "--db", dsn, "--devices", "cpu", "--workers", "2",
            "--chunk-bytes", chunk, "--no-index", "--json", check=True)
    assert orjson.loads(p.stdout)["chunks_total"] == 4
    rows = dict(conn.execute("SELECT worker, rows FROM embedfleet.workers WHERE job = 'four'").fetchall())
    assert len(rows) == 2 and all(n > 0 for n in rows.values()), rows
    assert sum(rows.values()) == 600


def test_a_restricted_role_gets_one_line_naming_the_privilege_and_a_reader_can_read(cli, dsn, conn):
    conn.execute("CREATE EXTENSION IF NOT EXISTS vector")  # pgvector is not a trusted extension: the admin's
    conn.execute("CREATE ROLE loader LOGIN")
    conn.execute("CREATE ROLE reader LOGIN")
    loader = _as_role(dsn, "loader")
    base = ("ingest", REVIEWS, "--preset", "amazon-reviews", "--db", loader, "--limit", "30", "--quiet")

    # No CREATE on the database and no ledger schema yet.
    line = one_line_error(cli(*base), "GRANT CREATE ON DATABASE")
    assert "loader" in line and "schema embedfleet" in line

    # The admin creates the ledger's schema for the role; it still cannot CREATE in public (PostgreSQL ≥ 15).
    conn.execute("CREATE SCHEMA embedfleet AUTHORIZATION loader")
    line = one_line_error(cli(*base), "GRANT USAGE, CREATE ON SCHEMA public TO loader")
    assert "--table SCHEMA." in line
    # Nothing was planned: no job left behind, running or otherwise.
    assert conn.execute("SELECT to_regclass('embedfleet.jobs')").fetchone()[0] is None

    # A schema of its own, named with --table schema.name: the job runs, its table gets its index.
    conn.execute("CREATE SCHEMA data AUTHORIZATION loader")
    cli(*base, "--table", "data.reviews", check=True)
    assert conn.execute("SELECT count(*) FROM data.reviews").fetchone()[0] == 30
    assert conn.execute("SELECT count(*) FROM pg_indexes WHERE schemaname = 'data' AND indexdef LIKE '%hnsw%'"
                        ).fetchone()[0] == 1

    # A role that may only read: status, search and verify work.
    for schema in ("embedfleet", "data"):
        conn.execute(f"GRANT USAGE ON SCHEMA {schema} TO reader")
        conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO reader")
    reader = _as_role(dsn, "reader")
    (job,) = orjson.loads(cli("status", "--db", reader, "--json", check=True).stdout)["jobs"]
    assert job["state"] == "done" and job["rows_written"] == 30
    hits = orjson.loads(cli("search", "battery", "--table", "data.reviews", "--db", reader, "--json", "-k", "3",
                            check=True).stdout)["results"]
    assert len(hits) == 3
    assert orjson.loads(cli("verify", "--table", "data.reviews", "--db", reader, "--json", check=True).stdout)["ok"]
    # …and cannot write: an ingest says which privilege is missing, no traceback.
    one_line_error(cli("ingest", REVIEWS, "--db", reader, "--table", "data.more", "--limit", "5", "--quiet"),
                    "reader")
    # A role that may not even use the ledger's schema: each command names the GRANT.
    conn.execute("CREATE ROLE outsider LOGIN")
    conn.execute("GRANT USAGE ON SCHEMA data TO outsider")
    conn.execute("GRANT SELECT ON data.reviews TO outsider")
    outsider = _as_role(dsn, "outsider")
    line = one_line_error(cli("ingest", REVIEWS, "--db", outsider, "--table", "data.more", "--limit", "5",
                              "--quiet"), "GRANT USAGE ON SCHEMA embedfleet TO outsider")
    assert "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA embedfleet TO outsider" in line
    one_line_error(cli("status", "--db", outsider), "GRANT USAGE ON SCHEMA embedfleet")


def test_a_model_that_cannot_load_stops_before_planning(cli, dsn, conn, tmp_path):
    model = tmp_path / "half-a-model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "bert", "architectures": ["BertModel"]}')
    one_line_error(cli("ingest", REVIEWS, "--db", dsn, "--model", model, "--quiet"), "model")
    jobs = conn.execute("SELECT count(*) FROM embedfleet.jobs").fetchone()[0] if conn.execute(
        "SELECT to_regclass('embedfleet.jobs')").fetchone()[0] else 0
    assert jobs == 0


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_file_without_the_text_field_stops_with_one_line_naming_it(cli, dsn, tmp_path, fmt):
    rows = [{"doc": f"d{i}", "body": f"text {i}"} for i in range(20)]
    path = tmp_path / f"notext.{fmt}"
    if fmt == "csv":
        path.write_text("doc,body\n" + "".join(f"{r['doc']},{r['body']}\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    line = one_line_error(cli("ingest", path, "--db", dsn, "--quiet"), "field 'text'")
    assert "fields: body, doc;" in line and "--text-field" in line
