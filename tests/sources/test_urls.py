"""Inputs through fsspec URLs: the same file by path, file://, memory:// and a ranged object store (in
memory, serving range requests the way s3fs/gcsfs/hf do) plans into the same chunks and reads into
the same records; a chunk's read fetches only its own bytes; bad URLs are one-line errors."""

from __future__ import annotations

import gzip
import importlib.util
import io
import os

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from embedfleet.errors import InputError
from embedfleet.ingest.preflight import first_records
from embedfleet.sources import (
    ChunkSpec,
    expand_inputs,
    files,
    input_kind,
    plan_chunks,
    read_chunk,
    table_name_for,
)
from embedfleet.sources.jsonl import block_records, stream_blocks
from embedfleet.sources.presets import get_preset
from embedfleet.sources.records import to_records


class RangeStore(AbstractFileSystem):
    """An object store in memory whose files fetch byte ranges (AbstractBufferedFile, like s3fs,
    gcsfs and hf), recording every range fetched."""

    protocol = "rangetest"
    objects: dict[str, bytes] = {}
    fetched: list[tuple[str, int, int]] = []

    def info(self, path, **kwargs):
        path = self._strip_protocol(path)
        if path in self.objects:
            return {"name": path, "size": len(self.objects[path]), "type": "file"}
        if any(name.startswith(path.rstrip("/") + "/") for name in self.objects):
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kwargs):
        return _RangeFile(self, path, mode, block_size or "default", autocommit, cache_options=cache_options, **kwargs)


class _RangeFile(AbstractBufferedFile):
    def _fetch_range(self, start, end):
        RangeStore.fetched.append((self.path, start, end))
        return RangeStore.objects[self.path][start:end]


fsspec.register_implementation("rangetest", RangeStore, clobber=True)


def _jsonl(n: int = 400) -> bytes:
    """BOM, CRLF, blank lines, a malformed line, a non-object, no final newline."""
    lines = []
    for i in range(1, n + 1):
        lines.append(b"" if i % 17 == 0 else b"{oops" if i % 23 == 0 else b"[1]" if i % 29 == 0 else
                     b'{"text": "document %d %s", "n": %d}\r' % (i, b"w" * (i % 50), i))
    return b"\xef\xbb\xbf" + b"\n".join(lines)


def _csv(n: int = 300) -> bytes:
    return ("text,n\r\n" + "".join(f'"row {i}, with comma",{i}\r\n' if i % 11 else "\r\n" for i in range(1, n + 1))).encode()


def _parquet(n: int = 3000) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": [f"row {i} " + "p" * (i % 40) for i in range(n)], "n": list(range(n))}), buf,
                   row_group_size=250)
    return buf.getvalue()


FORMATS = {
    "docs.jsonl": _jsonl,
    "docs.jsonl.gz": lambda: gzip.compress(_jsonl()[:3000]) + gzip.compress(_jsonl()[3000:]),  # two members
    "docs.ndjson.zst": lambda: zstandard.ZstdCompressor().compress(_jsonl()),
    "docs.csv": _csv,
    "docs.parquet": _parquet,
}


def _put(scheme: str, tmp_path, name: str, data: bytes) -> tuple[str, str]:
    """(local path, URL) of the same bytes."""
    path = tmp_path / name
    path.write_bytes(data)
    if scheme == "file":
        return str(path), f"file://{path}"
    if scheme == "memory":
        url = f"memory://{tmp_path.name}/{name}"
        fsspec.filesystem("memory").pipe_file(url, data)
        return str(path), url
    RangeStore.objects[f"{tmp_path.name}/{name}"] = data
    return str(path), f"rangetest://{tmp_path.name}/{name}"


def _records(chunks, after_line=0):
    return [(r.line, r.data, r.raw, r.error) for c in chunks for r in read_chunk(c, after_line)]


