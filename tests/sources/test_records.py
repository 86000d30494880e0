"""records: sanitizing, coercion, templating and to_records on both presets."""

from __future__ import annotations

import re
from datetime import date, datetime, timezone
from decimal import Decimal

import pytest

from embedfleet.errors import InputError
from embedfleet.sources import RawRecord
from embedfleet.sources.presets import get_preset
from embedfleet.sources.records import (
    PGTYPES,
    CoerceError,
    Record,
    Reject,
    coerce,
    coercer,
    jsonable,
    render_template,
    sanitize,
    to_records,
    validate_template,
)

AMAZON = get_preset("amazon-reviews")
GENERIC = get_preset("generic")


def review(**over) -> dict:
    base = {
        "rating": 4.0, "title": "Good case", "text": "Fits well.<br />Sturdy.", "images": [],
        "asin": "B01", "parent_asin": "P01", "user_id": "U1", "timestamp": 1600000000000,
        "helpful_vote": 2, "verified_purchase": True,
    }
    return {**base, **over}


def raw(data, line=1, source="/data/in/reviews.jsonl", error=None) -> RawRecord:
    return RawRecord(source, line, data, "raw text", error)


# --- sanitize ---------------------------------------------------------------------------------


def test_sanitize():
    assert sanitize("plain") == "plain"
    assert sanitize("a\x00b") == "ab"
    assert sanitize("x\ud800y\udfffz") == "x\ufffdy\ufffdz"
    assert sanitize("emoji 😀 中文 \u2028 tab\t") == "emoji 😀 中文 \u2028 tab\t"


def test_jsonable_sanitizes_nested_strings():
    got = jsonable({"a\x00": ["x\x00", {"b": "\ud800"}], "n": float("nan"), "t": (1, 2)})
    assert got == {"a": ["x", {"b": "\ufffd"}], "n": None, "t": [1, 2]}


# --- coercion ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "pgtype", "expected"),
    [
        (4, "real", 4.0), ("4.0", "real", 4.0), (" 3.5 ", "double precision", 3.5), ("", "real", None),
        (None, "integer", None), (3, "integer", 3), (3.0, "integer", 3), ("12", "integer", 12), ("12.0", "bigint", 12),
        (2**40, "bigint", 2**40), (True, "boolean", True), ("false", "boolean", False), ("TRUE", "boolean", True),
        (1, "boolean", True), ("0", "boolean", False), (12, "text", "12"), ("a\x00", "text", "a"),
        ({"k": "v\x00"}, "jsonb", {"k": "v"}),
        (1600000000000, "timestamptz", datetime(2020, 9, 13, 12, 26, 40, tzinfo=timezone.utc)),
        ("1600000000000", "timestamptz", datetime(2020, 9, 13, 12, 26, 40, tzinfo=timezone.utc)),
        ("2020-09-13T12:26:40Z", "timestamptz", datetime(2020, 9, 13, 12, 26, 40, tzinfo=timezone.utc)),
        ("2020-09-13 12:26:40", "timestamptz", datetime(2020, 9, 13, 12, 26, 40, tzinfo=timezone.utc)),
        ("2008-11-13", "date", date(2008, 11, 13)), (" 2008-11-13T10:00:00Z ", "date", date(2008, 11, 13)),
        (date(2008, 11, 13), "date", date(2008, 11, 13)), (datetime(2008, 11, 13, 23, 0), "date", date(2008, 11, 13)),
        ("", "date", None),
        ("science fiction", "text[]", ["science fiction"]),  # one tag; arXiv's categories split: below
        (b"caf\xc3\xa9 \xff", "text", "café \ufffd"),
        (["a b", 3, None, "c\x00"], "text[]", ["a b", "3", None, "c"]),  # a null element stays, in its place
        ("", "text[]", None), ("  ", "text[]", None), ([], "text[]", []), (("x",), "text[]", ["x"]),
        (1.25, "numeric", Decimal("1.25")), ("12345678901234567.89", "numeric", Decimal("12345678901234567.89")),
        (7, "numeric", Decimal(7)), (" -0.10 ", "numeric", Decimal("-0.10")), ("", "numeric", None),
    ],
)
def test_coerce(value, pgtype, expected):
    assert coerce(value, pgtype, "f") == expected


