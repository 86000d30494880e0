"""Binary COPY rows: framing checked byte by byte here; the server reads them in the integration tests."""

from __future__ import annotations

import struct
from datetime import datetime, timezone

import numpy as np
import pytest
from pgvector import HalfVector, Vector

from embedfleet.pg import copyin as copyrows
from embedfleet.pg.copyin import SIGNATURE, TRAILER, RowEncoder, assemble, vector_fields


def _fields(row: bytes) -> list[bytes | None]:
    """Split one encoded tuple back into its fields."""
    (count,) = struct.unpack_from(">h", row, 0)
    pos, out = 2, []
    for _ in range(count):
        (size,) = struct.unpack_from(">i", row, pos)
        pos += 4
        if size < 0:
            out.append(None)
        else:
            out.append(row[pos : pos + size])
            pos += size
    assert pos == len(row), "trailing bytes after the last field"
    return out


def test_vector_fields_are_pgvectors_own_binary_format_with_a_length():
    emb = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    for vtype, make in (("vector", lambda r: Vector(r)), ("halfvec", lambda r: HalfVector(r.astype(np.float16)))):
        fields = vector_fields(emb, vtype)
        for got, row in zip(fields, emb):
            body = make(row).to_binary()
            assert bytes(got) == struct.pack(">i", len(body)) + body


def test_rows_are_framed_with_room_for_the_vector_and_assembled_in_order():
    enc = RowEncoder(["text", "text", "float4", "int8", "bool", "timestamptz", "jsonb"])
    ts = datetime(2020, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    rows = enc.encode([
        ("a", "héllo", 4.5, 7, True, ts, {"k": [1, "x"]}),
        ("b", "", None, None, None, None, None),
    ])
    assert rows.n == 2
    emb = np.array([[1.0, 0.0], [0.0, -1.0]], dtype=np.float32)
    data = assemble(rows, vector_fields(emb, "vector"))
    assert data.startswith(SIGNATURE) and data.endswith(TRAILER)
    body = data[len(SIGNATURE) : -len(TRAILER)]
    first, second = body[: rows.offsets[1] + 16], body[rows.offsets[1] + 16 :]
    f = _fields(first)
    assert len(f) == 8  # seven columns and the embedding
    assert f[0] == b"a" and f[1] == "héllo".encode()
    assert struct.unpack(">f", f[2])[0] == 4.5 and struct.unpack(">q", f[3])[0] == 7 and f[4] == b"\x01"
    micros = struct.unpack(">q", f[5])[0]  # PostgreSQL's epoch is 2000-01-01
    assert micros == int((ts - datetime(2000, 1, 1, tzinfo=timezone.utc)).total_seconds() * 1e6)
    assert f[6] == b'\x01{"k":[1,"x"]}'  # jsonb version byte, then orjson's compact text
    assert f[7] == Vector(emb[0]).to_binary()
    g = _fields(second)
    assert g[0] == b"b" and g[1] == b"" and g[2:7] == [None] * 5 and g[7] == Vector(emb[1]).to_binary()


def test_assemble_refuses_a_count_mismatch():
    rows = RowEncoder(["text"]).encode([("a",)])
    with pytest.raises(ValueError, match="1 rows but 2 vectors"):
        assemble(rows, vector_fields(np.zeros((2, 3), np.float32), "vector"))


def test_psycopgs_row_writer_and_our_own_framing_give_the_same_bytes(monkeypatch):
    types = ["text", "text", "float4", "float8", "int4", "int8", "bool", "timestamptz", "jsonb"]
    ts = datetime(2020, 1, 2, 3, 4, 5, 678000, tzinfo=timezone.utc)
    rows = [
        ("a", "héllo \U0001f600", 4.5, -1e300, -(2**31), 2**62, True, ts, {"k": [1, "x", None], "é": 1.5}),
        ("b", "", None, None, None, None, None, None, None),
        ("c", "x" * 5000, float("nan"), float("inf"), 0, -1, False, datetime(1, 1, 1, tzinfo=timezone.utc), []),
    ]
    assert copyrows.format_row_binary is not None  # the fast path is the one in use here
    fast = RowEncoder(types).encode(rows)
    monkeypatch.setattr(copyrows, "format_row_binary", None)
    own = RowEncoder(types).encode(rows)
    assert bytes(fast.blob) == bytes(own.blob) and fast.offsets.tolist() == own.offsets.tolist()
    assert fast.offsets.dtype == np.int64 and fast.n == 3
    assert [struct.unpack_from(">h", fast.blob, o)[0] for o in fast.offsets[:-1]] == [10] * 3  # 9 + the embedding
