"""Passages of long documents (`ingest --passages TOKENS:OVERLAP`): real files, real PostgreSQL, the real
MiniLM tokenizer and model on CPU."""

from __future__ import annotations

import orjson
import pytest
from tokenizers import Tokenizer

from embedfleet.encode.models import resolve_model

WORDS = ("the river valley was settled early and its people traded salt wool and grain along roads that "
         "crossed the mountains where winters were long café Zürich naïve 東京 données — “quoted” words "
         "appear too").split()


def _document(i: int, words: int) -> str:
    """Sentences of 6-20 words; a paragraph break now and then."""
    out, k = [], 0
    while k < words:
        n = 6 + (i * 7 + k) % 15
        sentence = " ".join(WORDS[(i + k + j * 3) % len(WORDS)] for j in range(n))
        out.append(sentence.capitalize() + ("." if k % 3 else "!"))
        if k % 97 == 0 and k:
            out.append("\n\n")
        k += n
    return " ".join(out).replace(" \n\n ", "\n\n")


def _tokens(text: str) -> int:
    tok = Tokenizer.from_file(str(resolve_model(None) / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return len(tok.encode(text, add_special_tokens=False).ids)


@pytest.fixture
def corpus(tmp_path):
    # short ones and long ones: up to ~50x what MiniLM sees (256 tokens)
    docs = {f"doc{i}": _document(i, words) for i, words in enumerate([40, 120, 900, 3000, 9000, 300, 60, 2000])}
    path = tmp_path / "articles.jsonl"
    path.write_text("".join(orjson.dumps({"id": k, "text": v, "lang": "en"}).decode() + "\n" for k, v in docs.items()))
    return path, docs


def test_long_documents_become_overlapping_passages_that_reassemble_the_text(cli, dsn, conn, corpus):
    path, docs = corpus
    args = ("ingest", path, "--db", dsn, "--text-field", "text", "--id-field", "id", "--passages", "64:8",
            "--quiet", "--json")
    first = orjson.loads(cli(*args, check=True).stdout)
    rows = conn.execute("SELECT id, parent_id, passage, content, record->>'lang' FROM articles "
                        "ORDER BY parent_id, passage").fetchall()
    assert first["rows_written"] == len(rows) > 3 * len(docs)
    by_parent: dict[str, list] = {}
    for rid, parent, n, content, lang in rows:
        assert rid == f"{parent}#{n}" and lang == "en"  # the record's other columns on every passage
        by_parent.setdefault(parent, []).append(content)
    assert set(by_parent) == set(docs)
    for parent, pieces in by_parent.items():
        text = docs[parent]
        assert all(_tokens(p) <= 64 for p in pieces)  # within the limit, as the embedding sees each
        pos, prev_end = 0, None
        for k, piece in enumerate(pieces):
            start = text.find(piece, pos)
            assert start >= 0, f"{parent} passage {k} is not a slice of its text"
            if prev_end is None:
                assert text[:start].strip() == ""
            elif start >= prev_end:  # no overlap here: only whitespace between them
                assert text[prev_end:start].strip() == "", (parent, k)
            else:  # overlapping by at most 8 tokens (+1: a word cut differently on its own)
                assert 1 <= _tokens(text[start:prev_end]) <= 9, (parent, k, text[start:prev_end])
            pos, prev_end = start + 1, start + len(piece)
        assert text[prev_end:].strip() == ""  # nothing left out at the end
        if _tokens(text) > 64:
            assert len(pieces) > 1
    # The same command again: every passage row exactly once.
    cli(*args, check=True)
    assert conn.execute("SELECT count(*), count(DISTINCT id) FROM articles").fetchone() == (len(rows), len(rows))
    report = orjson.loads(cli("verify", "--table", "articles", "--db", dsn, "--json", check=True).stdout)
    assert report["ok"] and report["rows"] == len(rows)
    # The best passage of each record: distinct parents, nearest first; without grouping, the same
    # records' passages crowd the top.
    grouped = orjson.loads(cli("search", "salt and wool traded over the mountains", "--table", "articles", "--db", dsn,
                               "--group-by-parent", "-k", "5", "--json", check=True).stdout)["results"]
    parents = [r["parent_id"] for r in grouped]
    assert len(parents) == len(set(parents)) == 5
    assert [r["distance"] for r in grouped] == sorted(r["distance"] for r in grouped)
    plain = orjson.loads(cli("search", "salt and wool traded over the mountains", "--table", "articles", "--db", dsn,
                             "-k", "5", "--json", check=True).stdout)["results"]
    assert plain[0]["distance"] == pytest.approx(grouped[0]["distance"])  # the best passage overall leads both
    assert len({r["parent_id"] for r in plain}) < 5  # (these documents repeat themselves: one record's passages crowd)


def test_a_passage_larger_than_the_model_sees_is_refused_before_planning(cli, dsn, corpus):
    path, _ = corpus
    p = cli("ingest", path, "--db", dsn, "--text-field", "text", "--passages", "300", "--quiet")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "--passages 254 or less" in p.stderr
    p = cli("ingest", path, "--db", dsn, "--text-field", "text", "--passages", "64:40", "--quiet")
    assert p.returncode == 2 and "overlap" in p.stderr


def test_questions_beside_documents_embedded_with_the_query_prompt_and_verified_together(cli, dsn, corpus, tmp_path):
    path, _ = corpus
    cli("ingest", path, "--db", dsn, "--text-field", "text", "--id-field", "id", "--passages", "128:16", "--quiet",
        check=True)
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(orjson.dumps({"qid": f"q{i}", "question": q}).decode() + "\n" for i, q in enumerate(
        ["Which goods were traded along the roads?", "How long were the winters?", "Where is Zürich?"])))
    cli("ingest", questions, "--db", dsn, "--text-field", "question", "--id-field", "qid", "--prompt", "query",
        "--table", "articles_questions", "--quiet", check=True)
    doc = orjson.loads(cli("verify", "--table", "articles", "--table", "articles_questions", "--db", dsn, "--json",
                           check=True).stdout)
    assert doc["ok"] and doc["same_model"]
    docs, qs = doc["tables"]
    assert (docs["table"], docs["passages"], docs["prompt"]) == ("articles", "128:16", None)
    assert (qs["table"], qs["rows"], qs["prompt"]) == ("articles_questions", 3, "query")
    assert docs["model"] == qs["model"] and docs["dim"] == qs["dim"] == 384
    # one table alone keeps its own report's shape
    one = orjson.loads(cli("verify", "--table", "articles_questions", "--db", dsn, "--json", check=True).stdout)
    assert one["ok"] and one["table"] == "articles_questions" and "tables" not in one


def test_a_record_id_written_again_keeps_only_the_last_records_passages(cli, dsn, conn, tmp_path):
    """The table keeps the last of records sharing an id: its passage 0 replaced the earlier record's, and the
    earlier record's passages 1.. stayed beside it, one record's text mixed with another's."""
    long = " ".join(f"word{i} naïve café" for i in range(400))
    lines = [{"id": "9", "text": long}, {"id": "9", "text": "the same id, short now"}]  # in one unit
    lines += [{"id": "7", "text": long}] + [{"id": f"f{i}", "text": f"filler {i}"} for i in range(200)]
    lines += [{"id": "7", "text": "seven, short, in a later chunk"}]
    path = tmp_path / "dups.jsonl"
    path.write_text("".join(orjson.dumps(x).decode() + "\n" for x in lines))
    cli("ingest", path, "--db", dsn, "--text-field", "text", "--id-field", "id", "--passages", "64:8",
        "--table", "dup_passages", "--workers", "1", "--chunk-bytes", "8192", "--quiet", check=True)
    rows = dict(conn.execute("SELECT id, content FROM dup_passages WHERE parent_id = '9'").fetchall())
    assert rows == {"9#0": "the same id, short now"}  # in one unit: the last
    # in two chunks, whichever commits last (units of different chunks commit side by side), and all of it
    seven = dict(conn.execute("SELECT passage, content FROM dup_passages WHERE parent_id = '7'").fetchall())
    assert seven == {0: "seven, short, in a later chunk"} or (
        len(seven) > 1 and sorted(seven) == list(range(len(seven))) and "seven" not in "".join(seven.values()))
    report = orjson.loads(cli("verify", "--table", "dup_passages", "--db", dsn, "--json").stdout)
    assert report["count_matches_ledger"], report  # the passages deleted are counted out of the ledger's rows
