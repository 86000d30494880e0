"""`ingest --columns NAME:TYPE,…`: fields promoted from the records into typed columns of their own, for any
preset, so that --where, train and map use them as plain columns."""

from __future__ import annotations

import json
from decimal import Decimal

import orjson
import pytest
from conftest import one_line_error

from embedfleet.errors import InputError
from embedfleet.sources.presets import job_preset, parse_columns


def test_column_specs_are_parsed_and_checked():
    assert [(c.name, c.pgtype) for c in parse_columns(["stars:int", " lang : TEXT", "when:timestamp"])] == [
        ("stars", "bigint"), ("lang", "text"), ("when", "timestamptz")]
    for bad in (["stars"], ["stars:money"], ["x" * 64 + ":int"], ["tab\tname:int"], ["a:int", "a:text"]):
        with pytest.raises(InputError, match="--columns"):
            parse_columns(bad)
    # a table's column may have any name (quoted in SQL): it was refused as "letters, digits, _"
    assert [c.name for c in parse_columns(["Naïve Col:int", "a.b:text"])] == ["Naïve Col", "a.b"]
    with pytest.raises(InputError, match="already has a column"):
        job_preset("amazon-reviews", ["rating:int"])
    for later in ("content_tsv:text", "map_x:text"):  # columns --fts and map --store-coords add later
        with pytest.raises(InputError, match=f"--columns '{later.split(':')[0]}': the name of "):
            job_preset("generic", [later])
    preset = job_preset("generic", ["stars:int"])
    values = preset.values({"text": "t", "stars": "4", "other": 1}, "text")
    assert values == {"stars": 4, "record": {"other": 1}}  # promoted: out of `record`


