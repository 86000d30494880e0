"""Planning: boundaries never split a line, every line lands in exactly one chunk, numbers exact."""

from __future__ import annotations

import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedfleet.errors import InputError
from embedfleet.sources import (
    ChunkSpec,
    expand_inputs,
    input_kind,
    plan_chunks,
    read_chunk,
    table_name_for,
)
from embedfleet.sources import plan as plan_mod


def _random_file(rng: random.Random, path) -> list[tuple[int, bytes]]:
    """A random JSONL-ish file; returns its (line number, content) pairs, blanks excluded."""
    crlf, bom, final_nl = rng.random() < 0.5, rng.random() < 0.3, rng.random() < 0.5
    lines = []
    for _ in range(rng.randint(0, 60)):
        kind = rng.random()
        if kind < 0.15:
            lines.append(rng.choice([b"", b"  ", b"\t"]))
        else:
            lines.append(b'{"i": "' + b"x" * rng.choice([0, 1, 5, 40, 300]) + b'"}')
    nl = b"\r\n" if crlf else b"\n"
    body = nl.join(lines) + (nl if final_nl and lines else b"")
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + body)
    return [(i, line) for i, line in enumerate(lines, 1) if line.strip()]


@pytest.mark.parametrize("seed", range(60))
def test_chunks_cover_every_line_exactly_once(tmp_path, seed):
    rng = random.Random(seed)
    path = tmp_path / "f.jsonl"
    expected = _random_file(rng, path)
    chunk_bytes = rng.choice([1, 2, 7, 50, 333, 4096, 1 << 20, 1 << 62])  # the last: one chunk, whatever the file
    chunks = plan_chunks([str(path)], chunk_bytes)
    size = path.stat().st_size
    # Contiguous, newline-aligned, covering the file.
    assert [c.start for c in chunks] == [0] + [c.end for c in chunks[:-1]]
    assert (chunks[-1].end if chunks else 0) == size
    data = path.read_bytes()
    assert all(data[c.end - 1 : c.end] == b"\n" for c in chunks[:-1])
    # first_line is the physical line number at the chunk start.
    assert all(c.first_line == data[: c.start].count(b"\n") + 1 for c in chunks)
    got = [(r.line, r.raw.encode()) for c in chunks for r in read_chunk(c)]
    assert got == [(n, line) for n, line in expected]
    # A local file is cut by seeking and counted on threads, a URL in one streaming pass: the same chunks.
    streamed = plan_chunks([path.as_uri()], chunk_bytes)
    assert [(c.start, c.end, c.first_line) for c in streamed] == [(c.start, c.end, c.first_line) for c in chunks]


def test_chunk_sizes_follow_chunk_bytes(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_bytes(b'{"a": 1}\n' * 10_000)  # 9 bytes a line
    chunks = plan_chunks([str(path)], 9000)
    assert len(chunks) == 10
    assert all(c.end - c.start == 9000 for c in chunks)
    assert [c.first_line for c in chunks] == [1 + 1000 * i for i in range(10)]


def test_counting_spans_read_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_mod, "_BLOCK", 16)
    monkeypatch.setattr(plan_mod, "_CUT_READ", 8)  # a cut's newline found a few reads past its mark
    path = tmp_path / "f.jsonl"
    path.write_bytes(b"".join(b'{"n": %d}\n' % i for i in range(500)))
    chunks = plan_chunks([str(path)], 100)
    assert [r.data["n"] for c in chunks for r in read_chunk(c)] == list(range(500))
    assert all(c.first_line == r.line for c in chunks for r in list(read_chunk(c))[:1])


def test_empty_file_has_no_chunks(tmp_path):
    (tmp_path / "e.jsonl").write_bytes(b"")
    (tmp_path / "e.csv").write_bytes(b"")
    assert plan_chunks([str(tmp_path / "e.jsonl"), str(tmp_path / "e.csv")]) == []


