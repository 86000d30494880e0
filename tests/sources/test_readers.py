"""Readers: every input fault, compressed streams, CSV, Parquet, and resuming with after_line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from embedfleet.errors import InputError
from embedfleet.sources import ChunkSpec, plan_chunks, read_chunk

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def read_all(path, chunk_bytes=8 << 20, after_line=0):
    return [r for c in plan_chunks([str(path)], chunk_bytes) for r in read_chunk(c, after_line)]


FAULTY = (
    b"\xef\xbb\xbf" + b'{"a": 1}\r\n'  # 1 BOM + CRLF
    b"\r\n"  # 2 blank
    + "  \t\u3000 \n".encode()  # 3 whitespace only (ASCII and Unicode)
    + b'{"a": 2,,}\n'  # 4 malformed
    b"[1, 2]\n"  # 5 array
    b"42\n"  # 6 number
    b"null\n"  # 7 null
    b'{"a": "bad \xff byte"}\n'  # 8 invalid UTF-8
    b'{"a": "lone \\ud800 surrogate"}\n'  # 9 lone surrogate escape
    b'{"a": "nul \\u0000 here"}\n'  # 10 escaped NUL (sanitized later, in records)
    b'{"a": "tail"}'  # 11 no final newline
)


@pytest.mark.parametrize("chunk_bytes", [1, 5, 30, 1 << 20])
def test_faults(tmp_path, chunk_bytes):
    path = tmp_path / "f.jsonl"
    path.write_bytes(FAULTY)
    recs = read_all(path, chunk_bytes)
    assert [r.line for r in recs] == [1, 4, 5, 6, 7, 8, 9, 10, 11]
    by_line = {r.line: r for r in recs}
    assert by_line[1].data == {"a": 1} and by_line[1].raw == '{"a": 1}' and by_line[1].error is None
    # orjson's wording varies between releases; the reason and the column are what we promise
    err = by_line[4].error
    assert by_line[4].data is None and err.startswith("malformed JSON: Unexpected character") and err.endswith("column 9")
    assert by_line[4].raw == '{"a": 2,,}'
    assert by_line[5].error == "JSON value is an array, not an object"
    assert by_line[6].error == "JSON value is a number, not an object"
    assert by_line[7].error == "JSON value is null, not an object"
    assert by_line[8].data == {"a": "bad \ufffd byte"} and by_line[8].error is None
    assert by_line[9].data == {"a": "lone \ud800 surrogate"}  # records.sanitize replaces it
    assert by_line[10].data == {"a": "nul \x00 here"}
    assert by_line[11].data == {"a": "tail"}
    assert all(r.source == str(path) for r in recs)


def test_raw_nul_byte_is_malformed(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_bytes(b'{"a": "x\x00y"}\n')
    (rec,) = read_all(path)
    assert rec.error.startswith("malformed JSON: Unexpected control character")


def test_bom_only_at_file_start(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_bytes(b'{"a": 1}\n\xef\xbb\xbf{"a": 2}\n')
    recs = read_all(path, 1)
    assert recs[0].data == {"a": 1} and recs[1].error and "BOM" in recs[1].error


def test_lines_are_split_on_newline_only(tmp_path):
    # str.splitlines would also split at U+2028 and U+0085, which are legal raw inside JSON strings.
    path = tmp_path / "f.jsonl"
    path.write_bytes('{"a": "x\u2028y\x85z"}\n'.encode())
    (rec,) = read_all(path)
    assert rec.data == {"a": "x\u2028y\x85z"}


def test_long_line_across_read_blocks(tmp_path):
    path = tmp_path / "f.jsonl"
    long_text = "é" * 3_000_000  # 6 MB, longer than the 1 MiB read block
    path.write_text(json.dumps({"t": long_text}, ensure_ascii=False) + "\n" + '{"t": "short"}\n', encoding="utf-8")
    recs = read_all(path, 1)
    assert [len(r.data["t"]) for r in recs] == [3_000_000, 5] and [r.line for r in recs] == [1, 2]


def _write_lines(n: int) -> bytes:
    return b"".join(b'{"n": %d}\r\n' % i if i % 7 else b"\n" for i in range(1, n + 1))


def test_gzip_multi_member(tmp_path):
    path = tmp_path / "f.jsonl.gz"
    data = _write_lines(100)
    path.write_bytes(gzip.compress(b"\xef\xbb\xbf" + data[:500]) + gzip.compress(data[500:]))
    recs = read_all(path)
    assert [r.data["n"] for r in recs] == [i for i in range(1, 101) if i % 7]
    assert [r.line for r in recs] == [r.data["n"] for r in recs]


def test_zstd_multi_frame(tmp_path):
    path = tmp_path / "f.ndjson.zst"
    data = _write_lines(1000)
    cctx = zstandard.ZstdCompressor()
    path.write_bytes(b"".join(cctx.compress(data[i : i + 777]) for i in range(0, len(data), 777)))
    recs = read_all(path)
    assert [r.line for r in recs] == [i for i in range(1, 1001) if i % 7]
    assert all(r.data == {"n": r.line} for r in recs)


@pytest.mark.parametrize("name", ["f.jsonl.gz", "f.jsonl.zst", "f.csv.gz"])
def test_a_truncated_stream_yields_its_whole_lines_then_a_reject_saying_where(tmp_path, name):
    """The lines before the damage are read, not dropped with it (a read of 1 MB used to lose them all)."""
    n = 50_000  # zstd decodes whole blocks of 128 KB: the file must hold several
    text = "".join(f'{{"n": {i}, "t": "été {i}"}}\n' for i in range(1, n + 1)).encode()
    if name.endswith(".csv.gz"):
        text = b"n,t\n" + b"".join(f"{i},été {i}\n".encode() for i in range(1, n + 1))
    whole = gzip.compress(text) if name.endswith(".gz") else zstandard.ZstdCompressor().compress(text)
    path = tmp_path / name
    path.write_bytes(whole[: len(whole) * 2 // 3])
    *good, damage = read_all(path)
    assert damage.error is not None and damage.data is None
    assert damage.error.startswith(f"unreadable after line {damage.line - 1} (corrupt or truncated file?)")
    assert all(r.error is None for r in good) and len(good) > n // 3  # much of the 2/3 kept
    assert [int(r.data["n"]) for r in good] == list(range(1, len(good) + 1))  # no line cut short among them
    assert good[-1].line == damage.line - 1
    # Resuming after some of the good lines reads the rest and the same reject.
    assert read_all(path, after_line=1000) == [r for r in good if r.line > 1000] + [damage]


def test_a_gz_that_is_not_gzip_is_one_reject(tmp_path):
    path = tmp_path / "f.jsonl.gz"
    path.write_bytes(b'{"n": 1}\n')
    [damage] = read_all(path)
    assert damage.line == 1 and "Not a gzipped file" in damage.error


@pytest.mark.parametrize("name", ["f.jsonl", "f.jsonl.gz", "f.jsonl.zst"])
@pytest.mark.parametrize("after", [0, 1, 6, 7, 50, 99, 100, 500])
def test_resume_after_line(tmp_path, name, after):
    data = _write_lines(100)
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else zstandard.ZstdCompressor().compress(data) if name.endswith(".zst") else data)
    full = read_all(path, 64)
    resumed = read_all(path, 64, after_line=after)
    assert resumed == [r for r in full if r.line > after]


def test_csv(tmp_path):
    path = tmp_path / "f.csv"
    path.write_bytes(
        "\ufeffid,text,rating\r\n"
        '1,"hello, world",5\r\n'
        "\r\n"
        '2,"two\nlines ""quoted""",4\r\n'
        "3,too,many,fields\r\n"
        "4,short\r\n"
        "5,caf\xe9,3\r\n".encode("utf-8").replace(b"caf\xc3\xa9", b"caf\xe9")  # latin-1 byte: replaced
    )
    recs = read_all(path)
    assert [r.line for r in recs] == [2, 4, 6, 7, 8]  # as an editor numbers them: the header is line 1
    assert recs[0].data == {"id": "1", "text": "hello, world", "rating": "5"}
    assert json.loads(recs[0].raw) == recs[0].data
    assert recs[1].data["text"] == 'two\nlines "quoted"'
    assert recs[2].error == "CSV row has 4 fields, the header has 3" and recs[2].data is None
    assert recs[3].error == "CSV row has 2 fields, the header has 3"
    assert recs[4].data["text"] == "caf\ufffd"
    assert [r.line for r in read_all(path, after_line=4)] == [6, 7, 8]