@pytest.mark.parametrize(
    ("value", "pgtype"),
    [
        ("five", "real"), (True, "real"), ([1], "real"), (3.5, "integer"), ("3.5", "integer"), (2**31, "integer"),
        (2**63, "bigint"), (True, "integer"), ("yes", "boolean"), (2, "boolean"), ({"a": 1}, "text"),
        ("next tuesday", "timestamptz"), (True, "timestamptz"), (1e30, "timestamptz"),
        ("13/11/2008", "date"), (1226534400000, "date"), ({"a": 1}, "text[]"), ([["nested"]], "text[]"),
        ([{"a": 1}], "text[]"), ("ten", "numeric"), (True, "numeric"), (float("nan"), "numeric"), ("Infinity", "numeric"),
        (1e40, "real"), ("-1e39", "real"),  # past float4: it would be stored as Infinity
    ],
)
def test_coerce_rejects(value, pgtype):
    with pytest.raises(CoerceError, match=f"cannot coerce f=.* to {re.escape(pgtype)}"):
        coerce(value, pgtype, "f")
    with pytest.raises(CoerceError, match=f"cannot coerce f=.* to {re.escape(pgtype)}"):
        coercer(pgtype)(value, "f")  # the per-column fast path too


def test_coerce_message():
    with pytest.raises(CoerceError) as e:
        coerce("five", "real", "rating")
    assert str(e.value) == "cannot coerce rating='five' to real"
    assert isinstance(e.value, ValueError)
    with pytest.raises(CoerceError) as e:  # an object or array as the input wrote it, not Python's repr
        coerce({"a": [1, "é"], "b": None}, "bigint", "stars")
    assert str(e.value) == 'cannot coerce stars={"a": [1, "é"], "b": null} to bigint'


# Every type a JSON or Parquet value may have, in and out of each column's fast path.
_ANY_VALUES = [
    None, "", " ", "abc", "a\x00b", "caf\u00e9", "\ud800", " 7 ", "1.5", "true", "2020-09-13T12:26:40Z", True, False,
    0, 1, 2, -7, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**63, 10**30, 1600000000000, -(10**20),
    0.0, 2.5, 3.0, float("nan"), float("inf"), 1e30, Decimal("4.0"), [], [1, "x\x00"], {"k": None}, (1, 2),
    datetime(2020, 1, 1), b"bytes",
]


def _outcome(f, *args):
    try:
        return "ok", f(*args)
    except CoerceError as e:
        return "reject", str(e)


@pytest.mark.parametrize("pgtype", PGTYPES)
def test_coercer_matches_coerce(pgtype):
    fast = coercer(pgtype)
    for value in _ANY_VALUES:
        got, want = _outcome(fast, value, "f"), _outcome(coerce, value, pgtype, "f")
        # repr: nan != nan, and a bool must not come back as an int (True == 1)
        assert repr(got) == repr(want), (value, pgtype)
        assert type(got[1]) is type(want[1]), (value, pgtype)


# --- templates --------------------------------------------------------------------------------


def test_render_template():
    fields = {"title": "T", "text": "X", "details": {"Brand": "Acme"}, "n": 3, "tags": ["a", "b"], "d.k": "dotted key"}
    assert render_template("{title}\n\n{text}", fields) == "T\n\nX"
    assert render_template("{details.Brand}: {n} {tags}", fields) == "Acme: 3 a, b"
    assert render_template("{missing}|{details.nope}|{none}", {"none": None}) == "||"
    assert render_template("{{literal}} {title}", fields) == "{literal} T"
    assert render_template("{d.k}", fields) == "dotted key"
    assert render_template("{details}", fields) == '{"Brand":"Acme"}'
    assert render_template("{tags.1}", fields) == "b"


@pytest.mark.parametrize("bad", ["{title", "title}", "{}", "{a!r}", "{a:>10}", "{a[0]}", "{ }"])
def test_bad_templates(bad):
    with pytest.raises(InputError, match="bad text template"):
        validate_template(bad)


# --- to_records: amazon-reviews ---------------------------------------------------------------


def test_amazon_record():
    (rec,), rejects = to_records([raw(review(color="red"))], AMAZON)
    assert rejects == []
    assert isinstance(rec, Record) and rec.line == 1 and rec.source == "/data/in/reviews.jsonl"
    assert rec.id == "U1|B01|1600000000000"
    assert rec.content == "Good case\n\nFits well.\nSturdy."
    v = rec.values
    assert set(v) == {c.name for c in AMAZON.columns}
    assert v["rating"] == 4.0 and v["helpful_vote"] == 2 and v["verified_purchase"] is True
    assert v["text"] == "Fits well.<br />Sturdy."  # columns keep the input; only content is cleaned
    assert v["ts"] == datetime(2020, 9, 13, 12, 26, 40, tzinfo=timezone.utc)
    assert v["extra"] == {"color": "red"}
    assert v["product_title"] is None and v["price"] is None


@pytest.mark.parametrize(
    ("title", "text", "content"),
    [
        ("", "Only text", "Only text"),
        (None, "a<br>b<BR/>c<br />d", "a\nb\nc\nd"),
        ("Title", "", "Title"),
        ("  T  ", "x\x00y", "T  \n\nxy"),
    ],
)
def test_amazon_content(title, text, content):
    (rec,), _ = to_records([raw(review(title=title, text=text))], AMAZON)
    assert rec.content == content


