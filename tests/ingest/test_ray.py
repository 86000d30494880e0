"""`ingest --ray` on a real Ray cluster of two nodes started inside the test (CPU resources; nodes may
declare GPUs Ray only counts, to check placement). Real PostgreSQL, real MiniLM on CPU in the actors."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import orjson
import pytest

from embedfleet.synth import write_amazon_reviews

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 2, "num_gpus": 1})
    second = c.add_node(num_cpus=2, num_gpus=1)
    c.wait_for_nodes()
    yield c, second
    c.shutdown()


def _ingest(src, dsn, address, tmp_path, *extra) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "embedfleet.cli", "ingest", str(src), "--preset", "amazon-reviews", "--db", dsn,
         "--ray", address, "--chunk-bytes", "15000", "--no-index", "--json", *extra],
        env=dict(os.environ, EMBEDFLEET_HOME=str(tmp_path / "home"), EMBEDFLEET_LEASE_SECONDS="5"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_ingest_with_ray_places_one_worker_per_gpu_and_lands_every_row_once(cluster, dsn, conn, tmp_path):
    c, _ = cluster
    src = write_amazon_reviews(tmp_path / "rayed.jsonl", 300, seed=21)
    run = _ingest(src, dsn, c.address, tmp_path)
    out, err = run.communicate(timeout=900)
    assert run.returncode == 0, err[-3000:]
    doc = orjson.loads(out)
    assert doc["rows_written"] == 300 and doc["chunks_done"] == doc["chunks_total"]
    # one actor per GPU the cluster declares (two nodes, one each), each a worker in the ledger
    workers = conn.execute("SELECT worker, rows FROM embedfleet.workers WHERE job = 'rayed'").fetchall()
    assert len(workers) == 2 and all("-ray" in w for w, _ in workers) and sum(n for _, n in workers) == 300
    assert conn.execute("SELECT count(*), count(DISTINCT id) FROM rayed").fetchone() == (300, 300)


def test_removing_a_node_mid_run_still_lands_every_row_once(cluster, dsn, conn, tmp_path):
    c, second = cluster
    src = write_amazon_reviews(tmp_path / "shrunk.jsonl", 1200, seed=22)
    run = _ingest(src, dsn, c.address, tmp_path)
    deadline = time.time() + 600
    while time.time() < deadline:  # both actors work; then the second node goes away
        time.sleep(0.5)
        try:
            busy = conn.execute("SELECT count(DISTINCT worker) FROM embedfleet.chunks WHERE job = 'shrunk' "
                                "AND state = 'running' AND started IS NOT NULL").fetchone()[0]
            done = conn.execute("SELECT count(*) FROM embedfleet.chunks WHERE job = 'shrunk' AND state = 'done'"
                                ).fetchone()[0]
        except Exception:
            continue
        if busy == 2 and done >= 2:
            break
    assert run.poll() is None, "the run finished before a node could be removed; make the input bigger"
    c.remove_node(second)
    out, err = run.communicate(timeout=900)
    assert run.returncode == 0, err[-3000:]
    assert out.strip().startswith("{"), out[:3000]
    assert orjson.loads(out)["rows_written"] == 1200
    assert conn.execute("SELECT count(*), count(DISTINCT id) FROM shrunk").fetchone() == (1200, 1200)
    assert conn.execute("SELECT sum(rows_written) FROM embedfleet.chunks WHERE job = 'shrunk'").fetchone()[0] == 1200


def test_a_table_backfill_with_ray_lands_every_row_once(cluster, dsn, conn, tmp_path):
    c, _ = cluster
    conn.execute("CREATE TABLE rayed_src (id int PRIMARY KEY, body text)")
    conn.execute("INSERT INTO rayed_src SELECT g, 'a ray review ' || g || ' — café ' || repeat('word ', g % 30) "
                 "FROM generate_series(1, 400) g")
    run = subprocess.Popen(
        [sys.executable, "-m", "embedfleet.cli", "ingest", "--from-table", "rayed_src", "--text-field", "body",
         "--db", dsn, "--ray", c.address, "--chunk-bytes", "8192", "--no-index", "--json"],
        env=dict(os.environ, EMBEDFLEET_HOME=str(tmp_path / "home")), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    out, err = run.communicate(timeout=900)
    assert run.returncode == 0, err[-3000:]
    doc = orjson.loads(out)
    assert doc["rows_written"] == 400 and doc["chunks_done"] == doc["chunks_total"] > 2
    workers = conn.execute("SELECT worker FROM embedfleet.workers WHERE job = 'public.rayed_src_embeddings'").fetchall()
    assert len(workers) == 2 and all("-ray" in w for (w,) in workers)
    assert conn.execute("SELECT count(*), count(DISTINCT id) FROM rayed_src_embeddings").fetchone() == (400, 400)
