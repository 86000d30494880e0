"""One bulk read of a pgvector table: binary COPY of fixed-width rows, parsed with one np.frombuffer
a block, on one or several connections sharing one snapshot.

Glossary:
    Source     what to read: the table, its vector column, the id and label expressions, the
               user's --where (checked against the database by `describe`).
    Split      the deterministic train/validation split by row id (a hash computed in SQL).
    range      a range of heap pages (`ctid` bounds). The dataset's row order is the table's
               physical order: ranges in page order, each read by a TID range scan (or, for a
               whole table, a sequential scan with synchronised scans off), never in parallel
               inside the server, so every reader and every rank sees the same order. A partitioned
               table's ranges (`heap_pages`) read those pages of each partition in turn: its order
               follows the ranges, the same only for the same number of connections and ranks.
    tid        where a row is: its heap page << 16 | line pointer, and with several heaps (a partitioned
               table, a parent by inheritance) the heap's index in `Source.heaps` << 48.
    Plan       the precount: rows and labels per range, hence each range's offset in the
               destination, the classes, and the rows skipped for a NULL label or vector.
    TableRead  the connections (REPEATABLE READ, READ ONLY, one exported snapshot) that plan
               and then COPY the ranges, each into its slice of the destination.

The user's --where runs inside those READ ONLY transactions: it can filter, never write.
"""

from __future__ import annotations

import hashlib
import math
import os
import queue
import select
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import psycopg
from psycopg import pq, sql

from embedfleet.pg.scan import begin_snapshot, export_snapshot, page_spans, span_sql, user_filter, where_error
from embedfleet.errors import DatabaseError, InputError
from embedfleet.logs import plural
from embedfleet.pg.ddl import heap_pages, heaps as schema_heaps, split_table, table_exists, table_sql
from embedfleet.pg.copybin import (TRAILER, check_rows, chunk_count, chunk_rows, header_length, raw_field, row_dtype, scalar_field,
                                    vector_field, array_field, array_values)

__all__ = ["Source", "Split", "Plan", "Ids", "Columns", "TableRead", "describe", "class_index", "default_connections",
           "MAX_CLASSES"]

MAX_CLASSES = 10_000
BLOCK_ROWS = 16_384  # rows parsed per np.frombuffer: ~25 MB of 384-dim float32 rows
# Bytes a COPY message carries (a chunk of heap pages, see chunk_pages): one message a row left the
# client a libpq call and slices of Python a row, its bound (docs/decisions/train-bulk-read.md).
CHUNK_BYTES = 1 << 19
ROW_MESSAGE_CORES = 4  # from this many cores a one-connection read takes a message a row (use_chunks)
PRECOUNT_WORKERS = 4  # the server's parallel workers a one-range plan's counts may use
_LAST_PAGE = 4_294_967_294  # the highest heap page number a tid can name
HEAP_SHIFT = np.uint64(48)  # a tid's page (32 bits) and line pointer (16) lie below its heap's index
_IN_HEAP = np.uint64((1 << 48) - 1)
_KEY = "('x' || left(md5({id}), 8))::bit(32)"  # a stable 32-bit hash of the row id (md5, not hashtext)


@dataclass(frozen=True)
class Split:
    """Rows whose id hashes below `val_fraction` of 2^32 are validation, the rest training."""

    part: str = "train"  # "train" | "val"
    val_fraction: float = 0.1

    def __post_init__(self):
        if self.part not in ("train", "val"):
            raise InputError(f"split {self.part!r}: use 'train' or 'val'")
        if not 0.0 <= self.val_fraction < 1.0:
            raise InputError(f"--val-fraction {self.val_fraction}: use a value in [0, 1)")

    @property
    def threshold(self) -> int:
        return int(round(self.val_fraction * 2 ** 32))

    def rule(self) -> str:
        return (f"validation: rows whose ('x' || left(md5(id), 8))::bit(32)::bigint < {self.threshold} "
                f"(val_fraction {self.val_fraction} of 2^32); training: the others")

    @staticmethod
    def is_val(keys: np.ndarray, val_fraction: float) -> np.ndarray:
        """The same rule applied to keys read back (uint32)."""
        return keys.astype(np.int64) < int(round(val_fraction * 2 ** 32))

    @staticmethod
    def key_of(row_id: str) -> int:
        """The key SQL computes for one id (tests, and predict's checks)."""
        return int(hashlib.md5(row_id.encode()).hexdigest()[:8], 16)


UNSEEN_CLASS = -2  # a row's label with classes given (a head's, at predict): one they do not hold (-1: NULL)
_FLOAT_TYPES = ("float4", "float8", "numeric", "real", "double precision")  # the feature types that can hold NaN and infinities


@dataclass(frozen=True)
class Feature:
    """One column of a dataset's `x`: `width` values from a `kind` of column (see FEATURE_TYPES)."""

    name: str
    kind: str  # "scalar" | "array" | "vector" | "bytea"
    width: int
    type: str  # the column's type, for messages
    bool_type: bool = False  # a boolean scalar: cast through int

    @property
    def raw(self) -> bool:
        """Read as its bytes (little-endian float32) and placed on the client: SQL cannot cast a bytea."""
        return self.kind == "bytea"


# A feature's column types: one value each, a fixed-length array of numbers, a pgvector vector, raw float32.
SCALAR_TYPES = ("int2", "int4", "int8", "float4", "float8", "numeric", "bool")
ARRAY_TYPES = ("_float4", "_float8", "_int2", "_int4", "_int8", "_numeric")
FEATURE_TYPES = ("integer, bigint, smallint, real, double precision, numeric, boolean, an array of numbers, "
                 "vector, halfvec or bytea of float32")


