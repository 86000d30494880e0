"""PostgreSQL's binary COPY format, for fixed-width rows: pure functions over bytes and numpy.

A binary COPY stream is a header (11-byte signature, int32 flags, int32 header-extension length and
that many bytes), then one tuple per row — int16 field count, then per field an int32 length (-1:
NULL) and that many bytes — and a trailer int16 -1. Everything is big-endian. pgvector sends a
`vector` as int16 dim, int16 unused, then dim float32; a `halfvec` the same with float16.

A row here is `fields` (fixed-width, all non-NULL) followed by at most one variable-width text field
(the row id): its int32 length is part of the fixed prefix, its bytes are the rest of the row.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SIGNATURE", "TRAILER", "Field", "header_length", "row_dtype", "check_rows", "scalar_field", "vector_field"]

SIGNATURE = b"PGCOPY\n\xff\r\n\x00"
TRAILER = b"\xff\xff"

# A field: (name, numpy dtype of its value, expected byte length). Big-endian throughout.
Field = tuple[str, np.dtype, int]

_SCALARS = {"tid": np.dtype([("block", ">u4"), ("offset", ">u2")]), "int4": np.dtype(">i4"),
            "float8": np.dtype(">f8")}


def scalar_field(name: str, kind: str) -> Field:
    dt = _SCALARS[kind]
    return name, dt, dt.itemsize


def vector_field(name: str, vtype: str, dim: int) -> Field:
    """pgvector's binary `vector` / `halfvec`: int16 dim, int16 unused, dim big-endian floats."""
    elem = ">f4" if vtype == "vector" else ">f2"
    dt = np.dtype([("dim", ">i2"), ("unused", ">i2"), ("values", elem, (dim,))])
    return name, dt, dt.itemsize


def header_length(buf: bytes | memoryview) -> int:
    """Bytes taken by the stream header (signature, flags, extension); ValueError if it is not one."""
    if bytes(buf[:11]) != SIGNATURE or len(buf) < 19:
        raise ValueError("not a binary COPY stream (bad signature)")
    ext = int.from_bytes(bytes(buf[15:19]), "big", signed=False)
    return 19 + ext


def row_dtype(fields: list[Field], trailing_text: bool) -> np.dtype:
    """The structured dtype of a row's fixed-width part: field count, then each field's length and
    value, then (with `trailing_text`) the int32 length of the variable-width text field that follows."""
    parts: list[tuple] = [("nfields", ">i2")]
    for name, dt, _ in fields:
        parts += [(f"{name}_len", ">i4"), (name, dt)]
    if trailing_text:
        parts.append(("text_len", ">i4"))
    return np.dtype(parts)


def check_rows(rows: np.ndarray, fields: list[Field], trailing_text: bool,
               text_lengths: np.ndarray | None = None) -> str | None:
    """None when every row has the expected field count and field lengths; else what is wrong
    (a NULL, a vector of another dimension, a text field whose length disagrees with its message)."""
    nfields = len(fields) + (1 if trailing_text else 0)
    if rows.size == 0:
        return None
    if not np.all(rows["nfields"] == nfields):
        return f"rows with {sorted(set(rows['nfields'].tolist()) - {nfields})} fields instead of {nfields}"
    for name, dt, size in fields:
        lengths = rows[f"{name}_len"]
        if not np.all(lengths == size):
            bad = lengths[lengths != size][0]
            return f"{name}: a value of {bad} bytes where {size} were expected" + (
                " (NULL)" if bad == -1 else "")
        if dt.names and "dim" in dt.names:
            want = dt["values"].shape[0]
            dims = rows[name]["dim"]
            if not np.all(dims == want):
                return f"{name}: vectors of dimension {int(dims[dims != want][0])} among dimension {want}"
    if trailing_text and text_lengths is not None and not np.array_equal(rows["text_len"], text_lengths):
        return "the id field's length disagrees with its row"
    return None