def test_chunk_bytes_must_be_positive(tmp_path):
    with pytest.raises(InputError, match="at least 1 byte"):
        plan_chunks([], 0)


def test_stream_and_csv_are_one_chunk_ending_where_the_file_ended(tmp_path):
    for name in ("a.jsonl.gz", "b.ndjson.zst", "c.csv"):
        (tmp_path / name).write_bytes(b"x")
    chunks = plan_chunks(sorted(str(p) for p in tmp_path.iterdir()), 1)
    # a byte appended later is not this chunk's: a rerun plans it as a chunk of its own
    assert [(c.kind, c.start, c.end, c.first_line) for c in chunks] == [
        ("stream", 0, 1, 1), ("stream", 0, 1, 1), ("csv", 0, 1, 2)  # a CSV's data start on line 2
    ]
    assert all(os.path.isabs(c.source) for c in chunks)


def test_parquet_chunks_group_row_groups(tmp_path):
    path = tmp_path / "t.parquet"
    table = pa.table({"text": [f"row {i} " + "y" * 100 for i in range(1000)]})
    pq.write_table(table, path, row_group_size=100)
    one_each = plan_chunks([str(path)], 1)
    assert [(c.start, c.end, c.first_line) for c in one_each] == [(g, g + 1, 1 + 100 * g) for g in range(10)]
    whole = plan_chunks([str(path)], 1 << 40)
    assert [(c.start, c.end, c.first_line) for c in whole] == [(0, 10, 1)]
    groups = plan_chunks([str(path)], 3 * pq.ParquetFile(path).metadata.row_group(0).total_byte_size)
    assert [(c.start, c.end) for c in groups] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert all(isinstance(c, ChunkSpec) and c.kind == "parquet" for c in groups)


def test_empty_parquet_has_no_chunks(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    assert plan_chunks([str(path)]) == []


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("a.jsonl", "jsonl"), ("a.NDJSON", "jsonl"), ("a.json", "jsonl"), ("a.jsonlines", "jsonl"),
        ("a.jsonl.gz", "stream"), ("a.json.zst", "stream"), ("a.parquet", "parquet"), ("a.pq", "parquet"),
        ("a.csv", "csv"), ("a.csv.gz", "csv"), ("a.csv.zst", "csv"),
    ],
)
def test_input_kind(name, kind):
    assert input_kind(name) == kind


@pytest.mark.parametrize("name", ["a.txt", "a.gz", "a.parquet.gz", "jsonl"])
def test_input_kind_unknown_lists_supported(name):
    with pytest.raises(InputError, match=r"unsupported input file type: .*supported: \.jsonl"):
        input_kind(name)


@pytest.mark.parametrize(
    ("path", "table"),
    [
        ("reviews.jsonl.gz", "reviews"),
        ("/data/Cell_Phones_and_Accessories.jsonl", "Cell_Phones_and_Accessories"),
        ("x/arxiv.metadata.json.zst", "arxiv.metadata"),
        ("wiki.parquet", "wiki"),
        ("t.CSV.GZ", "t"),
    ],
)
def test_table_name_for(path, table):
    assert table_name_for(path) == table


def test_expand_inputs(tmp_path, monkeypatch):
    for name in ("b.jsonl", "a.jsonl", "c.csv"):
        (tmp_path / name).write_text("{}\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    got = expand_inputs(["*.jsonl", "a.jsonl", str(tmp_path / "c.csv"), "**/*.jsonl"])
    assert got == [str(tmp_path / n) for n in ("a.jsonl", "b.jsonl", "c.csv", "sub/d.jsonl")]


def test_expand_inputs_errors(tmp_path):
    with pytest.raises(InputError, match="input not found: .*nope.jsonl"):
        expand_inputs([str(tmp_path / "nope.jsonl")])
    with pytest.raises(InputError, match="input not found: .*matches no files"):
        expand_inputs([str(tmp_path / "*.parquet")])
    with pytest.raises(InputError, match="input is a directory"):
        expand_inputs([str(tmp_path)])
