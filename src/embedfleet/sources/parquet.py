"""Parquet reader: a chunk is a run of row groups, streamed in record batches, rows as dicts."""

from __future__ import annotations

from collections.abc import Iterator

import orjson
import pyarrow.parquet as pq

from embedfleet.sources.base import RawRecord, stream_error
from embedfleet.sources.files import is_url, open_random
from embedfleet.sources.plan import ChunkSpec

_BATCH_ROWS = 4096


def read_parquet(spec: ChunkSpec, after_line: int = 0) -> Iterator[RawRecord]:
    """Records of rows numbered > `after_line` in row groups [start, end)."""
    if spec.end <= spec.start:  # no row group (a file emptied, replaced): nothing to open
        return
    number = spec.first_line  # number of the next row
    f = open_random(spec.source) if is_url(spec.source) else None
    try:
        pf = pq.ParquetFile(spec.source if f is None else f)
        for batch in pf.iter_batches(batch_size=_BATCH_ROWS, row_groups=range(spec.start, spec.end)):
            if number + batch.num_rows - 1 <= after_line:  # resume: skip without converting
                number += batch.num_rows
                continue
            for row in batch.to_pylist():
                if number > after_line:
                    yield RawRecord(spec.source, number, row, orjson.dumps(row, default=str).decode(), None)
                number += 1
    except FileNotFoundError:  # a missing file is not a corrupt one
        raise
    except (OSError, ValueError) as e:  # pyarrow's errors derive from these
        raise stream_error(spec.source, number - 1, e) from e
    finally:
        if f is not None:
            f.close()
