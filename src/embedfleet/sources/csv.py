"""CSV reader (.csv, .csv.gz, .csv.zst): the header row names the fields, every value is a string.

`line` is the 1-based data row number (the header is row 0; blank rows are skipped but counted,
like blank JSONL lines). A row whose field count differs from the header's is a reject.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from typing import IO

import orjson

from embedfleet.sources.base import STREAM_ERRORS, RawRecord, open_binary, stream_error
from embedfleet.sources.plan import ChunkSpec

# Review texts are long; the csv module's default 128 KiB field limit would fail whole files.
csv.field_size_limit(2**31 - 1)


def read_csv(spec: ChunkSpec, after_line: int = 0) -> Iterator[RawRecord]:
    """Records of data rows numbered > `after_line`."""
    number = 0
    f = open_binary(spec.source)  # outside the try: a missing file is not a corrupt one
    try:
        with f:
            rows = _rows(f)
            header = next(rows, None)
            if header is None:
                return
            for number, row in enumerate(rows, 1):
                if number <= after_line or not any(v.strip() for v in row):
                    continue
                yield _record(spec.source, number, header, row)
    except (csv.Error, *STREAM_ERRORS) as e:
        raise stream_error(spec.source, number, e) from e


def data_rows(stream: IO[bytes], most: int) -> int:
    """The data rows of a CSV stream, blank ones included (counted like blank JSONL lines), read no
    further than the first past `most`."""
    rows = _rows(stream)
    number = 0
    if next(rows, None) is not None:
        for number, _ in enumerate(rows, 1):
            if number > most:
                break
    return number


def _rows(stream: IO[bytes]) -> Iterator[list[str]]:
    """The stream's rows, header first (a BOM dropped, bad UTF-8 replaced, quoted newlines kept in their field)."""
    return csv.reader(io.TextIOWrapper(stream, encoding="utf-8-sig", errors="replace", newline=""))


def _record(source: str, number: int, header: list[str], row: list[str]) -> RawRecord:
    if len(row) != len(header):
        raw = orjson.dumps(row).decode()
        return RawRecord(source, number, None, raw, f"CSV row has {len(row)} fields, the header has {len(header)}")
    data = dict(zip(header, row))
    return RawRecord(source, number, data, orjson.dumps(data).decode(), None)
