"""Presets: columns, meta loading and price parsing; the example corpus end to end."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedfleet.errors import InputError
from embedfleet.sources import RawRecord, plan_chunks, read_chunk
from embedfleet.sources.presets import get_preset, load_meta, parse_price
from embedfleet.sources.records import PGTYPES, to_records
from embedfleet.synth import write_amazon_meta, write_amazon_reviews

AMAZON = get_preset("amazon-reviews")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_get_preset():
    assert get_preset("generic").name == "generic"
    with pytest.raises(InputError, match="unknown preset 'nope'; choose one of: amazon-reviews, generic, wikipedia, arxiv"):
        get_preset("nope")


def _records(preset, *rows):
    return to_records([RawRecord("in.jsonl", i + 1, row, "", None) for i, row in enumerate(rows)], get_preset(preset))


def test_wikipedia_preset():
    """wikimedia/wikipedia's layout: id, url, title, text; the text only in content (no column, not in extra)."""
    cols = {c.name: c.pgtype for c in get_preset("wikipedia").columns}
    assert cols == {"url": "text", "title": "text", "extra": "jsonb"}
    article = {"id": "12", "url": "https://en.wikipedia.org/wiki/Anarchism", "title": "Anarchism",
               "text": "Anarchism is a political philosophy.\n\nHistory\n..."}
    recs, rejects = _records("wikipedia", article, {**article, "id": "25", "lang": "en"}, {**article, "id": ""},
                             {**article, "id": "39", "title": "", "text": "  "})
    assert [r.id for r in recs] == ["12", "25"]
    assert recs[0].content == "Anarchism\n\nAnarchism is a political philosophy.\n\nHistory\n..."
    assert recs[0].values == {"url": article["url"], "title": "Anarchism", "extra": None}
    assert recs[1].values["extra"] == {"lang": "en"}  # an unknown field is kept; the text is not
    assert [(r.line, r.reason) for r in rejects] == [(3, "field 'id' needed for the id is empty"),
                                                    (4, "template renders no text")]


ARXIV_LINE = {
    "id": "0704.0001", "submitter": "Pavel Nadolsky", "authors": "C. Bal\\'azs, E. L. Berger, P. M. Nadolsky, C.-P. Yuan",
    "title": "Calculation of prompt diphoton production cross sections at Tevatron and\n  LHC energies",
    "comments": "37 pages, 15 figures", "journal-ref": "Phys.Rev.D76:013009,2007", "doi": "10.1103/PhysRevD.76.013009",
    "report-no": "ANL-HEP-PR-07-12", "categories": "hep-ph astro-ph.CO", "license": None,
    "abstract": "  A fully differential calculation in perturbative quantum chromodynamics is\npresented.\n",
    "versions": [{"version": "v1", "created": "Mon, 2 Apr 2007 19:18:42 GMT"}], "update_date": "2008-11-13",
    "authors_parsed": [["Bal\\'azs", "C.", ""], ["Berger", "E. L.", ""]],
}


def test_arxiv_preset():
    """arxiv-metadata-oai-snapshot's fields typed: categories a text[] from its space-separated string."""
    from datetime import date

    cols = {c.name: c.pgtype for c in get_preset("arxiv").columns}
    assert cols == {"submitter": "text", "authors": "text", "title": "text", "comments": "text", "journal_ref": "text",
                    "doi": "text", "report_no": "text", "categories": "text[]", "license": "text", "abstract": "text",
                    "versions": "jsonb", "update_date": "date", "authors_parsed": "jsonb", "extra": "jsonb"}
    recs, rejects = _records("arxiv", ARXIV_LINE, {**ARXIV_LINE, "id": "math/0309136", "new_field": 1},
                             {**ARXIV_LINE, "id": "0704.0003", "update_date": "yesterday"})
    assert [r.id for r in recs] == ["0704.0001", "math/0309136"]
    v = recs[0].values
    assert recs[0].content == (ARXIV_LINE["title"] + "\n\n" + ARXIV_LINE["abstract"]).strip()
    assert v["categories"] == ["hep-ph", "astro-ph.CO"] and v["update_date"] == date(2008, 11, 13)
    assert (v["journal_ref"], v["report_no"], v["license"], v["extra"]) == ("Phys.Rev.D76:013009,2007",
                                                                            "ANL-HEP-PR-07-12", None, None)
    assert v["authors_parsed"][1] == ["Berger", "E. L.", ""]
    assert recs[1].values["extra"] == {"new_field": 1}
    assert [(r.line, r.reason) for r in rejects] == [(3, "cannot coerce update_date='yesterday' to date")]