def test_csv_gz_and_long_field(tmp_path):
    path = tmp_path / "f.csv.gz"
    path.write_bytes(gzip.compress(("text\n" + "x" * 300_000 + "\n").encode()))
    (rec,) = read_all(path)
    assert len(rec.data["text"]) == 300_000 and rec.line == 2


def test_csv_header_naming_a_column_twice_keeps_both(tmp_path):
    path = tmp_path / "dup.csv"
    path.write_text("text,dup,dup,dup\nhello,d1,d2,d3\n")
    (rec,) = read_all(path)
    assert rec.data == {"text": "hello", "dup": "d1", "dup_2": "d2", "dup_3": "d3"}


def test_csv_header_only(tmp_path):
    path = tmp_path / "f.csv"
    path.write_text("a,b\n")
    assert read_all(path) == []


def test_parquet_rows_and_resume(tmp_path):
    path = tmp_path / "f.parquet"
    table = pa.table({"id": list(range(10_000)), "text": [f"t{i}" for i in range(10_000)], "tags": [["a", str(i)] for i in range(10_000)]})
    pq.write_table(table, path, row_group_size=1000)
    chunks = plan_chunks([str(path)], 1)
    recs = [r for c in chunks for r in read_chunk(c)]
    assert [r.line for r in recs] == list(range(1, 10_001))
    assert recs[4320].data == {"id": 4320, "text": "t4320", "tags": ["a", "4320"]} and recs[4320].line == 4321
    assert json.loads(recs[4320].raw) == recs[4320].data
    c = chunks[3]  # rows 3001..4000
    assert [r.line for r in read_chunk(c, after_line=3995)] == [3996, 3997, 3998, 3999, 4000]
    assert list(read_chunk(c, after_line=4000)) == []


