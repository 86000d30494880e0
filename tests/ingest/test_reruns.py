"""A rerun of an ingest embeds what is new: lines appended to planned files (plain, compressed, CSV), files the
inputs now match; a file changed where it was already embedded is refused, and `--replace` embeds it again in
place of its rows. Each against the real command, the real MiniLM and a real PostgreSQL."""

from __future__ import annotations

import gzip
import json

import numpy as np
import orjson

from embedfleet.sources.changes import PlannedFile, changed_line, digest, next_line, planned_file, survey
from embedfleet.sources.plan import plan_chunks, plan_file


def _lines(tag: str, first: int, n: int) -> str:
    return "".join(orjson.dumps({"text": f"{tag} review {i} — café 🙂 " + "long " * (i % 7)}).decode() + "\n"
                   for i in range(first, first + n))


def _rows(conn, table: str) -> dict[str, str]:
    return dict(conn.execute(f"SELECT id, content FROM {table}").fetchall())


def _ingest(cli, dsn, *args):
    return cli("ingest", *args, "--db", dsn, "--devices", "cpu", "--quiet", "--no-index")


def _verify_ok(cli, dsn, table):
    report = json.loads(cli("verify", "--table", table, "--db", dsn, "--json", check=True).stdout)
    assert report["ok"] and report["count_matches_ledger"] and report["overwritten"] == 0, report
    return report


# ---- pure parts --------------------------------------------------------------------------------------------------


def test_survey_sorts_inputs_into_new_grown_and_changed(tmp_path):
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    a.write_text(_lines("a", 0, 5))
    b.write_text(_lines("b", 0, 5))
    planned = {str(p): planned_file(str(p), plan_file(str(p), 1 << 20)) for p in (a, b)}
    assert survey(planned, [str(a), str(b)]).new == []
    with a.open("a") as f:
        f.write(_lines("a", 5, 3))
    b.write_text(_lines("B", 0, 5))  # same length, other bytes
    c.write_text(_lines("c", 0, 2))
    found = survey(planned, [str(a), str(b), str(c)])
    assert found.new == [str(c)]
    assert [(p.source, size) for p, size in found.grown] == [(str(a), a.stat().st_size)]
    assert len(found.changed) == 1 and found.changed[0][0] == str(b)
    assert f"--replace {b}" in changed_line(*found.changed[0])
    assert survey(planned, [str(a), str(b)], frozenset({str(b)})).changed == []  # replaced: planned anew


