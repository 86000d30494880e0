"""An input named by a file:// URL goes through fsspec end to end (plan, workers' ranged reads) and lands
exactly the rows its local path does: same ids (the generic `<file name>:<line>`), contents, records."""

from __future__ import annotations

import orjson


def test_a_file_url_lands_the_same_rows_as_its_path(cli, dsn, conn, tmp_path):
    lines = []
    for i in range(1, 121):
        lines.append(b"" if i % 13 == 0 else b"{broken" if i % 31 == 0 else
                     orjson.dumps({"text": f"note {i} about the weather and {'rain ' * (i % 9)}", "n": i}))
    path = tmp_path / "notes.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    common = ["--db", dsn, "--quiet", "--no-index", "--chunk-bytes", "1500", "--text-field", "text"]
    cli("ingest", f"file://{path}", "--table", "a", *common, check=True)
    cli("ingest", path, "--table", "b", *common, check=True)
    a = conn.execute("SELECT id, content, record FROM a ORDER BY id").fetchall()
    b = conn.execute("SELECT id, content, record FROM b ORDER BY id").fetchall()
    assert len(a) == 120 - 9 - 3 and a == b
    assert {r[0] for r in a} == {f"notes.jsonl:{i}" for i in range(1, 121) if i % 13 and i % 31}
    chunks = conn.execute("SELECT job, count(*), min(source) FROM embedfleet.chunks GROUP BY job ORDER BY job").fetchall()
    assert chunks[0][1] == chunks[1][1] > 3  # several byte ranges of the same file each way
    assert chunks[0][2] == f"file://{path}" and chunks[1][2] == str(path)
    rejects = conn.execute("SELECT job, line FROM embedfleet.rejects ORDER BY job, line").fetchall()
    assert [line for job, line in rejects if job == "a"] == [line for job, line in rejects if job == "b"] == [31, 62, 93]


def test_bad_urls_fail_in_one_line_before_anything_starts(cli, tmp_path):
    import importlib.util

    cases = [("file:///no/such/notes.jsonl", "input not found: file:///no/such/notes.jsonl"),
             ("foo://bucket/notes.jsonl", "unknown protocol foo://")]
    if importlib.util.find_spec("s3fs") is None:
        cases.append(("s3://bucket/notes.jsonl", "pip install embedfleet[s3]"))
    for url, needle in cases:
        p = cli("ingest", url, "--quiet")
        assert p.returncode == 2 and "Traceback" not in p.stderr and needle in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
