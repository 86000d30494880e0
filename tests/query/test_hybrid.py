"""Hybrid search: a rare token (a product code) that the vector ranking misses from its top 10 comes first once
the full-text ranking is fused in (RRF), through `search --hybrid`, `--queries`, `--where` and serve's service;
without a full-text index, one line naming the command that adds it; the configuration recorded and reused."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

import pytest

from conftest import one_line_error

CODE = "QX7731Z"


def _corpus(path):
    rng = random.Random(5)
    items = ["charger", "cable", "case", "screen protector", "car mount", "earbuds", "battery pack"]
    rows = []
    for i in range(160):  # reviews full of codes, numbers and order talk: what a code's vector is near
        rows.append(f"Order Q{rng.randint(1000, 9999)}X{rng.randint(10, 99)} for the {rng.choice(items)}: part "
                    f"{rng.randint(100, 999)}-{rng.randint(10, 99)} arrived, code {rng.randint(1000, 9999)}Z works")
    rows.append(f"We hiked along the ridge at dawn and the lake below was still and silver; the guide's map was "
                f"marked {CODE} near the old hut, where we stopped for tea before the long descent.")
    path.write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(rows)))
    return f"r{len(rows) - 1}"


def test_hybrid_puts_a_rare_code_first_where_vectors_miss_it(cli, dsn, conn, tmp_path):
    src = tmp_path / "reviews.jsonl"
    target = _corpus(src)
    cli("ingest", src, "--db", dsn, "--devices", "cpu", "--quiet", "--id-field", "id", "--table", "plain", check=True)
    one_line_error(cli("search", CODE, "--table", "plain", "--db", dsn, "--hybrid"),
                   "`embedfleet index --table plain --fts` adds one")
    vector = json.loads(cli("search", CODE, "--table", "plain", "--db", dsn, "--json", check=True).stdout)
    assert target not in [r["id"] for r in vector["results"]]  # the vector ranking alone misses it
    p = cli("index", "--table", "plain", "--fts", "--fts-config", "english", "--db", dsn, "--json", check=True)
    assert json.loads(p.stdout)["added"] is True
    from embedfleet.pg.ddl import table_sql
    from embedfleet.pg.fts import fts_config

    assert fts_config(conn, table_sql(conn, "plain")) == "english"  # recorded with the column, reused
    assert conn.execute("SELECT count(*) FROM pg_indexes WHERE tablename = 'plain' AND indexdef ILIKE '%gin%'"
                        ).fetchone()[0] == 1
    hybrid = json.loads(cli("search", CODE, "--table", "plain", "--db", dsn, "--json", "--hybrid",
                            check=True).stdout)
    first = hybrid["results"][0]
    assert first["id"] == target and first["text_rank"] > 0 and first["score"] > 0
    assert all({"distance", "text_rank", "score"} <= set(r) for r in hybrid["results"])
    assert [r["score"] for r in hybrid["results"]] == sorted((r["score"] for r in hybrid["results"]), reverse=True)
    assert "content_tsv" not in first  # the tsvector stays in the database
    filtered = json.loads(cli("search", CODE, "--table", "plain", "--db", dsn, "--json", "--hybrid", "--where",
                              f"id <> '{target}'", "-k", "3", check=True).stdout)
    assert len(filtered["results"]) == 3 and target not in [r["id"] for r in filtered["results"]]
    queries = tmp_path / "q.txt"
    queries.write_text(f"{CODE}\nbattery pack\n")
    lines = cli("search", "--queries", queries, "--table", "plain", "--db", dsn, "--hybrid", check=True).stdout
    answers = [json.loads(line) for line in lines.splitlines()]
    assert answers[0]["results"][0]["id"] == target and len(answers) == 2
    again = json.loads(cli("index", "--table", "plain", "--fts", "--fts-config", "english", "--db", dsn, "--json",
                           check=True).stdout)
    assert again["added"] is False
    # without --fts-config, the table's recorded configuration is reused, not the default
    reused = json.loads(cli("index", "--table", "plain", "--fts", "--db", dsn, "--json", check=True).stdout)
    assert reused["added"] is False and reused["fts_config"] == "english"
    one_line_error(cli("index", "--table", "plain", "--fts", "--fts-config", "simple", "--db", dsn),
                   "has a full-text index with --fts-config 'english'")
    from embedfleet.query.serve import SearchService

    service = SearchService(dsn, "plain", device="cpu")
    try:
        results, _ = service.search(CODE, 5, hybrid=True)
        assert results[0]["id"] == target
    finally:
        service.close()


def test_ingest_fts_builds_it_at_the_end_and_rows_added_later_are_found(cli, dsn, conn, tmp_path):
    src = tmp_path / "reviews.jsonl"
    target = _corpus(src)
    p = cli("ingest", src, "--db", dsn, "--devices", "cpu", "--quiet", "--id-field", "id", "--table", "withfts",
            "--fts", "--json", check=True)
    assert "fts_s" in json.loads(p.stdout)["finalize"]
    # the column came with the table, filled as rows were written: only its index was built at the end, no rewrite
    assert conn.execute("SELECT relfilenode = oid FROM pg_class WHERE oid = 'withfts'::regclass").fetchone()[0]
    hybrid = json.loads(cli("search", CODE, "--table", "withfts", "--db", dsn, "--json", "--hybrid",
                            check=True).stdout)
    assert hybrid["results"][0]["id"] == target
    with src.open("a") as f:  # a rerun picks up appended lines: their tsvectors come with them
        f.write(json.dumps({"id": "late", "text": "a new note mentions ZZ9PLURAL once"}) + "\n")
    cli("ingest", src, "--db", dsn, "--devices", "cpu", "--quiet", "--id-field", "id", "--table", "withfts", "--fts",
        check=True)
    late = json.loads(cli("search", "ZZ9PLURAL", "--table", "withfts", "--db", dsn, "--json", "--hybrid",
                          check=True).stdout)
    assert late["results"][0]["id"] == "late"
    one_line_error(cli("ingest", src, "--db", dsn, "--devices", "cpu", "--quiet", "--table", "other", "--fts",
                       "--fts-config", "klingon"), "--fts-config 'klingon'")
    one_line_error(cli("ingest", src, "--db", dsn, "--devices", "cpu", "--quiet", "--table", "other",
                       "--fts-config", "english"), "add --fts")  # a knob without what it tunes: refused, not ignored
    # another job into a table whose full-text column has another configuration: refused before it writes a row,
    # not at its finish with its rows written and the job left unfinished
    other = tmp_path / "more.jsonl"
    other.write_text("".join(json.dumps({"id": f"m{i}", "text": f"more text {i}"}) + "\n" for i in range(5)))
    before = conn.execute("SELECT count(*) FROM withfts").fetchone()[0]
    one_line_error(cli("ingest", other, "--db", dsn, "--devices", "cpu", "--quiet", "--id-field", "id", "--table",
                       "withfts", "--job", "more", "--fts", "--fts-config", "german"),
                   "has a full-text index with --fts-config 'simple'")
    assert conn.execute("SELECT count(*) FROM withfts").fetchone()[0] == before
    assert conn.execute("SELECT count(*) FROM embedfleet.jobs WHERE job = 'more'").fetchone()[0] == 0
    # a query whose own text cannot be searched: its line says why, and the queries around it are answered
    qfile = tmp_path / "queries.txt"
    qfile.write_text(f"{CODE}\nbat\x00tery\nZZ9PLURAL\n", encoding="utf-8")
    p = cli("search", "--queries", qfile, "--table", "withfts", "--db", dsn, "--hybrid", "-k", "1")
    lines = [json.loads(line) for line in p.stdout.splitlines()]
    assert p.returncode == 2 and [d["query"] for d in lines] == [CODE, "bat\x00tery", "ZZ9PLURAL"]
    assert lines[0]["results"] and lines[2]["results"][0]["id"] == "late" and "NUL character" in lines[1]["error"]
    errors = p.stderr.strip().splitlines()
    assert len(errors) == 1 and "query 2" in errors[0] and "the others answered" in errors[0]


@pytest.mark.parametrize("rrf_k", [0])
def test_a_bad_rrf_constant_is_one_line(cli, dsn, tmp_path, rrf_k):
    src = tmp_path / "reviews.jsonl"
    _corpus(src)
    cli("ingest", src, "--db", dsn, "--devices", "cpu", "--quiet", "--id-field", "id", "--table", "rrf", "--fts",
        check=True)
    one_line_error(cli("search", CODE, "--table", "rrf", "--db", dsn, "--hybrid", "--rrf-k", rrf_k), "--rrf-k 0")


def test_hybrid_grouped_by_record_returns_k_records_when_one_long_record_fills_the_top(cli, dsn, conn, tmp_path):
    # one long record whose many passages all hold the words, and short ones that hold them once
    long = " ".join(f"The battery pack {i} charged the phone overnight and the battery stayed cool." for i in range(300))
    rows = [{"id": "long", "text": long}] + [
        {"id": f"s{i}", "text": f"Short note {i}: a battery pack, fine for the price."} for i in range(12)]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cli("ingest", src, "--db", dsn, "--devices", "cpu", "--quiet", "--id-field", "id", "--table", "grouped",
        "--passages", "32:0", "--fts", check=True)
    passages = conn.execute("SELECT count(*) FROM grouped WHERE parent_id = 'long'").fetchone()[0]
    assert passages > 8 * 5  # more than the first fetch's 8 × k passages from the one record
    doc = json.loads(cli("search", "battery pack", "--table", "grouped", "--db", dsn, "--json", "--hybrid",
                         "--group-by-parent", "-k", "5", check=True).stdout)
    parents = [r["parent_id"] for r in doc["results"]]
    assert len(parents) == 5 and len(set(parents)) == 5
    # serve's /search takes group_by_parent as the CLI takes --group-by-parent, in the URL or in a POST's body
    proc = subprocess.Popen([sys.executable, "-m", "embedfleet.cli", "serve", "--table", "grouped", "--db", dsn,
                             "--port", "0", "--device", "cpu"], stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, EMBEDFLEET_HOME=str(tmp_path / "home")))
    try:
        line = proc.stderr.readline()
        base = re.search(r"http://[^/]+", line).group(0)

        def call(path: str, body: dict | None = None) -> tuple[int, dict]:
            req = urllib.request.Request(base + path, data=body and json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        query = urllib.parse.urlencode({"q": "battery pack", "k": 5, "hybrid": "true", "group_by_parent": "true"})
        for status, answer in (call(f"/search?{query}"),
                               call("/search", {"q": "battery pack", "k": 5, "group_by_parent": True})):
            served = [r["parent_id"] for r in answer["results"]]
            assert status == 200 and len(served) == 5 and len(set(served)) == 5, answer
        status, answer = call("/search?q=battery&group_by_parent=maybe")
        assert status == 400 and answer["error"].startswith("group_by_parent='maybe'")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_row_the_vectors_find_and_the_words_match_past_the_text_rankings_depth_has_its_text_rank(cli, dsn,
                                                                                                     conn, tmp_path):
    """RRF counts each ranking's first candidates; `text_rank` is still each result's own full-text rank, so a row
    the vector ranking brought whose words match (beyond the text ranking's depth) does not read as a non-match."""
    import numpy as np

    from embedfleet.query.search import HYBRID_DEPTH, Searcher

    rng = random.Random(3)
    strong = [f"battery battery battery pack {i} battery" for i in range(3 * HYBRID_DEPTH)]
    seaside = ["lighthouse", "harbour", "gulls", "tide", "fishing boats", "cliffs", "sea fog", "the pier"]
    fillers = [f"the old {rng.choice(seaside)} keeper painted {rng.choice(seaside)} at dusk, {i}" for i in range(100)]
    weak = "the old lighthouse keeper painted seascapes at dusk, and the battery of his lamp"
    src = tmp_path / "mixed.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate([weak, *strong, *fillers])))
    cli("ingest", src, "--db", dsn, "--devices", "cpu", "--quiet", "--id-field", "id", "--table", "depth", "--fts",
        check=True)
    q = np.array(json.loads(conn.execute("SELECT embedding::text FROM depth WHERE id = 'r0'").fetchone()[0]), np.float32)
    rows = Searcher(conn, "depth").hybrid(q, "battery", k=5)
    matches = {i for (i,) in conn.execute("SELECT id FROM depth WHERE content_tsv @@ websearch_to_tsquery('simple', "
                                          "'battery')")}
    assert "r0" in [r["id"] for r in rows]  # first by its vector, past the text ranking's depth by its words
    for r in rows:
        assert (r["text_rank"] > 0) == (r["id"] in matches), r