def test_amazon_same_review_other_time_format_same_id():
    recs, _ = to_records([raw(review()), raw(review(timestamp="2020-09-13T12:26:40Z"), 2), raw(review(timestamp="1600000000000"), 3)], AMAZON)
    assert len({r.id for r in recs}) == 1 and len(recs) == 3  # duplicates kept: the writer dedupes


def test_amazon_rejects_keep_order_and_reasons():
    raws = [
        raw(None, 1, error="malformed JSON: Unexpected character at column 3"),
        raw(review(user_id=None), 2),
        raw(review(rating="five"), 3),
        raw(review(title="", text=" <br /> "), 4),
        raw(review(helpful_vote=1.5), 5),
        raw(review(), 6),
        raw({k: v for k, v in review().items() if k != "asin"}, 7),
    ]
    recs, rejects = to_records(raws, AMAZON)
    assert [r.line for r in recs] == [6]
    assert [(r.line, r.reason) for r in rejects] == [
        (1, "malformed JSON: Unexpected character at column 3"),
        (2, "missing field 'user_id' needed for the id"),
        (3, "cannot coerce rating='five' to real"),
        (4, "template renders no text"),
        (5, "cannot coerce helpful_vote=1.5 to integer"),
        (7, "missing field 'asin' needed for the id"),
    ]
    assert all(isinstance(r, Reject) for r in rejects)


def test_reject_raw_is_cut_and_sanitized():
    (rej,) = to_records([RawRecord("s", 1, None, "x\x00" * 5000, "malformed JSON: x")], AMAZON)[1]
    assert rej.raw == "x" * 2000  # cut to 4000 chars, then NULs removed


def test_meta_join_one_lookup_per_batch():
    calls = []
    products = {"P01": {"product_title": "Acme Case", "price": 9.99, "details": {"Brand": "Acme"}}}

    def lookup(keys):
        calls.append(keys)
        return {k: products[k] for k in keys if k in products}

    raws = [raw(review(), 1), raw(review(parent_asin="P02", user_id="U2"), 2), raw(review(), 3), raw(None, 4, error="bad")]
    recs, rejects = to_records(raws, AMAZON, template="{product_title} by {details.Brand}: {title}", meta_lookup=lookup)
    assert calls == [{"P01", "P02"}]
    assert [r.content for r in recs] == ["Acme Case by Acme: Good case", "by : Good case", "Acme Case by Acme: Good case"]
    assert recs[0].values["price"] == 9.99 and recs[0].values["store"] is None
    assert recs[1].values["product_title"] is None
    assert to_records([], AMAZON, meta_lookup=lookup) == ([], []) and len(calls) == 1


def test_text_field_and_template_choice():
    (rec,), _ = to_records([raw(review())], AMAZON, text_field="title")
    assert rec.content == "Good case"
    _, (rej,) = to_records([raw(review())], AMAZON, text_field="nope")
    assert rej.reason == "field 'nope' has no text"
    with pytest.raises(InputError, match="not both"):
        to_records([], AMAZON, template="{a}", text_field="b")


# --- to_records: generic ----------------------------------------------------------------------


def test_generic_defaults():
    recs, rejects = to_records([raw({"text": "hello", "lang": "en"}, 7), raw({"title": "no text"}, 8)], GENERIC)
    (rec,) = recs
    assert rec.id == "reviews.jsonl:7"  # file name only: the same on every machine
    assert rec.content == "hello" and rec.values == {"record": {"lang": "en"}}
    assert rejects[0].reason == "field 'text' has no text"


def test_generic_id_field_and_template():
    raws = [raw({"doc": {"id": 12}, "body": "b\x00", "title": "t"}, 1), raw({"body": "b"}, 2)]
    recs, rejects = to_records(raws, GENERIC, template="{title}: {body}", id_field="doc.id")
    assert [(r.id, r.content) for r in recs] == [("12", "t: b")]
    assert recs[0].values == {"record": {"doc": {"id": 12}, "body": "b", "title": "t"}}
    assert rejects[0].reason == "missing field 'doc.id' needed for the id"


def test_a_space_separated_list_splits_only_where_the_column_says_so():
    """arXiv's `categories` ("hep-ph astro-ph") is a list of words; a --columns NAME:text[] string is one value."""
    from embedfleet.sources.presets import get_preset

    assert coercer("text[]", words=True)("hep-ph  astro-ph\n", "categories") == ["hep-ph", "astro-ph"]
    assert coercer("text[]")("science fiction", "tags") == ["science fiction"]
    arxiv = dict((col, fn) for _, col, fn in get_preset("arxiv")._coercers)
    assert arxiv["categories"]("cs.CL cs.LG", "categories") == ["cs.CL", "cs.LG"]