def test_parquet_odd_types_render_as_json(tmp_path):
    import datetime
    import decimal

    path = tmp_path / "f.parquet"
    ts = datetime.datetime(2023, 1, 2, 3, 4, 5)
    pq.write_table(pa.table({"ts": [ts], "price": pa.array([decimal.Decimal("1.50")], pa.decimal128(5, 2))}), path)
    (rec,) = read_all(path)
    assert rec.data == {"ts": ts, "price": decimal.Decimal("1.50")}
    assert json.loads(rec.raw) == {"ts": "2023-01-02T03:04:05", "price": "1.50"}


def test_missing_file_and_unknown_kind(tmp_path):
    with pytest.raises(InputError, match="input not found"):
        list(read_chunk(ChunkSpec(str(tmp_path / "gone.jsonl"), "jsonl", 0, 10, 1)))
    with pytest.raises(InputError, match="input not found"):
        list(read_chunk(ChunkSpec(str(tmp_path / "gone.jsonl.gz"), "stream", 0, -1, 1)))
    with pytest.raises(InputError, match="unknown chunk kind"):
        list(read_chunk(ChunkSpec(str(tmp_path / "x"), "xml", 0, -1, 1)))


def test_example_faults_file():
    recs = read_all(EXAMPLES / "faults.jsonl", 100)
    errors = {r.line: r.error for r in recs if r.error}
    assert sorted(errors) == [5, 6, 7]
    assert [r.line for r in recs] == [1, 2] + list(range(5, 19))


def test_stream_blocks_parse_exactly_as_the_stream_reader(tmp_path):
    """Blocks of whole lines (what the worker sends its helpers for .gz/.zst) give the same records,
    line numbers and rejects as reading the stream directly, whatever the block size and resume point:
    BOM, CRLF, blank lines, malformed lines, lines longer than a block, no final newline."""
    import random

    from embedfleet.sources.jsonl import block_records, read_stream, stream_blocks

    rng = random.Random(1)
    lines = []
    for i in range(600):
        r = rng.random()
        lines.append(b"" if r < 0.05 else b"   " if r < 0.1 else b"{bad json" if r < 0.15 else
                     b'{"t": "' + b"x" * rng.randint(100, 3000) + b'"}\r' if r < 0.2 else b'{"t": %d}' % i)
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(b"\xef\xbb\xbf" + b"\n".join(lines)))
    spec = ChunkSpec(str(path), "stream", 0, -1, 1)
    for after in (0, 1, 17, 300, 599, 600):
        want = [(r.line, r.data, r.error) for r in read_stream(spec, after)]
        for block_bytes in (64, 1000, 1 << 20):
            got = [(r.line, r.data, r.error) for first, block in stream_blocks(spec, after, block_bytes)
                   for r in block_records(spec.source, first, block, after)]
            assert got == want, (after, block_bytes)


