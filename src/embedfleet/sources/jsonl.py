"""JSON Lines readers: a byte range of a plain file, or a whole compressed stream (.gz, .zst).

A compressed stream can also be cut into blocks of whole lines (`stream_blocks`) whose records are
parsed elsewhere (`block_records`): the worker only decompresses and counts lines, its helper
processes parse.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from embedfleet.sources.base import (BOM, STREAM_ERRORS, DamagedStream, RawRecord, Salvaging, iter_lines, open_binary,
                                     parse_line, split_lines, stream_error)
from embedfleet.sources.files import read_range
from embedfleet.sources.plan import ChunkSpec


def read_jsonl(spec: ChunkSpec, after_line: int = 0) -> Iterator[RawRecord]:
    """Records of lines numbered > `after_line` in the chunk's bytes [start, end) (of a URL: a ranged read)."""
    lines = split_lines(read_range(spec.source, spec.start, spec.end))
    yield from _records(spec.source, lines, spec.first_line, after_line, spec.start == 0)


def read_stream(spec: ChunkSpec, after_line: int = 0) -> Iterator[RawRecord]:
    """Records of lines numbered > `after_line` in a compressed chunk (a whole file, or a part appended later);
    where its bytes are damaged, the lines before and a reject saying where."""
    number = after_line
    f = Salvaging(open_binary(spec.source, spec.start, spec.end))  # outside the try: a missing file is not corrupt
    try:
        with f:
            for rec in _records(spec.source, iter_lines(f), spec.first_line, after_line, spec.start == 0):
                number = rec.line
                yield rec
    except STREAM_ERRORS as e:
        err = stream_error(spec.source, number, e)
        if not isinstance(err, DamagedStream):
            raise err from e
        yield err.reject


def stream_blocks(spec: ChunkSpec, after_line: int = 0,
                  block_bytes: int | Iterator[int] = 2 << 20) -> Iterator[tuple[int, bytes]]:
    """(first line number, block of whole lines) of about `block_bytes` each (or each the next of an
    iterator of sizes) from a compressed chunk, skipping blocks whose lines are all <= `after_line`.
    The last block may lack a final newline. Damaged bytes raise DamagedStream after the whole lines before them."""
    sizes = itertools.repeat(block_bytes) if isinstance(block_bytes, int) else block_bytes
    size = next(sizes)  # the next size is drawn once a block is yielded: blocks skipped on resume take none
    number = spec.first_line  # the first line of the next block
    f = Salvaging(open_binary(spec.source, spec.start, spec.end))  # outside the try: a missing file is not corrupt
    try:
        with f:
            tail = b""
            while block := f.read(size):
                block = tail + block if tail else block
                cut = block.rfind(b"\n") + 1
                if cut == 0:  # one line longer than a block: keep reading
                    tail = block
                    continue
                block, tail = block[:cut], block[cut:]
                count = block.count(b"\n")
                if number + count - 1 > after_line:
                    yield number, block
                    size = next(sizes)
                number += count
            if tail and number > after_line:
                yield number, tail
    except STREAM_ERRORS as e:
        raise stream_error(spec.source, number - 1, e) from e


def block_lines(block: bytes) -> int:
    """How many lines a block from `stream_blocks` holds."""
    return block.count(b"\n") + (0 if block.endswith(b"\n") else 1)


def block_records(source: str, first_line: int, block: bytes, after_line: int = 0) -> Iterator[RawRecord]:
    """The records of a block from `stream_blocks`, exactly as `read_stream` would yield them."""
    lines = block.split(b"\n")
    if block.endswith(b"\n"):
        lines.pop()
    yield from _records(source, iter(lines), first_line, after_line, first_line == 1)


def _records(source: str, lines: Iterator[bytes], first: int, after_line: int, at_file_start: bool) -> Iterator[RawRecord]:
    for number, line in enumerate(lines, first):
        if number == 1 and at_file_start and line.startswith(BOM):
            line = line[3:]
        if number <= after_line:
            continue
        rec = parse_line(source, number, line)
        if rec is not None:
            yield rec