@dataclass(frozen=True)
class Source:
    table: str
    column: str | None  # the vector column (the default feature); None where features are given
    vtype: str  # "vector" | "halfvec"
    dim: int
    id_column: str | None  # None: the row's ctid stands in for an id
    label: str | None = None
    label_kind: str | None = None  # "numeric" | "text"
    task: str | None = None  # "classify" | "regress"
    where: str | None = None
    ident: tuple[str, ...] = ()  # the table's identifier parts (schema, name), resolved once
    send: tuple[str, ...] = ()  # the vector type's binary send function (schema, name), from the catalog
    # partitioned, or a parent by inheritance: (oid, name) of each of its tables that holds rows (they share ctids)
    heaps: tuple[tuple[int, str], ...] = ()
    features: tuple[Feature, ...] = ()  # empty: the vector column, whose NULL rows are skipped
    fill: tuple[tuple[str, float], ...] = ()  # (column, value) standing in for its NULLs
    vector_dims: tuple[str, ...] = ("vector_dims",)  # pgvector's function, schema-qualified
    transport: str = "vector"  # how sent features travel: one pgvector `vector`, or a float4[] without pgvector

    @property
    def several_heaps(self) -> bool:
        return bool(self.heaps)

    @property
    def sent(self) -> tuple[Feature, ...]:
        """The features the server casts into one `vector` (all but the raw ones), in order."""
        return tuple(f for f in self.features if not f.raw)

    @property
    def vec_dim(self) -> int:
        """Values of the one vector a row sends (0: only raw features)."""
        return sum(f.width for f in self.sent) if self.features else self.dim

    @property
    def feature_slices(self) -> dict[str, slice]:
        if not self.features:
            return {self.column: slice(0, self.dim)}
        out, at = {}, 0
        for f in self.features:
            out[f.name] = slice(at, at + f.width)
            at += f.width
        return out

    def fill_for(self, name: str) -> float | None:
        return dict(self.fill).get(name)

    def _value_sql(self, f: Feature) -> sql.Composable:
        """A sent feature as float4[] (NULLs filled where asked)."""
        c, fill = sql.Identifier(f.name), self.fill_for(f.name)
        if f.kind == "scalar":
            v = sql.SQL("{}::int::float4" if f.bool_type else "{}::float4").format(c)
            if fill is not None:
                v = sql.SQL("coalesce({}, {}::float4)").format(v, sql.Literal(fill))
            return sql.SQL("ARRAY[{}]").format(v)
        v = sql.SQL("{}::float4[]").format(c)
        if fill is None:
            return v
        v = sql.SQL("array_replace({}, NULL, {}::float4)").format(v, sql.Literal(fill))
        return sql.SQL("coalesce({}, array_fill({}::float4, ARRAY[{}]))").format(v, sql.Literal(fill),
                                                                                  sql.Literal(f.width))

    def vec_sql(self) -> sql.Composable:
        """What a row sends as its one vector: the vector column, or the sent features as one `vector`."""
        if not self.features:
            return sql.Identifier(self.column)
        sent = self.sent
        if len(sent) == 1 and sent[0].kind == "vector" and sent[0].type == "vector" and self.fill_for(sent[0].name) is None:
            return sql.Identifier(sent[0].name)
        joined = sql.SQL(" || ").join(self._value_sql(f) for f in sent)
        if self.transport == "array":
            return sql.SQL("({})::float4[]").format(joined)
        vector = sql.Identifier(*((self.send[0], "vector") if self.send and self.send[0] else ("vector",)))
        return sql.SQL("({})::{}").format(joined, vector)

    def raw_sql(self, f: Feature) -> sql.Composable:
        """A raw feature's bytes (NULLs filled where asked)."""
        fill = self.fill_for(f.name)
        if fill is None:
            return sql.Identifier(f.name)
        return sql.SQL("coalesce({}, {}::bytea)").format(
            sql.Identifier(f.name), sql.Literal(np.full(f.width, fill, "<f4").tobytes()))

    def checks(self) -> list[tuple[Feature, str, sql.Composable]]:
        """(feature, what is wrong, the SQL condition true for a row where it is) for every feature."""
        out = []
        for f in self.features:
            c = sql.Identifier(f.name)
            filled = self.fill_for(f.name) is not None
            if not filled:
                out.append((f, "null", sql.SQL("{} IS NULL").format(c)))
            if f.kind == "array":
                out.append((f, "length", sql.SQL("({c} IS NOT NULL AND (array_ndims({c}) IS DISTINCT FROM 1 OR "
                                                 "cardinality({c}) <> {n}))").format(c=c, n=sql.Literal(f.width))))
                if not filled:
                    out.append((f, "element", sql.SQL("array_position({}, NULL) IS NOT NULL").format(c)))
            if f.type.removesuffix("[]").split("(")[0] in _FLOAT_TYPES:  # a vector holds no NaN, no infinity
                # as float8: numeric takes no infinity literal before PostgreSQL 14
                out.append((f, "nan", sql.SQL("{}::float8[] && '{{NaN,Infinity,-Infinity}}'::float8[]").format(c)
                            if f.kind == "array" else sql.SQL("{}::float8 IN ('NaN', 'Infinity', '-Infinity')").format(c)))
            if f.kind == "vector":
                out.append((f, "length", sql.SQL("{d}({c}) <> {n}").format(
                    d=sql.Identifier(*self.vector_dims), c=c, n=sql.Literal(f.width))))
            elif f.kind == "bytea":
                out.append((f, "length", sql.SQL("octet_length({}) <> {}").format(c, sql.Literal(4 * f.width))))
        return out

    def bad_sql(self) -> sql.Composable:
        """The first failing check's number (1-based), 0 for a row every feature can take."""
        checks = self.checks()
        if not checks:
            return sql.SQL("0")
        whens = [sql.SQL("WHEN {} THEN {}").format(cond, sql.Literal(i + 1)) for i, (_, _, cond) in enumerate(checks)]
        return sql.SQL("CASE {} ELSE 0 END").format(sql.SQL(" ").join(whens))

    def table_sql(self) -> sql.Identifier:
        return sql.Identifier(*(self.ident or (self.table,)))

    def heap_sql(self) -> sql.Composable:
        """The row's heap, as its index in `heaps`."""
        oids = "{" + ",".join(str(oid) for oid, _ in self.heaps) + "}"
        return sql.SQL("(array_position({}::oid[], tableoid) - 1)::int4").format(sql.Literal(oids))

    def id_sql(self) -> sql.Composable:
        if self.id_column is None:  # with several heaps a ctid is unique only in its own
            return sql.SQL("(tableoid::regclass::text || ctid::text)" if self.several_heaps else "ctid::text")
        return sql.SQL("{}::text").format(sql.Identifier(self.id_column))

    def label_sql(self) -> sql.Composable:
        cast = "float8" if self.label_kind == "numeric" else "text"
        return sql.SQL("{}::" + cast).format(sql.Identifier(self.label))

    def key_sql(self) -> sql.Composable:
        return sql.SQL(_KEY).format(id=self.id_sql())

    def send_sql(self) -> sql.Composable:
        """The vector's binary value as bytea: its type's send function, wherever pgvector is installed."""
        if self.transport == "array":
            return sql.SQL("pg_catalog.array_send({})").format(self.vec_sql())
        return sql.SQL("{}({})").format(sql.Identifier(*(self.send or (f"{self.vtype}_send",))), self.vec_sql())

    def fields(self) -> list:
        """The COPY fields of a row's values: the one vector (unless only raw features), then each raw feature."""
        if not self.vec_dim:
            out = []
        elif self.transport == "array":
            out = [array_field("vec", self.vec_dim)]
        else:
            out = [vector_field("vec", self.vtype, self.vec_dim)]
        return out + [raw_field(f"raw_{f.name}", f.width) for f in self.features if f.raw]

    def value_sql(self) -> list[sql.Composable]:
        """What a row sends for `fields()`, in order."""
        out = [self.vec_sql()] if self.vec_dim else []
        return out + [self.raw_sql(f) for f in self.features if f.raw]

    def values(self, rows: np.ndarray) -> np.ndarray:
        """The rows' x ([k, dim]) from their parsed fields: the vector's big-endian values as they are when
        it is all of x; else placed column by column as float32."""
        if not any(f.raw for f in self.features):
            return array_values(rows, "vec") if self.transport == "array" else rows["vec"]["values"]
        sent = (array_values(rows, "vec") if self.transport == "array" else rows["vec"]["values"]) if self.vec_dim else None
        out = np.empty((len(rows), self.dim), np.float32)
        slices = self.feature_slices
        at = 0
        for f in self.features:
            if f.raw:
                out[:, slices[f.name]] = rows[f"raw_{f.name}"]
            else:
                out[:, slices[f.name]] = sent[:, at:at + f.width]
                at += f.width
        return out


def _columns(conn: psycopg.Connection, table: str) -> dict[str, tuple[str, str, int, tuple[str, str]]]:
    """name → (type, type category, typmod, the type's send function as (schema, name), or Nones)."""
    rows = conn.execute(
        "SELECT a.attname, t.typname, t.typcategory, a.atttypmod, n.nspname, p.proname FROM pg_attribute a "
        "JOIN pg_type t ON t.oid = a.atttypid LEFT JOIN pg_proc p ON p.oid = t.typsend "
        "LEFT JOIN pg_namespace n ON n.oid = p.pronamespace "
        "WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
        [table_sql(conn, table).as_string(conn)],
    ).fetchall()
    return {name: (typ, cat, mod, (schema, send)) for name, typ, cat, mod, schema, send in rows}


