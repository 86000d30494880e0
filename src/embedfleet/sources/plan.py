"""Planning: turn inputs (local paths or fsspec URLs, see files.py) into chunks a worker can claim.

Pure apart from reading files to find boundaries: the same files and `chunk_bytes` always give the
same chunks, so a re-run of a job finds the ledger's chunks again. A plain JSONL file is cut at
newline-aligned byte offsets and its lines counted, so every chunk knows the physical number of its
first line (rejects and resume cursors name real lines): a local file by seeking to each cut, then
counting each chunk's newlines on threads side by side; a URL in one streaming pass. Compressed streams
and CSV cannot be entered mid-way and are one chunk each; Parquet is cut at row-group boundaries.
"""

from __future__ import annotations

import csv
import logging
import os
import posixpath
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from embedfleet.errors import InputError
from embedfleet.sources import files
from embedfleet.sources.base import STREAM_ERRORS, open_binary

log = logging.getLogger(__name__)

_BLOCK = 4 << 20  # read size while counting lines: big blocks keep the count in C
_CUT_READ = 64 << 10  # read size while looking for the newline after a cut's mark: a few lines
# Threads counting a local file's chunks (numpy counts without the GIL): on one thread a big input's plan
# kept every GPU waiting for seconds (docs/decisions/prestart-workers.md).
_COUNTERS = min(8, os.cpu_count() or 1)
_JSONL = (".jsonl", ".ndjson", ".jsonlines", ".json")
_COMPRESSED = (".gz", ".zst")
_PARQUET = (".parquet", ".pq")
_CSV = (".csv",)
CSV_FIRST_LINE = 2  # a CSV file's first data line, after a header of one line (where --limit counts from)
SUPPORTED = ".jsonl .ndjson .jsonlines .json (each optionally .gz or .zst), .parquet .pq, .csv (optionally .gz or .zst)"


@dataclass(frozen=True)
class ChunkSpec:
    source: str  # absolute path, or URL
    kind: str  # "jsonl" | "stream" (compressed jsonl) | "parquet" | "csv"
    start: int  # byte offset (jsonl) | first row group (parquet) | 0
    end: int  # exclusive byte end (jsonl) | exclusive row-group end (parquet) | -1 = to end of stream
    first_line: int  # 1-based line (jsonl/stream) or data row (parquet/csv) number of the chunk's first item


def _split_suffixes(path: str | os.PathLike) -> tuple[str, str, str]:
    """(stem, format suffix, compression suffix), matched case-insensitively; "" where absent."""
    name = Path(path).name
    lower = name.lower()
    comp = next((c for c in _COMPRESSED if lower.endswith(c)), "")
    rest = lower[: len(lower) - len(comp)]
    fmt = next((f for f in _JSONL + _PARQUET + _CSV if rest.endswith(f)), "")
    return name[: len(rest) - len(fmt)], fmt, comp


def compressed(path: str | os.PathLike) -> bool:
    """Whether the file's name says it is compressed (.gz, .zst)."""
    return bool(_split_suffixes(path)[2])


def input_kind(path: str | os.PathLike) -> str:
    """"jsonl", "stream", "parquet" or "csv", from the file name's suffixes."""
    _, fmt, comp = _split_suffixes(path)
    if fmt in _JSONL:
        return "stream" if comp else "jsonl"
    if fmt in _CSV:
        return "csv"
    if fmt in _PARQUET and not comp:
        return "parquet"
    raise InputError(f"unsupported input file type: {path} (supported: {SUPPORTED})")


def table_name_for(path: str | os.PathLike) -> str:
    """The file name without its known suffixes: "reviews.jsonl.gz" -> "reviews"."""
    stem, fmt, comp = _split_suffixes(path)
    return stem if fmt else Path(path).name[: len(Path(path).name) - len(comp)]


def expand_inputs(inputs: list[str]) -> list[str]:
    """Absolute, sorted, de-duplicated file paths and URLs; globs (with ** recursion) are expanded,
    on URLs too ("s3://bucket/wiki/*.parquet"). A file named by its path and by a file:// URL is kept once, as
    first named."""
    found: dict[str, str] = {}
    for item in inputs:
        for source in files.expand(item):
            found.setdefault(files.same_file(source), source)
    return sorted(found.values())


def id_root(sources: list[str]) -> str:
    """What every input has in common: the folder (or URL prefix) below which default ids name a file, so
    that d1/data.jsonl and d2/data.jsonl cannot give the same id. One input's root is its own folder."""
    if not sources:
        return ""
    heads = {s.split("://", 1)[0] + "://" + s.split("://", 1)[1].split("/", 1)[0] if files.is_url(s) else ""
             for s in sources}
    if len(heads) != 1:  # local paths beside URLs, or URLs of several hosts: ids carry the whole source
        return ""
    (head,) = heads
    folders = [posixpath.dirname(s[len(head):]) or "/" for s in sources]
    common = posixpath.commonpath(folders) if all(f.startswith("/") for f in folders) else ""
    return head + common


