"""What changed in a job's input files since they were planned: files never planned, bytes appended to planned
ones, and planned bytes that changed.

A rerun plans the first two as new chunks and refuses the third: rows embedded from bytes that are no longer
there would silently disagree with the file (`--replace PATH` embeds such a file again). A file is recognised
by its stamp (size and modification time) without reading it; past that, by a digest of the bytes planned: all
of them up to `WHOLE`, else its first and last MiB and `BLOCKS` blocks spread between (an edit inside a large
file that keeps its size and misses every sampled block goes unseen).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from embedfleet.errors import InputError
from embedfleet.sources import files
from embedfleet.sources.base import STREAM_ERRORS, open_binary
from embedfleet.sources.plan import ChunkSpec, compressed, input_kind

__all__ = ["PlannedFile", "Survey", "appended_from", "digest", "planned_file", "next_line", "survey", "changed_line"]

WHOLE = 16 << 20
EDGE = 1 << 20
BLOCK = 64 << 10
BLOCKS = 32
_COUNT = 4 << 20


@dataclass(frozen=True)
class PlannedFile:
    """An input file as far as its job planned it."""

    source: str
    kind: str
    size: int  # bytes planned
    stamp: str | None  # files.fingerprint when planned: the same stamp is the same file, unread
    digest: str  # of the bytes planned (`digest`)


@dataclass
class Survey:
    new: list[str]  # inputs never planned
    grown: list[tuple[PlannedFile, int]]  # planned files that gained bytes, with their size now
    changed: list[tuple[str, str]]  # planned files whose planned bytes changed: (source, what changed)


def digest(source: str, size: int) -> str:
    """A digest of the source's first `size` bytes (sampled past `WHOLE`)."""
    h = hashlib.sha256(str(size).encode())
    if size <= WHOLE:
        spans = [(0, size)]
    else:
        step = (size - 2 * EDGE) // (BLOCKS + 1)
        spans = [(0, EDGE)] + [(EDGE + step * (i + 1), EDGE + step * (i + 1) + BLOCK) for i in range(BLOCKS)]
        spans.append((size - EDGE, size))
    for start, end in spans:
        for block in files.read_range(source, start, end):
            h.update(block)
    return h.hexdigest()[:32]


def planned_file(source: str, chunks: list[ChunkSpec]) -> PlannedFile:
    """The record of `source` as just planned into `chunks` (its chunks; none for an empty file)."""
    kind = input_kind(source)
    size = max((c.end for c in chunks), default=0) if kind in ("jsonl", "stream", "csv") else files.size(source)
    return PlannedFile(source, kind, size, files.fingerprint(source), digest(source, size))


def survey(planned: dict[str, PlannedFile], inputs: list[str], replace: frozenset[str] = frozenset()) -> Survey:
    """Sort the job's inputs into new, grown and changed (a file it planned that the inputs no longer match is
    left alone, and so is one that is gone). A file in `replace` is none of these: the caller plans it anew."""
    out = Survey([], [], [])
    for source in inputs:
        if source not in planned and source not in replace:
            out.new.append(source)
    for source in inputs:
        p = planned.get(source)
        if p is None or source in replace:
            continue
        try:
            stamp = files.fingerprint(source)
            if stamp == p.stamp:
                continue
            size = files.size(source)
            why = _changed(p, size)
        except FileNotFoundError:
            continue
        if why:
            out.changed.append((source, why))
        elif size > p.size:
            out.grown.append((p, size))
    return out


def changed_line(source: str, why: str, remedy: str | None = None) -> str:
    """One line for a planned file changed where it was embedded: what changed, and how to embed it again (`remedy`;
    by default --replace)."""
    return (f"{source} changed where it was already embedded ({why}); "
            f"{remedy or f'to embed it again, rerun the same command with --replace {source}'}")


def _changed(p: PlannedFile, size: int) -> str | None:
    if size < p.size:
        return f"it has {size:,} bytes, {p.size:,} were planned"
    if digest(p.source, p.size) != p.digest:
        return f"its first {p.size:,} bytes differ from those planned"
    if size > p.size and p.kind == "parquet":
        return "a Parquet file cannot be appended to"
    if size > p.size and _lines_in_bytes(p) and p.size and _last_byte(p) != b"\n" and not _ending(p):
        return "its last planned line was continued"
    return None


def _lines_in_bytes(p: PlannedFile) -> bool:
    """Whether the file's own bytes are its lines: a plain JSONL or CSV file, not a compressed one (an appended gzip
    member or zstd frame is planned from its own first byte, as its own lines)."""
    return p.kind == "jsonl" or p.kind == "csv" and not compressed(p.source)


def appended_from(p: PlannedFile) -> tuple[int, int]:
    """(the byte the appended part starts at, lines to add to its first line's number): where the file's last
    planned line had no newline and the append begins with one, that newline ends the planned line (a file
    written without a final newline, then appended to)."""
    if not _lines_in_bytes(p) or not p.size or _last_byte(p) == b"\n":
        return p.size, 0
    ending = _ending(p)
    return p.size + ending, 1 if ending else 0


def _last_byte(p: PlannedFile) -> bytes:
    return b"".join(files.read_range(p.source, p.size - 1, p.size))


def _ending(p: PlannedFile) -> int:
    """The bytes of the line ending the file has just past what was planned (0: none there)."""
    after = b"".join(files.read_range(p.source, p.size, p.size + 2))
    return 1 if after.startswith(b"\n") else 2 if after == b"\r\n" else 0


def next_line(last: ChunkSpec) -> int:
    """The line a part appended after `last` (its file's last chunk) starts on: the line of the chunk's
    first byte, on by the chunk's newlines (a compressed chunk's, decompressed)."""
    if last.kind == "parquet":
        from embedfleet.sources.plan import chunk_lines

        return last.first_line + chunk_lines(last, 1 << 62)
    first = 1 if last.kind == "csv" and last.start == 0 else last.first_line  # a CSV's header is its line 1
    newlines = 0
    try:
        with open_binary(last.source, last.start, last.end) as f:
            while block := f.read(_COUNT):
                newlines += block.count(b"\n")
    except STREAM_ERRORS as e:
        raise InputError(f"{last.source}: cannot count the lines planned before (corrupt or truncated?): {e}") from e
    return first + newlines
