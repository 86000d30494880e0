"""PostgreSQL's binary COPY format, for fixed-width rows: pure functions over bytes and numpy.

A binary COPY stream is a header (11-byte signature, int32 flags, int32 header-extension length and
that many bytes), then one tuple per row — int16 field count, then per field an int32 length (-1:
NULL) and that many bytes — and a trailer int16 -1. Everything is big-endian. pgvector sends a
`vector` as int16 dim, int16 unused, then dim float32; a `halfvec` the same with float16.

A row here is `fields` (fixed-width, all non-NULL) followed by at most one variable-width text field
(the row id): its int32 length is part of the fixed prefix, its bytes are the rest of the row.

A chunk (`chunk_rows`) is one COPY tuple holding many rows: the row count, then one field per field
of the rows, then the ids' byte lengths (int4[]) and the ids concatenated (text). A scalar field is
an array (PostgreSQL's binary array: int32 ndim, int32 flags, uint32 element type, per dimension
int32 size and int32 lower bound, then per element an int32 length and its bytes — the same
length-then-value pairs a row has). A vector field is a bytea: the vectors' binary values end to end
(string_agg of vector_send), which spares the server an array of them to build and send. Reading a
table a few hundred rows a message leaves no per-row work to Python.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SIGNATURE", "TRAILER", "Field", "header_length", "row_dtype", "check_rows", "scalar_field", "vector_field",
           "raw_field", "array_field", "array_values", "chunk_count", "chunk_rows"]

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


def array_field(name: str, width: int) -> Field:
    """PostgreSQL's binary float4[] of `width` values, none NULL: int32 ndim, int32 flags, uint32 element type,
    int32 size and lower bound, then (int32 length, float32) per value."""
    dt = np.dtype([("a_ndim", ">i4"), ("a_flags", ">i4"), ("a_elem", ">u4"), ("a_size", ">i4"), ("a_lbound", ">i4"),
                   ("values", [("len", ">i4"), ("v", ">f4")], (width,))])
    return name, dt, dt.itemsize


def array_values(rows: np.ndarray, name: str) -> np.ndarray:
    """An array_field's values, [k, width] big-endian float32."""
    return rows[name]["values"]["v"]


def raw_field(name: str, width: int) -> Field:
    """A bytea of `width` little-endian float32 values (a chunk's: theirs end to end)."""
    dt = np.dtype(("<f4", (width,)))
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


def _wrong_size(name: str, got: int, size: int, vector: bool) -> str:
    """The one-line error for a field's value of `got` bytes (-1: NULL) where `size` were expected."""
    why = " (NULL)" if got == -1 else " (a vector of another dimension?)" if vector else ""
    return f"{name}: a value of {got} bytes where {size} were expected{why}"


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
            return _wrong_size(name, int(bad), size, bool(dt.names and "dim" in dt.names))
        if dt.names and "dim" in dt.names:
            want = dt["values"].shape[0]
            dims = rows[name]["dim"]
            if not np.all(dims == want):
                return f"{name}: vectors of dimension {int(dims[dims != want][0])} among dimension {want}"
        if dt.names and "a_ndim" in dt.names:
            a = rows[name]
            want = dt["values"].shape[0]
            if not (np.all(a["a_ndim"] == 1) and np.all(a["a_size"] == want) and np.all(a["values"]["len"] == 4)):
                return f"{name}: an array that is not {want} non-NULL float4 values"
    if trailing_text and text_lengths is not None and not np.array_equal(rows["text_len"], text_lengths):
        return "the id field's length disagrees with its row"
    return None


def _field(buf: memoryview, pos: int) -> tuple[memoryview, int]:
    """A tuple's field at `pos`: (its bytes, the position after it). A NULL is a ValueError."""
    size = int.from_bytes(buf[pos:pos + 4], "big", signed=True)
    if size < 0:
        raise ValueError("a NULL where a chunk has a field's values")
    return buf[pos + 4:pos + 4 + size], pos + 4 + size


