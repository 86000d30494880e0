"""JSON Lines readers: a byte range of a plain file, or a whole compressed stream (.gz, .zst)."""

from __future__ import annotations

from collections.abc import Iterator

from embedfleet.sources.base import BOM, STREAM_ERRORS, RawRecord, iter_lines, open_binary, parse_line, stream_error
from embedfleet.sources.plan import ChunkSpec


def read_jsonl(spec: ChunkSpec, after_line: int = 0) -> Iterator[RawRecord]:
    """Records of lines numbered > `after_line` in the chunk's bytes [start, end)."""
    with open(spec.source, "rb") as f:
        f.seek(spec.start)
        yield from _records(spec.source, iter_lines(f, spec.end - spec.start), spec.first_line, after_line, spec.start == 0)


def read_stream(spec: ChunkSpec, after_line: int = 0) -> Iterator[RawRecord]:
    """Records of lines numbered > `after_line` in a whole compressed file."""
    number = after_line
    f = open_binary(spec.source)  # outside the try: a missing file is not a corrupt one
    try:
        with f:
            for rec in _records(spec.source, iter_lines(f), 1, after_line, True):
                number = rec.line
                yield rec
    except STREAM_ERRORS as e:
        raise stream_error(spec.source, number, e) from e


def _records(source: str, lines: Iterator[bytes], first: int, after_line: int, at_file_start: bool) -> Iterator[RawRecord]:
    for number, line in enumerate(lines, first):
        if number == 1 and at_file_start and line.startswith(BOM):
            line = line[3:]
        if number <= after_line:
            continue
        rec = parse_line(source, number, line)
        if rec is not None:
            yield rec