def describe(conn: psycopg.Connection, table: str, label: str | None = None, where: str | None = None,
             task: str | None = None, features: Sequence[str] | None = None, fill_null=None,
             id_field: str | None = None) -> Source:
    """Resolve what to read against the database; one-line errors for what cannot be used. `features`:
    columns whose values, concatenated, make each row's x (default: the table's vector column)."""
    if not table_exists(conn, table):
        raise DatabaseError(f"table {table!r} does not exist; `embedfleet status` lists the jobs and their tables")
    cols = _columns(conn, table)
    vectors = [c for c, (typ, *_) in cols.items() if typ in ("vector", "halfvec")]
    pgvector = next((send[0] for typ, _, _, send in cols.values() if typ in ("vector", "halfvec") and send[0]), None)
    vector_dims = (pgvector, "vector_dims") if pgvector else ("vector_dims",)
    feats: tuple[Feature, ...] = ()
    fill: tuple = ()
    transport = "vector"
    if features is not None:
        feats = tuple(_feature(conn, table, cols, name, vector_dims) for name in _feature_names(features, cols, table))
        fill = _fill(fill_null, [f.name for f in feats])
        column, vtype, dim = None, "vector", sum(f.width for f in feats)
        send = next(((cols[f.name][3][0], "vector_send") for f in feats if f.kind == "vector" and cols[f.name][3][0]),
                    (pgvector, "vector_send") if pgvector else ("vector_send",))
        if pgvector is None:
            ns = conn.execute("SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace "
                              "WHERE e.extname = 'vector'").fetchone()
            if ns is not None:
                send, vector_dims = (ns[0], "vector_send"), (ns[0], "vector_dims")
            else:  # a database without pgvector: the features travel as one float4[] a row
                transport = "array"
    else:
        if fill_null is not None:
            raise InputError("fill_null applies to features: name them (features=[...], --features)")
        if not vectors:
            raise DatabaseError(f"table {table!r} has no vector or halfvec column: a head is trained on a table's "
                                "vectors, or on the columns it names (features=[...], train --features a,b,c)")
        column = "embedding" if "embedding" in vectors else vectors[0]
        if len(vectors) > 1 and column != "embedding":
            raise DatabaseError(f"table {table!r} has several vector columns ({', '.join(vectors)}) and none is "
                                "named embedding; name one with features=[...] (--features)")
        vtype, _, dim, send = cols[column]
        if dim <= 0:  # a column declared without a dimension: take the first row's
            row = conn.execute(sql.SQL("SELECT {d}({c}) FROM {t} WHERE {c} IS NOT NULL LIMIT 1").format(
                d=sql.Identifier(*vector_dims), c=sql.Identifier(column), t=table_sql(conn, table))).fetchone()
            dim = row[0] if row else 0
    if id_field is not None:
        if id_field not in cols:
            raise InputError(f"id_field {id_field!r}: table {table!r} has no such column")
        id_column = id_field
    else:
        id_column = _primary_key(conn, table) or ("id" if "id" in cols else None)
    kind = None
    if task is not None and task not in ("classify", "regress"):
        raise InputError(f"--task {task!r}: use classify or regress")
    if label is not None:
        if label not in cols:
            raise InputError(f"--label {label!r}: table {table!r} has no such column "
                             f"(it has {', '.join(c for c in cols if c != column)})")
        typ, cat, *_ = cols[label]
        if label == column or label in [f.name for f in feats]:
            raise InputError(f"--label {label!r} is also a feature: the label cannot be an input")
        kind = {"N": "numeric", "S": "text", "B": "text"}.get(cat)
        if kind is None:
            raise InputError(f"--label {label!r} is of type {typ}: use a numeric or text column")
        task = task or "classify"
        if task == "regress" and kind != "numeric":
            raise InputError(f"--task regress needs a numeric --label; {label!r} is of type {typ}")
    elif task is not None:
        raise InputError(f"--task {task} needs a --label column")
    ident = tuple(p for p in split_table(conn, table) if p is not None)
    target = sql.Identifier(*ident).as_string(conn)
    heaps = ()
    if conn.execute("SELECT relkind = 'p' OR relhassubclass FROM pg_class WHERE oid = %s::regclass", [target]).fetchone()[0]:
        heaps = tuple(schema_heaps(conn, table))
        if len(heaps) > 1 << 16:  # a tid's top 16 bits name its heap
            raise InputError(f"table {table!r} has {len(heaps):,} tables with rows under it; read at most 65,536")
    return Source(table, column, vtype, dim, id_column, label, kind, task if label else None, where or None,
                  ident, send, heaps, feats, fill, vector_dims, transport)


def _feature_names(features: Sequence[str], cols: dict, table: str) -> list[str]:
    if isinstance(features, str):
        features = [f.strip() for f in features.split(",") if f.strip()]
    names = list(features)
    if not names:
        raise InputError("features: name at least one column")
    for name in names:
        if not isinstance(name, str) or name not in cols:
            raise InputError(f"feature {name!r}: table {table!r} has no such column (it has {', '.join(cols)})")
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup:
        raise InputError(f"feature {dup!r} is named twice")
    return names


def _feature(conn: psycopg.Connection, table: str, cols: dict, name: str, vector_dims: tuple) -> Feature:
    """A column as a feature: its kind and width (a vector's declared dimension; else the first row's)."""
    typ, _, mod, _ = cols[name]
    pretty = typ.lstrip("_") + "[]" if typ.startswith("_") else typ
    if typ in SCALAR_TYPES:
        return Feature(name, "scalar", 1, pretty, typ == "bool")
    c, t = sql.Identifier(name), table_sql(conn, table)
    if typ in ARRAY_TYPES:
        width = sql.SQL("cardinality({})").format(c)
        kind = "array"
    elif typ in ("vector", "halfvec"):
        if mod > 0:
            return Feature(name, "vector", mod, pretty)
        width, kind = sql.SQL("{}({})").format(sql.Identifier(*vector_dims), c), "vector"
    elif typ == "bytea":
        width, kind = sql.SQL("octet_length({})").format(c), "bytea"
    else:
        raise InputError(f"feature {name!r} is of type {pretty}: a feature is {FEATURE_TYPES}")
    row = conn.execute(sql.SQL("SELECT {w} FROM {t} WHERE {c} IS NOT NULL LIMIT 1").format(w=width, t=t, c=c)).fetchone()
    if row is None or not row[0]:
        raise InputError(f"feature {name!r} ({pretty}) has no non-empty value to take its width from")
    n = int(row[0])
    if kind == "bytea":
        if n % 4:
            raise InputError(f"feature {name!r} (bytea) holds {n} bytes, not whole float32 values (little-endian, "
                             "4 bytes each)")
        n //= 4
    return Feature(name, kind, n, pretty)


def _fill(fill_null, names: list[str]) -> tuple[tuple[str, float], ...]:
    """fill_null as (column, value) pairs: one number for every feature, or a {column: number} mapping."""
    if fill_null is None:
        return ()
    if isinstance(fill_null, dict):
        unknown = [k for k in fill_null if k not in names]
        if unknown:
            raise InputError(f"fill_null names {unknown[0]!r}, which is not a feature ({', '.join(names)})")
        items = list(fill_null.items())
    else:
        items = [(n, fill_null) for n in names]
    try:
        pairs = tuple((k, float(v)) for k, v in items)
    except (TypeError, ValueError):
        raise InputError(f"fill_null {fill_null!r}: use a number, or a mapping of column to number") from None
    if any(not math.isfinite(v) for _, v in pairs):
        raise InputError(f"fill_null {fill_null!r}: use a finite number (a feature takes no NaN or infinity)")
    return pairs