def _array(data: memoryview, name: str, dt: np.dtype, size: int, k: int) -> np.ndarray:
    """The k elements of a one-dimensional binary array of fixed-width values, as (len, value) pairs."""
    pairs = np.dtype([("len", ">i4"), ("v", dt)])
    one_dim = int.from_bytes(data[:4], "big") == 1 and int.from_bytes(data[12:16], "big") == k
    if one_dim and len(data) == 20 + k * pairs.itemsize:
        return np.frombuffer(data, pairs, count=k, offset=20)
    pos, ndim = 12, int.from_bytes(data[:4], "big")  # not k values of `size` bytes: say which one is not
    pos += 8 * ndim
    for _ in range(k if ndim else 0):
        n = int.from_bytes(data[pos:pos + 4], "big", signed=True)
        if n != size:
            raise ValueError(_wrong_size(name, n, size, False))
        pos += 4 + n
    raise ValueError(f"{name}: an array of {len(data)} bytes for {k} values of {size} bytes")


def _packed(data: memoryview, name: str, dt: np.dtype, size: int, k: int) -> np.ndarray:
    """The k vectors of a bytea holding their binary values end to end."""
    if len(data) == k * size:
        return np.frombuffer(data, dt, count=k)
    pos = 0  # not k values of `size` bytes: say which one is not
    while pos + 4 <= len(data):
        n = 4 + int.from_bytes(data[pos:pos + 2], "big", signed=True) * (size - 4) // dt["values"].shape[0]
        if n != size:
            raise ValueError(_wrong_size(name, n, size, True))
        pos += n
    raise ValueError(f"{name}: {len(data)} bytes for {k} values of {size} bytes")


def chunk_count(msg: bytes | memoryview) -> int:
    """Rows in a chunk (its first field)."""
    return int.from_bytes(_field(memoryview(msg), 2)[0], "big", signed=True)


def chunk_rows(msg: bytes | memoryview, fields: list[Field], dtype: np.dtype,
               out: np.ndarray | None = None) -> tuple[np.ndarray, bytes, np.ndarray]:
    """One chunk (see the module's docstring) → (its rows as `dtype` = row_dtype(fields, True) holds
    them — in `out`, chunk_count(msg) rows of that dtype, if given —, the ids' bytes concatenated,
    their lengths). ValueError for a chunk that is not one."""
    buf = memoryview(msg)
    if int.from_bytes(buf[:2], "big") != len(fields) + 3:
        raise ValueError(f"a chunk of {int.from_bytes(buf[:2], 'big')} fields where {len(fields) + 3} were expected")
    count, pos = _field(buf, 2)
    k = int.from_bytes(count, "big", signed=True)
    rows = np.empty(k, dtype) if out is None else out
    if len(rows) != k:
        raise ValueError(f"room for {len(rows)} rows, the chunk has {k}")
    rows["nfields"] = len(fields) + 1
    for name, dt, size in fields:
        data, pos = _field(buf, pos)
        if dt.names and "dim" in dt.names:
            rows[f"{name}_len"] = size
            rows[name] = _packed(data, name, dt, size, k)
        elif dt.names and "a_ndim" in dt.names:  # arrays' binary values end to end (array_send)
            if len(data) != k * size:
                raise ValueError(f"{name}: {len(data)} bytes for {k} arrays of {size} bytes (of another length?)")
            rows[f"{name}_len"] = size
            rows[name] = np.frombuffer(data, dt, count=k)
        elif dt.subdtype is not None:
            if len(data) != k * size:
                raise ValueError(f"{name}: {len(data)} bytes for {k} values of {size} bytes")
            rows[f"{name}_len"] = size
            rows[name] = np.frombuffer(data, dt.base, count=k * dt.shape[0]).reshape(k, dt.shape[0])
        else:
            pairs = _array(data, name, dt, size, k)
            rows[f"{name}_len"] = pairs["len"]
            rows[name] = pairs["v"]
    data, pos = _field(buf, pos)
    lengths = _array(data, "id", np.dtype(">i4"), 4, k)["v"].astype(np.int64)
    ids, pos = _field(buf, pos)
    if int(lengths.sum()) != len(ids):
        raise ValueError(f"ids of {len(ids)} bytes where their lengths say {int(lengths.sum())}")
    rows["text_len"] = lengths
    return rows, bytes(ids), lengths
