"""Default ids across several inputs: two files of one name in two folders keep all their rows, and
`verify` reads the ledger's records against the rows stored, so an overwrite cannot pass as OK."""

from __future__ import annotations

import orjson

from embedfleet.sources import read_chunk
from embedfleet.sources.plan import id_name, id_root, plan_chunks
from embedfleet.sources.presets import get_preset
from embedfleet.sources.records import to_records


def _write(path, n, tag):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(orjson.dumps({"text": f"{tag} review {i} — café 🙂"}).decode() + "\n" for i in range(n)))
    return path


def test_default_ids_name_files_below_the_inputs_common_folder(tmp_path):
    a, b = _write(tmp_path / "d1" / "data.jsonl", 3, "a"), _write(tmp_path / "d2" / "data.jsonl", 3, "b")
    root = id_root([str(a), str(b)])
    assert [id_name(str(p), root) for p in (a, b)] == ["d1/data.jsonl", "d2/data.jsonl"]
    assert id_name(str(a), id_root([str(a)])) == "data.jsonl"  # one input: its name, as ids always were
    ids = []
    for spec in plan_chunks([str(a), str(b)]):
        records, _ = to_records(read_chunk(spec), get_preset("generic"), source_name=lambda s: id_name(s, root))
        ids += [r.id for r in records]
    assert len(set(ids)) == 6 and "d2/data.jsonl:3" in ids
    assert id_root(["s3://bucket/x/data.jsonl", "s3://bucket/y/data.jsonl"]) == "s3://bucket/"
    assert id_name("/ab/data.jsonl", "/a") == "/ab/data.jsonl"  # a sibling folder is not below the root


def test_same_file_name_in_two_folders_keeps_every_row_and_verify_says_ok(cli, dsn, conn, tmp_path):
    _write(tmp_path / "d1" / "data.jsonl", 20, "first")
    _write(tmp_path / "d2" / "data.jsonl", 30, "second")
    p = cli("ingest", tmp_path / "d1" / "data.jsonl", tmp_path / "d2" / "data.jsonl", "--table", "samebase",
            "--db", dsn, "--devices", "cpu", "--quiet", check=True)
    assert "50 rows" in p.stderr
    assert conn.execute("SELECT count(*) FROM samebase").fetchone()[0] == 50
    assert conn.execute("SELECT count(*) FROM samebase WHERE id LIKE 'd1/data.jsonl:%'").fetchone()[0] == 20
    glob = cli("ingest", str(tmp_path / "d*" / "data.jsonl"), "--table", "globbed", "--db", dsn, "--devices", "cpu",
               "--quiet", check=True)
    assert "50 rows" in glob.stderr
    v = cli("verify", "--table", "samebase", "--db", dsn, "--json")
    assert v.returncode == 0 and orjson.loads(v.stdout)["overwritten"] == 0


def test_verify_catches_records_that_overwrote_each_other(cli, dsn, tmp_path):
    """Forced: ids that collide across the two files (--id-field), 20 of 50 records written over."""
    for d, n in (("d1", 20), ("d2", 30)):
        (tmp_path / d).mkdir()
        (tmp_path / d / "data.jsonl").write_text(
            "".join(orjson.dumps({"n": i, "text": f"{d} {i}"}).decode() + "\n" for i in range(n)))
    p = cli("ingest", tmp_path / "d1" / "data.jsonl", tmp_path / "d2" / "data.jsonl", "--id-field", "n",
            "--table", "clash", "--db", dsn, "--devices", "cpu", "--quiet", check=True)
    assert "30 rows" in p.stderr and "20 records shared an id" in p.stderr
    v = cli("verify", "--table", "clash", "--db", dsn, "--json")
    report = orjson.loads(v.stdout)
    assert v.returncode == 1 and not report["ok"]
    assert (report["rows"], report["ledger_records"], report["overwritten"]) == (30, 50, 20)
    text = cli("verify", "--table", "clash", "--db", dsn)
    assert "20 of the 50 records written replaced" in text.stdout and "PROBLEMS FOUND" in text.stdout


def test_a_new_job_into_a_table_holding_its_ids_says_what_it_replaced_and_verify_counts_the_rows_it_found(
        cli, dsn, tmp_path):
    """The table's first jobs removed from the ledger (`jobs rm` keeps the table): a new job's records replace
    rows it found, and `verify` counts those rows beside the ledger's instead of calling the table wrong."""
    src = tmp_path / "ids.jsonl"
    src.write_text("".join(orjson.dumps({"n": i, "text": f"récit {i}"}).decode() + "\n" for i in range(30)))
    cli("ingest", src, "--id-field", "n", "--table", "held", "--job", "first", "--db", dsn, "--devices", "cpu",
        "--quiet", check=True)
    cli("jobs", "rm", "first", "--db", dsn, check=True)
    src.write_text("".join(orjson.dumps({"n": i, "text": f"récit {i} bis"}).decode() + "\n" for i in range(20, 40)))
    p = cli("ingest", src, "--id-field", "n", "--table", "held", "--job", "second", "--db", dsn, "--devices", "cpu",
            "--quiet", check=True)
    assert "10 new rows in table 'held', 10 of its 30 rows replaced, 40 in all" in p.stderr
    v = cli("verify", "--table", "held", "--db", dsn, "--json")
    report = orjson.loads(v.stdout)
    assert v.returncode == 0, report
    assert (report["rows"], report["ledger_rows"], report["rows_before_jobs"], report["overwritten"]) == (40, 10, 30, 0)
    assert "ledger 10 + 30 before its first job" in cli("verify", "--table", "held", "--db", dsn).stdout


def test_records_replacing_what_a_job_running_beside_them_wrote_are_not_duplicates():
    """Two jobs at once, ids overlapping: each one's records that found the other's row inserted nothing, and
    neither job's inputs held a duplicate. One job's own duplicates still count."""
    from datetime import datetime, timedelta, timezone

    from embedfleet.query.verify import JobCounts, overwritten_records

    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    s = timedelta(seconds=1)
    a = JobCounts(before=0, written=50, seen=50, created=t0, started=t0 + s, finished=t0 + 9 * s)
    b = JobCounts(before=0, written=25, seen=50, created=t0 + s, started=t0 + 2 * s, finished=t0 + 8 * s)
    assert overwritten_records([a, b]) == 0
    later = b._replace(created=t0 + 10 * s, started=t0 + 11 * s, finished=t0 + 12 * s)  # after a, yet found nothing
    assert overwritten_records([a, later]) == 25
    running = b._replace(finished=None)
    assert overwritten_records([a, running]) == 0
    own = a._replace(written=40)  # ten records of a's own inputs shared an id
    assert overwritten_records([own]) == 10
