"""What every reader yields, and the shared pieces: opening (de)compressed streams, splitting and parsing lines.

Fault semantics, the same for every reader:
- a UTF-8 BOM at the start of a file, CRLF line ends and a last line without a newline are normal;
- blank and whitespace-only lines are skipped silently but still count for line numbers;
- malformed JSON and a JSON value that is not an object are yielded with `error` set (they become
  rejects; nothing stops);
- invalid UTF-8 bytes are replaced with U+FFFD and the line is kept: one bad byte in a review
  should not lose the review, and the replacement character makes the damage visible;
- a compressed stream damaged or cut short yields its whole lines before the damage, then one reject saying
  where (a file copied or downloaded only in part keeps what arrived).
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
# Of those, what says the stream's own bytes are damaged: reading it again reads the same (not a lost connection).
DAMAGE_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile) + ((zstandard.ZstdError,) if zstandard else ())
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
        return io.BufferedReader(_ZstdFrames(raw), _READ)
    return raw


class _ZstdFrames(io.RawIOBase):
    """A zstd stream's frames one after another, raising where the stream ends inside a frame (zstandard's own
    stream reader ends there silently, so a truncated file read as a shorter one)."""

    def __init__(self, raw: IO[bytes]):
        self._raw, self._dctx, self._frame = raw, zstandard.ZstdDecompressor(), None
        self._out, self._at = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._at >= len(self._out):
            data = self._raw.read(_READ)
            if not data:
                if self._frame is not None and not self._frame.eof:
                    raise zstandard.ZstdError("the stream ends inside a frame")
                return 0
            self._out, self._at = self._decompress(data), 0
        n = min(len(b), len(self._out) - self._at)
        b[:n] = self._out[self._at:self._at + n]
        self._at += n
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            if self._frame is None or self._frame.eof:
                self._frame = self._dctx.decompressobj()
            out.append(self._frame.decompress(data))
            data = self._frame.unused_data if self._frame.eof else b""
        return b"".join(out)

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            super().close()


class Salvaging:
    """A decompressed stream read in pieces, so that the lines before a corrupt or truncated point are read before
    its error is raised (a plain `read(n)` drops the whole request's bytes with it)."""

    def __init__(self, stream: IO[bytes]):
        self._stream, self._error = stream, None

    def read(self, size: int) -> bytes:
        if self._error is not None:
            raise self._error
        parts, got = [], 0
        while got < size:
            try:
                piece = self._stream.read1(size - got)
            except STREAM_ERRORS as e:
                if not parts:
                    raise
                self._error = e
                break
            if not piece:
                break
            parts.append(piece)
            got += len(piece)
        return b"".join(parts)

    def __enter__(self) -> Salvaging:
        return self

    def __exit__(self, *exc) -> None:
        self._stream.close()


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


class DamagedStream(InputError):
    """A compressed stream whose bytes are damaged after `line`: a reader yields `reject` after the lines before
    it (they land; reading again would read the same)."""

    def __init__(self, message: str, source: str, line: int):
        super().__init__(message)
        self.reject = RawRecord(source, line + 1, None, "", message.removeprefix(f"{source}: "))


def stream_error(path: str, line: int, err: Exception) -> InputError:
    """A truncated or corrupt compressed stream, a message naming where; a DamagedStream where its bytes are."""
    message = f"{path}: unreadable after line {line} (corrupt or truncated file?): {err}"
    return DamagedStream(message, path, line) if isinstance(err, DAMAGE_ERRORS) else InputError(message)