def test_an_id_field_given_by_the_user_wins_over_the_presets():
    raw = RawRecord("in.jsonl", 1, {**ARXIV_LINE, "doi": "10.1/x"}, "", None)
    assert to_records([raw], get_preset("arxiv"), id_field="doi")[0][0].id == "10.1/x"


def test_amazon_columns():
    cols = {c.name: c.pgtype for c in AMAZON.columns}
    assert cols == {
        "rating": "real", "title": "text", "text": "text", "images": "jsonb", "asin": "text", "parent_asin": "text",
        "user_id": "text", "ts": "timestamptz", "helpful_vote": "integer", "verified_purchase": "boolean", "extra": "jsonb",
        "product_title": "text", "main_category": "text", "store": "text", "price": "real", "average_rating": "real",
        "rating_number": "integer", "features": "jsonb", "description": "jsonb", "categories": "jsonb", "details": "jsonb",
    }
    assert set(AMAZON.meta_columns) <= set(AMAZON.columns) and len(AMAZON.meta_columns) == 10
    assert AMAZON.meta_key == "parent_asin"
    assert all(c.pgtype in PGTYPES for p in ("amazon-reviews", "generic", "wikipedia", "arxiv")
               for c in get_preset(p).columns)


@pytest.mark.parametrize(
    ("value", "price"),
    [(12.99, 12.99), (5, 5.0), ("$12.99", 12.99), ("12.99", 12.99), ("$1,299.00", 1299.0), (" £7 ", 7.0),
     (None, None), ("None", None), ("—", None), ("$10.99 - $15.99", None), ("", None), (True, None)],
)
def test_parse_price(value, price):
    assert parse_price(value) == price


def _meta(**over):
    return {"parent_asin": "P1", "title": "Case", "price": "$9.50", "rating_number": "12", "average_rating": "n/a",
            "details": {"Brand": "X\u0000"}, "unknown": 1, **over}


@pytest.mark.parametrize("name", ["meta.jsonl", "meta.jsonl.gz", "meta.parquet"])
def test_load_meta_formats(tmp_path, name):
    rows = [_meta(), _meta(parent_asin="P2", price="—", rating_number="many")]
    path = tmp_path / name
    if name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist([dict(r, details=json.dumps(r["details"])) for r in rows]), path)
    else:
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
        path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    got = dict(load_meta(str(path), AMAZON))
    assert set(got) == {"P1", "P2"}
    p1 = got["P1"]
    assert set(p1) == {c.name for c in AMAZON.meta_columns}
    assert (p1["product_title"], p1["price"], p1["rating_number"], p1["average_rating"]) == ("Case", 9.5, 12, None)
    assert got["P2"]["price"] is None and got["P2"]["rating_number"] is None  # bad meta values -> None
    if not name.endswith(".parquet"):
        assert p1["details"] == {"Brand": "X"}


def test_load_meta_skips_and_counts(tmp_path, caplog):
    path = tmp_path / "meta.jsonl"
    path.write_text(json.dumps(_meta()) + "\n{broken\n" + json.dumps({"title": "no key"}) + "\n[]\n")
    skipped = []
    with caplog.at_level(logging.WARNING):
        got = list(load_meta(str(path), AMAZON, on_skip=lambda line, reason: skipped.append((line, reason))))
    assert [k for k, _ in got] == ["P1"]
    assert [line for line, _ in skipped] == [2, 3, 4]
    assert skipped[1] == (3, "missing field 'parent_asin'")
    assert "skipped 3 lines" in caplog.text and "meta.jsonl" in caplog.text


def test_load_meta_needs_a_meta_key(tmp_path):
    with pytest.raises(InputError, match="does not join a meta file"):
        list(load_meta(str(tmp_path / "m.jsonl"), get_preset("generic")))


