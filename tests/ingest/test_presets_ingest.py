"""The document presets end to end: small files in the corpora's own layouts, the real CLI, real MiniLM."""

from __future__ import annotations

from datetime import date

import orjson
import pyarrow as pa
import pyarrow.parquet as pq


def _types(conn, table: str) -> dict[str, str]:
    return dict(conn.execute("SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
                             "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped", [table]).fetchall())


def test_wikipedia_parquet_layout(cli, dsn, conn, tmp_path):
    # wikimedia/wikipedia's files: four string columns, several row groups
    articles = [{"id": str(12 + i), "url": f"https://en.wikipedia.org/wiki/Article_{i}", "title": f"Article {i}",
                 "text": f"Article {i} is about topic number {i}.\n\nSection\n" + "More words here. " * (i % 7 * 40)}
                for i in range(30)]
    articles[5]["text"] = ""  # a title alone still makes a row
    path = tmp_path / "train-00000-of-00041.parquet"
    pq.write_table(pa.Table.from_pylist(articles), path, row_group_size=8)
    doc = orjson.loads(cli("ingest", path, "--preset", "wikipedia", "--db", dsn, "--table", "wiki", "--quiet",
                           "--no-index", "--json", check=True).stdout)
    # Parquet: its size in text is not known; the bundled MiniLM is small: no compile would pay for itself
    assert doc["workers"][0]["startup"]["compile_first"] is False
    assert _types(conn, "wiki") == {"id": "text", "content": "text", "embedding": "vector(384)", "url": "text",
                                    "title": "text", "extra": "jsonb"}
    rows = {r[0]: r[1:] for r in conn.execute("SELECT id, content, url, title, extra FROM wiki").fetchall()}
    assert set(rows) == {a["id"] for a in articles}
    for a in articles:
        content, url, title, extra = rows[a["id"]]
        assert content == f"{a['title']}\n\n{a['text']}".strip() and (url, title, extra) == (a["url"], a["title"], None)
    assert orjson.loads(cli("verify", "--table", "wiki", "--db", dsn, "--json", check=True).stdout)["ok"]


def test_arxiv_jsonl_layout(cli, dsn, conn, tmp_path):
    lines = []
    for i in range(20):
        lines.append({
            "id": f"0704.{i + 1:04d}", "submitter": f"Author {i}", "authors": f"A. Author{i}, B. Other",
            "title": f"On the theory of thing {i}\n  and its consequences", "comments": f"{i + 3} pages",
            "journal-ref": None, "doi": None, "report-no": None,
            "categories": "hep-ph astro-ph" if i % 2 else "math.CO", "license": None,
            "abstract": f"  We study thing {i}.\nIt matters.\n",
            "versions": [{"version": "v1", "created": "Mon, 2 Apr 2007 19:18:42 GMT"}],
            "update_date": f"2008-11-{i + 1:02d}", "authors_parsed": [[f"Author{i}", "A.", ""], ["Other", "B.", ""]],
        })
    lines[3]["id"] = "math/0309136"
    lines[7]["update_date"] = "someday"  # a value that does not fit its column: a reject, the rest lands
    path = tmp_path / "arxiv-metadata-oai-snapshot.json"
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    cli("ingest", path, "--preset", "arxiv", "--db", dsn, "--table", "arxiv", "--quiet", "--no-index", check=True)
    types = _types(conn, "arxiv")
    assert (types["categories"], types["update_date"], types["versions"], types["journal_ref"]) == (
        "text[]", "date", "jsonb", "text")
    rows = {r[0]: r[1:] for r in conn.execute(
        "SELECT id, content, categories, update_date, authors_parsed, comments FROM arxiv").fetchall()}
    assert len(rows) == 19 and "0704.0008" not in rows
    content, categories, updated, parsed, comments = rows["0704.0002"]
    assert categories == ["hep-ph", "astro-ph"] and rows["math/0309136"][1] == ["hep-ph", "astro-ph"]
    assert rows["0704.0001"][1] == ["math.CO"]
    assert updated == date(2008, 11, 2) and parsed[1] == ["Other", "B.", ""] and comments == "4 pages"
    assert content == "On the theory of thing 1\n  and its consequences\n\n  We study thing 1.\nIt matters."
    # text[] is a real array: element queries work
    n = conn.execute("SELECT count(*) FROM arxiv WHERE 'astro-ph' = ANY(categories)").fetchone()[0]
    assert n == 9
    (reason,) = conn.execute("SELECT reason FROM embedfleet.rejects WHERE line = 8").fetchone()
    assert reason == "cannot coerce update_date='someday' to date"
