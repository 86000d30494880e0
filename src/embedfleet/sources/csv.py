"""CSV reader (.csv, .csv.gz, .csv.zst): the header row names the fields, every value is a string.

`line` is the line where a record starts, as an editor numbers the file's lines (the header is line 1,
so the first data row is line 2; a quoted field may run over several lines). Blank lines are skipped.
Every record is a row or a reject, so rows + rejects are the file's records:
- a row whose field count differs from the header's is a reject, wherever it stands;
- a quote that does not close where a field ends (a stray `"`) makes its line a reject, and the lines
  after it are read again as records of their own instead of being swallowed into one field.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from typing import IO

import orjson

from embedfleet.errors import InputError
from embedfleet.sources.base import STREAM_ERRORS, DamagedStream, RawRecord, open_binary, stream_error
from embedfleet.sources.plan import ChunkSpec

# Review texts are long; the csv module's default 128 KiB field limit would fail whole files.
csv.field_size_limit(2**31 - 1)

class _Lines:
    """A text stream's lines for csv.reader, counted, with the lines of the record being read kept so that
    all but the first can be read again."""

    def __init__(self, text: IO[str]):
        self._text, self._back = text, []
        self.number = 0  # lines handed out so far
        self.taken: list[str] = []

    def __iter__(self) -> "_Lines":
        return self

    def __next__(self) -> str:
        line = self._back.pop() if self._back else next(self._text)
        self.number += 1
        self.taken.append(line)
        return line

    def rewind(self, lines: list[str]) -> None:
        self._back.extend(reversed(lines))
        self.number -= len(lines)


def _records(lines: _Lines) -> Iterator[tuple[int, list[str] | None, str, str | None]]:
    """(line the record starts on, its fields or None, its text, why it is a reject or None), header first."""
    reader = csv.reader(lines, strict=True)
    while True:
        lines.taken = []
        start = lines.number + 1
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            taken = lines.taken
            yield start, None, (taken[0] if taken else "").rstrip("\r\n"), \
                f"malformed CSV quoting ({e}); the lines after it are read as records of their own"
            lines.rewind(taken[1:])
            reader = csv.reader(lines, strict=True)  # a fresh one: the last stopped inside a field
            continue
        yield start, row, "".join(lines.taken).rstrip("\r\n"), None


def _text(stream: IO[bytes]) -> IO[str]:
    return io.TextIOWrapper(stream, encoding="utf-8-sig", errors="replace", newline="")


def _header(source: str) -> list[str] | None:
    with open_binary(source) as f:
        return _open(f)[1]


def _open(stream: IO[bytes]) -> tuple[_Lines, list[str] | None]:
    """The stream's lines (a BOM dropped, bad UTF-8 replaced) and its header (None: an empty file)."""
    lines = _Lines(_text(stream))
    records = _records(lines)
    for _, header, _, error in records:
        if error is not None:
            raise csv.Error(f"the header row is malformed: {error.split(';')[0]}")
        if header:  # blank lines before the header are skipped
            return lines, unique_names(header)
    return lines, None


def unique_names(header: list[str]) -> list[str]:
    """A header's names, a name given again numbered (`dup`, `dup_2`): each column keeps its values (as a dict's
    key the last one alone was kept)."""
    seen: dict[str, int] = {}
    out = []
    for name in header:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out


def read_csv(spec: ChunkSpec, after_line: int = 0) -> Iterator[RawRecord]:
    """Records starting on lines > `after_line`."""
    line = 0
    f = open_binary(spec.source, spec.start, spec.end)  # outside the try: a missing file is not a corrupt one
    try:
        with f:
            lines, header = _chunk_lines(spec, f)
            if header is None:
                return
            for line, row, text, error in _records(lines):
                if line <= after_line:
                    continue
                if error is not None:
                    yield RawRecord(spec.source, line, None, text, error)
                elif any(v.strip() for v in row):
                    yield _record(spec.source, line, header, row, text)
    except csv.Error as e:
        if line == 0:
            raise InputError(f"{spec.source}: {e}") from e
        raise stream_error(spec.source, line, e) from e
    except STREAM_ERRORS as e:
        err = stream_error(spec.source, line, e)
        if not isinstance(err, DamagedStream):
            raise err from e
        yield err.reject  # the rows before the damage were read


def _chunk_lines(spec: ChunkSpec, f: IO[bytes]) -> tuple["_Lines", list[str] | None]:
    """A chunk's lines and the file's header (None: the file has none). A part appended later has the file's
    header, and its lines are numbered on from the plan's."""
    if spec.start == 0:
        return _open(f)
    lines = _Lines(_text(f))
    lines.number = spec.first_line - 1
    return lines, _header(spec.source)


def data_rows(stream: IO[bytes], most: int) -> int:
    """The lines of a CSV stream after its header (blank ones included, counted like blank JSONL lines),
    read no further than the first past `most`: what --limit counts."""
    lines, header = _open(stream)
    if header is None:
        return 0
    first = lines.number
    for _ in lines:
        if lines.number - first > most:
            break
    return lines.number - first


def record_cap(spec: ChunkSpec, most: int, last_line: int | None = None) -> tuple[int, int | None]:
    """(records read, the line the `most`-th starts on; None when the chunk holds fewer): where --limit's cap
    falls in a CSV chunk, whose records may run over several lines. Blank lines count, as blank JSONL lines do.
    `last_line`: records starting after it are not read (an earlier --limit's cap)."""
    n = 0
    try:
        with open_binary(spec.source, spec.start, spec.end) as stream:
            lines, header = _chunk_lines(spec, stream)
            if header is None:
                return 0, None
            for line, *_ in _records(lines):
                if last_line is not None and line > last_line:
                    break
                n += 1
                if n == most:
                    return n, line
    except (csv.Error, *STREAM_ERRORS):  # damaged: what was read counts (the reader says where)
        pass
    return n, None


def _record(source: str, line: int, header: list[str], row: list[str], text: str) -> RawRecord:
    if len(row) != len(header):
        return RawRecord(source, line, None, text, f"CSV row has {len(row)} fields, the header has {len(header)}")
    data = dict(zip(header, row))
    return RawRecord(source, line, data, orjson.dumps(data).decode(), None)