def id_name(source: str, root: str) -> str:
    """The name a default id gives `source`: its path below `root` ("d1/data.jsonl"), or the whole source
    where `root` does not hold it."""
    prefix = root if root.endswith("/") else root + "/"
    if root and source.startswith(prefix) and len(source) > len(prefix):
        return source[len(prefix):]
    return source


def plan_chunks(paths: list[str], chunk_bytes: int = 8 << 20) -> list[ChunkSpec]:
    """Chunks for every path, in path order; empty files give none."""
    if chunk_bytes < 1:
        raise InputError(f"chunk size must be at least 1 byte, got {chunk_bytes}")
    chunks: list[ChunkSpec] = []
    with ThreadPoolExecutor(_COUNTERS, thread_name_prefix="embedfleet-plan") as counters:
        for path in paths:
            chunks.extend(plan_file(files.absolute(path), chunk_bytes, counters=counters))
    return chunks


def plan_file(path: str, chunk_bytes: int, start: int = 0, first_line: int | None = None,
              counters: ThreadPoolExecutor | None = None) -> list[ChunkSpec]:
    """The chunks of `path`'s bytes from `start` on: the whole file, or (`start` > 0) a part appended since
    it was planned, its lines numbered on from `first_line`. A compressed file's or a CSV file's part is
    one chunk, which ends where the file ended when planned."""
    kind = input_kind(path)
    try:
        size = files.size(path)
        if size <= start:
            return []
        if start == 0 and kind in ("jsonl", "stream", "csv") and not files.is_url(path):
            _check_utf8(path)
        if kind == "jsonl" and not files.is_url(path):
            if counters is None:
                with ThreadPoolExecutor(_COUNTERS, thread_name_prefix="embedfleet-plan") as own:
                    return _local_jsonl_chunks(path, chunk_bytes, own, start, first_line or 1)
            return _local_jsonl_chunks(path, chunk_bytes, counters, start, first_line or 1)
        if kind == "jsonl":
            return _jsonl_chunks(path, chunk_bytes, start, first_line or 1)
        if kind == "parquet":
            return _parquet_chunks(path, chunk_bytes)
        # a CSV file's lines are numbered as an editor shows them: its data start after the header
        return [ChunkSpec(path, kind, start, size, first_line or (CSV_FIRST_LINE if kind == "csv" else 1))]
    except OSError as e:
        raise InputError(f"cannot read input {path}: {e.strerror or e}") from e


_SNIFF = 1 << 20  # how much of a text file is read for its encoding
_WIDE_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
              (b"\xfe\xff", "UTF-16"))


def _check_utf8(path: str) -> None:
    """A text file in UTF-16 or UTF-32 (by its byte-order mark) is refused in one line: read as UTF-8, each of its
    records would be a reject that does not say why. One whose first MiB has lines that are not UTF-8 (Latin-1,
    Windows-1252) is said once: those bytes are stored as U+FFFD, which no search then finds."""
    with open(path, "rb") as f:
        head = f.read(4)
    converted = f"{Path(path).stem}.utf8{''.join(Path(path).suffixes)}"
    for bom, name in _WIDE_BOMS:
        if head.startswith(bom):
            raise InputError(f"{path}: is {name} (it starts with a {name} byte-order mark); embedfleet reads UTF-8: "
                             f"convert it first, e.g. iconv -f {name} -t UTF-8 {path} > {converted}")
    bad = not_utf8_lines(path)
    if bad:
        more = f" (and {len(bad) - 1} more of its first MiB's lines)" if len(bad) > 1 else ""
        log.warning("%s: line %d%s has bytes that are not UTF-8, stored as U+FFFD; if the file is Latin-1 or "
                    "Windows-1252, convert it first: iconv -f WINDOWS-1252 -t UTF-8 %s > %s", path, bad[0], more,
                    path, converted)