def _primary_key(conn: psycopg.Connection, table: str) -> str | None:
    rows = conn.execute(
        "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
        "AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s::regclass AND i.indisprimary",
        [table_sql(conn, table).as_string(conn)]).fetchall()
    return rows[0][0] if len(rows) == 1 else None


def use_chunks(server_version: int, connections: int, cores: int | None = None) -> bool:
    """Whether a read takes chunks of rows a message (TID range scans: PostgreSQL 14+) or a message a row.
    One connection on a host with cores to spare takes a message a row: one sequential scan costs its
    server less, most of all on a table it has not cached, whose pages chunks place in shared buffers
    one by one (docs/decisions/train-bulk-read.md). Its client works over twice as hard, the bound on two cores or where several
    connections' clients share one GIL."""
    if cores is None:  # the cores this process may run on, not the host's
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return server_version >= 140000 and (connections > 1 or cores < ROW_MESSAGE_CORES)


def default_connections(settings) -> int:
    """Connections for one read (Settings.train_readers): each server backend produces rows on one core and the
    client parses on one (the GIL), so a few pay and many only contend."""
    return settings.train_readers or max(1, min(4, (os.cpu_count() or 2) // 4))


class Ids(Sequence):
    """Row ids as one UTF-8 buffer and end offsets: no Python object per row until one is asked for."""

    def __init__(self, buf: bytes = b"", ends: np.ndarray | None = None):
        self._buf = bytes(buf)
        self._ends = np.zeros(0, np.int64) if ends is None else np.asarray(ends, np.int64)

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if isinstance(i, np.ndarray) or isinstance(i, list):
            return [self[int(j)] for j in i]
        i = range(len(self))[i]
        start = int(self._ends[i - 1]) if i else 0
        return self._buf[start:int(self._ends[i])].decode()

    def __iter__(self):
        return iter(self.tolist())

    def tolist(self) -> list[str]:
        if not len(self):
            return []
        lengths = np.diff(self._ends, prepend=0)
        text = self._buf.decode()
        if len(text) == len(self._buf):  # ASCII: character offsets are byte offsets
            ends = self._ends.tolist()
            return [text[a:b] for a, b in zip([0] + ends[:-1], ends)]
        return [self._buf[a - n:a].decode() for a, n in zip(self._ends.tolist(), lengths.tolist())]

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def take(self, index: np.ndarray) -> Ids:
        """The ids at `index` (integer positions), as a new Ids: one gather of bytes."""
        index = np.asarray(index, np.int64)
        ends = self._ends
        starts = np.concatenate([[0], ends[:-1]]) if len(ends) else ends
        a, b = starts[index], ends[index]
        lengths = b - a
        new_ends = np.cumsum(lengths)
        src = np.frombuffer(self._buf, np.uint8)
        total = int(new_ends[-1]) if len(new_ends) else 0
        pos = np.arange(total, dtype=np.int64) + np.repeat(a - (new_ends - lengths), lengths)
        return Ids(src[pos].tobytes(), new_ends)

    @classmethod
    def concat(cls, parts: Iterable[Ids]) -> Ids:
        parts = [p for p in parts if len(p)]
        if not parts:
            return cls()
        bufs, ends, base = [], [], 0
        for p in parts:
            bufs.append(p._buf)
            ends.append(p._ends + base)
            base += len(p._buf)
        return cls(b"".join(bufs), np.concatenate(ends))

    def __reduce__(self):
        return Ids, (self._buf, self._ends)


@dataclass
class Plan:
    """The precount, and where each range's rows go."""

    ranges: list[tuple[int, int | None]]  # heap page bounds [start, end); None: to the end
    counts: list[int]  # rows each range will give
    classes: list | None
    skipped_null_label: int
    skipped_null_vector: int
    rows_both_sides: int  # rows selected before the train/validation split (with a label)
    seconds: float = 0.0

    @property
    def n(self) -> int:
        return int(sum(self.counts))

    @property
    def offsets(self) -> list[int]:
        return np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(int).tolist() if self.counts else []


@dataclass
class Columns:
    """What a read gives besides the vectors, in the dataset's order."""

    labels: np.ndarray | None  # int64 class indices (classify) or float64 values (regress)
    keys: np.ndarray  # uint32 split keys (empty unless asked for)
    tids: np.ndarray  # uint64: see the glossary's tid
    ids: Ids
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


class _CopyFailed(Exception):
    def __init__(self, sqlstate: str, message: str):
        super().__init__(message)
        self.sqlstate, self.message = sqlstate, message


def _user_error(sqlstate: str | None, message: str, where: str | None) -> Exception:
    """A failure of the user's SQL (syntax, unknown column, a write in a READ ONLY transaction,
    bad data in a cast) is an InputError naming --where; anything else a DatabaseError."""
    if where and sqlstate and sqlstate[:2] in ("42", "22", "25", "0A", "2B"):
        return where_error(message, where)
    return DatabaseError(f"reading the table failed: {message}")


def _first_line(e: psycopg.Error) -> str:
    return (e.diag.message_primary or str(e).strip().splitlines()[0]) if str(e).strip() else type(e).__name__


class TableRead:
    """Connections sharing one snapshot, to plan and read `source` (a context manager)."""

    def __init__(self, dsn: str, source: Source, split: Split | None = None, null_labels: str = "skip",
                 connections: int = 1, snapshot: str | None = None, classes: Sequence | None = None,
                 with_keys: bool = False):
        from embedfleet.pg.connect import connect

        self.source, self.split, self.null_labels, self.with_keys = source, split, null_labels, with_keys
        self.dsn = dsn
        self.fixed_classes = list(classes) if classes is not None else None
        self.conns: list[psycopg.Connection] = []
        try:
            for _ in range(max(1, connections)):
                self.conns.append(connect(dsn))
            lead = self.conns[0]
            begin_snapshot(lead, snapshot, physical=True)
            self.snapshot = snapshot
            if snapshot is None and len(self.conns) > 1:
                self.snapshot = export_snapshot(lead)
            for c in self.conns[1:]:
                begin_snapshot(c, self.snapshot, physical=True)
            self.pages, per_page = heap_pages(lead, source.table)
            self.chunk_pages = chunk_pages(source, per_page)
            self.chunked = use_chunks(lead.info.server_version, len(self.conns))
            # one connection: blocks put in place on a thread of their own while the server, the bound,
            # keeps sending (Handoff); several are their clients' bound, to which a thread more adds nothing
            self.ahead = len(self.conns) == 1
        except psycopg.Error as e:
            self.close()
            raise DatabaseError(f"cannot open a read of {source.table!r}: {_first_line(e)}") from None
        except BaseException:
            self.close()
            raise

    def keep_first(self) -> None:
        """Close every connection but the first, which keeps the snapshot (the streaming tier's)."""
        for c in self.conns[1:]:
            c.close()
        self.conns = self.conns[:1]

    def close(self) -> None:
        for c in self.conns:
            try:
                c.close()
            except Exception:
                pass
        self.conns = []

    def __enter__(self) -> TableRead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- SQL ----------------------------------------------------------------------------------

    def _ranges(self, parts: int) -> list[tuple[int, int | None]]:
        return page_spans(self.pages, parts, min_pages=2)

    @staticmethod
    def _range_sql(rng: tuple[int, int | None]) -> sql.Composable:
        return span_sql(rng)

    def _filter(self, rng, with_label: bool, with_split: bool, pages: sql.Composable | None = None) -> sql.Composable:
        """The rows a read takes from range `rng` (or the pages `pages` says, a condition on ctid)."""
        s = self.source
        parts = [pages or self._range_sql(rng)]
        if not s.features:  # the vector column's NULL rows are skipped; a feature's are refused (plan)
            parts.append(sql.SQL("{} IS NOT NULL").format(sql.Identifier(s.column)))
        if with_label and s.label and self.null_labels == "skip":
            parts.append(sql.SQL("{} IS NOT NULL").format(sql.Identifier(s.label)))
        if with_split and self.split is not None:
            op = "<" if self.split.part == "val" else ">="
            parts.append(sql.SQL("{}::bigint " + op + " {}").format(s.key_sql(), sql.Literal(self.split.threshold)))
        if s.where:
            parts.append(user_filter(s.where))
        return sql.SQL(" AND ").join(parts)

    def _precount_sql(self, rng) -> sql.Composable:
        s = self.source
        side = (sql.SQL("{}::bigint < {}").format(s.key_sql(), sql.Literal(self.split.threshold))
                if self.split is not None else sql.SQL("NULL::bool"))
        if s.label is None:
            lab = sql.SQL("NULL::text")
        elif s.task == "classify":
            lab = s.label_sql()
        elif s.label_kind == "numeric":  # a target that is NaN or infinite is told apart from a missing one
            lab = sql.SQL("CASE WHEN {l} IS NULL THEN '1' WHEN {l}::float8 IN ('NaN', 'Infinity', '-Infinity') "
                          "THEN 'nan' ELSE '0' END").format(l=sql.Identifier(s.label))
        else:
            lab = sql.SQL("({} IS NULL)::int::text").format(sql.Identifier(s.label))
        where = [self._range_sql(rng)] + ([user_filter(s.where)] if s.where else [])
        return sql.SQL(
            "SELECT {lab} AS label, {side} AS val, {nv} AS no_vector, count(*) FROM {t} WHERE {w} "
            "GROUP BY 1, 2, 3 LIMIT {cap}"
        ).format(lab=lab, side=side, t=s.table_sql(),
                 nv=sql.SQL("false") if s.features else sql.SQL("{} IS NULL").format(sql.Identifier(s.column)),
                 w=sql.SQL(" AND ").join(where), cap=sql.Literal(4 * MAX_CLASSES + 16))

    def fields(self, with_vectors: bool = True) -> list:
        s = self.source
        out = [scalar_field("tid", "tid")]
        if s.several_heaps:
            out.append(scalar_field("heap", "int4"))
        if s.label is not None:
            out.append(scalar_field("label", "float8" if s.label_kind == "numeric" else "int4"))
        if self.with_keys:
            out.append(scalar_field("key", "int4"))
        if with_vectors:
            out += s.fields()
        return out

    def _columns_sql(self, classes: list | None, with_vectors: bool) -> list[sql.Composable]:
        """What a read takes of each row, as `fields()` says (the id follows)."""
        s = self.source
        cols = [sql.SQL("ctid")] + ([s.heap_sql()] if s.several_heaps else [])
        if s.label is not None:
            if s.label_kind == "text":  # a class index (numeric labels map to classes on the client)
                pos = sql.SQL("array_position({}::text[], {}) - 1").format(sql.Literal(classes), s.label_sql())
                cols.append(sql.SQL("(CASE WHEN {} IS NULL THEN -1 ELSE coalesce({}, {}) END)::int4").format(
                    sql.Identifier(s.label), pos, sql.Literal(UNSEEN_CLASS)))
            else:
                cols.append(sql.SQL("coalesce({}, 'NaN')").format(s.label_sql()))
        if self.with_keys:
            cols.append(sql.SQL("{}::int4").format(s.key_sql()))
        if with_vectors:
            cols += s.value_sql()
        return cols

    def _rows_sql(self, rng, classes: list | None, with_vectors: bool) -> sql.Composable:
        """The COPY of range `rng`, a tuple a row (copy_rows): a one-connection read on a host with
        cores to spare, and PostgreSQL 13, which has no TID range scan for the chunks (use_chunks)."""
        s = self.source
        cols = self._columns_sql(classes, with_vectors) + [s.id_sql()]
        return sql.SQL("COPY (SELECT {cols} FROM {t} WHERE {w}) TO STDOUT (FORMAT BINARY)").format(
            cols=sql.SQL(", ").join(cols), t=s.table_sql(), w=self._filter(rng, True, True))

    def _chunks_sql(self, rng, classes: list | None, with_vectors: bool) -> sql.Composable:
        """The COPY of range `rng` in chunks of `chunk_pages` heap pages, one tuple each (copybin's
        `chunk_rows`): the row count, a field per field of `fields()`, the ids' lengths and the ids.
        Each chunk is a TID range scan (PostgreSQL 14+); its arrays keep the scan's (ctid) order, and the
        chunks come in page order."""
        s = self.source
        aggs = [sql.SQL("array_agg({})").format(c) for c in self._columns_sql(classes, False)]
        if with_vectors:  # the vectors' binary values end to end: less of the server's time a row than an
            # array of them (docs/decisions/train-bulk-read.md); raw features' bytes the same way
            if s.vec_dim:
                aggs.append(sql.SQL("string_agg({}, ''::bytea)").format(s.send_sql()))
            aggs += [sql.SQL("string_agg({}, ''::bytea)").format(s.raw_sql(f)) for f in s.features if f.raw]
        aggs += [sql.SQL("array_agg(octet_length({}))::int4[]").format(s.id_sql()),
                 sql.SQL("coalesce(string_agg({}, ''), '')").format(s.id_sql())]
        start, end = rng
        last = end if end is not None else max(self.pages, start + 1)
        cap = end if end is not None else _LAST_PAGE  # open-ended: the last chunk takes any page after
        # the page variable's name: the user's --where and columns share the chunk's scope
        upper = sql.SQL("CASE WHEN _ef_page + {k} >= {last} THEN {cap} ELSE _ef_page + {k} END").format(
            k=sql.Literal(self.chunk_pages), last=sql.Literal(last), cap=sql.Literal(cap))
        pages = sql.SQL("ctid >= format('(%s,0)', _ef_page)::tid AND ctid < format('(%s,0)', {u})::tid").format(u=upper)
        return sql.SQL(
            "COPY (SELECT _ef_chunk.* FROM generate_series({a}::bigint, {b}::bigint, {k}) AS _ef_page, LATERAL "
            "(SELECT count(*)::int8 AS n, {aggs} FROM {t} WHERE {w}) AS _ef_chunk WHERE _ef_chunk.n > 0) "
            "TO STDOUT (FORMAT BINARY)"
        ).format(a=sql.Literal(start), b=sql.Literal(last - 1), k=sql.Literal(self.chunk_pages),
                 aggs=sql.SQL(", ").join(aggs), t=s.table_sql(), w=self._filter(rng, True, True, pages))

    # ---- plan ---------------------------------------------------------------------------------

    def _parallel(self, fn: Callable, jobs: list) -> list:
        """fn(conn, job) for each job, job i on connection i % len(conns), results in job order."""
        slots = len(self.conns)
        if slots == 1:
            return [fn(self.conns[0], j) for j in jobs]
        out: list = [None] * len(jobs)

        def run(k):
            for i in range(k, len(jobs), slots):
                out[i] = fn(self.conns[k], jobs[i])

        with ThreadPoolExecutor(slots) as ex:
            for f in [ex.submit(run, k) for k in range(slots)]:
                f.result()
        return out

    def plan(self, parts: int | None = None) -> Plan:
        """Count what each range will give; the classes; the rows skipped. Errors here are the
        user's (a bad --where, nothing selected, only NULL labels)."""
        t0 = time.perf_counter()
        s = self.source
        ranges = self._ranges(parts or len(self.conns))

        # Counts do not depend on the scan's order (the read's do): the server may share a whole table's
        # scan among its parallel workers. Not a range's: PostgreSQL 18 has no parallel TID range scan,
        # and a parallel plan would scan the whole table for each range.
        helpers = PRECOUNT_WORKERS if len(ranges) == 1 else 0

        def count(conn, rng):
            try:
                if helpers:
                    conn.execute(f"SET LOCAL max_parallel_workers_per_gather = {helpers}")
                rows = conn.execute(self._precount_sql(rng)).fetchall()
            except psycopg.Error as e:
                raise _user_error(e.sqlstate, _first_line(e), s.where) from None
            if helpers:  # the read's own scans stay serial, in page order
                conn.execute("SET LOCAL max_parallel_workers_per_gather = 0")
            return rows

        per_range = self._parallel(count, ranges)
        groups = [row for res in per_range for row in res]
        if len(groups) > 4 * MAX_CLASSES:
            raise InputError(f"--label {s.label!r} has more than {MAX_CLASSES:,} distinct values: "
                             "use --task regress for a numeric target")
        want_val = None if self.split is None else self.split.part == "val"
        keep_null = self.null_labels == "keep"

        def on_side(val) -> bool:
            return want_val is None or val == want_val

        def null_label(lab) -> bool:
            return s.label is not None and (lab is None if s.task == "classify" else lab == "1")

        has = [(lab, val, c) for lab, val, nv, c in groups if not nv]
        labelled = [(lab, val, c) for lab, val, c in has if not null_label(lab)]
        if not has:
            raise InputError(f"the selection is empty: table {s.table!r} has no rows"
                             + ("" if s.features else " with a vector") + (f" where {s.where}" if s.where else ""))
        if s.task == "regress" and (bad := sum(c for lab, _, c in has if lab == "nan")):
            raise InputError(f"--label {s.label!r} holds NaN or an infinity in {plural(bad, 'selected row')}: filter "
                             "them out (where, --where) or mend them; a regression target takes finite numbers only")
        if s.label is not None and not labelled and not keep_null:  # (predictions want exactly those rows)
            raise InputError(f"--label {s.label!r} is NULL in all {sum(c for _, _, c in has):,} selected rows")
        classes = None
        if s.task == "classify":
            classes = self.fixed_classes
            if classes is None:
                values = {lab for lab, _, _ in labelled}
                if len(values) > MAX_CLASSES:
                    raise InputError(f"--label {s.label!r} has {len(values):,} distinct values (more than "
                                     f"{MAX_CLASSES:,}): use --task regress for a numeric target")
                classes = numeric_classes(values) if s.label_kind == "numeric" else sorted(values)
        # per range, the rows the COPY will give (the same filters in the same snapshot)
        counts = [sum(c for lab, val, nv, c in res if not nv and on_side(val) and (keep_null or not null_label(lab)))
                  for res in per_range]
        skipped_label = sum(c for lab, val, c in has if null_label(lab) and on_side(val)) if not keep_null else 0
        skipped_vector = sum(c for lab, val, nv, c in groups if nv and on_side(val))
        both = sum(c for _, _, c in labelled)
        return Plan(ranges, counts, classes, skipped_label, skipped_vector, both, time.perf_counter() - t0)

    def _selection(self) -> list[sql.Composable]:
        """The conditions of the rows a read takes (the user's filter, the split's side, a label present)."""
        s = self.source
        where = [user_filter(s.where)] if s.where else []
        if self.split is not None:
            op = "<" if self.split.part == "val" else ">="
            where.append(sql.SQL("{}::bigint " + op + " {}").format(s.key_sql(), sql.Literal(self.split.threshold)))
        if s.label is not None and self.null_labels == "skip":
            where.append(sql.SQL("{} IS NOT NULL").format(sql.Identifier(s.label)))
        return where

    def check_features(self, conn: psycopg.Connection | None = None) -> InputError | None:
        """The one-line error for the first feature check any selected row fails (None: every row passes): one
        scan. The stream tier's read runs it before the epochs (its windows read the features then); the
        other tiers only after a read failed, to say which column and row."""
        s = self.source
        if not s.features:
            return None
        conn = conn or self.conns[0]
        where = self._selection() or [sql.SQL("true")]
        found = conn.execute(sql.SQL("SELECT min(bad) FROM (SELECT {b} AS bad FROM {t} WHERE {w}) x WHERE bad > 0").format(
            b=s.bad_sql(), t=s.table_sql(), w=sql.SQL(" AND ").join(where))).fetchone()[0]
        return self._refusal(found, conn) if found else None

    def _refusal(self, check: int, conn: psycopg.Connection | None = None) -> InputError:
        """The one-line error for a row that fails feature check `check` (1-based), naming the column and the
        first such row's id (in id order)."""
        s = self.source
        f, what, cond = s.checks()[check - 1]
        where = [cond] + self._selection()
        c = sql.Identifier(f.name)
        size = {"scalar": sql.SQL("NULL::int"), "array": sql.SQL("cardinality({})").format(c),
                "vector": sql.SQL("{}({})").format(sql.Identifier(*s.vector_dims), c),
                "bytea": sql.SQL("octet_length({})").format(c)}[f.kind]
        order = sql.Identifier(s.id_column) if s.id_column else sql.SQL("ctid")
        row = (conn or self.conns[0]).execute(sql.SQL("SELECT {id}, {size} FROM {t} WHERE {w} ORDER BY {o} LIMIT 1").format(
            id=s.id_sql(), size=size, t=s.table_sql(), w=sql.SQL(" AND ").join(where), o=order)).fetchone()
        at = f"row {s.id_column or 'ctid'} {row[0]}" if row else "a row"
        col = f"feature column {f.name!r} ({f.type})"
        if what == "null":
            return InputError(f"{col} is NULL in {at}: filter such rows out (where, --where), or train with a "
                              "value for NULLs (fill_null, train --fill-null)")
        if what == "element":
            return InputError(f"{col} has a NULL element in {at}: filter such rows out (where, --where), or train "
                              "with a value for NULLs (fill_null, train --fill-null)")
        if what == "nan":
            return InputError(f"{col} holds NaN or an infinity in {at}: filter such rows out (where, --where) or "
                              "mend them; a feature takes finite numbers only")
        got = row[1] if row else None
        if row and f.kind == "array" and (dims := (conn or self.conns[0]).execute(sql.SQL(
                "SELECT array_ndims({}) FROM {} WHERE {}::text = %s").format(c, s.table_sql(), order),
                [str(row[0])]).fetchone()) \
                and (dims[0] or 1) > 1:
            return InputError(f"{col} is a {dims[0]}-dimensional array in {at}: a feature takes one dimension; "
                              f"flatten it (ARRAY(SELECT unnest({f.name})) in a view or column of its own)")
        unit = {"array": "values", "vector": "dimensions", "bytea": "bytes"}[f.kind]
        want = 4 * f.width if f.kind == "bytea" else f.width
        return InputError(f"{col} has {got} {unit} in {at} where the first row has {want}: a feature's width is "
                          "fixed; filter such rows out with where")

    # ---- read ---------------------------------------------------------------------------------

    def read(self, plan: Plan, put_vectors: Callable[[int, np.ndarray], None] | None,
             ranges: Sequence[int] | None = None) -> Columns:
        """COPY the planned ranges (all, or the given indices) into place: `put_vectors(offset,
        big-endian values)` for the vectors, arrays of the plan's full length for the rest."""
        t0 = time.perf_counter()
        s = self.source
        n = plan.n
        labels = None
        if s.label is not None:
            labels = np.full(n, -1, np.int64) if s.task == "classify" else np.full(n, np.nan, np.float64)
        keys = np.zeros(n if self.with_keys else 0, np.uint32)
        classes = None
        if s.task == "classify" and s.label_kind == "numeric":
            classes = np.asarray(plan.classes, np.float64)
        tids = np.zeros(n, np.uint64)
        fields = self.fields(put_vectors is not None)
        dtype = row_dtype(fields, trailing_text=True)
        todo = list(range(len(plan.ranges))) if ranges is None else list(ranges)
        offsets = plan.offsets
        pieces: dict[int, Ids] = {}

        def one(conn, i):
            make = self._chunks_sql if self.chunked else self._rows_sql
            query = make(plan.ranges[i], plan.classes, put_vectors is not None)
            off0 = offsets[i]
            pos = [off0]
            id_parts: list[Ids] = []

            def on_block(raw: np.ndarray, idbuf: bytearray, idlens: list):
                k = len(idlens)
                rows = np.frombuffer(raw, dtype, count=k)
                problem = check_rows(rows, fields, True, np.asarray(idlens, np.int64))
                if problem:
                    raise DatabaseError(f"table {s.table!r}: {problem}")
                o = pos[0]
                if o + k > off0 + plan.counts[i]:
                    raise DatabaseError(_CHANGED)
                if labels is not None:
                    labels[o:o + k] = rows["label"] if classes is None else class_index(classes, rows["label"])
                    if self.null_labels == "skip" and s.task == "classify" and np.any(labels[o:o + k] < 0):
                        raise DatabaseError(_CHANGED)
                if self.with_keys:
                    keys[o:o + k] = rows["key"].view(">u4")
                tids[o:o + k] = (rows["tid"]["block"].astype(np.uint64) << np.uint64(16)) | rows["tid"]["offset"]
                if s.several_heaps:
                    tids[o:o + k] |= rows["heap"].astype(np.uint64) << HEAP_SHIFT
                if put_vectors is not None:
                    put_vectors(o, s.values(rows))
                id_parts.append(Ids(idbuf, np.cumsum(idlens)))
                pos[0] = o + k

            try:
                if self.chunked:
                    copy_chunks(conn, query, fields, dtype, on_block, s.table, BLOCK_ROWS, self.ahead)
                else:
                    copy_rows(conn, query, dtype.itemsize, on_block, BLOCK_ROWS, ahead=self.ahead)
            except _CopyFailed as e:
                raise _user_error(e.sqlstate, e.message, s.where) from None
            except psycopg.Error as e:
                raise _user_error(e.sqlstate, _first_line(e), s.where) from None
            if pos[0] != off0 + plan.counts[i]:
                raise DatabaseError(_CHANGED)
            pieces[i] = Ids.concat(id_parts)

        try:
            if len(self.conns) == 1 or len(todo) == 1:
                for i in todo:
                    one(self.conns[0], i)
            else:
                self._parallel(lambda conn, i: one(conn, i), todo)
        except (DatabaseError, InputError) as e:
            if put_vectors is None or not s.features:
                raise
            raise self._diagnosed(e) from None
        ids = Ids.concat(pieces[i] for i in sorted(pieces))
        return Columns(labels, keys, tids, ids, time.perf_counter() - t0)

    def _diagnosed(self, error: Exception) -> Exception:
        """A failed read of features: the one-line refusal naming the column and row when a row fails a check (on a
        connection of its own: the read's transactions may be aborted), else the error itself. The checks run
        here rather than in every read's precount: a table that passes them pays no scan for them."""
        from embedfleet.pg.connect import connect

        try:
            with connect(self.dsn) as conn:
                return self.check_features(conn) or error
        except psycopg.Error:
            return error

    def read_vectors(self, tids: np.ndarray, put: Callable[[int, np.ndarray], None], chunk: int = 65_536) -> None:
        """The vectors of rows given by their tids, on the first connection, in this read's snapshot: the
        streaming tier's windows. One heap's tids come sorted ascending (the rows' order), as a TID scan
        returns them; several heaps' are sorted here, read heap by heap and put back in the order given."""
        s = self.source
        for a in range(0, len(tids), chunk):
            part = tids[a:a + chunk]
            if not s.several_heaps:
                self._vectors(s.table_sql(), part, lambda o, v, a=a: put(a + o, v))
                continue
            order = np.argsort(part, kind="stable")
            ordered = part[order]
            heap = ordered >> HEAP_SHIFT
            back = np.empty((len(part), s.dim), np.float32 if s.features else
                            vector_field("vec", s.vtype, s.dim)[1]["values"].base)
            for h in np.unique(heap).tolist():
                lo, hi = np.searchsorted(heap, h), np.searchsorted(heap, h, "right")
                table = sql.SQL("ONLY {}").format(sql.SQL(s.heaps[h][1]))  # regclass text: quoted already
                where = order[lo:hi]  # each of this heap's rows goes back to its place in the order given

                def place(o: int, v: np.ndarray, where: np.ndarray = where) -> None:
                    back[where[o:o + len(v)]] = v

                self._vectors(table, ordered[lo:hi] & _IN_HEAP, place)
            put(a, back)

    def _vectors(self, table: sql.Composable, tids: np.ndarray, put: Callable[[int, np.ndarray], None]) -> None:
        """The vectors of one heap's rows `tids` (sorted ascending), put in that order from offset 0."""
        s = self.source
        fields = s.fields()
        dtype = row_dtype(fields, trailing_text=False)
        lit = "{" + ",".join(f'"({b},{o})"' for b, o in zip((tids >> np.uint64(16)).tolist(),
                                                             (tids & np.uint64(0xFFFF)).tolist())) + "}"
        query = sql.SQL("COPY (SELECT {c} FROM {t} WHERE ctid = ANY({l}::tid[])) TO STDOUT (FORMAT BINARY)").format(
            c=sql.SQL(", ").join(s.value_sql()), t=table, l=sql.Literal(lit))
        got = [0]

        def on_block(raw, _ids, _lens):
            k = len(raw)
            rows = np.frombuffer(raw, dtype, count=k)
            problem = check_rows(rows, fields, False)
            if problem:
                raise DatabaseError(f"table {s.table!r}: {problem}")
            put(got[0], s.values(rows))
            got[0] += k

        try:
            copy_rows(self.conns[0], query, dtype.itemsize, on_block, with_text=False)
        except _CopyFailed as e:
            raise DatabaseError(f"streaming {s.table!r} failed: {e.message}") from None
        if got[0] != len(tids):
            raise DatabaseError(_CHANGED)


_CHANGED = ("the rows read differ from the rows counted in the same snapshot: is the --where filter "
            "volatile (random(), now())? Use a deterministic filter")


def numeric_classes(values) -> list:
    """A numeric label's distinct values, sorted, as ints where every one is whole (stars 1–5 read as float8:
    shown 1…5, not 1.0…5.0)."""
    classes = sorted(float(v) for v in values)
    return [int(c) for c in classes] if all(c.is_integer() for c in classes) else classes


def class_index(classes: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Index of each value in sorted `classes`; -1 for NaN (NULL), UNSEEN_CLASS for a value not among them."""
    values = np.asarray(values, np.float64)
    pos = np.minimum(np.searchsorted(classes, values), len(classes) - 1)
    return np.where(classes[pos] == values, pos, np.where(np.isnan(values), -1, UNSEEN_CLASS)).astype(np.int64)


def _messages(conn: psycopg.Connection, query: sql.Composable) -> Iterator[memoryview]:
    """The tuples of a binary `COPY ... TO STDOUT`, one message each (header and trailer left out);
    a failed COPY raises _CopyFailed once its results are read."""
    pg = conn.pgconn
    with conn.cursor() as cur, cur.copy(query):
        poller = select.poll()
        poller.register(pg.socket, select.POLLIN)
        get = pg.get_copy_data
        header = True
        while True:
            nb, d = get(1)
            if nb > 0:
                if header:
                    h = header_length(d)
                    d, nb, header = d[h:], nb - h, False
                    if nb == 0:
                        continue
                if nb == 2 and bytes(d) == TRAILER:
                    continue
                yield d
                continue
            if nb == 0:
                poller.poll()
                pg.consume_input()
                continue
            break
        error = None
        while True:  # the COPY's own result, then the end of results
            while pg.is_busy():
                poller.poll()
                pg.consume_input()
            res = pg.get_result()
            if res is None:
                break
            if res.status == pq.ExecStatus.FATAL_ERROR and error is None:
                error = _CopyFailed((res.error_field(pq.DiagnosticField.SQLSTATE) or b"").decode(),
                                    (res.error_field(pq.DiagnosticField.MESSAGE_PRIMARY) or b"").decode())
        if error is not None:
            raise error


def copy_rows(conn: psycopg.Connection, query: sql.Composable, fixed: int,
              on_block: Callable[[np.ndarray, bytearray, list], None], block_rows: int = BLOCK_ROWS,
              with_text: bool = True, ahead: bool = False) -> int:
    """Run a binary `COPY ... TO STDOUT` of one row a tuple and hand its rows on in blocks:
    on_block(raw (k, fixed) uint8 — the fixed-width prefix of each row, contiguous for np.frombuffer —,
    the bytes after the prefix of every row, concatenated, and their lengths). This loop only copies
    each row into a reused buffer (the per-row work psycopg's Copy.read adds is most of a read's client
    time). `ahead`: on_block runs on a thread of its own (Handoff). Returns the rows."""
    total = k = 0
    tail = bytearray()
    lens: list[int] = []
    with Handoff(on_block, ahead) as hand:
        bufs = [np.empty(block_rows * fixed, np.uint8) for _ in range(hand.slots)]
        slot = hand.slot()
        view = memoryview(bufs[slot])
        for d in _messages(conn, query):
            nb = len(d)
            if nb < fixed:
                raise DatabaseError(f"a row of {nb} bytes where at least {fixed} were expected (NULL or "
                                    "a vector of another dimension?)")
            view[k * fixed:(k + 1) * fixed] = d[:fixed]
            if with_text:
                tail += d[fixed:]
                lens.append(nb - fixed)
            k += 1
            if k == block_rows:
                hand.give(slot, bufs[slot].reshape(block_rows, fixed), tail, lens)
                total += k
                k, tail, lens = 0, bytearray(), []
                slot = hand.slot()
                view = memoryview(bufs[slot])
        if k:
            hand.give(slot, bufs[slot][:k * fixed].reshape(k, fixed), tail, lens if with_text else [0] * k)
            total += k
    return total


class Handoff:
    """Calls on_block(*block) for each block a COPY loop gives, in order: with `ahead`, on a thread of its
    own while the loop fills the next of two buffers, so the socket keeps being drained (a server whose
    socket is full stops producing, docs/decisions/train-bulk-read.md); else inline in one buffer. A context manager: on leaving, the
    blocks given are done; an error of on_block is raised in the loop (at its next slot) or on leaving."""

    def __init__(self, on_block: Callable, ahead: bool):
        self._on_block = on_block
        self.slots = 2 if ahead else 1
        self._error: BaseException | None = None
        self._stop = False  # the loop failed: blocks still queued are only handed back
        self._thread = None
        if ahead:
            self._free: queue.SimpleQueue = queue.SimpleQueue()
            self._todo: queue.SimpleQueue = queue.SimpleQueue()
            for i in range(self.slots):
                self._free.put(i)
            self._thread = threading.Thread(target=self._run, name="embedfleet-read-put", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while (item := self._todo.get()) is not None:
            slot, block = item
            if self._error is None and not self._stop:  # after an error, blocks are only handed back
                try:
                    self._on_block(*block)
                except BaseException as e:  # noqa: BLE001 - raised in the loop's thread
                    self._error = e
            self._free.put(slot)

    def slot(self) -> int:
        """A buffer the loop may fill (waits for the one the thread is done with)."""
        if self._thread is None:
            return 0
        slot = self._free.get()
        if self._error is not None:
            raise self._error
        return slot

    def give(self, slot: int, *block) -> None:
        if self._thread is None:
            self._on_block(*block)
        else:
            self._todo.put((slot, block))

    def __enter__(self) -> Handoff:
        return self

    def __exit__(self, kind, exc, _tb) -> None:
        if self._thread is not None:
            self._stop = kind is not None
            self._todo.put(None)
            self._thread.join()
            if self._error is not None and exc is not self._error:
                if kind is None:
                    raise self._error
                exc.__context__ = self._error  # the loop's own error first, the put's beside it


def chunk_pages(source: Source, rows_per_page: float | None) -> int:
    """Heap pages a chunk spans for about CHUNK_BYTES of rows: from the table's statistics, and never
    fewer rows a page than inline vectors would fill (vectors stored out of line leave many rows on a
    page, which only the statistics tell)."""
    per_value = 8 if source.transport == "array" else 2 if source.vtype == "halfvec" else 4
    row = per_value * source.dim + 48  # the vector, ctid, label, key and id
    per_page = max(rows_per_page or 0.0, 8192 / row)
    return max(1, min(1024, int(CHUNK_BYTES / (per_page * row))))


def copy_chunks(conn: psycopg.Connection, query: sql.Composable, fields: list, dtype: np.dtype,
                on_block: Callable[[np.ndarray, bytes, np.ndarray], None], table: str,
                block_rows: int = BLOCK_ROWS, ahead: bool = False) -> int:
    """Run a chunked binary COPY of `table` (TableRead._chunks_sql: many rows a tuple) and hand its rows
    on as copy_rows does, in blocks of whole chunks, at most `block_rows` rows unless one chunk has
    more. Each chunk is parsed straight into the block's buffer. `ahead` as copy_rows's. Returns the rows."""
    total = k = 0
    ids: list[bytes] = []
    lengths: list[np.ndarray] = []
    with Handoff(on_block, ahead) as hand:
        bufs = [np.empty(block_rows, dtype) for _ in range(hand.slots)]
        slot = hand.slot()
        for d in _messages(conn, query):
            try:
                n = chunk_count(d)
                if k + n > len(bufs[slot]):
                    if k:
                        hand.give(slot, bufs[slot][:k].view(np.uint8).reshape(k, dtype.itemsize),
                                  b"".join(ids), np.concatenate(lengths))
                        total, k, ids, lengths = total + k, 0, [], []
                        slot = hand.slot()
                    if n > len(bufs[slot]):
                        bufs[slot] = np.empty(n, dtype)
                _, id_bytes, id_lengths = chunk_rows(d, fields, dtype, out=bufs[slot][k:k + n])
            except ValueError as e:
                raise DatabaseError(f"table {table!r}: {e}") from None
            ids.append(id_bytes)
            lengths.append(id_lengths)
            k += n
        if k:
            hand.give(slot, bufs[slot][:k].view(np.uint8).reshape(k, dtype.itemsize), b"".join(ids),
                      np.concatenate(lengths))
            total += k
    return total
