"""Rows in PostgreSQL's binary COPY format, built in bulk and off the worker's main process.

A unit's rows are encoded where the unit is prepared (a helper process), with every column but the
embedding, which is placed last in the COPY column list. Once the vectors come back from the GPU,
`assemble` interleaves each row's bytes with its vector's bytes: the worker ships one buffer per
unit to the server and never touches a row's values. Values are dumped by psycopg's own binary
dumpers; only the framing (a field count, then a length before each field) is done here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import orjson
from psycopg import postgres
from psycopg.adapt import PyFormat, Transformer
from psycopg.pq import Format
from psycopg.types.json import set_json_dumps

try:  # psycopg's own writer of one binary COPY row (C in psycopg[binary]); not public API, hence the fallback
    from psycopg._copy_base import format_row_binary
except ImportError:  # pragma: no cover - a psycopg that moved it: RowEncoder frames rows itself
    format_row_binary = None

# psycopg's type names for our column types.
COPY_TYPES = {
    "text": "text", "real": "float4", "double precision": "float8", "numeric": "numeric", "integer": "int4",
    "bigint": "int8",
    "boolean": "bool", "timestamptz": "timestamptz", "date": "date", "jsonb": "jsonb", "text[]": "text[]",
}
SIGNATURE = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)  # magic, flags, header extension length
TRAILER = struct.pack(">h", -1)
_NULL = struct.pack(">i", -1)
_INT4 = struct.Struct(">i").pack


def _orjson_dumps(obj) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)


set_json_dumps(_orjson_dumps)  # jsonb values: orjson, in every process that encodes rows


@dataclass
class EncodedRows:
    """`n` rows back to back in `blob`; row i is blob[offsets[i]:offsets[i + 1]], its field count
    already including the embedding that `assemble` appends."""

    blob: bytes | np.ndarray  # any contiguous bytes-like buffer (uint8 when read back from a helper)
    offsets: np.ndarray  # int64 [n + 1]

    @property
    def n(self) -> int:
        return len(self.offsets) - 1


class RowEncoder:
    """Encodes rows of values for columns of the given psycopg type names, plus one trailing vector."""

    def __init__(self, types: Sequence[str]):
        self._tx = Transformer()
        self._tx.set_dumper_types([postgres.types.get_oid(t) for t in types], Format.BINARY)
        self._formats = [PyFormat.BINARY] * len(types)
        self._count = struct.pack(">h", len(types) + 1)

    def encode(self, rows: Sequence[Sequence]) -> EncodedRows:
        out = bytearray()
        ends = [0]
        write = self._write_row if format_row_binary is not None else self._write_row_py
        for row in rows:
            write(row, out)
            ends.append(len(out))
        return EncodedRows(bytes(out), np.array(ends, dtype=np.int64))

    def _write_row(self, row: Sequence, out: bytearray) -> None:
        """psycopg frames the row with the same dumpers, without a Python step per value; its field
        count is the row's, so it is overwritten with ours (which counts the embedding too)."""
        start = len(out)
        format_row_binary(row, self._tx, out)
        out[start : start + 2] = self._count

    def _write_row_py(self, row: Sequence, out: bytearray) -> None:
        out += self._count
        for value in self._tx.dump_sequence(row, self._formats):
            if value is None:
                out += _NULL
            else:
                out += _INT4(len(value))
                out += value


def vector_fields(emb: np.ndarray, vtype: str) -> np.ndarray:
    """Each row's embedding as a COPY field: int32 length, then pgvector's binary format
    (uint16 dim, uint16 0, big-endian float32 — or float16 for halfvec). uint8 [n, field bytes]."""
    n, dim = emb.shape
    body = np.ascontiguousarray(emb, dtype=">f2" if vtype == "halfvec" else ">f4")
    head = struct.pack(">iHH", 4 + body.itemsize * dim, dim, 0)
    out = np.empty((n, len(head) + body.itemsize * dim), dtype=np.uint8)
    out[:, : len(head)] = np.frombuffer(head, dtype=np.uint8)
    out[:, len(head) :] = body.view(np.uint8).reshape(n, -1)
    return out


def assemble(rows: EncodedRows, vectors: np.ndarray) -> bytes:
    """The whole COPY stream: signature, each row followed by its vector field, trailer."""
    if rows.n != len(vectors):
        raise ValueError(f"{rows.n} rows but {len(vectors)} vectors")
    blob, o = memoryview(rows.blob), rows.offsets.tolist()
    parts: list = [SIGNATURE]
    for i, vec in enumerate(vectors):
        parts.append(blob[o[i] : o[i + 1]])
        parts.append(vec)
    parts.append(TRAILER)
    return b"".join(parts)