def test_synth_corpus_round_trip(tmp_path):
    reviews = write_amazon_reviews(tmp_path / "r.jsonl", 500, products=20)
    meta = dict(load_meta(str(write_amazon_meta(tmp_path / "m.jsonl", 20)), AMAZON))
    raws = [r for c in plan_chunks([str(reviews)], 4096) for r in read_chunk(c)]
    recs, rejects = to_records(raws, AMAZON, meta_lookup=lambda keys: {k: meta[k] for k in keys if k in meta})
    assert len(recs) == 500 and rejects == [] and len({r.id for r in recs}) == 500
    assert all(r.values["product_title"].startswith("Product ") for r in recs)


def test_cached_corpus_is_never_left_short(tmp_path, monkeypatch):
    """A benchmark corpus is written once and reused; a write that stops half way (a time limit)
    leaves nothing under its name, so the next run writes it whole instead of reading a short file."""
    from embedfleet import synth

    def stopped(path, n, seed=0, products=1000):  # write_amazon_reviews's signature
        path.write_text('{"rating": 5.0}\n')
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(synth, "write_amazon_reviews", stopped)
        with pytest.raises(KeyboardInterrupt):
            synth.cached_reviews(tmp_path, 30)
    assert list(tmp_path.iterdir()) == []
    path = synth.cached_reviews(tmp_path, 30)
    assert path.read_bytes() == write_amazon_reviews(tmp_path / "again.jsonl", 30, products=5000).read_bytes()
    written = path.stat().st_mtime_ns
    assert synth.cached_reviews(tmp_path, 30) == path and path.stat().st_mtime_ns == written  # reused


def test_corpus_shards_are_written_side_by_side_with_their_own_ids(tmp_path):
    from embedfleet import synth

    paths = synth.cached_review_shards(tmp_path, 31, 3)
    lines = [p.read_text().splitlines() for p in paths]
    assert [len(x) for x in lines] == [11, 10, 10]
    ids = [(r["user_id"], r["asin"], r["timestamp"]) for x in lines for r in map(json.loads, x)]
    assert len(set(ids)) == 31  # one corpus of 31 reviews: no id twice across shards
    assert lines[1] != lines[2][: len(lines[1])]  # each shard its own texts
    # each shard is write_amazon_reviews with its seed, and is reused, not written again
    assert paths[2].read_bytes() == write_amazon_reviews(tmp_path / "again.jsonl", 10, seed=2, products=5000).read_bytes()
    written = [p.stat().st_mtime_ns for p in paths]
    assert synth.cached_review_shards(tmp_path, 31, 3) == paths and [p.stat().st_mtime_ns for p in paths] == written


def test_example_corpus():
    meta = dict(load_meta(str(EXAMPLES / "meta_Cell_Phones_and_Accessories.jsonl"), AMAZON))
    assert len(meta) == 40
    raws = [r for c in plan_chunks([str(EXAMPLES / "Cell_Phones_and_Accessories.jsonl")], 4096) for r in read_chunk(c)]
    recs, rejects = to_records(raws, AMAZON, meta_lookup=lambda keys: {k: meta[k] for k in keys if k in meta})
    assert len(recs) == 200 and rejects == []
    assert all(r.values["product_title"] for r in recs)
    assert not any("<br" in r.content for r in recs)


def test_example_faults_outcome():
    """The outcome examples/README.md promises for faults.jsonl."""
    raws = [r for c in plan_chunks([str(EXAMPLES / "faults.jsonl")], 64) for r in read_chunk(c)]
    recs, rejects = to_records(raws, AMAZON)
    assert [r.line for r in recs] == [1, 2, 10, 11, 12, 13, 14, 16, 17, 18]
    assert [(r.line, r.reason.split(":")[0]) for r in rejects] == [
        (5, "malformed JSON"), (6, "JSON value is an array, not an object"), (7, "JSON value is a string, not an object"),
        (8, "missing field 'user_id' needed for the id"), (9, "cannot coerce rating='five' to real"), (15, "template renders no text"),
    ]
    by_line = {r.line: r for r in recs}
    assert by_line[2].id == by_line[13].id and len({r.id for r in recs}) == 9
    assert "\x00" not in by_line[10].content and "\ufffd" in by_line[14].content and "\ufffd" in by_line[17].content
    assert len(by_line[11].values["text"]) == 20_000
    assert by_line[16].values["rating"] == 4.0 and by_line[16].values["verified_purchase"] is True
    assert by_line[18].values["extra"] == {"color": "Midnight Blue"}
