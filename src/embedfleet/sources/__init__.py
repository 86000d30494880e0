"""Inputs (local paths or fsspec URLs): plan chunks over files, then stream a chunk's records.
No database, no torch here."""

from __future__ import annotations

from collections.abc import Iterator

from embedfleet.errors import InputError
from embedfleet.sources.base import RawRecord
from embedfleet.sources.csv import read_csv
from embedfleet.sources.jsonl import read_jsonl, read_stream
from embedfleet.sources.parquet import read_parquet
from embedfleet.sources.plan import ChunkSpec, expand_inputs, input_kind, plan_chunks, table_name_for

__all__ = [
    "ChunkSpec",
    "RawRecord",
    "expand_inputs",
    "input_kind",
    "plan_chunks",
    "read_chunk",
    "table_name_for",
]

_READERS = {"jsonl": read_jsonl, "stream": read_stream, "parquet": read_parquet, "csv": read_csv}


def read_chunk(spec: ChunkSpec, after_line: int = 0) -> Iterator[RawRecord]:
    """Stream the chunk's records whose line number is > `after_line` (the resume cursor)."""
    reader = _READERS.get(spec.kind)
    if reader is None:
        raise InputError(f"{spec.source}: unknown chunk kind {spec.kind!r}")
    try:
        yield from reader(spec, after_line)
    except FileNotFoundError as e:
        raise InputError(f"input not found: {spec.source} (moved or deleted since the job was planned?)") from e
