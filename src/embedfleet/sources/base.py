"""What every reader yields, and the shared pieces: opening (de)compressed streams, splitting and parsing lines.

Fault semantics, the same for every reader:
- a UTF-8 BOM at the start of a file, CRLF line ends and a last line without a newline are normal;
- blank and whitespace-only lines are skipped silently but still count for line numbers;
- malformed JSON and a JSON value that is not an object are yielded with `error` set (they become
  rejects; nothing stops);
- invalid UTF-8 bytes are replaced with U+FFFD and the line is kept: one bad byte in a review
  should not lose the review, and the replacement character makes the damage visible.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO

import orjson

try:  # a declared dependency, but only .zst inputs need it: a slim install still reads everything else
    import zstandard
except ImportError:  # pragma: no cover
    zstandard = None

from embedfleet.errors import InputError
from embedfleet.sources.files import open_sequential

BOM = b"\xef\xbb\xbf"
_READ = 1 << 20
# What a truncated or corrupt .gz/.zst stream raises while being read.
STREAM_ERRORS = (OSError, EOFError, zlib.error) + ((zstandard.ZstdError,) if zstandard else ())
_TYPE_NAMES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


@dataclass(slots=True)
class RawRecord:
    source: str
    line: int
    data: dict | None  # the parsed object, or None when `error` is set
    raw: str  # the line's text (for rejects); a JSON rendering for Parquet/CSV rows
    error: str | None  # why this line is a reject, e.g. "malformed JSON: Unexpected character at column 12"


def open_binary(source: str, start: int = 0, end: int = -1) -> IO[bytes]:
    """The source's bytes, decompressed by suffix (.gz: gzip, multi-member; .zst: zstd, multi-frame). Of its
    stored bytes [start, end) (end -1: to its end): a part appended later is a member or frame of its own."""
    lower = source.lower()
    if lower.endswith(".zst") and zstandard is None:
        raise InputError(f"{source}: reading .zst needs the zstandard package (pip install zstandard)")
    raw = open_sequential(source)
    if start:
        raw.seek(start)
    if end >= 0:  # a file that grew since it was planned is read only as far as the plan says
        raw = io.BufferedReader(_Span(raw, end - start), _READ)
    if lower.endswith(".gz"):
        return _GzipReader(raw)
    if lower.endswith(".zst"):
        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=True)
    return raw


class _Span(io.RawIOBase):
    """The next `left` bytes of a raw stream, then its end."""

    def __init__(self, raw: IO[bytes], left: int):
        self._raw, self._left = raw, left

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self._left <= 0:
            return 0
        data = self._raw.read(min(len(b), self._left))
        b[:len(data)] = data
        self._left -= len(data)
        return len(data)

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            super().close()


class _GzipReader(gzip.GzipFile):
    """A GzipFile that also closes the file it reads (gzip.open does that only for a file it opened)."""

    def __init__(self, raw: IO[bytes]):
        super().__init__(fileobj=raw, mode="rb")
        self._raw = raw

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._raw.close()


def split_lines(blocks: Iterable[bytes]) -> Iterator[bytes]:
    """Lines of consecutive byte blocks without their "\\n"; memory is one block plus the longest line."""
    tail = b""
    for block in blocks:
        lines = (tail + block).split(b"\n") if tail else block.split(b"\n")
        tail = lines.pop()
        yield from lines
    if tail:
        yield tail


def iter_lines(stream: IO[bytes]) -> Iterator[bytes]:
    """Lines of a whole byte stream, read in fixed blocks."""
    return split_lines(iter(lambda: stream.read(_READ), b""))


def parse_line(source: str, number: int, line: bytes) -> RawRecord | None:
    """One JSONL line as a RawRecord; None for a blank line (skipped, but it was counted)."""
    if line.endswith(b"\r"):
        line = line[:-1]
    if not line or line.isspace():
        return None
    raw = line.decode("utf-8", "replace")
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        if raw.isspace():  # Unicode whitespace only (e.g. U+3000): blank too
            return None
        data, err = _parse_lenient(raw, e)
        if err:
            return RawRecord(source, number, None, raw, err)
    if type(data) is not dict:
        return RawRecord(source, number, None, raw, f"JSON value is {_type_name(data)}, not an object")
    return RawRecord(source, number, data, raw, None)


def _parse_lenient(text: str, orjson_error: orjson.JSONDecodeError) -> tuple[object, str | None]:
    """The rare lines orjson refuses but that hold a usable object: invalid UTF-8 bytes (already
    replaced in `text`), lone surrogate escapes (sanitized later) and integers beyond 64 bits.
    Else orjson's reason."""
    try:
        return json.loads(text), None
    except (ValueError, RecursionError):
        msg = orjson_error.msg
        return None, f"malformed JSON: {msg[:1].upper()}{msg[1:]} at column {orjson_error.colno}"


def _type_name(value: object) -> str:
    return "null" if value is None else _TYPE_NAMES.get(type(value), type(value).__name__)


def stream_error(path: str, line: int, err: Exception) -> InputError:
    """A truncated or corrupt compressed stream: the chunk fails with a message naming where."""
    return InputError(f"{path}: unreadable after line {line} (corrupt or truncated file?): {err}")