def _reviews(path, n=200):
    rows = []
    for i in range(n):
        good = i % 2 == 0
        rows.append({"text": ("great battery, love it" if good else "broke in a week, refund") + f" #{i}",
                     "stars": 5 if good else 1, "lang": "en" if i % 3 else "de"})
    rows.append({"text": "a review whose stars do not parse", "stars": "five", "lang": "en"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_promoted_columns_serve_where_and_train(cli, dsn, conn, tmp_path):
    src = _reviews(tmp_path / "gen.jsonl")
    p = cli("ingest", src, "--columns", "stars:int,lang:text", "--db", dsn, "--devices", "cpu", "--quiet", check=True)
    assert "200 rows" in p.stderr and "1 rejected" in p.stderr
    types = dict(conn.execute("SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
                              "WHERE attrelid = 'gen'::regclass AND attnum > 0").fetchall())
    assert types["stars"] == "bigint" and types["lang"] == "text"
    assert conn.execute("SELECT count(*) FROM gen WHERE record ? 'stars'").fetchone()[0] == 0
    assert "stars" in conn.execute("SELECT reason FROM embedfleet.rejects WHERE job = 'gen'").fetchone()[0]
    s = cli("search", "battery", "--table", "gen", "--db", dsn, "--where", "stars >= 4 AND lang = 'de'", "--json")
    results = orjson.loads(s.stdout)["results"]
    assert results and all(r["stars"] == 5 and r["lang"] == "de" for r in results)
    t = cli("train", "--table", "gen", "--label", "stars", "--task", "classify", "--db", dsn, "--devices", "cpu",
            "--out", tmp_path / "run", "--json", check=True)
    doc = orjson.loads(t.stdout)
    assert doc["final"]["val_accuracy"] >= 0.9 and doc["batch_size"] == 16  # 180 train rows: auto batch 16


def test_a_numeric_column_holds_amounts_exactly_and_a_bad_one_is_a_reject(cli, dsn, conn, tmp_path):
    src = tmp_path / "prices.jsonl"
    src.write_text("".join(orjson.dumps(r).decode() + "\n" for r in (
        {"text": "a cable", "price": 0.1}, {"text": "a case", "price": "12345678901234567.89"},
        {"text": "a charger", "price": 3}, {"text": "a screen", "price": "ten"})))
    with src.open("a") as f:  # JSON numbers with more digits than a float holds: as written, not rounded
        f.write('{"text": "a phone", "price": 12345678901234567890.123456789}\n'
                '{"text": "a strap", "price": 0.1000000000000000055511151231257827}\n'
                '{"text": "a stand", "price": 1e400}\n')
    p = cli("ingest", src, "--columns", "price:numeric", "--db", dsn, "--devices", "cpu", "--quiet", check=True)
    assert "6 rows" in p.stderr and "1 rejected" in p.stderr
    prices = dict(conn.execute("SELECT content, price FROM prices").fetchall())
    assert prices == {"a cable": Decimal("0.1"), "a case": Decimal("12345678901234567.89"), "a charger": Decimal(3),
                      "a phone": Decimal("12345678901234567890.123456789"),
                      "a strap": Decimal("0.1000000000000000055511151231257827"), "a stand": Decimal("1e400")}
    assert "price" in conn.execute("SELECT reason FROM embedfleet.rejects WHERE job = 'prices'").fetchone()[0]
    s = cli("search", "cable", "--table", "prices", "--db", dsn, "--where", "price > 1", "--json", check=True)
    assert {r["content"] for r in orjson.loads(s.stdout)["results"]} == {"a case", "a charger", "a phone", "a stand"}


def test_an_existing_table_without_the_column_is_refused_before_planning(cli, dsn, conn, tmp_path):
    src = _reviews(tmp_path / "gen.jsonl", 20)
    cli("ingest", src, "--db", dsn, "--devices", "cpu", "--quiet", check=True)
    p = cli("ingest", src, "--columns", "stars:int", "--job", "again", "--db", dsn, "--quiet")
    lines = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert p.returncode == 2 and len(lines) == 1 and "without column 'stars'" in lines[0] and "ADD COLUMN" in lines[0]
    assert conn.execute("SELECT count(*) FROM embedfleet.jobs WHERE job = 'again'").fetchone()[0] == 0
    bad = cli("ingest", src, "--columns", "stars", "--table", "x", "--db", dsn, "--quiet")
    assert bad.returncode == 2 and "NAME:TYPE" in bad.stderr and "Traceback" not in bad.stderr


def test_an_existing_column_of_another_type_is_refused_before_planning(cli, dsn, conn, tmp_path):
    """Rows go in by binary COPY: a double's bytes landed in a bigint column as its bit pattern, and text's stopped
    the COPY, the worker waiting for ever. Refused, naming both types; the table's own type goes in."""
    src = _reviews(tmp_path / "typed.jsonl", 20)
    cli("ingest", src, "--columns", "stars:int", "--table", "typed", "--db", dsn, "--devices", "cpu", "--quiet",
        check=True)
    before = conn.execute("SELECT count(*), sum(stars) FROM typed").fetchone()
    for kind, shown in (("double", "double precision"), ("text", "text")):
        p = cli("ingest", src, "--columns", f"stars:{kind}", "--table", "typed", "--job", f"as_{kind}", "--db", dsn,
                "--devices", "cpu", "--quiet", timeout=120)
        one_line_error(p, f"table 'typed' already has column 'stars' as bigint, not {shown}: give its type "
                          "(--columns stars:bigint)")
    assert conn.execute("SELECT count(*), sum(stars) FROM typed").fetchone() == before
    cli("ingest", src, "--columns", "stars:bigint", "--table", "typed", "--job", "as_bigint", "--db", dsn,
        "--devices", "cpu", "--quiet", check=True)
    assert conn.execute("SELECT count(*), sum(stars) FROM typed").fetchone() == before


def test_a_column_whose_field_no_record_has_is_said(cli, dsn, conn, tmp_path):
    """A typo or another case (`Stars` for `stars`) made a column of NULLs without a word."""
    src = tmp_path / "cs.jsonl"
    src.write_text('{"text": "a cable", "stars": 5}\n{"text": "a case", "stars": 1}\n')
    p = cli("ingest", src, "--columns", "Stars:int,stars:int", "--db", dsn, "--devices", "cpu", "--quiet", check=True)
    warned = [line for line in p.stderr.splitlines() if "missing or null in every row" in line]
    assert len(warned) == 1 and "--columns Stars:" in warned[0]
    assert conn.execute('SELECT count("Stars"), count(stars) FROM cs').fetchone() == (0, 2)