def test_csv_stray_quote_rejects_its_line_and_reads_the_next_ones(tmp_path):
    """A stray quote would swallow the following rows into one field; its line is a reject and every line
    after it is a record of its own. Short rows are rejects mid-file and at the end alike."""
    path = tmp_path / "f.csv"
    path.write_text(
        "id,text,rating\n"            # 1
        "1,fine,5\n"                   # 2
        '2,"broken quote,4\n'          # 3: opens a field that never closes where a field ends
        "3,next,3\n"                   # 4
        "4,short\n"                    # 5: short mid-file
        '5,"ok ""quoted""",2\n'        # 6
        "6,after,1\n"                  # 7
        "7,short at the end"           # 8: short, and no final newline
    )
    recs = read_all(path)
    assert [(r.line, r.error is None) for r in recs] == [(2, True), (3, False), (4, True), (5, False), (6, True),
                                                         (7, True), (8, False)]
    assert "quoting" in recs[1].error and recs[1].raw == '2,"broken quote,4'
    assert recs[3].error == recs[6].error == "CSV row has 2 fields, the header has 3"
    assert [r.data["id"] for r in recs if r.error is None] == ["1", "3", "5", "6"]
    assert recs[4].data["text"] == 'ok "quoted"'
    # a quote left open to the end of the file: the same, and nothing after it is lost
    path.write_text('id,text\n1,"never closed\n2,b\n3,c\n')
    assert [(r.line, r.error is None) for r in read_all(path)] == [(2, False), (3, True), (4, True)]


@pytest.mark.parametrize("encoding,name", [("utf-16", "UTF-16"), ("utf-32", "UTF-32")])
def test_a_utf16_or_utf32_file_is_refused_in_one_line_naming_its_encoding(tmp_path, encoding, name):
    """Read as UTF-8, every record was a reject about surrogates, and the count was off by one."""
    for suffix in ("jsonl", "csv"):
        path = tmp_path / f"wide.{suffix}"
        path.write_bytes('{"text": "one"}\r\n{"text": "two"}\r\n'.encode(encoding))
        with pytest.raises(InputError, match=rf"wide\.{suffix}: is {name} .*iconv -f {name} -t UTF-8"):
            plan_chunks([str(path)])


def test_a_latin1_file_is_said_once_with_its_first_line_and_how_to_convert_it(tmp_path, caplog):
    """Its é and ü became U+FFFD in every row without a word: search for "café" then found none of them."""
    import gzip
    import logging

    lines = ['{"text": "plain ascii"}', '{"text": "café crème"}', '{"text": "ok — utf8 here"}', '{"text": "über"}']
    body = "\n".join(lines).encode("utf-8").replace("café crème".encode(), "café crème".encode("latin-1"))
    body = body.replace("über".encode(), "über".encode("latin-1")) + b"\n"
    for name, data in (("l1.jsonl", body), ("l1.jsonl.gz", gzip.compress(body)), ("fine.jsonl", "\n".join(lines).encode())):
        (tmp_path / name).write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="embedfleet"):
        plan_chunks([str(tmp_path / "l1.jsonl"), str(tmp_path / "l1.jsonl.gz"), str(tmp_path / "fine.jsonl")])
    said = [r.getMessage() for r in caplog.records if "not UTF-8" in r.getMessage()]
    assert len(said) == 2 and all("line 2 (and 1 more of its first MiB's lines) has bytes" in m for m in said)
    assert "iconv -f WINDOWS-1252 -t UTF-8" in said[0] and "l1.utf8.jsonl" in said[0]
    records = read_all(tmp_path / "l1.jsonl")
    assert [r.data["text"] for r in records] == ["plain ascii", "caf\ufffd cr\ufffdme", "ok — utf8 here", "\ufffdber"]


def test_parquet_binary_columns_are_their_utf8_text_in_content_ids_and_templates(tmp_path):
    """A binary column (legacy Spark and Impala files hold strings so) was embedded as Python's `b'bin one'`."""
    from embedfleet.sources.presets import get_preset
    from embedfleet.sources.records import to_records

    path = tmp_path / "bin.parquet"
    pq.write_table(pa.table({"k": pa.array([b"k1", "k\u00ef2".encode()], pa.binary()),
                             "text": pa.array([b"bin one", "b\u00efn two".encode()], pa.binary()),
                             }), path)
    generic = get_preset("generic")
    records, rejects = to_records(read_all(path), generic, text_field="text", id_field="k")
    assert not rejects and [(r.id, r.content) for r in records] == [("k1", "bin one"), ("k\u00ef2", "b\u00efn two")]
    records, _ = to_records(read_all(path), generic, template="{k}: {text}")
    assert [r.content for r in records] == ["k1: bin one", "k\u00ef2: b\u00efn two"]