def test_a_continued_last_line_and_a_shorter_file_are_changes(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_bytes(b'{"text": "one"}\n{"text": "tw')
    p = planned_file(str(a), plan_file(str(a), 1 << 20))
    with a.open("ab") as f:
        f.write(b'o"}\n')
    assert "its last planned line was continued" in survey({str(a): p}, [str(a)]).changed[0][1]
    a.write_bytes(b'{"text": "one"}\n')
    assert "were planned" in survey({str(a): p}, [str(a)]).changed[0][1]


def test_digest_samples_a_large_file_and_sees_its_edges(tmp_path):
    big = tmp_path / "big.jsonl"
    data = bytearray(np.random.default_rng(0).integers(97, 123, 20 << 20, dtype=np.uint8).tobytes())
    big.write_bytes(bytes(data))
    before = digest(str(big), len(data))
    data[-10] = ord("!")
    big.write_bytes(bytes(data))
    assert digest(str(big), len(data)) != before


def test_appended_parts_are_numbered_on_from_the_planned_lines(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text(_lines("a", 0, 10))
    (last,) = plan_file(str(a), 1 << 20)
    assert next_line(last) == 11
    size = a.stat().st_size
    with a.open("a") as f:
        f.write(_lines("a", 10, 4))
    (part,) = plan_file(str(a), 1 << 20, start=size, first_line=next_line(last))
    assert (part.start, part.first_line) == (size, 11)
    gz = tmp_path / "s.jsonl.gz"
    gz.write_bytes(gzip.compress(_lines("g", 0, 6).encode()))
    (first,) = plan_chunks([str(gz)])
    assert next_line(first) == 7 and first.end == gz.stat().st_size
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("id,text\n1,x\n2,y\n")
    (c,) = plan_chunks([str(csv_path)])
    assert next_line(c) == 4  # the header is line 1, two rows: the next is line 4
    assert isinstance(planned_file(str(csv_path), [c]), PlannedFile)


# ---- the command -------------------------------------------------------------------------------------------------


def test_appended_lines_and_new_files_are_embedded_once_each(cli, dsn, conn, tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text(_lines("a", 0, 40))
    assert _ingest(cli, dsn, a, "--table", "grow").returncode == 0
    with a.open("a") as f:
        f.write(_lines("a", 40, 25))
    p = _ingest(cli, dsn, a, "--table", "grow")
    assert p.returncode == 0, p.stderr
    rows = _rows(conn, "grow")
    assert len(rows) == 65 and rows["a.jsonl:65"].startswith("a review 64 ")
    (tmp_path / "b.jsonl").write_text(_lines("b", 0, 12))
    p = _ingest(cli, dsn, tmp_path / "*.jsonl", "--table", "grow")
    assert p.returncode == 0, p.stderr
    rows = _rows(conn, "grow")
    assert len(rows) == 77 and rows["b.jsonl:12"].startswith("b review 11 ")
    chunks = conn.execute("SELECT count(*) FROM embedfleet.chunks WHERE job = 'grow'").fetchone()[0]
    p = _ingest(cli, dsn, tmp_path / "*.jsonl", "--table", "grow")  # nothing new: nothing planned, nothing written
    assert p.returncode == 0 and "77 rows" in p.stderr
    assert conn.execute("SELECT count(*) FROM embedfleet.chunks WHERE job = 'grow'").fetchone()[0] == chunks
    _verify_ok(cli, dsn, "grow")


def test_a_file_without_a_final_newline_then_appended_to_embeds_the_new_lines(cli, dsn, conn, tmp_path):
    for name, ending in (("lf", "\n"), ("crlf", "\r\n")):
        a = tmp_path / f"{name}.jsonl"
        a.write_bytes(_lines("n", 0, 5).replace("\n", ending).encode()[:-len(ending)])  # no newline at the end
        assert _ingest(cli, dsn, a, "--table", f"nonl_{name}").returncode == 0
        with a.open("ab") as f:  # what `printf '\n{...}\n' >> file` does
            f.write((ending + _lines("n", 5, 3).replace("\n", ending)).encode())
        p = _ingest(cli, dsn, a, "--table", f"nonl_{name}")
        assert p.returncode == 0, p.stderr
        rows = _rows(conn, f"nonl_{name}")
        assert len(rows) == 8 and rows[f"{name}.jsonl:5"].startswith("n review 4 ")
        assert rows[f"{name}.jsonl:6"].startswith("n review 5 ") and rows[f"{name}.jsonl:8"].startswith("n review 7 ")
        _verify_ok(cli, dsn, f"nonl_{name}")
    c = tmp_path / "c.jsonl"  # a last line truly continued is still a change
    c.write_text(_lines("c", 0, 3)[:-1])
    assert _ingest(cli, dsn, c, "--table", "cont").returncode == 0
    with c.open("a") as f:
        f.write(' "more"\n')
    assert "its last planned line was continued" in _ingest(cli, dsn, c, "--table", "cont").stderr


def test_appended_gzip_members_and_csv_rows_are_embedded_with_their_line_numbers(cli, dsn, conn, tmp_path):
    gz, csv_path = tmp_path / "s.jsonl.gz", tmp_path / "t.csv"
    gz.write_bytes(gzip.compress(_lines("g", 0, 20).encode()))
    csv_path.write_text("id,text\n" + "".join(f"r{i},csv row {i} — naïve\n" for i in range(15)))
    assert _ingest(cli, dsn, gz, "--table", "gzgrow").returncode == 0
    assert _ingest(cli, dsn, csv_path, "--table", "csvgrow", "--id-field", "id").returncode == 0
    with gz.open("ab") as f:  # what `gzip -c more >> s.jsonl.gz` does: a member of its own
        f.write(gzip.compress(_lines("g", 20, 7).encode()))
    with csv_path.open("a") as f:
        f.write("".join(f"r{i},csv row {i} — naïve\n" for i in range(15, 19)) + "short\n")
    p = _ingest(cli, dsn, gz, "--table", "gzgrow")
    assert p.returncode == 0, p.stderr
    rows = _rows(conn, "gzgrow")
    assert len(rows) == 27 and rows["s.jsonl.gz:21"].startswith("g review 20 ") and rows["s.jsonl.gz:27"]
    p = _ingest(cli, dsn, csv_path, "--table", "csvgrow", "--id-field", "id")
    assert p.returncode == 0, p.stderr
    rows = _rows(conn, "csvgrow")
    assert len(rows) == 19 and rows["r18"] == "csv row 18 — naïve"
    rejects = conn.execute("SELECT line, reason FROM embedfleet.rejects WHERE job = 'csvgrow'").fetchall()
    assert rejects == [(21, "CSV row has 1 fields, the header has 2")]  # line 21 as an editor numbers it
    _verify_ok(cli, dsn, "gzgrow")


def test_a_gzip_member_appended_to_a_csv_and_lines_added_to_a_file_empty_when_planned_are_embedded(
        cli, dsn, conn, tmp_path):
    """A member appended to a .csv.gz was refused as "its last planned line was continued" (the last compressed
    byte is no newline); a file planned empty that gained lines failed every rerun with a KeyError."""
    gz, empty, other = tmp_path / "g.csv.gz", tmp_path / "e1.jsonl", tmp_path / "e2.jsonl"
    gz.write_bytes(gzip.compress("id,text\n1,hello — ü\n2,there\n".encode()))
    empty.write_text("")
    other.write_text(_lines("o", 0, 2))
    assert _ingest(cli, dsn, gz, "--table", "csvgz").returncode == 0
    assert _ingest(cli, dsn, tmp_path / "e*.jsonl", "--table", "grewup").returncode == 0
    with gz.open("ab") as f:
        f.write(gzip.compress(b"3,appended\n"))
    empty.write_text(_lines("e", 0, 3))
    p = _ingest(cli, dsn, gz, "--table", "csvgz")
    assert p.returncode == 0, p.stderr
    assert _rows(conn, "csvgz") == {"g.csv.gz:2": "hello — ü", "g.csv.gz:3": "there", "g.csv.gz:4": "appended"}
    p = _ingest(cli, dsn, tmp_path / "e*.jsonl", "--table", "grewup")
    assert p.returncode == 0, p.stderr
    assert sorted(_rows(conn, "grewup")) == ["e1.jsonl:1", "e1.jsonl:2", "e1.jsonl:3", "e2.jsonl:1", "e2.jsonl:2"]
    _verify_ok(cli, dsn, "csvgz")
    _verify_ok(cli, dsn, "grewup")


def test_replace_of_a_file_emptied_deletes_its_rows_and_keeps_the_job(cli, dsn, conn, tmp_path):
    """A file truncated to nothing, then --replace: its rows stayed (a summary of fewer rows than the table held,
    and verify found a problem); as the job's only input, the job was removed and its table kept full."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    a, b, c, q = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.csv", tmp_path / "q.parquet"
    a.write_text(_lines("a", 0, 12))
    b.write_text(_lines("b", 0, 4))
    c.write_text("id,text\n" + "".join(f"{i},csv row {i}\n" for i in range(5)))
    pq.write_table(pa.table({"text": [f"parquet row {i}" for i in range(3)]}), q)
    assert _ingest(cli, dsn, a, b, c, q, "--table", "emptied").returncode == 0
    assert _ingest(cli, dsn, a, "--table", "alone").returncode == 0
    for emptied in (a, c, q):
        emptied.write_bytes(b"")
    p = _ingest(cli, dsn, a, b, c, q, "--table", "emptied", "--replace", a, "--replace", c, "--replace", q)
    assert p.returncode == 0, p.stderr
    assert sorted(_rows(conn, "emptied")) == [f"b.jsonl:{i}" for i in range(1, 5)]
    _verify_ok(cli, dsn, "emptied")
    p = _ingest(cli, dsn, a, "--table", "alone", "--replace", a)
    assert p.returncode == 0 and "no table made" not in p.stderr, p.stderr
    assert _rows(conn, "alone") == {}
    status = json.loads(cli("status", "--job", "alone", "--db", dsn, "--json", check=True).stdout)["jobs"][0]
    assert status["state"] == "done" and status["rows_written"] == 0
    a.write_text(_lines("a", 0, 2))  # lines again: the job goes on
    p = _ingest(cli, dsn, a, "--table", "alone")
    assert p.returncode == 0, p.stderr
    assert sorted(_rows(conn, "alone")) == ["a.jsonl:1", "a.jsonl:2"]


def test_a_changed_file_is_refused_and_replace_embeds_it_again_in_place(cli, dsn, conn, tmp_path):
    from embedfleet.encode.encoder import Encoder

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(_lines("a", 0, 30))
    b.write_text(_lines("b", 0, 10))
    assert _ingest(cli, dsn, a, b, "--table", "rep").returncode == 0
    before = _rows(conn, "rep")
    a.write_text(_lines("a", 0, 4) + '{"text": "an edited review"}\n' + _lines("a", 5, 15))  # 20 lines now
    p = _ingest(cli, dsn, a, b, "--table", "rep")
    assert p.returncode != 0
    (line,) = [x for x in p.stderr.strip().splitlines() if x.startswith("error:")]
    assert f"{a} changed where it was already embedded" in line and f"--replace {a}" in line
    assert _rows(conn, "rep") == before  # nothing written
    p = _ingest(cli, dsn, a, b, "--table", "rep", "--replace", a)
    assert p.returncode == 0, p.stderr
    rows = _rows(conn, "rep")
    mine = {k: v for k, v in rows.items() if k.startswith("a.jsonl:")}
    assert len(mine) == 20 and mine["a.jsonl:5"] == "an edited review" and "a.jsonl:21" not in rows
    assert {k: v for k, v in rows.items() if k.startswith("b.jsonl:")} == \
        {k: v for k, v in before.items() if k.startswith("b.jsonl:")}
    stored = conn.execute("SELECT embedding::text FROM rep WHERE id = 'a.jsonl:5'").fetchone()[0]
    expected = Encoder(device="cpu").encode(["an edited review"])[0]
    assert np.abs(np.array(json.loads(stored)) - expected).max() < 1e-5
    _verify_ok(cli, dsn, "rep")
    assert _ingest(cli, dsn, a, b, "--table", "rep").returncode == 0  # the replaced file is the planned one now


def test_limit_counts_over_what_was_planned_before(cli, dsn, conn, tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text(_lines("a", 0, 10))
    assert _ingest(cli, dsn, a, "--table", "lim", "--limit", "25").returncode == 0
    with a.open("a") as f:
        f.write(_lines("a", 10, 30))
    assert _ingest(cli, dsn, a, "--table", "lim", "--limit", "25").returncode == 0
    rows = _rows(conn, "lim")
    assert len(rows) == 25 and "a.jsonl:25" in rows and "a.jsonl:26" not in rows
    with a.open("a") as f:
        f.write(_lines("a", 40, 5))
    assert _ingest(cli, dsn, a, "--table", "lim", "--limit", "25").returncode == 0
    assert len(_rows(conn, "lim")) == 25


def test_limit_on_a_rerun_counts_the_csv_records_planned_not_their_lines(cli, dsn, conn, tmp_path):
    """A quoted CSV field over several lines is one record: a rerun's --limit counts the records planned before."""
    a = tmp_path / "a.csv"
    a.write_text("text\n" + "".join(f'"review {i}\nsecond line\nthird"\n' for i in range(4)))
    assert _ingest(cli, dsn, a, "--table", "limcsv", "--limit", "6").returncode == 0
    assert len(_rows(conn, "limcsv")) == 4
    with a.open("a") as f:
        f.write("".join(f"review {i}\n" for i in range(4, 10)))
    assert _ingest(cli, dsn, a, "--table", "limcsv", "--limit", "6").returncode == 0
    assert sorted(_rows(conn, "limcsv").values()) == sorted([f"review {i}\nsecond line\nthird" for i in range(4)]
                                                            + ["review 4", "review 5"])


def test_replace_names_only_the_jobs_files(cli, dsn, tmp_path):
    a, other = tmp_path / "a.jsonl", tmp_path / "other.jsonl"
    a.write_text(_lines("a", 0, 3))
    other.write_text(_lines("o", 0, 3))
    assert _ingest(cli, dsn, a, "--table", "only").returncode == 0
    p = _ingest(cli, dsn, a, "--table", "only", "--replace", other)
    assert p.returncode != 0 and f"--replace {other}: not one of job 'only''s input files" in p.stderr


def test_a_file_named_by_its_path_and_its_file_url_is_one_input_in_a_job_and_its_reruns(cli, dsn, conn, tmp_path):
    """Named both ways in one command it was embedded twice (every id a duplicate); named the other way on a
    rerun, it was a new input and embedded again."""
    path = tmp_path / "a.jsonl"
    path.write_text(_lines("a", 0, 40))
    p = _ingest(cli, dsn, path, f"file://{path}", "--table", "twice", "--text-field", "text", "--json")
    assert p.returncode == 0, p.stderr
    assert orjson.loads(p.stdout)["rows_written"] == 40 and "shared an id" not in p.stderr
    assert conn.execute("SELECT count(DISTINCT source) FROM embedfleet.chunks WHERE job = 'twice'").fetchone()[0] == 1
    with path.open("a") as f:
        f.write(_lines("a", 40, 7))
    again = _ingest(cli, dsn, f"file://{path}", "--table", "twice", "--text-field", "text", "--json")
    assert again.returncode == 0, again.stderr
    assert orjson.loads(again.stdout)["rows_written"] == 47  # the table's rows: only the 7 appended were new
    assert conn.execute("SELECT count(DISTINCT source) FROM embedfleet.chunks WHERE job = 'twice'").fetchone()[0] == 1
    _verify_ok(cli, dsn, "twice")
    replaced = _ingest(cli, dsn, f"file://{path}", "--replace", str(path), "--table", "twice", "--text-field", "text")
    assert replaced.returncode == 0, replaced.stderr
    assert len(_rows(conn, "twice")) == 47
    _verify_ok(cli, dsn, "twice")


def test_replace_of_a_file_whose_ids_come_from_its_records_is_refused_before_anything_changes(cli, dsn, conn, tmp_path):
    """It upserted the records still in the file and kept the row of one that had left it: search found a review
    the file no longer has, and verify's count was off by one."""
    a = tmp_path / "a.jsonl"
    a.write_text("".join(orjson.dumps({"rid": f"r{i}", "text": f"review {i} — ünïcode"}).decode() + "\n"
                         for i in range(6)))
    args = ("--table", "byid", "--text-field", "text", "--id-field", "rid")
    assert _ingest(cli, dsn, a, *args).returncode == 0
    before = _rows(conn, "byid")
    a.write_text("".join(orjson.dumps({"rid": f"r{i}", "text": f"edited {i}"}).decode() + "\n" for i in range(5)))
    p = _ingest(cli, dsn, a, *args)  # the refusal of the change says what works here, not --replace
    (line,) = [x for x in p.stderr.strip().splitlines() if x.startswith("error:")]
    assert f"{a} changed where it was already embedded" in line and "--replace" not in line and "jobs rm" in line
    p = _ingest(cli, dsn, a, *args, "--replace", a)
    assert p.returncode != 0
    (line,) = [x for x in p.stderr.strip().splitlines() if x.startswith("error:")]
    assert f"--replace {a}: job" in line and "--id-field rid" in line and "jobs rm" in line and "--drop-table" in line
    assert _rows(conn, "byid") == before  # nothing written
    job = conn.execute("SELECT job FROM embedfleet.jobs WHERE table_name = 'byid'").fetchone()[0]
    assert cli("jobs", "rm", job, "--drop-table", "--db", dsn).returncode == 0
    assert _ingest(cli, dsn, a, *args).returncode == 0  # as the line says: the file as it is now, and only it
    assert _rows(conn, "byid") == {f"r{i}": f"edited {i}" for i in range(5)}
    _verify_ok(cli, dsn, "byid")


def test_a_planned_file_gone_is_said_with_its_rows_kept(cli, dsn, conn, tmp_path):
    """A file renamed or deleted between runs kept its rows silently (a renamed one's rows twice, by both names)."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "one.jsonl").write_text(_lines("one", 0, 3))
    (d / "two.jsonl").write_text(_lines("two", 0, 2))
    assert _ingest(cli, dsn, d / "*.jsonl", "--table", "gonefile").returncode == 0
    (d / "two.jsonl").rename(d / "deux.jsonl")
    p = _ingest(cli, dsn, d / "*.jsonl", "--table", "gonefile")
    assert p.returncode == 0, p.stderr
    said = [x for x in p.stderr.splitlines() if "gone (" in x]
    assert len(said) == 1, p.stderr
    line = said[0]
    assert "1 planned file of job gonefile is gone (two.jsonl): its rows stay in table gonefile" in line
    assert "jobs rm gonefile --drop-table" in line
    assert sorted(_rows(conn, "gonefile")) == ["deux.jsonl:1", "deux.jsonl:2", "one.jsonl:1", "one.jsonl:2",
                                               "one.jsonl:3", "two.jsonl:1", "two.jsonl:2"]
