"""Bad input as a new user gives it, through the real command: one line and an exit code that say what is
wrong, and the good records around it land."""

from __future__ import annotations

import json

import orjson
import pytest

from conftest import one_line_error


def test_a_misspelled_template_field_is_refused_before_planning(cli, dsn, conn, tmp_path):
    src = tmp_path / "books.jsonl"
    src.write_text("".join(json.dumps({"title": f"title {i}", "details": {"author": f"a{i}"}}) + "\n"
                           for i in range(30)))
    p = cli("ingest", src, "--text-template", "{title} {nonexistent}", "--db", dsn, "--devices", "cpu", "--quiet")
    line = one_line_error(p, "{nonexistent}")
    assert p.returncode == 2 and "fields: details, title" in line
    assert conn.execute("SELECT to_regclass('embedfleet.jobs')").fetchone()[0] is None  # nothing planned
    # a dotted path that exists is fine, and a field only some records lack renders empty (documented)
    src.write_text(json.dumps({"title": "has both", "details": {"author": "x"}}) + "\n"
                   + json.dumps({"title": "only a title"}) + "\n" + json.dumps({"details": {}}) + "\n")
    p = cli("ingest", src, "--text-template", "{title} {details.author}", "--db", dsn, "--devices", "cpu",
            "--quiet", check=True)
    assert "2 rows" in p.stderr and "1 rejected" in p.stderr
    assert sorted(r[0] for r in conn.execute("SELECT content FROM books")) == ["has both x", "only a title"]
    assert conn.execute("SELECT line, reason FROM embedfleet.rejects").fetchall() == [(3, "template renders no text")]


def test_a_csv_with_a_stray_quote_lands_every_other_record(cli, dsn, conn, tmp_path):
    src = tmp_path / "notes.csv"
    src.write_text("id,text\n1,first note\n2,\"a stray quote\n3,third note\n4,fourth note\n\n5,fifth note\n"
                   "6,\"two\nlines\"\n7,short,row,too,long\n8,last note")
    p = cli("ingest", src, "--id-field", "id", "--db", dsn, "--devices", "cpu", "--quiet", check=True)
    assert "6 rows" in p.stderr and "2 rejected" in p.stderr
    assert sorted(r[0] for r in conn.execute("SELECT id FROM notes")) == ["1", "3", "4", "5", "6", "8"]
    rejects = dict(conn.execute("SELECT line, reason FROM embedfleet.rejects WHERE job = 'notes'").fetchall())
    # line 3: the stray quote; line 10: five fields (lines as an editor shows them: 8-9 are one quoted record)
    assert set(rejects) == {3, 10} and "quoting" in rejects[3] and "5 fields" in rejects[10]
    assert orjson.loads(cli("verify", "--table", "notes", "--db", dsn, "--json").stdout)["ok"]


def test_cosmetic_refusals_are_one_line(cli, dsn, tmp_path):
    p = cli("status", "--db", "notadsn")
    assert p.returncode == 2 and "not a PostgreSQL connection string" in one_line_error(p, "--db")
    p = cli("search", "", "--table", "t", "--db", dsn)
    assert p.returncode == 2 and "empty" in one_line_error(p, "query")
    p = cli("predict", "--run", tmp_path, "--table", "t", "--out", tmp_path / "p.csv", "--db", dsn)
    assert p.returncode == 2 and "Parquet" in one_line_error(p, "--out")
    p = cli("cache", "path", "--json")
    assert p.returncode == 0 and orjson.loads(p.stdout)["path"].endswith("cache")


def test_an_id_field_no_record_has_and_a_template_field_no_review_has_are_refused_before_planning(cli, dsn, conn,
                                                                                                   tmp_path):
    """Where other faults rejected some records too (empty texts), the missing id field was found only after
    every record was read; with --meta a misspelt template field was never checked, and rendered empty."""
    src = tmp_path / "messy.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": "" if i % 3 == 0 else f"review {i}"}) + "\n"
                           for i in range(30)) + "{not json\n")
    p = cli("ingest", src, "--id-field", "uuid", "--db", dsn, "--devices", "cpu", "--quiet")
    line = one_line_error(p, "--id-field 'uuid': none of the first 30 records of messy.jsonl has it")
    assert p.returncode == 2 and "fields: id, text" in line
    assert conn.execute("SELECT to_regclass('embedfleet.jobs')").fetchone()[0] is None  # nothing planned
    examples = "examples/Cell_Phones_and_Accessories.jsonl", "examples/meta_Cell_Phones_and_Accessories.jsonl"
    p = cli("ingest", examples[0], "--meta", examples[1], "--preset", "amazon-reviews", "--text-template",
            "{titel}\\n\\n{text}", "--table", "typo", "--db", dsn, "--devices", "cpu", "--quiet")
    line = one_line_error(p, "--text-template field {titel}: none of the first")
    assert "the products have:" in line and "title" in line


def test_a_json_file_holding_one_array_is_refused_with_how_to_make_json_lines_of_it(cli, dsn, conn, tmp_path):
    """A pretty-printed array was embedded through to "all 17 records were rejected (malformed JSON …)" and a
    failed job."""
    good, array = tmp_path / "good.jsonl", tmp_path / "papers.json"
    good.write_text('{"text": "a line of its own"}\n')
    array.write_text(json.dumps([{"text": f"paper {i} — ü"} for i in range(17)], indent=2, ensure_ascii=False))
    one_line_error(cli("ingest", good, array, "--table", "arr", "--db", dsn, "--devices", "cpu"),
                   "papers.json holds one JSON array; embedfleet reads JSON Lines, one object a line: convert it "
                   "with `jq -c '.[]' papers.json > papers.jsonl`")
    assert conn.execute("SELECT to_regclass('arr') IS NULL").fetchone()[0]
    if conn.execute("SELECT to_regclass('embedfleet.jobs') IS NOT NULL").fetchone()[0]:  # no job recorded
        assert not conn.execute("SELECT 1 FROM embedfleet.jobs WHERE job = 'arr'").fetchone()


@pytest.mark.parametrize("sep, said", [(";", "with ';' between names"), ("\t", "with a tab between names")])
def test_a_csv_separated_otherwise_than_by_commas_is_refused_before_planning(cli, dsn, conn, tmp_path, sep, said):
    """Every record was rejected ("CSV row has 2 fields, the header has 1") into a failed job, and nothing named the
    separator."""
    src = tmp_path / "semi.csv"
    src.write_text(f"id{sep}text{sep}stars\n" + "".join(f"r{i}{sep}row {i}, with a comma{sep}{i % 5}\n"
                                                         for i in range(50)))
    one_line_error(cli("ingest", src, "--table", "semi", "--db", dsn, "--devices", "cpu"),
                   f"semi.csv: its header is one column ('id{sep}text{sep}stars'".replace("\t", "\\t") + f"), {said}")
    assert conn.execute("SELECT to_regclass('semi') IS NULL").fetchone()[0]
