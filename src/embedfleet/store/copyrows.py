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

# psycopg's type names for our column types.
COPY_TYPES = {
    "text": "text", "real": "float4", "double precision": "float8", "integer": "int4", "bigint": "int8",
    "boolean": "bool", "timestamptz": "timestamptz", "jsonb": "jsonb",
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
        offsets = np.empty(len(rows) + 1, dtype=np.int64)
        offsets[0] = 0
        dump = self._tx.dump_sequence
        for i, row in enumerate(rows):
            out += self._count
            for value in dump(row, self._formats):
                if value is None:
                    out += _NULL
                else:
                    out += _INT4(len(value))
                    out += value
            offsets[i + 1] = len(out)
        return EncodedRows(bytes(out), offsets)


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