@pytest.mark.parametrize("scheme", ["file", "memory", "rangetest"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_a_url_plans_and_reads_exactly_as_its_local_path(tmp_path, scheme, name):
    path, url = _put(scheme, tmp_path, name, FORMATS[name]())
    (url,) = expand_inputs([url])
    assert files.is_url(url) and url.startswith(f"{scheme}://")
    assert (input_kind(url), table_name_for(url)) == (input_kind(path), table_name_for(path))
    for chunk_bytes in (1, 4000, 8 << 20):
        by_path, by_url = plan_chunks([path], chunk_bytes), plan_chunks([url], chunk_bytes)
        assert [(c.kind, c.start, c.end, c.first_line) for c in by_url] == \
               [(c.kind, c.start, c.end, c.first_line) for c in by_path]
        assert {c.source for c in by_url} == {url}
        want = _records(by_path)
        assert want and _records(by_url) == want
        # a chunk's first records, one chunk at a time (each read on its own)
        assert [_records([c])[:1] for c in by_url] == [_records([c])[:1] for c in by_path]
        assert _records(by_url, after_line=57) == [r for r in want if r[0] > 57]
    # the generic preset's default ids (<file name>:<line>) do not depend on how the file was reached
    chunks = plan_chunks([url], 8 << 20)
    recs, rejects = to_records([r for c in chunks for r in read_chunk(c)], get_preset("generic"), text_field="text")
    local, local_rejects = to_records(_raws(path), get_preset("generic"), text_field="text")
    assert [(r.id, r.content, r.values) for r in recs] == [(r.id, r.content, r.values) for r in local]
    assert [(r.line, r.reason) for r in rejects] == [(r.line, r.reason) for r in local_rejects]
    assert recs[0].id.startswith(os.path.basename(path) + ":")
    assert [(r.line, r.data) for r in first_records(url)] == [(r.line, r.data) for r in first_records(path)]


def _raws(path):
    return [r for c in plan_chunks([path], 8 << 20) for r in read_chunk(c)]


def test_compressed_url_streams_in_blocks_like_the_path(tmp_path):
    """What the worker sends its helpers for a .gz: the same blocks of lines from a URL."""
    path, url = _put("rangetest", tmp_path, "docs.jsonl.gz", FORMATS["docs.jsonl.gz"]())
    for after in (0, 100):
        got = [(first, block) for first, block in stream_blocks(ChunkSpec(url, "stream", 0, -1, 1), after, 5000)]
        want = [(first, block) for first, block in stream_blocks(ChunkSpec(path, "stream", 0, -1, 1), after, 5000)]
        assert got == want and len(got) > 1
        assert [(r.line, r.data) for f, b in got for r in block_records(url, f, b, after)] == \
               [(r.line, r.data) for f, b in want for r in block_records(path, f, b, after)]


def test_a_jsonl_chunk_fetches_only_its_own_byte_range(tmp_path, monkeypatch):
    data = _jsonl(3000)
    _, url = _put("rangetest", tmp_path, "big.jsonl", data)
    chunks = plan_chunks([url], 10_000)
    assert len(chunks) > 5
    for c in (chunks[0], chunks[3], chunks[-1]):
        RangeStore.fetched.clear()
        assert list(read_chunk(c))
        assert [(s, e) for _, s, e in RangeStore.fetched] == [(c.start, c.end)]  # one request, exactly the chunk
    # an object store is asked once per chunk of a few MB too (each request is a round trip)
    _, url = _put("rangetest", tmp_path, "bigger.jsonl", b'{"text": "%s"}\n' % (b"z" * 1000) * 5000)
    c = plan_chunks([url], 3 << 20)[0]
    RangeStore.fetched.clear()
    assert len(list(read_chunk(c))) > 3000 and [(s, e) for _, s, e in RangeStore.fetched] == [(c.start, c.end)]
    # a chunk longer than one request: pieces, still none past its end
    monkeypatch.setattr(files, "_URL_READ", 1000)
    monkeypatch.setattr(files, "_LOCAL_READ", 1000)
    c = chunks[2]
    RangeStore.fetched.clear()
    assert [r.line for r in read_chunk(c)] == [r.line for r in read_chunk(ChunkSpec(str(tmp_path / "big.jsonl"), *_fields(c)))]
    spans = [(s, e) for _, s, e in RangeStore.fetched]
    assert len(spans) > 1 and spans[0][0] == c.start and spans[-1][1] == c.end
    assert all(e1 == s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))  # contiguous, no byte twice


def _fields(c: ChunkSpec):
    return c.kind, c.start, c.end, c.first_line


def test_a_parquet_chunk_fetches_its_row_groups_not_the_file(tmp_path):
    data = _parquet(20_000)
    _, url = _put("rangetest", tmp_path, "big.parquet", data)
    chunks = plan_chunks([url], 1)
    assert len(chunks) == 80
    RangeStore.fetched.clear()
    assert [r.data["n"] for r in read_chunk(chunks[40])] == list(range(10_000, 10_250))
    # pyarrow reads the footer (the file's tail), then the chunk's column chunks and nothing else
    tail = [(s, e) for _, s, e in RangeStore.fetched if e == len(data)]
    body = [(s, e) for _, s, e in RangeStore.fetched if e < len(data)]
    assert len(tail) == 1 and tail[0][1] - tail[0][0] <= 64 << 10
    rg = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(40)
    cols = [rg.column(i) for i in range(rg.num_columns)]
    lo = min(c.dictionary_page_offset or c.data_page_offset for c in cols)
    hi = max((c.dictionary_page_offset or c.data_page_offset) + c.total_compressed_size for c in cols)
    assert body and all(lo <= s and e <= hi for s, e in body)


def test_url_globs_expand_to_sorted_canonical_urls(tmp_path):
    mem = fsspec.filesystem("memory")
    base = f"memory://{tmp_path.name}"
    for name in ("b.jsonl", "a.jsonl", "c.csv", "sub/d.jsonl"):
        mem.pipe_file(f"{base}/{name}", b"{}\n")
    got = expand_inputs([f"{base}/*.jsonl", f"{base}/a.jsonl", f"{base}/**/*.jsonl"])
    assert got == [f"memory:///{tmp_path.name}/{n}" for n in ("a.jsonl", "b.jsonl", "sub/d.jsonl")]
    (tmp_path / "x.jsonl").write_text("{}\n")
    assert expand_inputs([f"file://{tmp_path}/*.jsonl"]) == [f"file://{tmp_path}/x.jsonl"]


def _one_line_error(fn, match):
    with pytest.raises(InputError, match=match) as e:
        fn()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_urls_are_one_line_errors(tmp_path):
    _one_line_error(lambda: expand_inputs(["memory://nowhere/nope.jsonl"]), r"^input not found: memory://nowhere/nope\.jsonl$")
    _one_line_error(lambda: expand_inputs([f"file://{tmp_path}/nope.jsonl"]), r"^input not found: file://")
    _one_line_error(lambda: expand_inputs(["memory://nowhere/*.jsonl"]), "matches no files")
    fsspec.filesystem("memory").pipe_file(f"memory://{tmp_path.name}/dir/x.jsonl", b"{}\n")
    _one_line_error(lambda: expand_inputs([f"memory://{tmp_path.name}/dir"]), "input is a directory")
    _one_line_error(lambda: expand_inputs(["foo://bucket/x.jsonl"]), r"unknown protocol foo:// in foo://bucket/x\.jsonl")
    # a file gone since planning, read by a worker
    _one_line_error(lambda: list(read_chunk(ChunkSpec("memory:///gone.jsonl", "jsonl", 0, 10, 1))), "input not found")
    _one_line_error(lambda: list(read_chunk(ChunkSpec("memory:///gone.csv", "csv", 0, -1, 1))), "input not found")
    _one_line_error(lambda: list(read_chunk(ChunkSpec("rangetest://x/gone.parquet", "parquet", 0, 1, 1))),
                    "input not found")
    _one_line_error(lambda: plan_chunks(["memory:///gone.jsonl"]), "cannot read input memory:///gone.jsonl")


@pytest.mark.parametrize(("url", "extra"), [("s3://bucket/x.jsonl", "s3"), ("gs://bucket/x.jsonl", "gcs")])
def test_a_missing_filesystem_library_names_the_extra(url, extra):
    if importlib.util.find_spec({"s3": "s3fs", "gcs": "gcsfs"}[extra]):
        pytest.skip("the library is installed here")
    _one_line_error(lambda: expand_inputs([url]), rf"pip install embedfleet\[{extra}\]")


def test_local_paths_stay_plain_and_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n')
    assert not files.is_url("x.jsonl") and not files.is_url("/a/b://c") and files.is_url("hf://datasets/a/b/x.jsonl")
    (c,) = plan_chunks(["x.jsonl"])
    assert c.source == str(tmp_path / "x.jsonl")


def test_fingerprint_changes_with_the_contents(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("{}\n")
    st = os.stat(path)
    assert files.fingerprint(str(path)) == f"{path}|{st.st_size}|{st.st_mtime_ns}"
    url = f"rangetest://{tmp_path.name}/m.jsonl"
    RangeStore.objects[f"{tmp_path.name}/m.jsonl"] = b"{}\n"
    before = files.fingerprint(url)
    RangeStore.objects[f"{tmp_path.name}/m.jsonl"] = b'{"a": 1}\n'
    assert files.fingerprint(url) != before


def test_a_filesystem_failure_is_one_line_naming_the_input(monkeypatch):
    class NoCredentials(Exception):  # what botocore raises is not an OSError
        pass

    def refuse(self, path, **kwargs):
        raise NoCredentials("Unable to locate credentials")

    monkeypatch.setattr(RangeStore, "info", refuse)
    msg = _one_line_error(lambda: expand_inputs(["rangetest://bucket/x.jsonl"]), "cannot read input")
    assert msg == "cannot read input rangetest://bucket/x.jsonl: NoCredentials: Unable to locate credentials"