def not_utf8_lines(path: str, most: int = _SNIFF) -> list[int]:
    """The numbers of the lines, among the whole ones in the first `most` bytes of `path` (decompressed), that
    are not UTF-8."""
    try:
        with open_binary(path) as stream:
            sample = stream.read(most)
    except (OSError, *STREAM_ERRORS):  # unreadable or damaged: the reader says where
        return []
    if len(sample) == most:
        sample = sample[:sample.rfind(b"\n") + 1]
    try:
        sample.decode("utf-8")
        return []
    except UnicodeDecodeError:
        pass
    out = []
    for number, line in enumerate(sample.split(b"\n"), 1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:
            out.append(number)
    return out


def chunk_lines(spec: ChunkSpec, most: int) -> int | None:
    """The lines `spec` holds (data rows for Parquet and CSV; none for a damaged stream), or None if more
    than `most`. Reads only as far as `most` needs: --limit's count across inputs whose lengths the plan
    does not know."""
    if spec.kind == "parquet":
        meta = _parquet_metadata(spec.source)
        n = sum(meta.row_group(g).num_rows for g in range(spec.start, spec.end))
    elif spec.kind == "jsonl":
        n = _lines(files.read_range(spec.source, spec.start, spec.end, _BLOCK), most)
    else:
        from embedfleet.sources.csv import data_rows  # here: that module reads ChunkSpec from this one

        try:
            with open_binary(spec.source, spec.start, spec.end) as stream:
                n = (data_rows(stream, most) if spec.kind == "csv" and spec.start == 0
                     else _lines(iter(lambda: stream.read(_BLOCK), b""), most))
        except (csv.Error, *STREAM_ERRORS):  # damaged: counted as none (the reader says where); the next input counts
            n = 0
    return n if n <= most else None


def _lines(blocks, most: int) -> int:
    """Lines in `blocks` (a last one without a newline counts), or more than `most` once past it."""
    n, last = 0, b"\n"
    for block in blocks:
        n += block.count(b"\n")
        last = block[-1:] or last
        if n > most:
            return n
    return n + (last != b"\n")


def _local_jsonl_chunks(path: str, chunk_bytes: int, counters: ThreadPoolExecutor, start: int = 0,
                        first_line: int = 1) -> list[ChunkSpec]:
    """`_jsonl_chunks`' chunks for a local file: the cuts found by seeking to each mark (a few lines read
    for each), then every chunk's newlines but the last's counted on `counters`."""
    size = os.path.getsize(path)
    cuts = []
    with open(path, "rb") as f:
        while start < size:
            end = _line_end(f, start + chunk_bytes - 1, size)
            cuts.append((start, end))
            start = end
    counts = counters.map(lambda cut: _newlines(path, *cut), cuts[:-1])  # nothing is numbered after the last
    out = []
    for (start, end), n in zip(cuts, [*counts, 0]):
        out.append(ChunkSpec(path, "jsonl", start, end, first_line))
        first_line += n
    return out


def _line_end(f, mark: int, size: int) -> int:
    """The offset just past the first newline at or after `mark` in open file `f`, or `size` if none."""
    if mark >= size:  # a chunk as big as the file (the meta loader asks 2**62 bytes: past any seek)
        return size
    f.seek(mark)
    pos = mark
    while block := f.read(_CUT_READ):
        j = block.find(b"\n")
        if j >= 0:
            return pos + j + 1
        pos += len(block)
    return size


def _newlines(path: str, start: int, end: int) -> int:
    """Newlines in bytes [start, end) of a local file, counted without the GIL (unlike bytes.count)."""
    return sum(int(np.count_nonzero(np.frombuffer(block, np.uint8) == 10))
               for block in files.read_range(path, start, end, _BLOCK))


def _jsonl_chunks(path: str, chunk_bytes: int, start: int = 0, first_line: int = 1) -> list[ChunkSpec]:
    """Cut after the first newline at or past each `chunk_bytes` mark, counting lines on the way.

    Memory stays at one block however long the lines are; a chunk is never shorter than
    `chunk_bytes` except the last, and a line longer than a chunk simply makes its chunk longer.
    """
    out: list[ChunkSpec] = []
    newlines = first_line - 1  # newlines before `pos`
    pos = start  # file offset of block[0]
    for block in files.read_range(path, start, None, _BLOCK):
        i = 0  # position in block up to which newlines are counted
        while True:
            j = block.find(b"\n", max(start + chunk_bytes - 1 - pos, i))
            if j < 0:
                newlines += block.count(b"\n", i)
                break
            newlines += block.count(b"\n", i, j + 1)
            end = pos + j + 1
            out.append(ChunkSpec(path, "jsonl", start, end, first_line))
            start, first_line, i = end, newlines + 1, j + 1
        pos += len(block)
    if start < pos:
        out.append(ChunkSpec(path, "jsonl", start, pos, first_line))
    return out


def _parquet_chunks(path: str, chunk_bytes: int) -> list[ChunkSpec]:
    """Consecutive row groups whose uncompressed size adds up to about `chunk_bytes`."""
    meta = _parquet_metadata(path)
    out: list[ChunkSpec] = []
    group_start, size, row, first_row = 0, 0, 1, 1
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        size += rg.total_byte_size
        row += rg.num_rows
        if size >= chunk_bytes or g == meta.num_row_groups - 1:
            if row > first_row:  # skip runs of empty row groups
                out.append(ChunkSpec(path, "parquet", group_start, g + 1, first_row))
            group_start, size, first_row = g + 1, 0, row
    return out


def _parquet_metadata(path: str) -> pq.FileMetaData:
    try:
        if files.is_url(path):
            with files.open_random(path) as f:
                return pq.ParquetFile(f).metadata
        return pq.ParquetFile(path).metadata
    except FileNotFoundError:
        raise
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError variants for non-parquet bytes
        raise InputError(f"cannot read Parquet file {path}: {e}") from e
